"""The memory model (pure) and the watch that feeds it: prior, measured, growing, over budget."""

import math

import pytest

from lightning_dltune.measurement.memory import (
    MemorySample,
    MiB,
    WorkerMemory,
    fit,
    in_flight_bytes,
    lead_bytes,
    max_workers,
    over_budget,
    safe_workers,
    total_bytes,
    worker_bytes,
)
from lightning_dltune.measurement.probe import MemoryWatch
from lightning_dltune.tuning.diagnose import diagnose
from lightning_dltune.tuning.model import Budget, Policy, estimate
from lightning_dltune.tuning.rules import decide, enforce_memory
from lightning_dltune.tuning.state import TuningState

from test_decide import cfg, trial, with_mem


def readings(workers, base_mib, growth_mib, batches):
    """What a watch reads from ``workers`` workers that start at ``base_mib`` and grow ``growth_mib`` per batch
    each of them loads, after each of ``batches`` (all workers together)."""
    return [
        MemorySample(i, b, workers, workers * (base_mib + growth_mib * b / workers) * MiB, 0.0)
        for i, b in enumerate(batches)
    ]


def test_the_fit_recovers_base_and_growth_of_the_latest_worker_set():
    old = readings(4, 100, 9.0, [10, 20, 30])  # an earlier set, bigger: not the running one
    new = readings(2, 30, 0.5, [0, 8, 16, 24, 32])
    mem = fit(old + new)
    assert mem.base_bytes == pytest.approx(30 * MiB)
    assert mem.growth_bytes == pytest.approx(0.5 * MiB)
    assert mem.samples == 8
    assert mem.peak_total_bytes == max(r.total_bytes for r in old)  # the peak is the window's, any set


@pytest.mark.parametrize(
    ("samples", "base_mib", "growth_mib"),
    [
        ([], 0.0, 0.0),
        (readings(2, 30, 0.5, [16]), 30 + 0.5 * 8, 0.0),  # one point: no growth can be fitted
        (readings(2, 30, 0.0, [0, 10, 20, 30]), 30, 0.0),  # flat
        ([MemorySample(i, b, 2, (80 - b) * MiB, 0) for i, b in enumerate([0, 10, 20])], None, 0.0),  # shrinking
    ],
)
def test_the_fit_without_enough_points_or_growth(samples, base_mib, growth_mib):
    mem = fit(samples)
    if base_mib is not None:
        assert mem.base_bytes == pytest.approx(base_mib * MiB)
    assert mem.growth_bytes == growth_mib


@pytest.mark.parametrize(
    ("mem", "workers", "life", "ceiling", "expected_mib"),
    [
        (WorkerMemory(40 * MiB), 4, 1000, None, 40),  # measured, flat
        (WorkerMemory(40 * MiB, 0.1 * MiB), 4, 1000, None, 40 + 0.1 * 250),  # each of 4 loads 250 batches
        (WorkerMemory(40 * MiB, 0.1 * MiB), 8, 1000, None, 40 + 0.1 * 125),  # more workers, less each
        (WorkerMemory(40 * MiB, 0.1 * MiB), 1, 1000, 100 * MiB, 100),  # capped at what the process holds
        (WorkerMemory(40 * MiB, 0.1 * MiB), 4, math.inf, 300 * MiB, 300),  # unknown life: grows to the ceiling
        (WorkerMemory(40 * MiB), 0, 1000, None, 0),
    ],
)
def test_a_workers_predicted_size(mem, workers, life, ceiling, expected_mib):
    assert worker_bytes(mem, workers, life, ceiling) == pytest.approx(expected_mib * MiB)


def test_the_most_workers_that_fit_count_growth_and_batches_in_flight():
    growing = WorkerMemory(20 * MiB, 0.2 * MiB)  # 1000 batches an epoch: 200 MiB of copies shared out
    flight = in_flight_bytes(1 * MiB, 2, pin_memory=False)
    assert flight == 2 * MiB and in_flight_bytes(1 * MiB, 2, pin_memory=True) == 2 * MiB  # pinned replace shared
    # w * (20 + 200 / w + 2) = 22 w + 200 <= 400  ->  w <= 9
    assert max_workers(growing, 400 * MiB, 1000, None, flight, limit=64) == 9
    assert total_bytes(growing, 9, 1000, None, flight) <= 400 * MiB < total_bytes(growing, 10, 1000, None, flight)
    assert max_workers(growing, 150 * MiB, 1000, None, flight, limit=64) == 0  # even one worker is over
    assert max_workers(growing, 400 * MiB, 1000, None, flight, limit=4) == 4
    assert safe_workers(300 * MiB, 1000 * MiB, 2 * MiB) == 3


def test_over_budget_counts_the_batches_in_flight():
    assert not over_budget(380 * MiB, 4, 4 * MiB, 400 * MiB)
    assert over_budget(390 * MiB, 4, 4 * MiB, 400 * MiB)
    assert not over_budget(10_000 * MiB, 4, 0, None)  # no budget
    assert not over_budget(0, 4, 100 * MiB, 1 * MiB)  # nothing read yet


# --- the decision ------------------------------------------------------------------------------------------
MEM = Budget(cpus=2, max_workers=64, memory_bytes=600 * MiB)


def test_prior_a_jump_that_fits_even_at_the_ceiling_goes_straight_there():
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=40)  # this process holds 40 MiB
    decision = decide([start], MEM, Policy())
    assert decision.action == "try" and decision.settings == cfg(13)  # 13 x 40 MiB fits 600 MiB
    assert not decision.probe_memory


def test_prior_a_far_jump_over_the_ceiling_measures_a_smaller_config_first():
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)  # a 250 MiB dataset of objects
    decision = decide([start], MEM, Policy())
    assert decision.action == "try" and decision.settings == cfg(2)  # 2 x 250 fits; 13 x 250 might not
    assert "2 first, to measure a worker's memory before going to 13" in decision.reason
    assert decision.probe_memory  # its window runs its full length: never judged early
    tiny = decide([start], Budget(cpus=2, max_workers=64, memory_bytes=100 * MiB), Policy())
    assert tiny.settings == cfg(1)  # even one might not fit: measure one


def test_without_a_known_footprint_the_prior_caps_the_first_jump():
    decision = decide([trial(0, 100, 10, fetch_cpu_ms=1)], MEM, Policy())
    assert decision.settings == cfg(9) and "memory budget (64 MiB per worker)" in decision.reason  # 600 // 64


def test_measured_growth_sets_the_cap_at_the_end_of_the_epoch():
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)
    # 2 workers measured at 30 MiB growing 0.5 MiB per batch; an epoch of 600 batches: w * 30 + 300 <= 600
    two = with_mem(trial(2, 45, 10), 30, growth_mib=0.5, main_mib=250, epoch=600)
    decision = decide([start, two], MEM, Policy())
    assert decision.action == "try" and decision.settings.num_workers == 10, decision.reason
    assert "capped at 10 by the memory budget" in decision.reason
    est = estimate([start, two], MEM, Policy())
    assert est.mem_measured and est.mem_cap_workers == 10
    flat = with_mem(trial(2, 45, 10), 30, main_mib=250, epoch=600)  # the same size, not growing
    assert estimate([start, flat], MEM, Policy()).mem_cap_workers == 20


def overlapping(batches):
    """One worker's USS (MiB) after ``batches`` batches where samples overlap: 110 MiB of copies, saturating."""
    return 60 + 110 * -math.expm1(-batches / 4)


def test_the_fit_tells_growth_that_saturates_from_growth_that_does_not():
    steps = range(2, 58, 3)
    mem = fit([MemorySample(i, n, 1, overlapping(n) * MiB, overlapping(n) * MiB) for i, n in enumerate(steps)])
    assert mem.saturation_batches == 4 and mem.base_bytes == pytest.approx(60 * MiB)
    assert mem.jump_bytes == pytest.approx(110 * MiB) and mem.growth_bytes == pytest.approx(0, abs=1)
    assert worker_bytes(mem, 4, 60, None) == pytest.approx(overlapping(15) * MiB)  # 15 batches each: nearly all
    linear = fit(readings(1, 40, 0.2, steps))
    assert linear.jump_bytes == 0 and linear.growth_bytes == pytest.approx(0.2 * MiB)
    # a one-off copy at a worker's start (a garbage collection touching every object), then copy-on-read
    both = fit([MemorySample(i, n, 1, (20 + 15 * -math.expm1(-n / 4) + 0.3 * n) * MiB, 0) for i, n in enumerate(steps)])
    assert (both.jump_bytes, both.growth_bytes) == (pytest.approx(15 * MiB), pytest.approx(0.3 * MiB))


def test_a_trial_sized_on_growth_that_saturates_stays_within_the_budget():
    # the seed guide's copy-on-read (#34): each sample reads 40,000 of 2 million strings, overlapping its neighbours'.
    # One worker measured over 56 batches; a straight line through its readings predicted 4 workers to fit 600 MiB,
    # and they went to 641 MiB within nine steps: a fresh worker copies most of what it will hold in its first batches
    from dataclasses import replace

    start = with_mem(trial(0, 100, 15, fetch_cpu_ms=1), 0, main_mib=471)
    samples = [MemorySample(i, n, 1, overlapping(n) * MiB, overlapping(n) * MiB) for i, n in enumerate(range(2, 58, 3))]
    one = trial(1, 90, 15)
    one = replace(one, stats=one.stats.with_memory(fit(samples), 0.0, 471 * MiB, 60))
    est = estimate([start, one], MEM, Policy())
    assert est.mem_cap_workers == 3, est  # 4 x 167 MiB > 600 MiB >= 3 x 169 MiB
    decision = decide([start, one], MEM, Policy())
    assert decision.action == "try" and decision.settings.num_workers == 3, decision.reason


def test_over_budget_goes_down_at_once_and_the_config_is_never_tried_again():
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)
    # 6 workers hold 900 MiB together (copy-on-read), 3 steps into the window: not enough steps, still acted on
    over = with_mem(trial(6, 20, 10, steps=3), 150, growth_mib=1.0, main_mib=250, epoch=600)
    state = TuningState()
    state.current = cfg(0)
    state.apply(state.decide(start.stats, MEM, None), start.stats, MEM, 10)
    state.current = cfg(6)
    decision = state.decide(over.stats, MEM, None)
    assert decision is not None and decision.action == "try" and decision.failed
    # per worker: 150 + 1.0 * 600 / w, capped at 250  ->  w * 250 <= 600 at w = 2 (3 * 250 = 750 is over)
    assert decision.settings.num_workers == 2
    assert "went over the memory budget (900 MiB of 600 MiB)" in decision.reason
    state.apply(decision, over.stats, MEM, 13)
    assert cfg(6) in state.failed_configs and state.memory_limit == 2
    assert "150 MiB per worker, growing 1.00 MiB per batch it loads" in diagnose(state.trials, cfg(2), MEM)
    assert "copy-on-read" in diagnose(state.trials, cfg(2), MEM)
    assert "numpy arrays" in diagnose(state.trials, cfg(2), MEM)


def test_workers_under_the_budget_by_less_than_they_grow_before_they_stop_go_down_before_crossing_it():
    from dataclasses import replace

    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)
    # 6 workers read at 585 MiB together, growing 3 MiB per batch: before a switch down stops them, each loads a
    # batch and the next step takes one (7 batches, 21 MiB): they would cross the 600 MiB budget
    near = with_mem(trial(6, 20, 10, steps=3), 97.5, growth_mib=3.0, main_mib=250, epoch=600)
    near = replace(near, stats=replace(near.stats, worker_mem_lead_bytes=lead_bytes(3.0 * MiB, 6)))
    assert near.stats.worker_mem_lead_bytes == 21 * MiB
    decision = enforce_memory([start, near], MEM)
    assert decision is not None and decision.failed and decision.settings.num_workers < 6
    assert "was about to go over the memory budget (585 MiB of 600 MiB, 21.0 MiB more before its workers stop)" in (
        decision.reason
    )
    # read as far under it: nothing to do
    far = replace(near, stats=replace(near.stats, worker_mem_lead_bytes=lead_bytes(1.0 * MiB, 6)))
    assert enforce_memory([start, far], MEM) is None


def test_over_budget_after_settling_settles_lower():
    state = TuningState()
    state.current = cfg(0)
    start = with_mem(trial(0, 0.1, 10, fetch_cpu_ms=1), 0, main_mib=250)
    state.apply(state.decide(start.stats, MEM, None), start.stats, MEM, 10)  # stall under the threshold
    assert state.done
    state.current = cfg(4)  # say the user's loader had 4 workers, and they grew
    grown = with_mem(trial(4, 1, 10), 170, growth_mib=1.0, main_mib=250, epoch=600)
    decision = state.decide(grown.stats, MEM, None)
    assert decision is not None and decision.action == "settle" and decision.settings.num_workers < 4
    assert state.decide(with_mem(trial(4, 1, 10), 100, main_mib=250).stats, MEM, None) is None  # within budget


def test_running_workers_predicted_to_outgrow_the_budget_settle_on_fewer_before_they_do():
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)
    # 4 workers measured at 20 MiB each, growing 1 MiB per batch: by the end of a 200-batch epoch they hold
    # 4 * 20 + 200 = 280 MiB of a 270 MiB budget, 3 of them 260 MiB. They still wait (more would be wanted)
    four = with_mem(trial(4, 20, 10), 20, growth_mib=1.0, main_mib=250, epoch=200)
    budget = Budget(cpus=2, max_workers=64, memory_bytes=270 * MiB)
    decision = decide([start, four], budget, Policy())
    assert decision.action == "settle" and decision.settings == cfg(3), decision.reason
    assert "4 workers are predicted to outgrow the 270 MiB memory budget" in decision.reason
    assert not decision.failed  # nothing went over: 4 workers stay allowed on a later, shorter epoch
    roomy = Budget(cpus=2, max_workers=64, memory_bytes=280 * MiB)
    assert decide([start, four], roomy, Policy()).settings.num_workers >= 4  # exactly fits: not outgrown
    unmeasured = with_mem(trial(4, 20, 10), 0, main_mib=250, epoch=200)  # no reading of the workers yet
    assert decide([start, unmeasured], budget, Policy()).settings.num_workers >= 4
    # whatever settles: 4 workers that stall no more are not settled on either
    fed = with_mem(trial(4, 0.1, 10), 20, growth_mib=1.0, main_mib=250, epoch=200)
    settled = decide([start, fed], budget, Policy())
    assert settled.action == "settle" and settled.settings == cfg(3), settled.reason


# --- the watch -------------------------------------------------------------------------------------------
def test_the_watch_counts_batches_per_worker_set_and_windows_apart():
    pids = [11, 12]
    sizes = {11: 10 * MiB, 12: 12 * MiB}
    t = [0.0]
    watch = MemoryWatch(lambda: pids, read=lambda ps: [sizes[p] for p in ps], clock=lambda: t[0])
    for _ in range(4):
        watch.batch_taken()
    first = watch.sample()
    assert first == MemorySample(0.0, 0, 2, 22 * MiB, 12 * MiB)  # the set started when first seen
    for _ in range(6):
        watch.batch_taken()
    sizes[11] = 14 * MiB
    assert watch.sample().batches == 6 and watch.latest.total_bytes == 26 * MiB
    pids[:] = [21]  # a new worker set (a switch): its batches count from here
    sizes[21] = 5 * MiB
    assert watch.sample().batches == 0
    mem = watch.take()
    assert mem.samples == 3 and mem.peak_total_bytes == 26 * MiB and watch.latest is None
    assert watch.take().samples == 1  # a window without a reading takes one at its end


def test_a_few_workers_read_stand_for_all_and_a_window_closing_without_a_reading_reads_two_in_the_open():
    pids = list(range(16))
    sizes = {p: (10 + p) * MiB for p in pids}
    read: list[int] = []  # every worker read, in order (each is read on its own)

    def reader(ps):
        read.extend(ps)
        return [sizes[p] for p in ps]

    watch = MemoryWatch(lambda: pids, read=reader)
    mem = watch.take()  # no reading from the thread in this window: the training process reads, briefly
    assert read == [0, 1] and mem.samples == 1
    assert mem.peak_total_bytes == pytest.approx(16 * 10.5 * MiB)  # 16 workers at the mean of the two read
    watch.take()
    assert read[-2:] == [2, 3]  # the next few in turn: each worker is read, over time
    # the total is each worker's latest reading: 0-3 as read, the 12 never read at the mean of 2 and 3
    assert watch.latest is None and watch._newest.total_bytes == pytest.approx((10 + 11 + 12 + 13 + 12 * 12.5) * MiB)
    assert watch.sample().workers == 16 and read[-16:] == pids  # all of them, asked for all
    assert watch.latest.total_bytes == sum(sizes.values())
    watch.take()
    assert len(read) == 20  # the window had the thread's reading
    watch.take(
        decision_waits=False
    )  # no decision waits on it (tuning ended): the latest reading of the same workers stands
    sizes[4] += 16 * MiB  # one worker grew: read with one other, it is counted alone, the rest as last read
    assert len(read) == 20 and watch.take(decision_waits=True).samples == 1 and read[-2:] == [4, 5]
    assert watch._newest.total_bytes == sum(sizes.values())
    pids[:] = [1, 2, 3]  # other workers: read, fresh or not
    assert watch.take(decision_waits=False).samples == 1 and read[-2:] == [1, 2]


def test_the_budget_check_grows_the_latest_reading_by_the_measured_growth_per_batch_taken():
    from lightning_dltune.measurement.probe import Probe

    pids, sizes = [11, 12], {11: 10 * MiB, 12: 10 * MiB}
    probe = Probe(worker_pids=lambda: pids, memory_of=lambda ps: [sizes[p] for p in ps], footprint=lambda: 40 * MiB)
    watch, settings = probe.memory, cfg(2)
    assert probe.held_bytes(settings) == 0 and not probe.over_budget(settings, 1)  # nothing read yet
    for _ in range(3):  # a window whose readings grow 1 MiB per batch taken (0.5 MiB per worker)
        watch.sample()
        for _ in range(4):
            watch.batch_taken()
        sizes[11] += 2 * MiB
        sizes[12] += 2 * MiB
    probe.close()  # fits the growth (1 MiB per batch, all workers together) and reads the process's footprint
    assert watch.growth_bytes == pytest.approx(1 * MiB) and watch.ceiling_bytes == 40 * MiB
    watch.sample()  # the next window's reading: 2 x 16 MiB
    assert probe.held_bytes(settings) == pytest.approx(32 * MiB)
    for _ in range(10):  # 10 batches later, not read again: 10 MiB more is counted
        watch.batch_taken()
    assert probe.held_bytes(settings) == pytest.approx(42 * MiB)
    # before a switch down stops them, the 2 workers load a batch each and the next step takes one: 3 MiB more
    assert watch.lead_bytes == pytest.approx(3 * MiB)
    assert not probe.over_budget(settings, 46 * MiB)
    assert watch.pressure == pytest.approx(42 / 46)  # what the readings' pace follows
    sizes[11] += 5 * MiB
    sizes[12] += 5 * MiB  # they did grow: the estimate crosses a 44 MiB budget, a reading now confirms it: 42 MiB
    # read under the budget, but not by what they grow before they stop: left before a reading crosses it
    assert probe.over_budget(settings, 44 * MiB) and watch.latest.total_bytes == 42 * MiB
    for _ in range(10):  # the estimate says 52 MiB, but they stopped growing: read now, not over 46 MiB
        watch.batch_taken()
    assert probe.held_bytes(settings) > 46 * MiB
    assert not probe.over_budget(settings, 46 * MiB) and watch.latest.total_bytes == 42 * MiB
    for _ in range(100):  # no worker is counted past what the training process holds (40 MiB each)
        watch.batch_taken()
    assert probe.held_bytes(settings) == pytest.approx(80 * MiB)
    assert probe.held_bytes(cfg(3)) == 0  # a reading of 2 workers does not stand for a loader of 3


def test_a_new_loaders_workers_are_not_judged_on_the_readings_of_the_ones_it_replaces():
    pids, sizes = [11, 12, 13, 14], 50 * MiB
    watch = MemoryWatch(lambda: pids, read=lambda ps: [sizes for _ in ps])
    watch.sample()  # 4 workers at 200 MiB, read after the decision that replaces them with 2
    watch.loader_built(2)
    assert watch.latest is None and watch.held(2) == 0 and watch.held(4) is None  # counted from nothing
    pids[:] = [21, 22]
    sizes = 10 * MiB
    watch.sample()
    assert watch.held(2) == 20 * MiB and watch.held(4) is None
    assert watch.take().peak_total_bytes == 20 * MiB  # the window's fit has only the new workers' readings


def test_the_check_goes_on_from_the_running_workers_newest_reading_across_windows_until_a_new_loader():
    pids = [11]
    watch = MemoryWatch(lambda: pids, read=lambda ps: [10 * MiB for _ in ps])
    watch.sample()
    watch.take()  # a window closes: the check at each step is not blind until the thread reads again
    assert watch.latest is None and watch.held(1) == 10 * MiB and not watch.newest_in_window
    watch.loader_built(1)  # a new loader: its workers are not the ones read (even with the same count)
    assert watch.held(1) == 0
    watch.sample()
    assert watch.held(1) == 10 * MiB


def test_the_first_workers_read_once_are_taken_to_grow_at_most_all_they_hold_per_batch():
    watch = MemoryWatch(lambda: [11, 12], read=lambda ps: [10 * MiB for _ in ps])
    for _ in range(4):
        watch.batch_taken()
    watch.sample()  # 20 MiB after 4 batches: at most 5 MiB a batch
    assert watch.growth_bytes == pytest.approx(5 * MiB)
    for _ in range(4):
        watch.batch_taken()
    assert watch.held(2) == pytest.approx(40 * MiB)
    watch.sample()  # read again: not growing
    assert watch.growth_bytes == 0 and watch.held(2) == pytest.approx(20 * MiB)


def test_a_new_loaders_workers_are_counted_from_nothing_growing_as_the_ones_before_until_read():
    pids, size = [11, 12], [10 * MiB]
    watch = MemoryWatch(lambda: pids, read=lambda ps: [size[0] for _ in ps])
    for _ in range(3):  # 2 workers growing 2 MiB per batch taken, together
        watch.sample()
        for _ in range(5):
            watch.batch_taken()
        size[0] += 5 * MiB
    assert watch.growth_bytes == pytest.approx(2 * MiB)
    watch.loader_built(3)  # 3 new workers, not read yet
    for _ in range(10):
        watch.batch_taken()
    assert watch.held(3) == pytest.approx(20 * MiB)  # 10 batches at the growth measured before
    pids[:] = [21, 22, 23]
    size[0] = 4 * MiB
    watch.sample()  # read: the reading stands, and their own growth is read again
    assert watch.held(3) == pytest.approx(12 * MiB)


def test_the_memory_watch_spends_little_cpu_far_from_the_budget_and_reads_often_near_it():
    from lightning_dltune.measurement.probe import CPU_SHARE_FAR, CPU_SHARE_NEAR, MemoryWatch

    sizes, t = [100 * MiB], [0.0]
    watch = MemoryWatch(lambda: [11], read=lambda ps: list(sizes), clock=lambda: t[0], interval_s=0.25)
    watch._read_s = 0.1  # reading 16 torch workers' page tables takes about this much CPU
    watch.pressure, watch.budget_bytes = 0.3, 400 * MiB
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_NEAR)  # not read twice: its growth is unknown
    watch.sample()
    t[0] += 1.0
    for _ in range(2):  # one worker loads each batch: 2 batches apart, its readings measure its growth
        watch.batch_taken()
    watch.sample()  # read twice, not growing
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_FAR)  # 5 s: 2% of a CPU
    watch.pressure = 0.8
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_NEAR)  # 1 s: 10% of a CPU
    watch.pressure = 0.3
    watch.measuring = True  # a window there to fit the workers' growth reads at the larger share
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_NEAR)
    watch.measuring = False
    t[0] += 1.0
    sizes[0] = 120 * MiB  # 10 MiB a second over its three readings, 280 MiB from the budget: read again in 5 s
    watch.sample()
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_FAR)
    watch.budget_bytes = 180 * MiB  # 60 MiB from it: 6 s to go, read again in half of that
    assert watch.next_interval() == pytest.approx(3.0)
    watch.budget_bytes = 130 * MiB  # 1 s to go: never more often than 10% of a CPU
    assert watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_NEAR)
    watch._read_s = 0.005
    assert watch.next_interval() == 0.25  # cheap reads: every 0.25 s at most


def test_readings_too_few_batches_apart_do_not_measure_the_workers_growth():
    # 4 workers each keeping 1 MiB of every batch they load, dealt batches in turn: read at batches 1 and 3 (a busy
    # host's thread), two of them loaded nothing between; that read as no growth, the thread went to its slow pace
    # and the check at each step let the workers reach 520 MiB of a 160 MiB budget before the next reading
    from lightning_dltune.measurement.probe import CPU_SHARE_NEAR

    pids, loaded = [11, 12, 13, 14], dict.fromkeys([11, 12, 13, 14], 2)  # each loaded its 2 prefetched batches
    watch = MemoryWatch(lambda: pids, read=lambda ps: [(20 + loaded[p]) * MiB for p in ps])
    watch._read_s, watch.budget_bytes = 0.1, 160 * MiB

    def take(n):
        for _ in range(n):
            watch.batch_taken()
            loaded[pids[watch.batches % 4]] += 1

    take(1)
    watch.sample()
    take(2)
    watch.sample()  # 2 batches later: growth unknown, not none; read at the near pace; the at-most bound stands
    assert watch.measured_growth == 0 and watch.next_interval() == pytest.approx(0.1 / CPU_SHARE_NEAR)
    held = watch.held(4)
    take(1)  # the check at each step counts the at-most growth: a reading is asked for before the budget is crossed
    assert watch.held(4) - held > 20 * MiB
    take(5)
    watch.sample()  # 8 batches after the first reading: 2 loads each, 1 MiB a batch taken, all 4 together
    assert watch.measured_growth == pytest.approx(1 * MiB)


@pytest.mark.parametrize(
    ("running", "workers", "budget", "fits"),
    [
        (100, 4, None, True),  # no budget
        (100, 4, 100 + 4 * (50 + 10), True),  # exactly fits: the new ones at their base, with their batches
        (100, 4, 100 + 4 * (50 + 10) - 1, False),
        (0, 8, 400, False),  # 8 new workers alone do not fit
    ],
)
def test_a_background_start_must_fit_beside_the_running_workers(running, workers, budget, fits):
    from lightning_dltune.measurement.memory import WorkerMemory, fits_beside

    assert fits_beside(running, WorkerMemory(base_bytes=50, growth_bytes=5), workers, 10, budget) is fits


def test_a_worker_not_read_now_is_counted_grown_since_its_own_reading():
    """A leaking loader's 4 workers, read 2 at a time in the open: the 2 not read are not left at their old reading."""
    pids = [11, 12, 13, 14]
    size = {p: 10 * MiB for p in pids}
    watch = MemoryWatch(lambda: pids, read=lambda ps: [size[p] for p in ps])
    for _ in range(2):  # all 4 read twice, 8 batches apart: 8 MiB per batch taken, together (2 MiB each)
        watch.sample()
        for _ in range(8):
            watch.batch_taken()
        for p in pids:
            size[p] += 16 * MiB
    assert watch.growth_bytes == pytest.approx(8 * MiB)
    # read 2 of them: 11 and 12 as read (42 MiB each); 13 and 14 from their reading 8 batches ago (26 MiB), grown
    # 2 MiB a batch since (42 MiB): not 26
    assert watch.sample(most=2).total_bytes == pytest.approx(4 * 42 * MiB)


def test_the_first_reading_s_at_most_growth_asks_for_a_reading_and_is_not_counted_as_what_workers_grow_ahead():
    from lightning_dltune.measurement.probe import Probe

    pids = list(range(8))
    probe = Probe(worker_pids=lambda: pids, memory_of=lambda ps: [200 * MiB for _ in ps], footprint=lambda: 4 * 2**30)
    probe.memory.batch_taken()
    probe.memory.sample()  # 8 workers of 200 MiB after 1 batch: at most 1600 MiB a batch, not measured
    assert probe.memory.growth_bytes == pytest.approx(1600 * MiB) and probe.memory.lead_bytes == 0
    for _ in range(4):
        probe.memory.batch_taken()
    # the bound grows the estimate past a 15 GiB budget; the reading it asks for (1600 MiB) decides
    assert not probe.over_budget(cfg(8), 15 * 2**30)


def test_workers_above_the_ceiling_of_this_decision_are_not_read_as_outgrowing_a_roomy_budget():
    # under DDP the worker ceiling follows the ranks' need and may shrink between decisions: 15 workers measured at
    # 8 MiB each against a 5 GiB budget fit, whatever the ceiling now (the cap counted only up to it, and read 15 as
    # "more than fit")
    start = with_mem(trial(0, 100, 10, fetch_cpu_ms=1), 0, main_mib=250)
    fifteen = with_mem(trial(15, 0.5, 10), 8, main_mib=250, epoch=12)
    decision = decide([start, fifteen], Budget(cpus=1, max_workers=8, memory_bytes=5 * 2**30), Policy())
    assert "outgrow" not in decision.reason, decision.reason


def test_workers_read_a_few_at_a_time_give_their_whole_growth_per_batch():
    # 4 workers, each growing 1 MiB a batch taken (a leaking loader), read 2 at a time: a total holds the other two's
    # older readings, whose slope read half the growth (the check at each step then let the workers past the budget)
    pids = [11, 12, 13, 14]
    sizes = dict.fromkeys(pids, 10 * MiB)
    watch = MemoryWatch(lambda: pids, read=lambda ps: [sizes[p] for p in ps])
    growth = []
    for _ in range(4):
        for _ in range(4):
            watch.batch_taken()
            for p in pids:
                sizes[p] += MiB
        watch.sample(most=2)
        growth.append(watch.measured_growth / MiB)
    # from the first workers read twice on (the third reading), all four workers' growth per batch
    assert growth[2:] == pytest.approx([4.0, 4.0]), growth
