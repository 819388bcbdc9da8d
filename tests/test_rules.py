"""One case per named rule of the decision (``rules.RULES``, ``rules.SETTLE_OVERRIDES`` and the rules outside
``decide``): the rule decides, and the decision records its name. A rule added without a case here fails
``test_every_rule_has_a_case``."""

import math
from dataclasses import replace

import pytest

from lightning_dltune.measurement.gpu import GpuStats
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.output.report import summary_table
from lightning_dltune.tuning.model import Budget, Policy, Trial
from lightning_dltune.tuning.rules import FINAL, RULES, SETTLE_OVERRIDES, decide, enforce_memory, verify_cached
from lightning_dltune.tuning.state import TuningState

from test_decide import BUDGET, cfg, trial, with_mem

MEMORY = Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20)
WIDE = Budget(cpus=2.0, max_workers=64)


def copies(t, copy_ms, step_ms):
    """``t`` with a GPU timeline that read every step: ``copy_ms`` of host-to-device copy and ``step_ms`` of kernels."""
    n = t.stats.steps
    gpu = GpuStats(steps=n, copy_s=copy_ms * n / 1e3, step_s=step_ms * n / 1e3)
    return Trial(t.settings, t.stats.with_gpu(gpu))


def stepping_on(t, cpus):
    """``t`` with the training process measured using ``cpus`` CPUs while it steps (its CPU time: the step's and the
    loading's)."""
    s = t.stats
    return replace(t, stats=replace(s, main_cpu_s=s.fetch_cpu_s + cpus * s.step_s))


# 0 workers: 24 ms of CPU to load a batch (a decode), a 20 ms step that computes on both of the 2 CPUs
CPU_STEP = stepping_on(trial(0, 24, 20, fetch_cpu_ms=24), 2.0)

# rule: (trials, budget, keyword arguments of decide, action, settings)
CASES = {
    "too_few_steps": ([trial(0, 160, 10, steps=1)], BUDGET, {}, "measure", cfg(0)),
    "config_failed": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 0, 0, steps=0, failed="worker killed")],
        BUDGET,
        {},
        "settle",
        cfg(0),
    ),
    "stall_below_threshold": ([trial(0, 0.1, 10)], BUDGET, {}, "settle", cfg(0)),
    "trials_spent": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(4, 40, 10), trial(8, 20, 10)],
        WIDE,
        {"policy": Policy(max_trials=3)},
        "settle",
        cfg(8),
    ),
    "change_did_not_pay": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 20, 10), trial(16, 30, 10)],
        WIDE,
        {},
        "settle",
        cfg(8),
    ),
    "running_outgrows_memory": (
        [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(5, 20, 10), 30, growth_mib=1.0, epoch=100)],
        MEMORY,
        {},
        "settle",
        cfg(3),
    ),
    "handover_eats_the_gain": ([trial(0, 0.6, 8, fetch_cpu_ms=0.6)], BUDGET, {}, "settle", cfg(0)),
    "bursty_waits": (
        [trial(0, 80, 10, fetch_cpu_ms=1), trial(12, 2, 10, p50_ms=0.1, p90_ms=8)],
        BUDGET,
        {},
        "try",
        cfg(12, 4),
    ),
    "past_the_cpu_cap": (
        [trial(0, 17, 9, steps=3, fetch_cpu_ms=17), trial(2, 8, 10, steps=35, worker_cpu_ms=18)],
        BUDGET,
        {},
        "try",
        cfg(4),
    ),
    "slow_batches_hold_up": ([trial(0, 36, 10), trial(5, 6, 10, steps=35)], WIDE, {}, "try", cfg(5, 4)),
    "no_more_workers": (
        [trial(0, 160, 9), trial(16, 3, 9, p50_ms=3, p90_ms=3.5)],
        Budget(cpus=2.0, max_workers=16),
        {},
        "settle",
        cfg(16),
    ),
    "workers_would_contend": ([CPU_STEP], BUDGET, {}, "settle", cfg(0)),
    # the same, in 64-batch epochs: 8 workers at prefetch 8 hold one, loaded in a burst at its start
    "load_epoch_ahead": ([CPU_STEP], BUDGET, {"epoch_steps": 64}, "try", cfg(8, 8)),
    # ... and it paid: 30 ms a step against 44 (its first steps waited for the burst: 17% stalled)
    "loaded_ahead_paid": (
        [replace(CPU_STEP, rule="load_epoch_ahead"), trial(8, 5, 25, prefetch=8)],
        BUDGET,
        {"epoch_steps": 64},
        "settle",
        cfg(8, 8),
    ),
    "jump_to_the_model": ([trial(0, 160, 10, fetch_cpu_ms=1)], BUDGET, {}, "try", cfg(16)),
    # the overrides of a settle
    "settle_within_memory": (
        [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(5, 0.1, 10), 30, growth_mib=1.0, epoch=100)],
        MEMORY,
        {},
        "settle",
        cfg(3),
    ),
    "pinned_memory_first": ([copies(trial(0, 0.1, 10), 4, 6)], BUDGET, {}, "try", replace(cfg(0), pin_memory=True)),
    "keep_running_config": (
        [trial(0, 43, 5.5), trial(10, 1.5, 6, p50_ms=1.4, p90_ms=1.8), trial(10, 1.4, 6, prefetch=4)],
        Budget(cpus=16.0, max_workers=64),
        {},
        "settle",
        cfg(10, 4),
    ),
    # a trial whose start would cost more than it saves over the steps left
    "start_costs_more": ([trial(0, 160, 10, fetch_cpu_ms=1)], BUDGET, {"remaining_steps": 4}, "hold", cfg(16)),
}


@pytest.mark.parametrize("rule", list(CASES))
def test_the_rule_decides_and_is_named(rule):
    trials, budget, kwargs, action, settings = CASES[rule]
    decision = decide(trials, budget, **kwargs)
    assert (decision.rule, decision.action, decision.settings) == (rule, action, settings), decision.reason


def test_over_memory_budget():
    over = with_mem(trial(8, 20, 10), 40)  # 320 MiB against 200
    decision = enforce_memory([trial(0, 160, 10, fetch_cpu_ms=1), over], MEMORY)
    assert (decision.rule, decision.action, decision.settings.num_workers) == ("over_memory_budget", "try", 5)
    assert decision.failed is not None


def test_cached_settings_hold():
    window = trial(8, 0.2, 10)
    entry = {"stall_frac": 0.02, "samples_per_s": window.stats.samples_per_s}
    decision = verify_cached(entry, window, BUDGET, Policy())
    assert (decision.rule, decision.action, decision.settings) == ("cached_settings_hold", "settle", cfg(8))


def test_failed_on_a_rank():
    state = TuningState()
    state.start = state.current = cfg(0)
    decision = state.decide(WindowStats(), BUDGET, None, failed=[cfg(8)])
    assert (decision.rule, decision.action, decision.settings) == ("failed_on_a_rank", "settle", cfg(0))
    state.apply(decision, WindowStats(), BUDGET, step=3, failed=[cfg(8)])
    assert state.trials[-1].rule == "failed_on_a_rank"


def test_a_trial_records_its_rule_and_a_failed_config_is_named_so():
    state = TuningState()
    state.start = state.current = cfg(0)
    start = trial(0, 160, 10, fetch_cpu_ms=1)
    decision = state.decide(start.stats, BUDGET, None)
    state.apply(decision, start.stats, BUDGET, step=40)
    assert state.trials[-1].rule == "jump_to_the_model"
    assert "[jump_to_the_model] try workers=16" in summary_table(state.trials, None)
    assert Trial.from_dict(state.trials[-1].to_dict()).rule == "jump_to_the_model"  # the report keeps it
    state.current = cfg(16)
    state.fail(WindowStats(), "a DataLoader worker died: killed", BUDGET, step=50)
    assert state.trials[-1].rule == "config_failed" and state.trials[-1].failed


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 8 workers on 2 CPUs, never started
def test_an_epoch_loaded_ahead_is_judged_at_its_end_and_its_loader_does_not_go_on_into_the_next_epoch():
    from torch.utils.data import DataLoader, SequentialSampler

    from lightning_dltune.switching.seamless import Seamless
    from lightning_dltune.switching.switch import ResumableBatchSampler

    state = TuningState()
    state.start = state.current = cfg(0)
    decision = state.decide(CPU_STEP.stats, BUDGET, None, epoch_steps=64)
    assert (decision.rule, decision.settings) == ("load_epoch_ahead", cfg(8, 8))
    state.apply(decision, CPU_STEP.stats, BUDGET, step=3)
    state.current = cfg(8, 8)
    burst = trial(8, 40, 50, prefetch=8, steps=12).stats  # its first steps wait on the burst: plainly stalled
    assert not state.judge_early(burst, BUDGET) and not state.undecided(burst) and state.whole_epoch
    assert state.loads_ahead(8, 8) and not state.loads_ahead(8, 2)

    def loader(workers, prefetch):
        batches = ResumableBatchSampler(SequentialSampler(range(64)), 1, False)
        return DataLoader(range(64), batch_sampler=batches, num_workers=workers, prefetch_factor=prefetch)

    seamless = Seamless(bursts=lambda d: state.loads_ahead(d.num_workers, d.prefetch_factor))
    assert "load each epoch ahead" in seamless.why_not(loader(8, 8))
    assert seamless.why_not(loader(8, 2)) is None  # any other loader goes on, as before
    paid = trial(8, 5, 25, prefetch=8)
    settle = state.decide(paid.stats, BUDGET, None, epoch_steps=64)
    assert (settle.rule, settle.action, settle.settings) == ("loaded_ahead_paid", "settle", cfg(8, 8))
    state.apply(settle, paid.stats, BUDGET, step=64)
    assert not state.whole_epoch and state.loads_ahead(8, 8)  # settled on it: still no seamless epochs


def test_an_epoch_loaded_ahead_is_compared_on_its_whole_epoch_and_survives_a_checkpoint():
    from lightning_dltune.tuning.state import WindowPlan
    from lightning_dltune.tuning.windows import whole_epoch

    # after a switch, 6 steps of 60 ms while the burst loads, then 5 of 20 ms (0.46 s): the slow block is not left out
    stats = trial(8, 0, 20, prefetch=8, steps=11).stats
    stats = replace(stats, wall_s=0.46, step_s=0.46, wall_trim_s=0.02, busy_trim_s=0.02, startup_wait_s=1.2)
    whole = whole_epoch(stats)
    assert whole.steps == 11 and whole.wall_trim_s == pytest.approx(0.46 / 11) and whole.busy_trim_s > 0.02
    assert Trial(cfg(8, 8), whole).compared_sec_per_sample > Trial(cfg(8, 8), stats).compared_sec_per_sample
    # an in-epoch plan (long epochs) closes a whole-epoch window at the epoch's end, and not inside it
    flag = [True]
    plan = WindowPlan(mode="in_epoch", whole=lambda: flag[0])
    plan.epoch_started(resumable=True, tuning=True, epoch_batches=400)
    assert plan.in_epoch and plan.close_at_epoch_end(300, last_epoch=False)
    assert not plan.close_in_epoch(40, early=True, left=200, any_rank=None, epoch_seconds=lambda: 100.0)
    flag[0] = False
    assert not plan.close_at_epoch_end(300, last_epoch=False)
    assert plan.close_in_epoch(40, early=True, left=200, any_rank=None, epoch_seconds=lambda: 100.0)
    # a checkpoint taken during the trial: the resumed run judges it at the epoch's end, without seamless epochs
    state = TuningState()
    state.start = state.current = cfg(0)
    state.apply(state.decide(CPU_STEP.stats, BUDGET, None, epoch_steps=64), CPU_STEP.stats, BUDGET, step=3)
    resumed = TuningState()
    resumed.load_state_dict(state.state_dict())
    assert resumed.whole_epoch and resumed.loads_ahead(8, 8) and resumed.target == cfg(8, 8)


def test_every_rule_has_a_case():
    named = {rule.__name__ for rule in RULES} | {rule.__name__ for rule in SETTLE_OVERRIDES} | {"start_costs_more"}
    assert named - set(CASES) == set(), "a rule without a case in CASES"
    assert {rule.__name__ for rule in RULES} >= FINAL


def test_an_older_trial_over_the_memory_budget_reads_as_that_rule():
    """A report or checkpoint written before rules had names: the memory budget's failure is told by its words."""
    old = {"settings": {"num_workers": 8}, "stats": {}, "failed": "over the memory budget (320 MiB of 200 MiB)"}
    assert Trial.from_dict(old).rule == "over_memory_budget"
    assert Trial.from_dict({**old, "failed": None}).rule == ""


def test_pinned_memory_is_tried_once_where_lightning_reloads_and_its_workers_were_not_persistent():
    """Where Lightning reloads the loader, the pinned trial ran without persistent workers (see
    ``TuningState.within_reloads``): it counts as tried, and a settle after it is not turned into the same trial."""
    start = copies(trial(4, 0.1, 10), 4, 6)
    pinned = copies(trial(4, 0.1, 10), 4, 6)
    pinned = Trial(replace(cfg(4), pin_memory=True, persistent_workers=False), pinned.stats)
    decision = decide([start, pinned], BUDGET)
    assert decision.action == "settle" and decision.rule != "pinned_memory_first", decision


# window rule: (trials, budget) where it is the first of its table that holds
WINDOW_CASES = {
    "plain_stall": ([trial(0, 160, 10, steps=2, fetch_cpu_ms=1)], None),
    # 3 steps at 0 workers beside a step on both CPUs, its stall under a plain one's half: contention is foreseen
    "contention_foreseen": ([stepping_on(trial(0, 16, 20, steps=3, fetch_cpu_ms=16), 2.0)], BUDGET),
    # one steady step at 0 workers, with its start-up step: the model asks for max_workers already
    "stalled_from_the_start": (
        [trial(0, 160, 10, steps=1, fetch_cpu_ms=1, start_wait_ms=160, start_busy_ms=10)],
        BUDGET,
    ),
    "sized_on_a_longer_step": (
        [trial(0, 60, 12.5), trial(16, 3.0, 8.0, steps=4, wait_sem_ms=0.5, busy_sem_ms=0.2)],
        None,
    ),
    # 2 workers beside a step that computes on the CPUs: each of its 6 steps slower than the 44 ms it left
    "slower_than_before": ([CPU_STEP, trial(2, 5, 50, steps=6, min_wall_ms=54)], None),
    # a third of the time waiting with workers, after min_steps: beyond the threshold, short of a plain stall
    "stalls_with_workers": ([trial(0, 160, 10, fetch_cpu_ms=1), trial(4, 5, 10, steps=8)], None),
    "still_open": (
        [
            trial(0, 40, 8, fetch_cpu_ms=1),
            trial(6, 4.0, 10, steps=35, sem_ms=0.5, wait_sem_ms=0.5),
            trial(11, 7.0, 10, steps=12, sem_ms=4.0, wait_sem_ms=4.0),
        ],
        None,
    ),
    "win_not_yet_shown": (
        [
            trial(0, 16.5, 6.9, steps=3, fetch_cpu_ms=16.0, sem_ms=0.3, wait_sem_ms=0.3, min_wall_ms=23.0),
            trial(2, 10.0, 7.0, steps=8, sem_ms=5.0, wait_sem_ms=5.0),
        ],
        BUDGET,
    ),
}


@pytest.mark.parametrize("rule", list(WINDOW_CASES))
def test_the_window_rule_holds_first_in_its_table(rule):
    from lightning_dltune.tuning.windows import JUDGED_EARLY, RUNS_ON

    trials, budget = WINDOW_CASES[rule]
    table = JUDGED_EARLY if rule in {r.__name__ for r in JUDGED_EARLY} else RUNS_ON
    first = next((r.__name__ for r in table if r(trials, Policy(), budget)), None)
    assert first == rule
    if table is JUDGED_EARLY:
        from lightning_dltune.tuning.windows import judged_early

        assert judged_early(trials, Policy(), budget) == rule


def test_every_window_rule_has_a_case():
    from lightning_dltune.tuning.windows import JUDGED_EARLY, RUNS_ON

    assert {r.__name__ for r in (*JUDGED_EARLY, *RUNS_ON)} == set(WINDOW_CASES)


def test_config_failed_before_anything_was_measured_keeps_the_starting_config():
    decision = decide([trial(4, 0, 0, steps=0, failed="workers failed to start")], BUDGET)
    assert (decision.rule, decision.action, decision.settings) == ("config_failed", "settle", cfg(4))
    assert "no config could be measured" in decision.reason


def test_no_more_workers_where_the_model_s_count_was_measured_already():
    # 12 workers were measured, then 8: the model asks for 12 again
    trials = [trial(0, 160, 10, fetch_cpu_ms=1), trial(12, 30, 10), trial(8, 20, 10)]
    decision = decide(trials, Budget(cpus=2.0, max_workers=12))
    assert (decision.rule, decision.action, decision.settings) == ("no_more_workers", "settle", cfg(8))
    assert "was already measured" in decision.reason


def test_an_epoch_is_loaded_ahead_only_where_the_budgets_hold_it_and_a_trial_that_did_not_pay_settles_back():
    """Beside a step that computes on both CPUs, 64-batch epochs fit 8 workers at prefetch 8: tried, and judged at
    the epoch's end. Epochs longer than 16 workers at prefetch 8 hold, or an unknown length, settle at 0 workers as
    before; so does a memory budget that holds fewer workers. A trial slower than 0 workers settles back on them."""
    decision = decide([CPU_STEP], BUDGET, epoch_steps=64)
    assert decision.whole_epoch and "predicted to take 2.05 s against 2.82 s without it" in decision.reason, decision
    for kwargs in ({"epoch_steps": 129}, {"epoch_steps": math.inf}, {}):
        assert decide([CPU_STEP], BUDGET, **kwargs).rule == "workers_would_contend", kwargs
    tight = Budget(cpus=2.0, max_workers=7)
    assert decide([CPU_STEP], tight, epoch_steps=64).rule == "workers_would_contend"
    # a 200 MiB memory budget: 8 workers fit even if each comes to hold the 10 MiB this process holds, with their 8
    # batches in flight of 0.5 MiB; not with batches of 4 MiB, nor in a process of 400 MiB
    memory = Budget(cpus=2.0, max_workers=16, memory_bytes=200 * 2**20)
    for main_mib, batch_mib, rule in (
        (10, 0.5, "load_epoch_ahead"),
        (10, 4, "workers_would_contend"),
        (400, 0.5, "workers_would_contend"),
    ):
        held = with_mem(CPU_STEP, 0, batch_mib=batch_mib, main_mib=main_mib)
        assert decide([held], memory, epoch_steps=64).rule == rule, (main_mib, batch_mib)
    # a step on 1.6 of the 2 CPUs: steady workers predicted a little faster than none, loading ahead faster still
    assert decide([stepping_on(CPU_STEP, 1.6)], BUDGET, epoch_steps=64).rule == "load_epoch_ahead"
    # a step on one thread is not held up in lockstep: not for a step on 1 CPU, nor one on half a CPU that 2 workers
    # slowed (a loader that oversubscribed the CPUs)
    assert decide([stepping_on(CPU_STEP, 1.0)], BUDGET, epoch_steps=64).rule != "load_epoch_ahead"
    half = decide([stepping_on(CPU_STEP, 0.5), trial(2, 5, 50, steps=40)], BUDGET, epoch_steps=64)
    assert half.rule != "load_epoch_ahead", half
    # where the model expected no contention and 2 workers were tried: their step slowed from 20 to 50 ms
    measured = decide([CPU_STEP, trial(2, 5, 50, steps=40)], BUDGET, epoch_steps=64)
    assert (measured.rule, measured.settings) == ("load_epoch_ahead", cfg(8, 8)), measured
    assert "(workers=2 prefetch=2 slowed it)" in measured.reason
    unslowed = decide([CPU_STEP, trial(2, 30, 20, steps=40)], BUDGET, epoch_steps=64)  # slower, not its step
    assert unslowed.rule == "change_did_not_pay", unslowed
    slower = trial(8, 10, 40, prefetch=8)  # 50 ms a step against 44
    back = decide([replace(CPU_STEP, rule="load_epoch_ahead"), slower], BUDGET, epoch_steps=64)
    assert (back.action, back.settings) == ("settle", cfg(0)), back
    # 2 steps of 20 ms are too few to read the CPUs they use (the kernel adds other threads' CPU time at its ticks):
    # not taken for a step in lockstep
    brief = replace(CPU_STEP, stats=replace(CPU_STEP.stats, steps=2, step_s=0.04, main_cpu_s=0.128, fetch_cpu_s=0.048))
    assert decide([brief], BUDGET, epoch_steps=64).rule not in ("load_epoch_ahead", "workers_would_contend")


def test_contention_is_expected_before_a_trial_where_the_step_leaves_the_loading_no_idle_cpu():
    """Beside a step that computes on both of the 2 CPUs in lockstep, the loading delays it by all its CPU time: 2
    workers are predicted at 44 ms a step against 44 at 0 workers, and not tried. Where the step leaves CPUs idle, or
    its CPUs were not measured, the model's count is tried."""
    decision = decide([CPU_STEP], BUDGET)
    assert (decision.rule, decision.action, decision.settings) == ("workers_would_contend", "settle", cfg(0))
    assert "computes on 2.0 of the 2 CPUs" in decision.reason and "44.0 ms against 44.0 ms now" in decision.reason
    one = decide([stepping_on(CPU_STEP, 1.0)], BUDGET)  # the other CPU idle for 20 ms: 4 ms land on the step
    assert (one.rule, one.action) == ("jump_to_the_model", "try"), one.reason
    wide = decide([CPU_STEP], Budget(cpus=4.0, max_workers=16))  # 2 idle CPUs hold the loading
    assert (wide.rule, wide.action) == ("jump_to_the_model", "try"), wide.reason
    unmeasured = replace(CPU_STEP, stats=replace(CPU_STEP.stats, main_cpu_s=0.0))
    assert decide([unmeasured], BUDGET).action == "try"
    # loading far heavier than a step on 1 CPU: the CPU work over the CPUs bounds the stretch, and workers are tried
    heavy = stepping_on(trial(0, 200, 10, fetch_cpu_ms=200), 1.0)
    assert decide([heavy], BUDGET).rule == "jump_to_the_model"
    heavier = stepping_on(trial(0, 1400, 10, fetch_cpu_ms=1400), 1.0)
    assert decide([heavier], Budget(cpus=8.0, max_workers=64)).rule == "jump_to_the_model"
    # over 4 steps the 20 ms a step the 1 CPU's step saves (80 ms) does not pay the 2 workers' start (100 ms)
    held = decide([stepping_on(CPU_STEP, 1.0)], BUDGET, remaining_steps=4)
    assert (held.rule, held.action) == ("start_costs_more", "hold"), held.reason


def test_a_slower_trial_ends_after_its_sign_steps_and_the_tuner_goes_back():
    slower = trial(2, 5, 50, steps=6, min_wall_ms=54)
    decision = decide([CPU_STEP, slower], BUDGET)
    assert (decision.rule, decision.settings) == ("change_did_not_pay", cfg(0)), decision.reason
    # five steps are short of twice the sign test (a new loader's first steps may still be filling its prefetch);
    # a trial faster on one of its steps is not ended
    from lightning_dltune.tuning.windows import judged_early

    assert judged_early([CPU_STEP, trial(2, 5, 50, steps=5, min_wall_ms=54)]) is None
    assert judged_early([CPU_STEP, trial(2, 5, 50, steps=6, min_wall_ms=30)]) is None
