"""The tuning state and the window plan, without a Trainer: phase transitions, hold, failure, resume state."""

import ast
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Budget, Trial
from lightning_dltune.tuning.state import Phase, TuningState, WindowPlan, batches_left

BUDGET = Budget(cpus=2.0, max_workers=16)
ZERO = LoaderSettings()
FOUR = LoaderSettings.normalized(4)
EIGHT = LoaderSettings.normalized(8)


def stats(wait_ms: float, step_ms: float = 10.0, steps: int = 10, batch: int = 16) -> WindowStats:
    wall = (wait_ms + step_ms) / 1e3 * steps
    return WindowStats(
        steps=steps,
        samples=steps * batch,
        wall_s=wall,
        wait_s=wait_ms / 1e3 * steps,
        step_s=step_ms / 1e3 * steps,
        wait_p50_s=wait_ms / 1e3,
        wait_p90_s=wait_ms / 1e3,
        fetch_cpu_s=0.0,
    )


def started(settings: LoaderSettings = ZERO, **kwargs) -> TuningState:
    state = TuningState(**kwargs)
    assert state.loader_seen(settings) and not state.loader_seen(settings)  # only the first loader is the start
    state.current = settings
    return state


def judge(state: TuningState, window: WindowStats, remaining: int | None = None, step: int = 0, budget=BUDGET):
    decision = state.decide(window, budget, remaining)
    return decision, state.apply(decision, window, budget, step)


def test_phase_is_a_str_enum_that_reads_as_before():
    assert Phase.SETTLED == "settled" and str(Phase.HELD) == "held"
    assert TuningState().phase is Phase.TUNING and TuningState(observe_only=True).phase is Phase.OBSERVING


@pytest.mark.parametrize(
    ("window", "remaining", "action", "phase", "change"),
    [
        (stats(wait_ms=160), None, "try", Phase.TUNING, True),  # a plain stall at 0 workers: jump
        (stats(wait_ms=0.1), None, "settle", Phase.SETTLED, True),  # no stall: settle on the start
        (stats(wait_ms=160), 2, "hold", Phase.HELD, False),  # two steps left cannot pay for a start-up
    ],
)
def test_one_window_moves_the_phase(window, remaining, action, phase, change):
    state = started()
    decision, applied = judge(state, window, remaining, step=7)
    assert decision.action == action and state.phase is phase
    assert (applied is not None) is change
    assert state.trials[-1].decision.startswith({"try": "try", "settle": "settle on", "hold": "stay"}[action])
    if action == "try":
        assert state.target == decision.settings and state.target.num_workers > 4
        assert state.best_settings is None and state.settled_step is None
    else:
        assert state.settled_step == 7 and state.best_settings == ZERO.to_loader_kwargs() and state.diagnosis


def test_held_keeps_the_plan_for_a_resumed_run_and_a_new_fit_tunes_again():
    state = started()
    decision, _ = judge(state, stats(wait_ms=160), remaining=2)
    assert state.phase is Phase.HELD and state.held == decision
    assert state.state_dict()["target"] == decision.settings.to_loader_kwargs()  # the plan, not the running config
    assert state.cacheable() is None  # held on the starting config: nothing worth caching
    assert state.headline().startswith("stays on workers=0 for the rest of this run")
    state.begin_fit()
    assert state.phase is Phase.TUNING and state.held is None


def test_a_held_config_that_beat_the_start_is_cacheable():
    state, roomy = started(), Budget(cpus=2.0, max_workers=64)  # room for more workers: not settled at the cap
    judge(state, stats(wait_ms=160), budget=roomy)
    state.current = state.target
    judge(state, stats(wait_ms=30, step_ms=4), remaining=1, budget=roomy)  # a faster step: more workers wanted
    assert state.phase is Phase.HELD
    assert state.cacheable() == state.current != ZERO


def test_observing_and_disabled_only_record():
    for state in (started(observe_only=True), started()):
        if state.phase is Phase.TUNING:
            state.disable()
        assert judge(state, stats(wait_ms=160)) == (None, None)
        assert state.phase in (Phase.OBSERVING, Phase.DISABLED) and len(state.trials) == 1
        assert state.trials[0].decision == "" and state.target is None


def test_failure_falls_back_to_the_best_measured_config_and_never_reuses_the_failed_one():
    state = started()
    judge(state, stats(wait_ms=160))
    state.current = EIGHT
    fallback = state.fail(stats(wait_ms=1, steps=2), "a DataLoader worker died: killed", BUDGET, step=30)
    assert fallback == ZERO  # the only config measured that did not fail
    assert state.phase is Phase.SETTLED and state.settled_step == 30 and state.target == ZERO
    assert state.trials[-1].failed.startswith("a DataLoader worker died") and not state.trials[-1].usable
    assert state.best_settings == ZERO.to_loader_kwargs()


def test_a_loader_that_feeds_fewer_workers_caps_them_and_tuning_goes_on():
    state = started()
    judge(state, stats(wait_ms=160))  # a plain stall: the rules ask for many workers
    state.current = LoaderSettings.normalized(14)
    going_on = state.fed_fewer(state.current, "workers failed their first batches: no shard", fed=4)
    assert going_on == FOUR and state.target == FOUR and state.phase is Phase.TUNING
    assert state.feed_limit == 4 == state.workers_limit and not state.trials[-1].usable
    state.current = FOUR
    decision, _ = judge(state, stats(wait_ms=40))  # still stalled: no more workers than the loader feeds
    assert decision is not None and decision.settings.num_workers <= 4
    restored = TuningState()
    restored.load_state_dict(state.state_dict())
    assert restored.feed_limit == 4
    assert "Failed, and not used again: workers=14 prefetch=2 (workers failed their first batches" in state.diagnosis


def test_failures_are_bounded():
    state = started(FOUR)
    for _ in range(3):
        assert state.fail(WindowStats(), "workers failed to start: boom", BUDGET, step=0) is not None
    assert state.fail(WindowStats(), "workers failed to start: boom", BUDGET, step=0) is None
    assert state.recoveries == 3


def test_only_the_tuners_own_worker_changes_count_as_its_failures():
    state = started(FOUR)
    assert not state.tuner_changed_workers()
    state.current = FOUR.with_prefetch(4)  # same workers, deeper prefetch: a failure is the user's
    assert not state.tuner_changed_workers()
    state.current = EIGHT
    assert state.tuner_changed_workers()


def test_cache_hit_is_verified_by_its_first_window_and_only_then():
    state = started()
    assert state.start_from_cache(FOUR, {"samples_per_s": 1000.0})
    state.current = FOUR
    decision, applied = judge(state, stats(wait_ms=0.1))
    assert decision.action == "settle" and "cached settings verified" in decision.reason
    assert state.cache_hit and state.phase is Phase.SETTLED and applied is not None
    late = started()
    judge(late, stats(wait_ms=160))
    assert not late.start_from_cache(FOUR, {})  # too late: tuning already moved on


def test_state_dict_round_trips_through_primitives():
    state = started()
    judge(state, stats(wait_ms=160))
    saved = state.state_dict()
    assert all(isinstance(v, (int, str, list, dict, type(None))) for v in saved.values())
    restored = TuningState()
    restored.load_state_dict(saved)
    assert restored.trials == state.trials and restored.target == state.target and restored.start == ZERO
    assert restored.phase is Phase.TUNING


def test_a_settled_checkpoint_resumes_settled_on_its_result_and_old_checkpoints_load():
    state = started()
    judge(state, stats(wait_ms=0.1))
    restored = TuningState()
    restored.load_state_dict(state.state_dict())
    assert restored.phase is Phase.SETTLED and restored.target == ZERO
    observer = TuningState(observe_only=True)
    observer.load_state_dict(state.state_dict())
    assert observer.phase is Phase.OBSERVING and observer.target is None  # observe-only never aims
    empty = TuningState()
    empty.load_state_dict({})  # a checkpoint from before the tuner existed
    assert empty.phase is Phase.TUNING and empty.trials == []


def test_finish_gives_a_result_and_says_when_tuning_had_not_settled():
    state = started()
    judge(state, stats(wait_ms=160))
    state.finish(BUDGET)
    assert state.best_settings == ZERO.to_loader_kwargs()
    assert state.diagnosis.endswith("(tuning had not settled when training ended.)")
    assert state.report_content()["phase"] == "tuning" and state.report_content()["trials"] == state.trials


def test_the_diagnosis_at_fits_end_names_the_ceiling_the_trials_were_judged_under():
    # under DDP the ranks agree a ceiling (13 here) above this rank's own share (8): the diagnosis of a fit that ends
    # before tuning settles names the ceiling its trials were judged under
    agreed, own = Budget(cpus=2.0, max_workers=13), Budget(cpus=2.0, max_workers=8)
    state = started()
    judge(state, stats(wait_ms=160), budget=agreed)
    assert state.phase is Phase.TUNING and state.target.num_workers == 13
    state.finish(own)
    assert "ceiling of 13 workers" in state.diagnosis and "ceiling of 8" not in state.diagnosis, state.diagnosis


@pytest.mark.parametrize(
    ("args", "left"),
    [
        ((100, 3, 0, 10, -1, 10, True), 290),  # epochs bound the run
        ((100, 3, 0, 10, 50, 10, True), 40),  # max_steps is tighter
        ((100, 3, 0, 10, 50, 10, False), 290),  # steps are not batches (accumulation): only epochs count
        ((100, -1, 0, 10, -1, 10, True), None),  # unbounded
        ((float("inf"), 3, 0, 10, -1, 10, True), None),  # an iterable of unknown length
    ],
)
def test_batches_left(args, left):
    assert batches_left(*args) == left


@pytest.mark.parametrize(
    ("mode", "steps", "stall", "left", "other", "epoch_s", "closes"),
    [
        ("in_epoch", 20, 0.1, 100, None, 1.0, True),  # a full window in in-epoch mode
        ("in_epoch", 10, 0.1, 100, None, 1.0, False),  # not full yet
        ("in_epoch", 20, 0.1, 5, None, 1.0, False),  # too close to the epoch's end: the epoch end judges
        ("auto", 2, 0.9, 100, None, 1.0, True),  # plainly the loader beyond noise: close after 2 steps
        ("auto", 1, 0.9, 100, None, 1.0, False),  # ... not after 1
        ("auto", 8, 0.3, 100, None, 1.0, False),  # a close call waits for the epoch (or a full window)
        ("auto", 8, 0.9, 100, False, 1.0, True),  # under DDP, at a power of two, where this rank judges it
        ("auto", 16, 0.1, 100, True, 1.0, True),  # ... or another rank does (its loader holds every rank up)
        ("auto", 16, 0.1, 100, False, 1.0, False),  # ... not where no rank does
        ("auto", 4, 0.9, 100, True, 1.0, True),  # ... from the first power of two above early_steps (2)
        ("auto", 2, 0.9, 100, True, 1.0, False),  # ... not at early_steps itself
        ("auto", 12, 0.9, 100, True, 1.0, False),  # ... only at a power of two or a window's length (no collective
        ("auto", 21, 0.9, 100, True, 1.0, False),  # every step)
        ("auto", 20, 0.9, 100, False, 1.0, True),  # ... the window's length
        ("auto", 20, 0.1, 100, None, 1.0, False),  # a short epoch waits for its end
        ("auto", 20, 0.1, 100, None, 120.0, True),  # a first window predicting a long epoch goes in-epoch
        ("epoch", 20, 0.9, 100, None, 120.0, False),  # epoch mode never closes inside an epoch
    ],
)
def test_window_plan(mode, steps, stall, left, other, epoch_s, closes):
    plan = WindowPlan(mode=mode, window_steps=20, min_steps=8)
    plan.epoch_started(resumable=True, tuning=True, epoch_batches=120)
    asked = []
    state = started()
    stats = WindowStats(steps=steps, samples=16 * steps, wall_s=0.01 * steps, wait_s=stall * 0.01 * steps)
    early = state.judge_early(stats)
    any_rank = None if other is None else lambda flag: flag or other  # DDP: the other rank judges it so, or not
    assert plan.close_in_epoch(steps, early, left, any_rank, lambda: asked.append(1) or epoch_s) is closes
    assert len(asked) <= 1


def test_under_ddp_a_min_steps_below_early_steps_judges_from_min_steps():
    plan = WindowPlan(mode="auto", window_steps=20, min_steps=2)  # the user's: fewer than early_steps (2) + 1
    plan.epoch_started(resumable=True, tuning=True, epoch_batches=120)
    assert plan.close_in_epoch(2, True, 100, lambda flag: flag, lambda: 1.0)
    assert not plan.close_in_epoch(1, True, 100, lambda flag: flag, lambda: 1.0)


@pytest.mark.parametrize(
    ("steps", "last_epoch", "undecided", "in_epoch", "closes"),
    [
        (8, False, False, False, True),  # min_steps pooled: judged
        (7, False, False, False, False),  # short epochs pool on
        (7, True, False, False, True),  # the last epoch judges what it has
        (8, False, True, False, False),  # a comparison within noise runs on into the next epoch
        (8, True, True, False, True),  # ... but never past the run's end
        (20, False, False, True, False),  # an in-epoch window carries over into the next epoch
    ],
)
def test_a_window_closes_at_an_epoch_end(steps, last_epoch, undecided, in_epoch, closes):
    plan = WindowPlan(mode="auto", window_steps=20, min_steps=8, in_epoch=in_epoch)
    assert plan.close_at_epoch_end(steps, last_epoch, lambda: undecided) is closes
    if not undecided:  # and inside an epoch, an undecided window never closes
        assert not plan.close_in_epoch(20, True, 100, None, lambda: 120.0, undecided=lambda: True)


def test_a_window_is_undecided_only_while_tuning_and_on_one_process():
    def noisy(wait_ms, steps, sem_ms):
        return replace(stats(wait_ms, steps=steps), wall_sem_s=sem_ms / 1e3, wait_sem_s=sem_ms / 1e3)

    state = started()
    # 0 workers, then 6 over 35 steps; now 11 that read slower over 12 steps, within a bursty window's noise
    state.trials += [Trial(ZERO, stats(40, 8)), Trial(LoaderSettings.normalized(6), noisy(4, 35, 0.5))]
    state.current = LoaderSettings.normalized(11)
    assert state.undecided(noisy(7, 12, 4.0))
    assert not state.undecided(noisy(7, 12, 4.0), distributed=True)  # every rank must close it at the same step
    assert not state.undecided(noisy(7, 12, 0.2))  # beyond noise: judged
    state.disable()
    assert not state.undecided(noisy(7, 12, 4.0))  # not tuning


def test_a_window_runs_on_where_judging_it_would_settle_back_on_a_start_it_may_beat():
    def window(wait_ms, step_ms, steps, sem_ms, cpu_ms=0.0):
        s = replace(stats(wait_ms, step_ms, steps), wall_sem_s=sem_ms / 1e3, wait_sem_s=sem_ms / 1e3)
        return replace(s, fetch_cpu_s=cpu_ms * steps / 1e3)

    two = LoaderSettings.normalized(2)
    # loading on the training process's CPU at 0 workers, 3 steps of 17 ms; then 2 workers, no longer stalled, at
    # 12.3 ms a step but noisy (a busy host): judged now, the run settles back on 0 workers, having shown no win
    state = started()
    judge(state, window(10.0, 7.0, 3, 0.1, cpu_ms=10.0))
    state.current = two
    noisy = window(0.3, 12.0, 8, 4.0)
    back = state.decide(noisy, BUDGET, None)
    assert (back.action, back.settings) == ("settle", ZERO), back.reason
    assert state.undecided(noisy)  # so it runs on (up to 4 x min_steps steps)
    assert not state.undecided(window(0.3, 12.0, 8, 0.2))  # little noise: a win, judged
    assert not state.undecided(window(0.3, 12.0, 32, 4.0))  # long enough: judged whatever the noise

    # 0 workers, then 2 that still stall, faster within noise: the next move is more workers, not back
    state = started()
    judge(state, window(30.0, 10.0, 3, 1.0))
    state.current = two
    stalled = window(15.0, 10.0, 8, 8.0)
    assert state.decide(stalled, BUDGET, None).action == "try"
    assert not state.undecided(stalled)


def test_a_long_epoch_or_in_epoch_mode_switches_inside_epochs_only_while_tuning():
    plan = WindowPlan(mode="auto", window_steps=20, min_steps=8)
    plan.epoch_started(resumable=True, tuning=True, epoch_batches=160)
    assert plan.in_epoch
    plan.epoch_started(resumable=True, tuning=False, epoch_batches=160)
    assert not plan.in_epoch
    plan.epoch_started(resumable=False, tuning=True, epoch_batches=1000)
    assert not plan.in_epoch


def _module_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:  # module level: what importing the module pulls in
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # a module imported from its package
    return names


def test_the_tuning_state_imports_neither_torch_nor_lightning():
    package = Path(sys.modules["lightning_dltune"].__file__).parent
    todo, seen = ["lightning_dltune.tuning.state"], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = package / module.split(".", 1)[1].replace(".", "/")
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.exists():  # a name imported from a module, not a module
            continue
        imports = _module_imports(path)
        heavy = {m for m in imports if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning")}
        assert not heavy, f"{module} imports {heavy}: the tuning state must stay pure"
        todo += [m for m in imports if m.startswith("lightning_dltune.")]
    assert {"lightning_dltune.tuning.rules", "lightning_dltune.measurement.measure"} <= seen


def test_a_jump_sized_on_the_main_process_step_is_judged_again_early():
    """Loading in the training process made the step look 10 ms; with 4 workers it is 5 ms and still stalls:
    the window is judged after 3 steps, and the next jump is sized on the step measured with workers."""
    state = started()
    zero = WindowStats(steps=8, samples=128, wall_s=8 * 0.170, wait_s=8 * 0.160, step_s=8 * 0.010)
    decision, _ = judge(state, zero)
    assert decision.action == "try" and decision.settings.num_workers == 16  # 1.25 x 160 / 10 -> 20, capped
    four = LoaderSettings.normalized(4, 2)
    state.current = four  # as if the loader had been switched to 4 workers
    stalled = WindowStats(steps=3, samples=48, wall_s=3 * 0.008, wait_s=3 * 0.003, step_s=3 * 0.005)
    assert stalled.stall_frac < state.policy.early_stall  # not plainly the loader's: judged early for the step
    assert state.judge_early(stalled)
    fed = WindowStats(steps=3, samples=48, wall_s=3 * 0.0052, wait_s=3 * 0.0002, step_s=3 * 0.005)
    assert not state.judge_early(fed)  # no stall left: nothing to re-judge early
    slow_step = WindowStats(steps=3, samples=48, wall_s=3 * 0.013, wait_s=3 * 0.003, step_s=3 * 0.010)
    assert not state.judge_early(slow_step)  # the step it was sized on was right: wait for min_steps


def test_one_steady_step_at_0_workers_is_judged_with_the_start_up_step_only_against_the_budget():
    """The start-up step's wait is a second sample at 0 workers; the jump it allows must already reach the cap."""
    state = started()
    one = replace(stats(180.0, steps=1), startup_wait_s=0.170, startup_busy_s=0.040)
    assert not state.judge_early(one)  # no budget: never on one step
    assert state.judge_early(one, BUDGET)  # ceil(1.25 * 180 / 10) = 23 workers, over the cap of 16
    assert not state.judge_early(one, Budget(cpus=2.0, max_workers=64))  # 23 of 64: a shorter step could add more
    state.memory_limit = 12  # a config over the memory budget caps the workers: that cap counts too
    assert state.judge_early(one, Budget(cpus=2.0, max_workers=64))
    assert not state.judge_early(replace(one, startup_wait_s=0.0), BUDGET)  # no start-up step in this window


def test_a_window_judged_on_one_step_is_judged_so_again_at_its_close_where_memory_is_read():
    """The close adds the workers' and this process's memory, which can lower the cap but not raise it: the
    decision there is a move, never 'keep measuring' (a 1-step trial and a restarted window)."""
    judged = 0
    for wait_ms, step_ms, workers, memory, held in itertools.product(
        (30, 60, 120, 180), (5, 10, 20), (4, 16, 64), (None, 256 * 2**20, 4096 * 2**20), (0, 2048 * 2**20)
    ):
        state = started()
        budget = Budget(cpus=2.0, max_workers=workers, memory_bytes=memory)
        peeked = replace(stats(wait_ms, step_ms, steps=1), startup_wait_s=wait_ms / 1e3, startup_busy_s=0.040)
        if not state.judge_early(peeked, budget):
            continue
        judged += 1
        closed = replace(peeked, main_mem_bytes=held, batch_bytes=2**20, epoch_batches=100.0)
        decision = state.decide(closed, budget, None)
        assert decision.action != "measure", (wait_ms, step_ms, workers, memory, held, decision.reason)
    assert judged >= 10  # the grid holds windows judged so


def test_on_a_gpu_the_host_stall_closes_a_window_only_after_min_steps():
    """The host can wait while the GPU's queue fills: that is no stall, and the GPU's gap is read at the close."""
    state = started()
    waiting = WindowStats(steps=3, samples=48, wall_s=3 * 0.020, wait_s=3 * 0.015, step_s=3 * 0.005)
    assert state.judge_early(waiting) and not state.judge_early(waiting, on_gpu=True)
    longer = WindowStats(steps=8, samples=128, wall_s=8 * 0.020, wait_s=8 * 0.015, step_s=8 * 0.005)
    assert state.judge_early(longer, on_gpu=True)


def probing_memory():
    """A state whose first window (0 workers, 100 ms waits, the process's memory known) chose a small config to
    read a worker's memory before a far jump, now running it; and the budget it was judged on."""
    state = started()
    budget = Budget(cpus=2.0, max_workers=16, memory_bytes=600 * 2**20)
    zero = WindowStats(
        steps=8, samples=128, wall_s=8 * 0.110, wait_s=8 * 0.100, step_s=8 * 0.010, main_mem_bytes=250 * 2**20
    )
    decision, _ = judge(state, zero, budget=budget)
    assert decision.probe_memory and decision.settings.num_workers == 2
    state.current = decision.settings
    return state, budget


def test_a_window_that_reads_a_smaller_configs_memory_is_never_cut_short():
    state, _ = probing_memory()
    stalled = WindowStats(steps=3, samples=48, wall_s=3 * 0.060, wait_s=3 * 0.055, step_s=3 * 0.005)
    assert not state.judge_early(stalled)  # plainly stalled, but its memory must be read first


def test_a_config_tried_to_read_its_memory_need_not_pay_to_go_on():
    # the probe was chosen smaller than the model wants: that it was no faster than 0 workers (its step slowed
    # beside the worker, say) says nothing about the jump it was there to make safe
    state, budget = probing_memory()
    no_faster = WindowStats(
        steps=20,
        samples=320,
        wall_s=20 * 0.108,
        wait_s=20 * 0.098,
        step_s=20 * 0.010,
        worker_mem_bytes=20 * 2**20,
        worker_mem_total_bytes=40 * 2**20,
        worker_mem_base_bytes=20 * 2**20,
        main_mem_bytes=250 * 2**20,
    )
    decision, _ = judge(state, no_faster, budget=budget)
    assert decision.action == "try" and decision.settings.num_workers > 2, decision.reason


def test_a_fit_that_ends_after_every_measured_config_failed_reports_the_fallback_it_runs():
    state = started(LoaderSettings.normalized(4, 2))
    budget = Budget(cpus=2.0, max_workers=16, memory_bytes=160 * 2**20)
    over = WindowStats(
        steps=20,
        samples=160,
        wall_s=0.5,
        wait_s=0.01,
        step_s=0.49,
        worker_mem_total_bytes=300 * 2**20,
        worker_mem_bytes=75 * 2**20,
        worker_mem_base_bytes=20 * 2**20,
        main_mem_bytes=100 * 2**20,
        epoch_batches=60,
    )
    decision, _ = judge(state, over, budget=budget)
    assert decision.action == "try" and decision.failed and decision.settings.num_workers < 4
    state.current = decision.settings  # fit ends before the fallback's window closes
    state.finish(budget)
    assert state.best_settings == decision.settings.to_loader_kwargs()
    assert "Memory:" in state.diagnosis and "had not settled" in state.diagnosis
