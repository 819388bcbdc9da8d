from dataclasses import replace

import pytest

from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.measurement.memory import MiB
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.compare import pick_best
from lightning_dltune.tuning.diagnose import diagnose
from lightning_dltune.tuning.model import Budget, Policy, Trial, estimate, handover_s
from lightning_dltune.tuning.rules import decide, verify_cached
from lightning_dltune.tuning.state import TuningState
from lightning_dltune.tuning.windows import steady_from_the_start

BUDGET = Budget(cpus=2.0, max_workers=16)


def cfg(workers: int, prefetch: int | None = None) -> LoaderSettings:
    return LoaderSettings.normalized(workers, prefetch)


def trial(
    workers,
    wait_ms,
    step_ms,
    *,
    prefetch=None,
    steps=40,
    batch=16,
    fetch_cpu_ms=0.0,
    worker_cpu_ms=0.0,
    p50_ms=None,
    p90_ms=None,
    sem_ms=0.0,
    wait_sem_ms=0.0,
    busy_sem_ms=0.0,
    failed=None,
    min_wait_ms=0.0,
    min_wall_ms=0.0,
    start_wait_ms=0.0,
    start_busy_ms=0.0,
):
    wall = (wait_ms + step_ms) * steps / 1e3
    stats = WindowStats(
        steps=steps,
        samples=steps * batch,
        wall_s=wall,
        wait_s=wait_ms * steps / 1e3,
        step_s=step_ms * steps / 1e3,
        wait_p50_s=(wait_ms if p50_ms is None else p50_ms) / 1e3,
        wait_p90_s=(wait_ms if p90_ms is None else p90_ms) / 1e3,
        wall_sem_s=sem_ms / 1e3,
        wait_sem_s=wait_sem_ms / 1e3,
        busy_sem_s=busy_sem_ms / 1e3,
        fetch_cpu_s=fetch_cpu_ms * steps / 1e3,
        worker_cpu_s=worker_cpu_ms * steps / 1e3,
        wait_min_s=min_wait_ms / 1e3,
        startup_wait_s=start_wait_ms / 1e3,
        startup_busy_s=start_busy_ms / 1e3,
        sample_wall_min_s=min_wall_ms / 1e3 / batch,
    )
    return Trial(cfg(workers, prefetch), stats, failed)


@pytest.mark.parametrize(
    ("trials", "budget", "action", "expected"),
    [
        pytest.param([trial(0, 0.1, 10)], BUDGET, "settle", cfg(0), id="in-memory data keeps 0 workers"),
        pytest.param([trial(0, 2, 60)], BUDGET, "settle", cfg(0), id="accelerator-bound keeps 0 workers"),
        pytest.param([trial(0, 160, 10, fetch_cpu_ms=1)], BUDGET, "try", cfg(16), id="io-bound jumps past the cores"),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(20),
            id="io-bound jump sized by the model: ceil(1.25*160/10)",
        ),
        pytest.param(
            [trial(0, 40, 10, fetch_cpu_ms=40)], BUDGET, "try", cfg(2), id="cpu-bound capped at the CPU budget"
        ),
        pytest.param(
            [trial(0, 40, 10, fetch_cpu_ms=40)],
            Budget(cpus=8.0, max_workers=64),
            "try",
            cfg(5),
            id="cpu-bound with enough CPUs gets what the model needs",
        ),
        pytest.param([trial(0, 10, 40)], BUDGET, "try", cfg(1), id="small stall needs one worker"),
        pytest.param(
            [trial(0, 0.6, 8, fetch_cpu_ms=0.6)],
            BUDGET,
            "settle",
            cfg(0),
            id="a 7% stall that a worker's hand-over (1 ms, the prior) would cost as much as it hides keeps 0 workers",
        ),
        pytest.param([trial(0, 160, 10, steps=1)], BUDGET, "measure", cfg(0), id="too few steps to judge"),
        pytest.param(
            [trial(0, 180, 10, steps=1, start_wait_ms=170, start_busy_ms=40)],
            BUDGET,
            "try",
            cfg(16),
            id="one steady step at 0 workers and the start-up step's wait beside it, both 170-180 ms: decided",
        ),
        pytest.param(
            [trial(0, 180, 20, steps=1, start_wait_ms=170, start_busy_ms=40)],
            Budget(cpus=2.0, max_workers=64),
            "measure",
            cfg(0),
            id="... not where the jump, sized on that one step (an upper bound), is short of the cap: 12 of 64",
        ),
        pytest.param(
            [trial(0, 180, 20, steps=1, fetch_cpu_ms=90, start_wait_ms=170, start_busy_ms=40)],
            Budget(cpus=2.0, max_workers=64),
            "measure",
            cfg(0),
            id="... nor where the CPUs cap the jump (4 of 64): the start needs its steps to show the final win",
        ),
        pytest.param(
            [trial(0, 180, 20, steps=2, wait_sem_ms=5, start_wait_ms=170, start_busy_ms=40)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(12),
            id="... which a second steady step judges as before",
        ),
        pytest.param(
            [trial(0, 1, 10, steps=1, start_wait_ms=2000, start_busy_ms=40)],
            BUDGET,
            "measure",
            cfg(0),
            id="... not where the start-up step's wait was start-up only (a dataset opened lazily)",
        ),
        pytest.param(
            [trial(0, 180, 10, steps=1, start_wait_ms=60, start_busy_ms=40)],
            BUDGET,
            "measure",
            cfg(0),
            id="... nor where the two waits are too far apart to bound the wait at half the step",
        ),
        pytest.param(
            [trial(0, 180, 10, steps=1, start_wait_ms=170, start_busy_ms=3000)],
            BUDGET,
            "measure",
            cfg(0),
            id="... nor where the model's first step took seconds (a GPU's context): its busy time bounds the step",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 20, 10, steps=1, start_wait_ms=20, start_busy_ms=10)],
            BUDGET,
            "measure",
            cfg(16),
            id="... nor with workers, whose first step after the build waits for their start",
        ),
        pytest.param(
            [trial(0, 60, 10, steps=2, wait_sem_ms=40, busy_sem_ms=1)],
            BUDGET,
            "measure",
            cfg(0),
            id="two steps of a bursty wait: its lower bound is not plainly the loader's yet",
        ),
        pytest.param(
            [trial(0, 160, 10, steps=2, wait_sem_ms=1, busy_sem_ms=2)],
            BUDGET,
            "try",
            cfg(16),
            id="two steps waiting 160 ms beyond doubt: decided (a confidence bound, not a count)",
        ),
        pytest.param(
            [trial(0, 40, 10, steps=2, wait_sem_ms=1, busy_sem_ms=2, fetch_cpu_ms=38)],
            BUDGET,
            "measure",
            cfg(0),
            id="... not where the training process's CPU does the loading: the win the CPUs cap needs 3 steps to show",
        ),
        pytest.param(
            [trial(0, 40, 10, steps=3, wait_sem_ms=1, busy_sem_ms=2, fetch_cpu_ms=38)],
            BUDGET,
            "try",
            cfg(2),
            id="... which 3 steps give it",
        ),
        pytest.param(
            [trial(0, 160, 10, steps=3)], BUDGET, "try", cfg(16), id="an overwhelming stall is judged after 3 steps"
        ),
        pytest.param(
            [trial(0, 20, 10, steps=3, wait_sem_ms=8)],
            BUDGET,
            "measure",
            cfg(0),
            id="... but not when its noise could bring it under half",
        ),
        pytest.param(
            [trial(0, 160, 10, steps=3, wait_sem_ms=60)],
            BUDGET,
            "try",
            cfg(16),
            id="a noisy wait far above the step is still overwhelming",
        ),
        pytest.param([trial(0, 8, 10, steps=3)], BUDGET, "measure", cfg(0), id="a close call waits for min_steps"),
        pytest.param(
            [trial(0, 95, 10, steps=3, wait_sem_ms=60, busy_sem_ms=1, min_wait_ms=40)],
            BUDGET,
            "try",
            cfg(12),
            id="3 steps of a bursty wait, each over 40 ms against a 10 ms step: a sign test shows the stall",
        ),
        pytest.param(
            [trial(0, 95, 10, steps=3, wait_sem_ms=60, busy_sem_ms=1, min_wait_ms=5)],
            BUDGET,
            "measure",
            cfg(0),
            id="... not when one of them waited less than the step",
        ),
        pytest.param(
            [trial(0, 95, 10, steps=2, wait_sem_ms=60, busy_sem_ms=1, min_wait_ms=40)],
            BUDGET,
            "measure",
            cfg(0),
            id="... nor after 2 steps (both slower by chance: 1 in 4)",
        ),
        pytest.param(
            [trial(0, 60, 10, p50_ms=40, p90_ms=120)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(15),
            id="batches come in order: the slow ones size the workers, ceil(1.25*p90/step)",
        ),
        pytest.param(
            [trial(0, 36, 10, steps=3), trial(5, 6, 10, steps=35)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(10),
            id="a few steps at 0 workers that missed the slow batches are overruled by a stalled window",
        ),
        pytest.param(
            [trial(0, 36, 10, steps=3, p90_ms=200), trial(5, 6, 10, steps=35)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(10),
            id="... and so is its slowest batch: the stalled window sizes the next jump",
        ),
        pytest.param(
            [trial(0, 36, 10), trial(5, 6, 10, steps=35)],
            Budget(cpus=2.0, max_workers=64),
            "try",
            cfg(5, 4),
            id="... a full window at 0 workers is not: the tightest bound holds (no more workers: deeper prefetch)",
        ),
        pytest.param(
            [trial(0, 43, 5.5), trial(10, 1.5, 6, p50_ms=1.4, p90_ms=1.8)],
            Budget(cpus=16.0, max_workers=64),
            "try",
            cfg(10, 4),
            id="enough workers by the model, a steady wait all the same: deeper prefetch (the H200 benchmark)",
        ),
        pytest.param(
            [trial(0, 100, 8, p90_ms=160), trial(16, 4, 8, p50_ms=3.5, p90_ms=5)],
            Budget(cpus=2.0, max_workers=16),
            "try",
            cfg(16, 4),
            id="at max_workers, past the mean batch's count, a steady wait: deeper prefetch (the bursty benchmark)",
        ),
        pytest.param(
            [trial(0, 160, 9), trial(16, 3, 9, p50_ms=3, p90_ms=3.5)],
            Budget(cpus=2.0, max_workers=16),
            "settle",
            cfg(16),
            id="... short of the mean batch's count the wait is from too few workers: settle at the cap",
        ),
        pytest.param(
            [trial(0, 43, 5.5), trial(10, 1.5, 6, p50_ms=1.4, p90_ms=1.8), trial(10, 1.4, 6, prefetch=4)],
            Budget(cpus=16.0, max_workers=64),
            "settle",
            cfg(10, 4),
            id="... and settle where it did not pay (on the running config: going back would restart its workers)",
        ),
        pytest.param(
            [trial(0, 17, 9, steps=3, fetch_cpu_ms=17), trial(2, 8, 10, steps=35, worker_cpu_ms=34)],
            BUDGET,
            "settle",
            cfg(2),
            id="the CPU cap reads the uncontended batch time, not workers waiting for the CPUs",
        ),
        pytest.param(
            [trial(0, 17, 9, steps=3, fetch_cpu_ms=17), trial(2, 8, 10, steps=35, worker_cpu_ms=18)],
            BUDGET,
            "try",
            cfg(4),
            id="... but workers that used half the CPUs at the cap try twice as many once: the OS shares the CPUs",
        ),
        pytest.param(
            [
                trial(0, 17, 9, steps=3, fetch_cpu_ms=17),
                trial(2, 8, 10, steps=35, worker_cpu_ms=18),
                trial(4, 7.5, 10, steps=35, worker_cpu_ms=18),
            ],
            BUDGET,
            "settle",
            cfg(4),
            id="... once: as fast within noise, the running config stays",
        ),
        pytest.param(
            [
                trial(0, 17, 7.5, steps=3, fetch_cpu_ms=17),
                trial(2, 14, 7, steps=35, worker_cpu_ms=17),
                trial(4, 4, 14, steps=35, worker_cpu_ms=34),
            ],
            BUDGET,
            "settle",
            cfg(4),
            id="... faster, at the model's count, still waiting for the CPUs: no deeper prefetch (the CPU benchmark)",
        ),
        pytest.param(
            [trial(0, 80, 10), trial(10, 3, 5, steps=3)],
            BUDGET,
            "try",
            cfg(16),
            id="a jump sized on the step at 0 workers is corrected after 3 steps with workers",
        ),
        pytest.param(
            [trial(0, 80, 10), trial(10, 3, 10, steps=3)],
            BUDGET,
            "measure",
            cfg(10),
            id="... but a jump sized on the right step waits for min_steps",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 0.2, 10)],
            BUDGET,
            "settle",
            cfg(16),
            id="stall gone after the jump",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 12, 10), trial(16, 11.5, 10)],
            BUDGET,
            "settle",
            cfg(16),
            id="more workers stopped paying: the running config, as fast, stays (going back would restart)",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 12, 10), trial(16, 13.5, 10)],
            BUDGET,
            "settle",
            cfg(8),
            id="more workers stopped paying: back to the cheaper config where the running one is slower beyond noise",
        ),
        pytest.param(
            [trial(0, 1.0, 10), trial(2, 0.9, 10)],
            BUDGET,
            "settle",
            cfg(0),
            id="back to the user's 0 workers where the running config is no measured win over them",
        ),
        pytest.param(
            [trial(12, 2.5, 10, steps=15), trial(16, 2.0, 10, steps=23)],
            BUDGET,
            "settle",
            cfg(16),
            id="a start with workers (a cache hit) is one config among others: the running one, as fast, stays",
        ),
        pytest.param(
            [trial(0, 80, 10, fetch_cpu_ms=1), trial(12, 2, 10, p50_ms=0.1, p90_ms=8)],
            BUDGET,
            "try",
            cfg(12, 4),
            id="bursty waits with the workers the model sizes (ceil(1.25 * 80 / 10) = 10) deepen the prefetch",
        ),
        pytest.param(
            [trial(0, 80, 10, fetch_cpu_ms=1), trial(8, 2, 10, p50_ms=0.1, p90_ms=8)],
            BUDGET,
            "try",
            cfg(10),
            id="bursty waits with workers short of the model's headroom add workers before deepening the prefetch",
        ),
        pytest.param(
            [trial(0, 80, 10, fetch_cpu_ms=1), trial(10, 4, 10, steps=12), trial(8, 2, 10, p50_ms=0.1, p90_ms=8)],
            BUDGET,
            "try",
            cfg(8, 4),
            id="... and deepen it where the model's count was measured already",
        ),
        pytest.param(
            [trial(0, 160, 10), trial(2, 75, 10, worker_cpu_ms=80), trial(4, 70, 10, worker_cpu_ms=80)],
            BUDGET,
            "settle",
            cfg(4),
            id="cpu-saturated: settle on the fastest",
        ),
        pytest.param(
            [trial(0, 50, 10), trial(8, 60, 10), trial(16, 65, 10)],
            BUDGET,
            "settle",
            cfg(0),
            id="never slower than the starting config",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 0, 0, steps=0, failed="worker killed")],
            BUDGET,
            "settle",
            cfg(0),
            id="a failed config is never chosen",
        ),
    ],
)
def test_decide(trials, budget, action, expected):
    decision = decide(trials, budget, Policy())
    assert (decision.action, decision.settings) == (action, expected), decision.reason


def start_only(samples_ms, busy_ms=7.0, collate_ms=1.0, fetch_cpu_ms=0.0, batch=None):
    """A window at 0 workers that has only its start-up step, its batch timed sample by sample; ``collate_ms``: what
    the fetch spent beside its samples; ``batch``: the step's batch size as it is read (default: the samples)."""
    from lightning_dltune._stats import sem

    rest = [ms / 1e3 for ms in samples_ms[1:]]
    return WindowStats(
        startup_step_samples=len(samples_ms) if batch is None else batch,
        startup_wait_s=(sum(samples_ms) + collate_ms) / 1e3,
        startup_busy_s=busy_ms / 1e3,
        startup_fetch_cpu_s=fetch_cpu_ms / 1e3,
        startup_samples=len(samples_ms),
        startup_first_sample_s=samples_ms[0] / 1e3,
        startup_sample_mean_s=sum(rest) / max(1, len(rest)),
        startup_sample_sem_s=sem(rest) if len(rest) > 1 else 0.0,
    )


@pytest.mark.parametrize(
    ("stats", "budget", "action", "expected"),
    [
        pytest.param(start_only([10.0] * 16), BUDGET, "try", cfg(16), id="16 samples of 10 ms: a plain stall, decided"),
        pytest.param(
            start_only([2000.0] + [10.0] * 15),
            BUDGET,
            "try",
            cfg(16),
            id="a file opened on the first sample: the batch still waits 150 ms for the others, decided",
        ),
        pytest.param(
            start_only([2000.0] + [0.1] * 15),
            BUDGET,
            "measure",
            cfg(0),
            id="... but not where the opening was the whole wait (the others take 0.1 ms)",
        ),
        pytest.param(
            start_only([2.0] * 32, busy_ms=20.0, collate_ms=250.0),
            Budget(cpus=2.0, max_workers=8),
            "measure",
            cfg(0),
            id="the first fetch's own costs (drawing a large epoch's order: 250 ms) are not read as the samples' wait",
        ),
        pytest.param(
            start_only([10.0] * 4),
            BUDGET,
            "measure",
            cfg(0),
            id="4 samples are too few to tell a steady batch from a slow start",
        ),
        pytest.param(
            start_only([0.5] * 14 + [100.0, 100.0]),
            BUDGET,
            "measure",
            cfg(0),
            id="two slow samples of 16 (a bursty store): too far apart for their mean to show a plain stall",
        ),
        pytest.param(
            start_only([10.0] * 16, fetch_cpu_ms=150.0),
            BUDGET,
            "measure",
            cfg(0),
            id="loaded on the training process's CPU: the CPUs cap the win, which needs more steps to show",
        ),
        pytest.param(
            start_only([10.0] * 16, busy_ms=20.0),
            Budget(cpus=2.0, max_workers=64),
            "measure",
            cfg(0),
            id="the model's count, on the first step's busy time (an upper bound), short of the cap: 11 of 64",
        ),
    ],
)
def test_a_start_up_step_whose_samples_show_it_steady_is_judged_alone(stats, budget, action, expected):
    judged = steady_from_the_start(stats)
    if judged is not stats:  # as one steady step, its samples counted as every window counts them
        assert judged.steps == 1 and judged.samples == stats.startup_step_samples
    decision = decide([Trial(cfg(0), judged)], budget, Policy())
    assert (decision.action, decision.settings) == (action, expected), decision.reason
    assert steady_from_the_start(replace(judged, steps=1)) == replace(judged, steps=1)  # a window with steps: as is


def test_a_start_up_step_is_judged_on_the_samples_its_batch_is_read_to_hold():
    # a batch whose size Lightning cannot read counts 1 sample in every window: the first one too, or the next
    # windows, compared per sample, would read many times slower than it
    one = steady_from_the_start(start_only([10.0] * 16, batch=1))
    assert (one.steps, one.samples) == (1, 1)
    assert steady_from_the_start(start_only([10.0] * 16, batch=0)).steps == 0  # no count read: not judged alone


def test_at_max_workers_short_of_the_mean_a_deeper_prefetch_is_not_tried_even_in_place():
    # 16 workers at the cap, a wait left: their count times the step (144 ms) is short of a 160 ms batch, so the
    # wait is from too few workers, which prefetch does not add, whether or not the change restarts the workers
    trials = [trial(0, 160, 9), trial(16, 3, 9, p50_ms=3, p90_ms=3.5)]
    budget = Budget(cpus=2.0, max_workers=16)
    for in_place in (False, True):
        assert decide(trials, budget, Policy(), in_place=in_place).action == "settle"
    capped = decide(trials, Budget(cpus=2.0, max_workers=64), Policy(), in_place=True)  # not at the cap: workers
    assert (capped.action, capped.settings.num_workers) == ("try", 23), capped.reason


def test_trial_budget_ends_tuning():
    trials = [trial(0, 160, 10, fetch_cpu_ms=1), trial(4, 40, 10), trial(8, 20, 10)]
    decision = decide(trials, Budget(cpus=2, max_workers=64), Policy(max_trials=3))
    assert decision.action == "settle" and decision.settings == cfg(8)
    assert "budget of 3 trials" in decision.reason


def test_decide_rejects_an_empty_history():
    with pytest.raises(ValueError, match="`trials` is empty"):
        decide([], BUDGET)


def test_the_hand_over_is_read_on_the_least_median_wait_with_workers():
    assert handover_s([trial(0, 0.6, 8)]) == Policy().handover_prior_s  # nothing measured with workers yet
    measured = [trial(0, 0.6, 8), trial(1, 2.5, 8, p50_ms=2.4), trial(2, 1.6, 8, p50_ms=1.5)]
    assert handover_s(measured) == pytest.approx(1.5e-3)


def test_estimate_takes_the_tightest_bound_over_the_history():
    est = estimate([trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 15, 10)], Budget(cpus=2, max_workers=64))
    assert est.batch_s == pytest.approx(0.160)  # 8 * 25 ms = 200 ms is a looser bound
    assert est.needed_workers == 20
    assert not est.cpu_bound


def test_the_jump_from_0_workers_is_sized_on_the_typical_step_not_the_mean_its_slow_steps_inflate():
    # the bursty benchmark's 0-worker window: steps of 7-8 ms and some of 19 ms (loading in the training process),
    # a mean of 12.5 ms where the step with workers takes 8 ms
    slow_steps = replace(trial(0, 60, 12.5, p90_ms=98).stats, busy_p50_s=0.008)
    [start] = [Trial(cfg(0), slow_steps)]
    assert estimate([start], BUDGET).busy_s == pytest.approx(0.008)
    assert decide([start], Budget(cpus=2, max_workers=64)).settings == cfg(16)  # ceil(1.25 * 98 / 8), not 10
    # with workers the mean stands: every step, slow or not, is one the loader must keep up with
    with_workers = replace(trial(8, 5, 12.5).stats, busy_p50_s=0.008)
    assert estimate([start, Trial(cfg(8), with_workers)], BUDGET).busy_s == pytest.approx(0.0125)
    # a window from an older cache (no median): the mean
    assert estimate([trial(0, 60, 12.5)], BUDGET).busy_s == pytest.approx(0.0125)


def test_the_jump_from_0_workers_is_sized_on_the_least_step_there():
    # the long-epoch benchmark: 2 steps at 0 workers, of 11 and 46 ms (a mean and median of 28.6 ms), where the
    # step with workers takes 10 ms: sized on the median, the jump went to 8 workers and needed a second one to 16
    slow = replace(trial(0, 170, 28.5, steps=2, p90_ms=175).stats, busy_p50_s=0.0285, busy_min_s=0.011)
    start = Trial(cfg(0), slow)
    assert estimate([start], BUDGET).busy_s == pytest.approx(0.011)
    assert decide([start], Budget(cpus=2, max_workers=16)).settings == cfg(16)  # ceil(1.25 * 175 / 11) = 20
    on_the_median = Trial(cfg(0), replace(slow, busy_min_s=0.0))  # a window from an older cache
    assert decide([on_the_median], Budget(cpus=2, max_workers=16)).settings == cfg(8)  # ceil(1.25 * 175 / 28.5)
    # with workers, the least step is not what the loader must keep up with: the mean stands
    with_workers = replace(trial(8, 5, 12.5).stats, busy_min_s=0.006)
    assert estimate([start, Trial(cfg(8), with_workers)], BUDGET).busy_s == pytest.approx(0.0125)


@pytest.mark.parametrize(
    ("a", "b", "winner"),
    [
        (trial(8, 1.0, 10), trial(16, 0.8, 10), 8),  # 2% apart: within noise, fewer workers win
        (trial(8, 3.0, 10), trial(16, 0.5, 10), 16),  # 19% apart: the faster one wins
        (trial(8, 3.0, 10, sem_ms=5), trial(16, 0.5, 10, sem_ms=5), 16),  # noise never hides > min_gain
    ],
)
def test_pick_best_is_the_cheapest_within_noise(a, b, winner):
    start = trial(0, 160, 10)  # far slower: the run moved away from it beyond doubt
    assert pick_best([start, a, b]).settings.num_workers == winner


@pytest.mark.parametrize(
    ("start", "other", "winner"),
    [
        (trial(0, 1.0, 10), trial(2, 0.6, 10), 0),  # 3.6% faster: not the min_gain it takes to move
        (trial(0, 1.0, 10, sem_ms=1.0, wait_sem_ms=1.0), trial(2, 0.1, 10, sem_ms=1.0, wait_sem_ms=1.0), 0),  # 8%
        (trial(0, 5.0, 10), trial(2, 0.1, 10), 2),  # 33% faster: a measured win
        # a 40 ms step measured in phases of 50 and 60 ms (a sleep's overshoot): the walls' noise hides an 11% win,
        # but the steps agree within their noise and the waits differ far beyond theirs: the wait decides
        (
            trial(0, 7.0, 50, steps=19, sem_ms=3.8, wait_sem_ms=0.1, busy_sem_ms=1.2),
            trial(1, 2.5, 48.5, steps=19, sem_ms=2.8, wait_sem_ms=0.3, busy_sem_ms=1.2),
            1,
        ),
        # ... or where the step at 0 workers is longer beyond its noise (loading in the training process slows it)
        (
            trial(0, 7.0, 52.7, steps=19, sem_ms=3.8, wait_sem_ms=0.1, busy_sem_ms=1.2),
            trial(1, 2.5, 48.5, steps=19, sem_ms=2.8, wait_sem_ms=0.3, busy_sem_ms=0.2),
            1,
        ),
        # ... while a step longer with workers beyond its noise (their CPU contention) is compared whole, with the
        # walls' noise
        (
            trial(0, 7.0, 45, steps=19, sem_ms=5, wait_sem_ms=0.1, busy_sem_ms=0.2),
            trial(1, 2.5, 48, steps=19, sem_ms=5, wait_sem_ms=0.3, busy_sem_ms=0.2),
            0,
        ),
    ],
)
def test_moving_away_from_the_starting_config_needs_a_win_beyond_noise(start, other, winner):
    assert pick_best([start, other]).settings.num_workers == winner


def test_a_step_shorter_within_its_noise_still_counts_where_the_walls_show_the_win():
    # dltune demo: 10 workers took 1.6 ms off a 13.3 ms step (within its noise) and 0.6 ms off the wait: on the
    # waits alone 4% (not the 5% it takes), on the walls 13% beyond their noise
    from lightning_dltune.tuning.compare import faster_by

    six = trial(6, 3.5, 13.3, steps=55, sem_ms=0.5, wait_sem_ms=0.4, busy_sem_ms=1.0)
    ten = trial(10, 2.9, 11.7, steps=59, sem_ms=0.5, wait_sem_ms=0.35, busy_sem_ms=1.0)
    gain, noise = faster_by(six, ten)
    assert gain > 0.1 * six.compared_sec_per_sample and gain > noise
    decision = decide([trial(0, 72, 15, steps=3, fetch_cpu_ms=5), six, ten], BUDGET)
    assert "stopped paying" not in decision.reason


def on_gpu(t, host_ms, host_sem_ms, gpu_ms):
    """``t`` with a host whose time per step is ``host_ms`` (trimmed) and a GPU timeline that read every step."""
    stats = replace(
        t.stats,
        wall_trim_s=host_ms / 1e3,
        wall_trim_sem_s=host_sem_ms / 1e3,
        gpu_steps=t.stats.steps,
        gpu_wall_trim_s=gpu_ms / 1e3,
        gpu_wall_trim_sem_s=0.01 / 1e3,
    )
    return Trial(t.settings, stats)


def test_a_host_running_ahead_of_the_gpu_is_compared_on_the_gpus_time():
    # 11 ms of GPU time per step, 7 ms with pinned copies; the host queues work ahead and measures its own pace,
    # noisy (the queue fills, then the host blocks): on the host's time the gain is within noise
    start = on_gpu(trial(0, 0.3, 3.2), 3.5, 1.5, 11.0)
    pinned = Trial(replace(cfg(0), pin_memory=True), on_gpu(trial(0, 0.3, 1.1), 1.4, 0.05, 7.0).stats)
    assert pick_best([start, pinned]) is pinned
    # a GPU that waits for the host: the host's time is the run's, whatever the GPU measured
    assert on_gpu(trial(0, 0.3, 3.2), 3.5, 0.1, 2.0).compared_sec_per_sample == pytest.approx(3.5e-3 / 16)


@pytest.mark.parametrize(
    ("trials", "settled", "prefix"),
    [
        ([trial(0, 0.1, 10)], cfg(0), "accelerator-bound"),
        ([trial(0, 160, 10), trial(16, 0.2, 10)], cfg(16), "input-bound at the start"),
        # in-memory data at 0 workers: the wait is CPU spent assembling the batch, and workers only add copies
        (
            [trial(0, 3, 10, fetch_cpu_ms=3), trial(2, 8, 10)],
            cfg(0),
            "input-bound by assembling batches sample by sample",
        ),
        # ... or where receiving a batch from a worker would cost about what assembling it here does: none tried
        ([trial(0, 0.6, 8, fetch_cpu_ms=0.6)], cfg(0), "input-bound by assembling batches sample by sample"),
        ([trial(0, 40, 10, fetch_cpu_ms=40), trial(2, 12, 10, worker_cpu_ms=40)], cfg(2), "input-bound and CPU-bound"),
    ],
)
def test_diagnosis(trials, settled, prefix):
    assert diagnose(trials, settled, BUDGET).startswith(prefix)


def with_mem(t, worker_mib, batch_mib=0.0, growth_mib=0.0, main_mib=0.0, epoch=0, total_mib=None):
    """``t`` with its workers measured at ``worker_mib`` each (their sum ``total_mib``), growing ``growth_mib``
    per batch a worker loads, in a process of ``main_mib`` and an epoch of ``epoch`` batches."""
    from dataclasses import replace

    from lightning_dltune.measurement.memory import WorkerMemory

    w = t.settings.num_workers
    total = worker_mib * w if total_mib is None else total_mib
    mem = WorkerMemory(worker_mib * MiB, growth_mib * MiB, worker_mib * MiB, total * MiB, 1 if worker_mib else 0)
    return replace(t, stats=t.stats.with_memory(mem, batch_mib * MiB, main_mib * MiB, epoch))


def test_a_settle_on_workers_never_measured_quotes_the_window_under_the_config_it_ran_on():
    # 4 workers measured, then predicted to outgrow the budget: the tuner settles on the 3 that fit, unmeasured. The
    # stall quoted is the 4 workers' (not 3's), and 4 workers are not "more workers that did not help"
    measured = [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(4, 20, 10), 60, growth_mib=0.5, epoch=40)]
    text = diagnose(measured, cfg(3), Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20))
    assert text.startswith(
        "input-bound and held back by the memory budget: still 67% of the time waiting for data with workers=4 "
        "prefetch=2, the last config measured (workers=3 prefetch=2, settled on, was not), the model wants"
    ), text
    text = diagnose(measured, cfg(3), BUDGET)  # no memory budget: the cap is max_workers'
    assert "workers=4 prefetch=2, the last config measured" in text and "did not help" not in text, text


@pytest.mark.parametrize(
    ("trials", "budget", "action", "expected", "why"),
    [
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1)],
            Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20),
            "try",
            cfg(3),
            "memory budget",
            id="unmeasured workers: the 64 MiB prior caps the first jump",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(3, 45, 10), 40)],
            Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20),
            "try",
            cfg(5),
            "memory budget (40 MiB per worker)",
            id="measured worker memory sets the cap",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(5, 20, 10), 40)],
            Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20),
            "settle",
            cfg(5),
            "memory budget",
            id="at the memory cap: settle",
        ),
        pytest.param(
            [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(5, 20, 10, p50_ms=2, p90_ms=40), 40)],
            Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20),
            "settle",
            cfg(5),
            "memory budget",
            id="at the memory cap, bursty waits get no deeper prefetch: workers loading further ahead grow sooner",
        ),
        pytest.param(
            [with_mem(trial(0, 160, 10, fetch_cpu_ms=1), 0, 16)],
            Budget(cpus=2, max_workers=64, shm_bytes=128 * 2**20),
            "try",
            cfg(2),
            "shared memory",
            id="batches in flight must fit half of /dev/shm",
        ),
    ],
)
def test_memory_and_shm_caps(trials, budget, action, expected, why):
    decision = decide(trials, budget, Policy())
    assert (decision.action, decision.settings) == (action, expected), decision.reason
    assert why in decision.reason


def test_a_switch_must_pay_for_its_start_up_in_the_steps_left():
    start = trial(0, 160, 10, fetch_cpu_ms=1)  # 170 ms a step; 16 workers would make it about 10 ms
    assert decide([start], BUDGET, remaining_steps=None).action == "try"  # unknown length: always worth it
    assert decide([start], BUDGET, remaining_steps=100).action == "try"  # saves ~16 s, costs ~0.8 s
    held = decide([start], BUDGET, remaining_steps=4)  # saves ~0.6 s, costs 16 x 0.05 s prior
    assert held.action == "hold" and held.settings == cfg(16)
    assert "over the 4 steps left, less than the 0.80 s" in held.reason


def test_restart_cost_is_measured_per_worker_on_earlier_trials():
    from dataclasses import replace

    from lightning_dltune.tuning.model import restart_cost_s

    assert restart_cost_s([trial(0, 160, 10)], 8) == pytest.approx(8 * Policy().startup_prior_s)
    measured = trial(4, 30, 10)
    measured = replace(measured, stats=replace(measured.stats, startup_s=0.8))  # 0.2 s per worker
    assert restart_cost_s([trial(0, 160, 10), measured], 8) == pytest.approx(1.6)
    # 4 -> 16 workers saves ~30 ms a step and costs 16 x 0.2 s = 3.2 s: worth it over 200 steps, not over 100
    history = [trial(0, 160, 10, fetch_cpu_ms=1), measured]
    assert decide(history, BUDGET, remaining_steps=200).action == "try"
    held = decide(history, BUDGET, remaining_steps=100)
    assert held.action == "hold" and held.settings == cfg(16) and "less than the 3.20 s" in held.reason


def test_a_start_in_the_background_is_charged_its_build_not_its_first_batches():
    from lightning_dltune.tuning.model import restart_cost_s

    # 4 workers started in the open: 0.8 s, of which 0.1 s building the loader, the rest its first batches
    opened = trial(4, 30, 10)
    opened = replace(opened, stats=replace(opened.stats, startup_s=0.8, build_s=0.1))
    history = [trial(0, 160, 10, fetch_cpu_ms=1), opened]
    assert restart_cost_s(history, 16) == pytest.approx(3.2)
    assert restart_cost_s(history, 16, behind=True) == pytest.approx(0.4)  # 16 x 0.1 s / 4
    # inside an epoch, 4 -> 16 starts behind the 4 workers: over 100 steps it pays, as it does not in the open
    assert decide(history, BUDGET, remaining_steps=100, in_epoch=True).action == "try"
    assert decide(history, BUDGET, remaining_steps=100).action == "hold"  # at an epoch's end: in the open
    # once a background start was measured, its overlap's cost is what the next one is charged
    behind = trial(8, 10, 10)
    behind = replace(behind, stats=replace(behind.stats, startup_s=0.4, build_s=0.08, startup_behind=1))
    assert restart_cost_s([*history, behind], 16, behind=True) == pytest.approx(0.8)
    assert restart_cost_s([*history, behind], 16) == pytest.approx(3.2)  # in the open: the largest measured


def test_a_prefetch_change_made_on_the_running_workers_is_charged_no_restart():
    # 16 workers (the cap) and bursty waits: deeper prefetch is the next move; restarting 16 workers costs 16 x 0.2 s
    running = trial(16, 3.0, 9, p50_ms=0.5, p90_ms=12)
    running = replace(running, stats=replace(running.stats, startup_s=3.2))
    history = [trial(0, 70, 12, fetch_cpu_ms=1), running]
    held = decide(history, BUDGET, remaining_steps=200)  # saves about 1.5 ms x 200 = 0.3 s, less than 3.2 s
    assert held.action == "hold" and held.settings == cfg(16, 4)
    tried = decide(history, BUDGET, remaining_steps=200, in_place=True)  # the same workers go on: nothing to pay
    assert (tried.action, tried.settings) == ("try", cfg(16, 4)), tried.reason
    # from 0 workers every worker starts, in place or not
    assert decide([trial(0, 160, 10, fetch_cpu_ms=1)], BUDGET, remaining_steps=4, in_place=True).action == "hold"


@pytest.mark.parametrize(
    ("last", "still"),
    [
        # 11 workers over 12 steps read slower than 6 over 35, within a bursty window's noise: it runs on
        pytest.param(trial(11, 7.0, 10, steps=12, sem_ms=4.0, wait_sem_ms=4.0), True, id="slower within noise"),
        # the same reading with little noise: more workers stopped paying, judged now
        pytest.param(trial(11, 7.0, 10, steps=12, sem_ms=0.2, wait_sem_ms=0.2), False, id="slower beyond noise"),
        # a gain of min_gain or more is judged at once, noise or not
        pytest.param(trial(11, 1.0, 10, steps=12, sem_ms=4.0, wait_sem_ms=4.0), False, id="faster"),
        # 4 x min_steps steps: judged whatever the noise
        pytest.param(trial(11, 7.0, 10, steps=32, sem_ms=4.0, wait_sem_ms=4.0), False, id="long enough"),
    ],
)
def test_a_window_whose_comparison_is_within_noise_runs_on_up_to_four_times_min_steps(last, still):
    from lightning_dltune.tuning.windows import still_open

    history = [trial(0, 40, 8, fetch_cpu_ms=1), trial(6, 4.0, 10, steps=35, sem_ms=0.5, wait_sem_ms=0.5)]
    assert still_open([*history, last]) == still
    assert not still_open(history[:1])  # nothing to compare with
    if still:  # judged at its end, it would have settled on the 6 workers for good
        judged = decide([*history, last], BUDGET)
        assert judged.settings == cfg(6) and "stopped paying" in judged.reason


# the CPU-bound start: 3 steps at 0 workers, 23.4 ms each, loading on the training process's CPU
CPU_START = trial(0, 16.5, 6.9, steps=3, fetch_cpu_ms=16.0, sem_ms=0.3, wait_sem_ms=0.3, min_wall_ms=23.0)


@pytest.mark.parametrize(
    ("history", "shown"),
    [
        # 2 workers read 17 ms a step, but a busy host made their 8 steps noisy: more of their steps show the win
        # (or not); judged now, a settle would go back to 0 workers for good
        pytest.param([trial(2, 10.0, 7.0, steps=8, sem_ms=5.0, wait_sem_ms=5.0)], False, id="win within noise"),
        # the same reading with little noise: a win, judged now
        pytest.param([trial(2, 10.0, 7.0, steps=8, sem_ms=0.3, wait_sem_ms=0.3)], True, id="win beyond noise"),
        # slower than the start beyond noise: nothing a longer window could win
        pytest.param([trial(2, 18.0, 7.0, steps=8, sem_ms=0.3, wait_sem_ms=0.3)], True, id="slower"),
        # 4 x min_steps steps: judged whatever the noise
        pytest.param([trial(2, 10.0, 7.0, steps=32, sem_ms=5.0, wait_sem_ms=5.0)], True, id="long enough"),
        # 4 workers, noisy, after 2 workers that read faster: 2 workers are the likelier pick, the start is not
        # what 4 workers must beat
        pytest.param(
            [trial(2, 9.0, 7.0, steps=8, sem_ms=0.3, wait_sem_ms=0.3), trial(4, 14.0, 7.0, steps=8, sem_ms=5.0)],
            True,
            id="not the fastest",
        ),
    ],
)
def test_a_win_over_a_start_at_0_workers_within_noise_is_not_yet_shown(history, shown):
    from lightning_dltune.tuning.compare import pick_best
    from lightning_dltune.tuning.windows import win_not_yet_shown

    trials = [CPU_START, *history]
    assert win_not_yet_shown(trials) is not shown
    if not shown:  # judged at its end, the choice would go back to the start
        assert pick_best(trials) is CPU_START


def test_a_start_with_workers_is_not_waited_on_for_a_win():
    from lightning_dltune.tuning.windows import win_not_yet_shown

    # the user's 4 workers, then 8 that read faster within noise: settling keeps the running 8 (stay_on_running),
    # nothing goes back to the start, so nothing is gained by running on
    history = [trial(4, 3.0, 10, steps=20, sem_ms=0.5, wait_sem_ms=0.5), trial(8, 0.2, 10, steps=8, sem_ms=3.0)]
    assert not win_not_yet_shown(history)
    assert decide(history, BUDGET).settings == cfg(8)


def test_workers_added_beside_the_running_ones_are_charged_only_their_own_start():
    # 8 workers that stall: more workers are the next move. A restart costs 0.2 s a worker (measured), forking one
    # 0.02 s (its build); 100 steps left
    running = trial(8, 10, 10)
    running = replace(running, stats=replace(running.stats, startup_s=1.6, build_s=0.16))
    history = [trial(0, 160, 10, fetch_cpu_ms=1), running]
    held = decide(history, BUDGET, remaining_steps=100)  # restarting 16 workers in the open: 3.2 s
    assert held.action == "hold" and held.settings.num_workers > 8, held.reason
    added = decide(history, BUDGET, remaining_steps=100, in_place=True)  # 8 more start beside the 8: 0.16 s
    assert (added.action, added.settings) == ("try", held.settings), added.reason


def test_fewer_workers_measured_faster_are_gone_back_to_only_where_the_steps_left_pay_for_their_restart():
    # the bursty benchmark: 13 workers, then 16 measured 1.1 ms a step slower (beyond noise). Going back to 13 is a
    # new loader between epochs: its workers start again (0.05 s each, measured), and the epoch starts empty
    thirteen = trial(13, 4.0, 7.2, steps=35, sem_ms=0.2)
    thirteen = replace(thirteen, stats=replace(thirteen.stats, startup_s=0.65))
    history = [trial(0, 60, 7.0, steps=3), thirteen, trial(16, 5.1, 7.2, steps=39, sem_ms=0.2)]
    # saves about 0.26 s, against a 0.65 s restart: the run holds on 16, and 13, measured faster, is the result
    short = decide(history, BUDGET, remaining_steps=240)
    assert (short.action, short.settings) == ("hold", cfg(13)), short.reason
    assert "going back to workers=13 prefetch=2 would save about 0.26 s" in short.reason
    state = TuningState()
    state.trials, state.start, state.current = history[:-1], cfg(0), cfg(16)
    assert state.apply(short, history[-1].stats, BUDGET, step=77) is None  # nothing to build: the run stays on 16
    assert state.phase.value == "held" and state.result == cfg(13) and state.cacheable() == cfg(13)
    long = decide(history, BUDGET, remaining_steps=2000)  # 2.2 s saved: worth the restart
    assert (long.action, long.settings) == ("settle", cfg(13)), long.reason
    unknown = decide(history, BUDGET)  # a run of unknown length: the faster config
    assert (unknown.action, unknown.settings) == ("settle", cfg(13)), unknown.reason


def test_going_back_to_a_shallower_prefetch_on_the_running_workers_is_free_so_the_cheaper_config_is_chosen():
    history = [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 2.0, 10), trial(16, 1.9, 10, prefetch=4)]
    assert decide(history, BUDGET).settings == cfg(16, 4)  # a restart to go back: the running config stays
    back = decide(history, BUDGET, in_place=True)  # made on the running workers: nothing to restart
    assert (back.action, back.settings) == ("settle", cfg(16)) and "deeper prefetch did not pay" in back.reason


def test_the_step_with_workers_is_compared_with_the_step_the_jump_was_sized_on():
    from lightning_dltune.tuning.windows import sized_on_a_longer_step

    # 0 workers: a mean step of 12.5 ms inflated by slow steps, a median of 8 ms (what the jump was sized on)
    start = Trial(cfg(0), replace(trial(0, 60, 12.5).stats, busy_p50_s=0.008))
    jumped = trial(16, 3.0, 8.0, steps=4, wait_sem_ms=0.5, busy_sem_ms=0.2)
    assert not sized_on_a_longer_step([start, jumped])  # 8 ms is the step it was sized on: no early re-judging
    assert sized_on_a_longer_step([trial(0, 60, 12.5), jumped])  # a mean of 12.5 ms did size it on too long a step


def test_once_a_config_went_over_the_memory_budget_none_with_more_workers_is_chosen():
    # the user's 4 workers measured before their memory grew; 4 workers with prefetch 4 then went over the budget
    # (their growth, not the prefetch), and 3 was as far as the memory held: 4 must not come back
    before_growth = trial(4, 4.5, 22.8, steps=10)
    history = [
        before_growth,
        trial(4, 5.4, 22.5, prefetch=4, failed="over the memory budget"),
        trial(3, 4.8, 22.8, prefetch=4),
    ]
    assert pick_best(history).settings == cfg(4)  # without the limit: the fastest, cheapest start
    assert pick_best(history, memory_limit=3).settings == cfg(3, 4)
    held = decide(history, Budget(cpus=2.0, max_workers=3), memory_limit=3)
    assert held.settings.num_workers <= 3, held.reason


def rate(t):
    return t.stats.samples_per_s


@pytest.mark.parametrize(
    "entry, window, verified",
    [
        # under the threshold: verified whatever the entry says
        ({}, trial(2, 2.0, 60.0), True),
        # settled at 4.5%, now 5.9% at the same throughput: noise around the threshold, not a stale config
        ("settled 4.5%", trial(2, 4.0, 64.0), True),
        # ... but not without a recorded throughput, nor when the throughput fell
        ({"stall_frac": 0.045}, trial(2, 4.0, 64.0), False),
        ("settled 4.5%, faster then", trial(2, 4.0, 64.0), False),
        # an entry that settled stalling is held to the threshold (the stale-config case)
        ("settled 20%", trial(2, 4.0, 64.0), False),
        # the tolerance is the noise floor, not more
        ("settled 4.5%", trial(2, 8.0, 64.0), False),
    ],
)
def test_verify_cached_tolerates_noise_around_the_threshold_only(entry, window, verified):
    same = rate(window)
    entry = (
        {
            "settled 4.5%": {"stall_frac": 0.045, "samples_per_s": same},
            "settled 4.5%, faster then": {"stall_frac": 0.045, "samples_per_s": same * 1.2},
            "settled 20%": {"stall_frac": 0.20, "samples_per_s": same},
        }[entry]
        if isinstance(entry, str)
        else entry
    )
    got = verify_cached(entry, Trial(window.settings, window.stats), BUDGET, Policy())
    assert (got is not None) == verified
    if verified:
        assert got.action == "settle" and "cached settings verified" in got.reason


@pytest.mark.parametrize(
    ("running", "lead"),
    [
        # 0 workers, 340 ms a step of which 320 ms loading: take over at once. The training process cannot load
        # while it starts the new workers, and each of them loads as soon as it has started (iterate_growing):
        # the first is ready as the last starts, where one more batch loaded first would come on top of it
        (trial(0, 320.0, 20.0), 0),
        (trial(0, 2.0, 20.0), 0),
        # 4 workers, 50 ms a step: a batch takes up to 200 ms to load, 4 steps
        (trial(4, 30.0, 20.0), 4),
        # capped: never more than 64 steps of the slower config
        (trial(100, 0.0, 1.0), 64),
    ],
)
def test_handover_lead_is_what_fits_in_a_new_workers_first_batch(running, lead):
    from lightning_dltune.tuning.model import handover_lead

    assert handover_lead([running]) == lead
    assert handover_lead([]) == 0  # nothing measured: take over at once


@pytest.mark.parametrize(
    ("start", "best_kept"),
    [
        # 3 steps of a bursty wait at 0 workers (40-200 ms, a window left early by the sign test): the mean's error
        # cannot show 16 workers' 10.5 ms steps faster, every step of the start being slower than them does
        (trial(0, 95, 10, steps=3, sem_ms=60, wait_sem_ms=60, min_wall_ms=50), True),
        (trial(0, 95, 10, steps=3, sem_ms=60, wait_sem_ms=60), False),  # the least step not measured
        (trial(0, 95, 10, steps=3, sem_ms=60, wait_sem_ms=60, min_wall_ms=10.6), False),  # one step as fast
        (trial(0, 95, 10, steps=2, sem_ms=60, wait_sem_ms=60, min_wall_ms=50), False),  # too few steps
    ],
)
def test_leaving_the_start_is_shown_by_every_one_of_its_steps_being_slower(start, best_kept):
    from lightning_dltune.tuning.compare import pick_best

    workers = trial(16, 0.5, 10, steps=20, sem_ms=0.5)
    assert pick_best([start, workers]) is (workers if best_kept else start)
