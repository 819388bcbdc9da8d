"""The cost model: every prediction the rules make is one ``model.predict``, with these fields."""

from dataclasses import replace

import pytest

from lightning_dltune.tuning.model import Budget, Policy, estimate, predict

from test_decide import BUDGET, cfg, trial, with_mem
from test_rules import copies

MiB = 2**20
START = trial(0, 160, 10, fetch_cpu_ms=1)  # 160 ms to load a batch in the training process, a 10 ms step


def test_more_workers_take_the_busy_time_and_a_hand_over_or_the_loader_s_pace():
    est = estimate([START], BUDGET)
    p = predict(cfg(8), est, [START])
    # 8 workers deliver a batch every 20 ms; the step (10 ms) and a hand-over before one was measured (1 ms) are less
    assert p.step_s == pytest.approx(0.160 / 8)
    assert p.wait_s == pytest.approx(0.160 / 8 - 0.010)
    p = predict(cfg(32), est, [START])  # enough workers: the step and the hand-over
    assert p.step_s == pytest.approx(0.010 + Policy().handover_prior_s)


def test_the_cpus_the_workers_get_bound_their_pace():
    # 4 workers used 1.2 CPUs (60 ms of CPU a 50 ms step); 16 would get at most the budget's 2 CPUs
    running = trial(4, 40, 10, worker_cpu_ms=60)
    trials = [START, running]
    est = estimate(trials, BUDGET)
    assert predict(cfg(16), est, trials).step_s == pytest.approx(0.060 / 2)


def test_deeper_prefetch_and_pinned_memory_take_their_share_off_the_step():
    trials = [START, trial(16, 2.0, 10)]
    est = estimate(trials, BUDGET)
    assert predict(cfg(16, 4), est, trials).step_s == pytest.approx(0.012 - Policy().prefetch_absorbs * 0.002)
    copied = copies(trial(16, 2.0, 10), copy_ms=4.0, step_ms=8.0)
    pinned = replace(cfg(16), pin_memory=True)
    p = predict(pinned, estimate([START, copied], BUDGET), [START, copied])
    assert p.step_s == pytest.approx(0.012 - Policy().pinned_copy_saves * 0.004)


def test_memory_and_shared_memory_of_the_workers_and_their_batches_in_flight():
    measured = with_mem(trial(4, 20, 10), 30, batch_mib=1.0)
    trials = [START, measured]
    est = estimate(trials, Budget(cpus=2, max_workers=64, memory_bytes=1000 * MiB))
    p = predict(cfg(8), est, trials)
    assert p.memory_bytes == pytest.approx(8 * (30 + 2 * 1.0) * MiB)  # each worker and its 2 prefetched batches
    assert p.shm_bytes == pytest.approx(16 * MiB)
    pinned = predict(replace(cfg(8), pin_memory=True), est, trials)
    assert pinned.memory_bytes == pytest.approx(p.memory_bytes + 1.0 * MiB)  # the pin thread's batch


def test_what_a_start_costs_depends_on_where_the_switch_is_made():
    trials = [START, trial(8, 20, 10)]
    est = estimate(trials, BUDGET)
    prior = Policy().startup_prior_s
    assert predict(cfg(16), est, trials).start_s == pytest.approx(16 * prior)  # a new loader, in the open
    assert predict(cfg(16), est, trials, in_place=True).start_s == pytest.approx(8 * prior)  # 8 added beside
    assert predict(cfg(8, 4), est, trials, in_place=True).start_s == 0.0  # prefetch on the running workers


def test_a_step_that_computes_on_the_cpus_is_delayed_by_the_loading_its_idle_cpus_cannot_hold():
    from lightning_dltune.tuning.model import contended_s

    from test_rules import CPU_STEP, stepping_on

    # a 20 ms step on both of the 2 CPUs, its threads in lockstep, and 24 ms of CPU to load a batch: no CPU is idle
    # while it steps, so the loading delays it by all 24 ms (the measured 2-worker trial: 19 ms to 45-47 ms)
    est = estimate([CPU_STEP], BUDGET)
    assert contended_s(est) == pytest.approx(0.020 + 0.024)
    assert predict(cfg(2), est, [CPU_STEP]).step_s == pytest.approx(contended_s(est))
    # on 1.8 CPUs: two threads, no CPU free of them (their short idle gaps hold no batch): all 24 ms again
    assert contended_s(estimate([stepping_on(CPU_STEP, 1.8)], BUDGET)) == pytest.approx(0.020 + 0.024)
    # a step on one thread is slowed toward a fair share, in the share of the CPUs it uses: on 1 CPU of 2, 44 ms of
    # work on 2 CPUs (22 ms), 2 ms past the step, half of it; on half a CPU the fair share is the step alone; a step
    # on none is not slowed
    assert contended_s(estimate([stepping_on(CPU_STEP, 1.0)], BUDGET)) == pytest.approx(0.021)
    assert contended_s(estimate([stepping_on(CPU_STEP, 0.5)], BUDGET)) == pytest.approx(0.020)
    assert contended_s(estimate([stepping_on(CPU_STEP, 0.0)], BUDGET)) == pytest.approx(0.020)
    # loading far heavier than a one-thread step (200 ms of CPU a batch, a 20 ms step on 1 CPU of 2): not 200 ms a
    # step, but halfway from the step to the CPU work over the CPUs (110 ms), 65 ms
    heavy = stepping_on(trial(0, 200, 20, fetch_cpu_ms=200), 1.0)
    assert contended_s(estimate([heavy], BUDGET)) == pytest.approx(0.065)
    # two threads in lockstep, 100 ms of loading a batch: all of it delays the 20 ms step (120 ms), under twice the
    # fair share ((100 + 40) / 2 x 2 = 140 ms)
    two = estimate([stepping_on(trial(0, 100, 20, fetch_cpu_ms=100), 2.0)], BUDGET)
    assert contended_s(two) == pytest.approx(0.120)


def test_a_loader_waiting_on_i_o_is_paced_by_its_batch_time_not_its_workers_cpu_share():
    # 8 workers that use 0.5 ms of CPU a 30 ms step (storage-bound): 16 are paced by the 160 ms batch, 10 ms; the
    # running workers' CPU share (1/60 of a CPU, doubled) would read 15 ms
    trials = [START, trial(8, 20, 10, worker_cpu_ms=0.5)]
    assert predict(cfg(16), estimate(trials, BUDGET), trials).step_s == pytest.approx(0.010)
