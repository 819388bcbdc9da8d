"""One case per diagnosis (``diagnose.DIAGNOSES`` and ``stall_left``): the measurements that select it, and what it
says. A diagnosis added without a case here fails ``test_every_diagnosis_has_a_case``."""

from dataclasses import replace

import pytest

from lightning_dltune.tuning.diagnose import DIAGNOSES, diagnose, diagnosed
from lightning_dltune.tuning.model import Budget

from test_decide import BUDGET, cfg, trial, with_mem
from test_rules import CPU_STEP, copies, stepping_on

WIDE = Budget(cpus=2.0, max_workers=64)


def with_host_work(t, other_ms):
    return replace(t, stats=replace(t.stats, other_s=other_ms * t.stats.steps / 1e3))


# name: (trials, settled, budget, held, what it says)
CASES = {
    "nothing_measured_dx": (
        [trial(4, 0, 0, steps=0, failed="workers failed to start")],
        cfg(0),
        BUDGET,
        False,
        "unknown: workers=4 prefetch=2 failed (workers failed to start)",
    ),
    "host_bound": ([with_host_work(trial(0, 1, 2), 8)], cfg(0), BUDGET, False, "host-bound: 8.0 ms per step"),
    "transfer_bound": ([copies(trial(0, 0.1, 10), 8, 4)], cfg(0), BUDGET, False, "transfer-bound"),
    "accelerator_bound": ([trial(0, 0.1, 10)], cfg(0), BUDGET, False, "accelerator-bound"),
    "loading_hidden": ([trial(0, 160, 10), trial(16, 0.2, 10)], cfg(16), BUDGET, False, "input-bound at the start"),
    # beside a step on both CPUs, 8 workers at prefetch 8 loaded each 64-batch epoch ahead: 30 ms a step against 44
    "loaded_ahead": (
        [replace(CPU_STEP, rule="load_epoch_ahead"), trial(8, 5, 25, prefetch=8)],
        cfg(8, 8),
        BUDGET,
        False,
        "CPU contention, avoided by loading ahead: the step computes on 2.0 of the 2 CPUs, so workers loading beside "
        "it would slow it; workers=8 prefetch=8 hold 64 batches in flight and load each epoch's batches in a burst "
        "at its start, after which the step runs alone: 1.88 ms a sample against 2.75 ms with workers=0",
    ),
    # 2 ranks on 8 workers: rank 1's samples take 6x as long, and it still waits 39% of the time, rank 0 2%
    "one_rank_holds_up": (
        [
            replace(trial(0, 160, 10, fetch_cpu_ms=1), ranks=(0.5, 0.94)),
            replace(trial(8, 6.4, 10), ranks=(0.02, 0.39)),
        ],
        cfg(8),
        Budget(cpus=2.0, max_workers=8),
        False,
        "input-bound on rank 1: its loader holds every rank up (it waited 39% of the time, rank 0 2%, which waits "
        "for it inside the all-reduce); every rank runs on workers=8 prefetch=2; the model wants",
    ),
    "held_by_memory": (
        [trial(0, 160, 10, fetch_cpu_ms=1), with_mem(trial(4, 20, 10), 60, growth_mib=0.5, epoch=40)],
        cfg(3),
        Budget(cpus=2, max_workers=64, memory_bytes=200 * 2**20),
        False,
        "input-bound and held back by the memory budget",
    ),
    "held_by_shm": (
        [with_mem(trial(0, 160, 10, fetch_cpu_ms=1), 0, 16), with_mem(trial(2, 60, 10), 0, 16)],
        cfg(2),
        Budget(cpus=2, max_workers=64, shm_bytes=128 * 2**20),
        False,
        "input-bound and held back by the shared memory (/dev/shm) budget",
    ),
    # 2 workers made the 20 ms step 50 ms, and the run went back to 0 workers
    "workers_contend": (
        [CPU_STEP, trial(2, 5, 50, steps=6, min_wall_ms=54)],
        cfg(0),
        BUDGET,
        False,
        "CPU contention: with workers=2 prefetch=2 the step took 2.5x longer (50 ms against 20 ms): workers and "
        "training share the 2 CPUs; `torch.set_num_threads(n)` with n under 2 leaves CPUs to workers (the step "
        "computes on 2.0)",
    ),
    "cpu_bound": (
        [trial(0, 40, 10, fetch_cpu_ms=40), trial(2, 12, 10, worker_cpu_ms=40)],
        cfg(2),
        BUDGET,
        False,
        "input-bound and CPU-bound",
    ),
    "built_sample_by_sample": (
        [trial(0, 3, 10, fetch_cpu_ms=3), trial(2, 8, 10)],
        cfg(0),
        BUDGET,
        False,
        "input-bound by assembling batches sample by sample",
    ),
    "more_workers_did_not_help": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 20, 10), trial(16, 20, 10)],
        cfg(8),
        WIDE,
        False,
        "and more workers did not help",
    ),
    "max_workers_too_low": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(16, 5, 10)],
        cfg(16),
        BUDGET,
        False,
        "over the tuner's ceiling of 16 workers (set `max_workers` to change it): raise it",
    ),
    "stopped_for_the_run": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 10, 10)],
        cfg(8),
        WIDE,
        True,
        "input-bound: still 50% of the time waiting for data with workers=8 prefetch=2 (",
    ),
    "stall_left": (
        [trial(0, 160, 10, fetch_cpu_ms=1), trial(8, 10, 10)],
        cfg(8),
        WIDE,
        False,
        "its cause was not measured (the waits are not bursty and the trial budget was not spent)",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_diagnosis_is_selected_by_its_measurements(name):
    trials, settled, budget, held, says = CASES[name]
    got, text = diagnosed(trials, settled, budget, held=held)
    assert got == name and says in text, text


def test_more_workers_did_not_help_where_the_config_kept_was_not_faster_than_one_with_fewer():
    # the dltune demo's shape on 2 CPUs: 10 workers, then 15, no faster; the tuner stays on 15 (going back would
    # restart the workers for nothing), and the stall left is said with what was measured and the fixes
    trials = [trial(0, 160, 10, fetch_cpu_ms=1), trial(10, 20, 10), trial(15, 21, 10)]
    got, text = diagnosed(trials, cfg(15), WIDE)
    assert got == "more_workers_did_not_help", text
    assert "(workers=15 prefetch=2 was not 5% faster than workers=10 prefetch=2)" in text, text
    assert text.endswith("give the job more CPUs, or use faster storage."), text
    assert diagnosed([trials[0], trial(10, 40, 10), trial(15, 20, 10)], cfg(15), WIDE)[0] != got  # 15 paid


def test_what_is_left_says_what_was_measured():
    """The stall left, where no other diagnosis applies: bursty waits where they are, the trial budget where it was
    spent, else plainly not measured (never a guess between the two)."""
    start = trial(0, 160, 10, fetch_cpu_ms=1)
    bursty = diagnosed([start, trial(8, 10, 10, p50_ms=2, p90_ms=30)], cfg(8), WIDE)[1]
    assert "waits are bursty (p90 30.0 ms against a median of 2.0 ms)" in bursty, bursty
    spent = [start, trial(4, 30, 10), trial(6, 20, 10), trial(7, 15, 10), trial(8, 12, 10), trial(9, 10, 10)]
    assert "the trial budget (6) ran out" in diagnosed(spent, cfg(9), WIDE)[1]


def test_a_held_run_says_why_it_stopped():
    from lightning_dltune.tuning.model import Decision

    trials, settled, budget, _, _ = CASES["stopped_for_the_run"]
    held = Decision("hold", cfg(16), "workers=16 prefetch=2 would save about 0.10 s over the 8 steps left")
    text = diagnose(trials, settled, budget, held=held)
    assert text.endswith("a longer or resumed run goes on to workers=16 prefetch=2."), text


def test_every_diagnosis_has_a_case():
    assert {d.__name__ for d in DIAGNOSES} | {"stall_left"} == set(CASES)


def test_contention_is_said_where_the_step_measurably_slowed_and_alike_for_readings_within_noise():
    trials, settled, budget, _, _ = CASES["workers_contend"]
    # readings of the same runs a little apart (the steps 1 ms longer or shorter, noisier): the same diagnosis
    for step_ms, sem_ms in ((49.0, 0.5), (51.0, 2.0)):
        other = [CPU_STEP, trial(2, 5, step_ms, steps=6, busy_sem_ms=sem_ms)]
        assert diagnosed(other, settled, budget)[0] == "workers_contend"
    # nothing tried: the model expected the step stretched by the loading as long as it is now
    expected = diagnose([CPU_STEP], cfg(0), budget)
    assert diagnosed([CPU_STEP], cfg(0), budget)[0] == "workers_contend"
    assert expected.startswith(
        "CPU contention expected: the step computes on 2.0 of the 2 CPUs, and loading a batch takes 24.0 ms of CPU "
        "that the CPUs it leaves idle cannot hold: workers would slow the step about as much as they hide (44 ms a "
        "step predicted against 44 ms now), so none were tried"
    ), expected
    # where the step leaves CPUs idle, the model expected a gain: not contention
    assert diagnosed([stepping_on(CPU_STEP, 1.0)], cfg(0), budget)[0] != "workers_contend"
    # a step that computes on under half a CPU is not contention
    light = stepping_on(CPU_STEP, 0.2)
    assert diagnosed([light, *trials[1:]], settled, budget)[0] != "workers_contend"
    # nor a trial whose step took as long as at 0 workers, even where the quickest step at 0 workers was shorter
    quick = replace(CPU_STEP, stats=replace(CPU_STEP.stats, busy_min_s=0.015))
    assert diagnosed([quick, trial(2, 5, 20, steps=6)], settled, budget)[0] != "workers_contend"
