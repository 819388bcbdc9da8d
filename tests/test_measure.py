import os
import random
import statistics
import time
from dataclasses import replace

import psutil
import pytest
import torch

from lightning_dltune._stats import few
from lightning_dltune.measurement.measure import (
    StepTimer,
    WindowStats,
    _psutil_descendants,
    _stat_cpu_seconds,
    descendants,
    process_cpu_seconds,
    quantile,
)
from lightning_dltune.measurement.probe import batch_size
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.compare import pick_best
from lightning_dltune.tuning.model import Trial


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.cpu = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float, cpu: float = 0.0) -> None:
        self.t += seconds
        self.cpu += cpu


def run_steps(timer: StepTimer, clock: FakeClock, steps, samples: int = 8) -> None:
    """steps: (wait, other, step, fetch_cpu) per step; fetch happens in the gap before the step."""
    for wait, other, step, cpu in steps:
        clock.advance(other / 2)
        timer.fetch_started()
        clock.advance(wait, cpu)
        timer.fetch_ended()
        clock.advance(other / 2)
        timer.step_started()
        clock.advance(step)
        timer.step_ended(samples)


@pytest.fixture
def timer_and_clock():
    clock = FakeClock()
    return StepTimer(clock=clock, cpu_clock=lambda: clock.cpu), clock


def test_wait_step_and_other_are_kept_apart(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.030, 0.002, 0.010, 0.001)] * 4)
    s = timer.take_window()
    assert s.steps == 4 and s.samples == 32
    assert s.wait_s == pytest.approx(0.120)
    assert s.step_s == pytest.approx(0.040)
    assert s.other_s == pytest.approx(0.008)
    assert s.wall_s == pytest.approx(0.168)
    assert s.stall_frac == pytest.approx(0.120 / 0.168)
    assert s.samples_per_s == pytest.approx(32 / 0.168)
    assert s.fetch_cpu_s == pytest.approx(0.004)
    assert timer.take_window().steps == 0  # taking a window resets it


def test_first_step_after_a_build_is_startup_not_steady_state(timer_and_clock):
    timer, clock = timer_and_clock
    timer.loader_requested()
    clock.advance(0.5)  # building the loader, starting workers
    timer.epoch_started()
    run_steps(timer, clock, [(0.2, 0.0, 0.01, 0.0)] + [(0.001, 0.0, 0.01, 0.0)] * 3)
    s = timer.take_window()
    assert s.steps == 3
    assert s.startup_s == pytest.approx(0.7)
    assert s.build_s == pytest.approx(0.5)  # of the start-up, the build before the epoch's first fetch
    assert s.wait_s == pytest.approx(0.003)


def test_validation_is_excluded_from_the_step_gap(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0)])
    timer.pause()
    clock.advance(2.0)
    timer.resume()
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0)])
    s = timer.take_window()
    assert s.excluded_s == pytest.approx(2.0)
    assert s.other_s == pytest.approx(0.0, abs=1e-9)
    assert s.stall_frac == pytest.approx(0.5)


def test_bursty_waits_show_in_the_tail(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, ([(0.0005, 0.0, 0.01, 0.0)] * 9 + [(0.1, 0.0, 0.01, 0.0)]) * 5)
    s = timer.take_window()
    assert s.wait_p50_s == pytest.approx(0.0005)
    assert s.wait_p90_s > 20 * s.wait_p50_s


def test_the_start_up_steps_samples_are_summarized_apart_from_the_first(timer_and_clock):
    timer, clock = timer_and_clock
    timer.loader_requested()
    timer.epoch_started()
    assert timer.startup_next
    run_steps(timer, clock, [(0.17, 0.0, 0.005, 0.0)])
    assert not timer.startup_next
    timer.startup_samples([0.05, 0.010, 0.012, 0.008])  # a slow first sample, then three alike
    s = timer.peek_window()
    assert s.steps == 0 and s.startup_samples == 4 and s.startup_first_sample_s == pytest.approx(0.05)
    assert s.startup_step_samples == 8  # the step's batch size, as every step's is read
    assert s.startup_sample_mean_s == pytest.approx(0.010) and s.startup_sample_sem_s == pytest.approx(0.002 / 3**0.5)
    timer.startup_samples([0.01, 0.01])  # too few to tell the first apart from the rest: none
    assert timer.peek_window().startup_samples == 0


def test_the_least_wait_wall_and_busy_time_of_the_steady_steps_are_kept(timer_and_clock):
    timer, clock = timer_and_clock
    timer.loader_requested()  # a new loader: its first step is start-up, not one of the window's
    timer.epoch_started()
    run_steps(
        timer,
        clock,
        [(0.001, 0.0, 0.005, 0.0), (0.2, 0.004, 0.01, 0.0), (0.04, 0.0, 0.012, 0.0), (0.09, 0.0, 0.011, 0.0)],
    )
    s = timer.take_window()
    assert s.steps == 3 and s.wait_min_s == pytest.approx(0.04) and s.sample_wall_min_s == pytest.approx(0.052 / 8)
    assert s.busy_min_s == pytest.approx(0.011)  # the step and the host's other work: 10 + 4, 12, 11 ms
    # the start-up step's own wait and busy time are kept apart (`windows.stalled_from_the_start`)
    assert s.startup_wait_s == pytest.approx(0.001) and s.startup_busy_s == pytest.approx(0.005)
    # per sample, each step over its own batch: a short last batch is slower per sample, not faster
    run_steps(timer, clock, [(0.04, 0.0, 0.01, 0.0)] * 2, samples=16)
    run_steps(timer, clock, [(0.03, 0.0, 0.002, 0.0)], samples=4)
    s = timer.take_window()
    assert s.sample_wall_min_s == pytest.approx(0.05 / 16) and s.startup_wait_s == 0.0  # no build in this one
    # and its step is shorter: the least busy time is that of the steps with the largest batch
    assert s.busy_min_s == pytest.approx(0.01)
    # the logging window keeps sums only, over every step (the start-up step too): neither the spread nor the least
    run_steps(timer, clock, [(0.04, 0.0, 0.01, 0.0)] * 2)
    log = timer.take_log_window()
    assert log.steps == 9 and log.wait_min_s == 0.0 and log.wall_sem_s == 0.0


def test_log_window_is_independent_of_the_trial_window(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0)] * 3)
    assert timer.take_log_window().steps == 3
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0)] * 2)
    assert timer.take_log_window().steps == 2
    assert timer.take_window().steps == 5


def test_wall_standard_error_is_zero_for_identical_steps_and_positive_otherwise(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0)] * 5)
    assert timer.take_window().wall_sem_s == pytest.approx(0.0, abs=1e-12)
    run_steps(timer, clock, [(0.01, 0.0, 0.01, 0.0), (0.03, 0.0, 0.01, 0.0)] * 5)
    assert timer.take_window().wall_sem_s > 0.001


@pytest.mark.parametrize("steps", [2, 3, 5, 6, 40])
def test_the_spread_of_a_window_is_the_textbook_one(steps):
    # the per-step sums are kept flat (no Welford objects): the errors must still be the plain formulas', on a clock
    # far from 0 (a long run's perf_counter) and for the few-step windows whose wall and wait errors come from the
    # steps themselves rather than from blocks
    rng = random.Random(steps)
    clock = FakeClock()
    clock.t = 1e6
    timer = StepTimer(clock=clock, cpu_clock=lambda: clock.cpu)
    timer.epoch_started()
    rows = [(rng.uniform(0, 0.02), rng.uniform(0, 0.002), rng.uniform(0.009, 0.011), 0.0) for _ in range(steps)]
    run_steps(timer, clock, rows)
    s = timer.take_window()
    busy = [r[1] + r[2] for r in rows]
    waits = [r[0] for r in rows]
    widen = few(steps - 1)
    assert s.busy_sem_s == pytest.approx(statistics.stdev(busy) / steps**0.5 * widen, rel=1e-6)
    assert s.busy_min_s == pytest.approx(min(busy), rel=1e-6)
    assert s.wait_min_s == pytest.approx(min(waits), abs=1e-9)
    if steps < 6:
        assert s.wait_sem_s == pytest.approx(statistics.stdev(waits) / steps**0.5 * widen, rel=1e-6)


def test_a_tail_too_short_for_a_few_step_window_is_refused():
    with pytest.raises(ValueError, match=r"tail_size=5\): it must be 6 or more"):
        StepTimer(tail_size=5)


def test_alternating_waits_from_two_workers_are_plainly_a_stall(timer_and_clock):
    # two workers deliver their batches in turn: the waits alternate between none and a long one. Step by
    # step they look like noise as large as the mean; over blocks of consecutive steps they are steady
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.0, 0.0, 0.014, 0.0), (0.070, 0.0, 0.014, 0.0)] * 4)
    s = timer.take_window()
    assert s.stall_frac == pytest.approx(35 / 49)
    assert s.wait_sem_s == pytest.approx(0.0, abs=1e-12)  # blocks of 2 steps, each the same
    assert s.stall_lower_bound() == pytest.approx(35 / 49)


def test_a_window_of_alternating_waits_is_steady_so_a_config_twice_as_fast_is_kept(timer_and_clock):
    # the run starts on 2 workers (6 steps: waits alternate, as in the test above), then 10 workers are twice as
    # fast. Step by step the first window's wall looks as noisy as the gain is large; block by block it is steady
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.0, 0.0, 0.010, 0.0), (0.060, 0.0, 0.010, 0.0)] * 3)
    two = timer.take_window()
    run_steps(timer, clock, [(0.010, 0.0, 0.010, 0.0), (0.008, 0.0, 0.011, 0.0)] * 4)
    ten = timer.take_window()
    assert two.wall_sem_s == pytest.approx(0.0, abs=1e-12)  # blocks of 2 steps, each the same
    start, faster = Trial(LoaderSettings(2, 2), two), Trial(LoaderSettings(10, 2), ten)
    assert pick_best([start, faster]) is faster


def window(timer, clock, walls_ms):
    run_steps(timer, clock, [(0.0, 0.0, w / 1e3, 0.0) for w in walls_ms])
    return timer.take_window()


def test_one_step_slowed_from_outside_neither_hides_a_gain_nor_makes_one(timer_and_clock):
    # 25 steps of 11 ms, then of 7 ms (pinned copies): one 150 ms step (a collector's pause, a busy host) in the
    # first window would make its error as large as the gain; left out with its block, the gain stands
    timer, clock = timer_and_clock
    timer.epoch_started()
    slow = window(timer, clock, [11.0] * 12 + [150.0] + [11.0] * 12)
    pinned = window(timer, clock, [7.0] * 25)
    assert slow.wall_trim_s == pytest.approx(0.011) and slow.wall_sem_s > 0.005
    assert slow.busy_trim_s == pytest.approx(0.011)  # the busy time too: configs are compared on it (faster_by)
    assert slow.busy_p50_s == pytest.approx(0.011)  # and its median (what the jump from 0 workers is sized on)
    start, faster = Trial(LoaderSettings(0), slow), Trial(LoaderSettings(0, pin_memory=True), pinned)
    assert pick_best([start, faster]) is faster
    # the same pause in the start's window does not make an equal config look faster
    same = Trial(LoaderSettings(2, 2), window(timer, clock, [11.0] * 25))
    assert pick_best([start, same]) is start


def test_a_trend_across_blocks_keeps_the_wait_uncertain(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.010 * i, 0.0, 0.014, 0.0) for i in range(9)])
    s = timer.take_window()
    assert s.wait_sem_s > 0.01  # block means 0.01, 0.04, 0.07 s
    assert s.stall_lower_bound() < 0.5 < s.stall_frac


@pytest.mark.parametrize(
    ("wait_ms", "busy_ms", "wait_sem_ms", "busy_sem_ms", "expected"),
    [
        (160, 10, 0, 0, 160 / 170),
        (160, 10, 60, 0, 40 / 50),  # a noisy wait far above the step is still plainly a stall
        (20, 10, 8, 0, 4 / 14),
        (20, 10, 0, 5, 20 / 40),
        (20, 10, 12, 0, 0.0),
    ],
)
def test_the_stall_bound_takes_the_wait_low_and_the_busy_time_high(
    wait_ms, busy_ms, wait_sem_ms, busy_sem_ms, expected
):
    steps = 5
    s = WindowStats(
        steps=steps,
        wall_s=(wait_ms + busy_ms) * steps / 1e3,
        wait_s=wait_ms * steps / 1e3,
        step_s=busy_ms * steps / 1e3,
        wall_sem_s=1.0,  # the wall's error carries the wait's: the bound must not read it
        wait_sem_s=wait_sem_ms / 1e3,
        busy_sem_s=busy_sem_ms / 1e3,
    )
    assert s.stall_lower_bound() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 0.5, 0.0), ([1.0], 0.9, 1.0), ([0.0, 10.0], 0.5, 5.0), ([1.0, 2.0, 3.0, 4.0, 5.0], 0.9, 4.6)],
)
def test_quantile(values, q, expected):
    assert quantile(values, q) == pytest.approx(expected)


def test_stats_round_trip_through_a_dict():
    s = WindowStats(steps=3, samples=24, wall_s=1.0, wait_s=0.5)
    d = s.to_dict()
    assert d["stall_frac"] == 0.5 and d["samples_per_s"] == 24.0
    assert WindowStats.from_dict(d) == s


def test_a_background_start_is_charged_its_overlap_beyond_the_old_pace_and_the_hand_over_wait(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.030, 0.0, 0.010, 0.0)] * 4)  # the old config: 40 ms a step
    assert timer.take_window().mean_wall_s == pytest.approx(0.040)
    timer.overlap_started()
    assert not timer.steady  # the old config's steps while the new loader starts: out of the window
    run_steps(timer, clock, [(0.040, 0.0, 0.010, 0.0)] * 3)  # starting workers slow it: 50 ms a step
    timer.fetch_started()
    timer.rebuilt_in_fetch()  # the hand-over, in the fetch: its wait is start-up too
    clock.advance(0.020)
    timer.fetch_ended()
    timer.step_started()
    clock.advance(0.010)
    timer.step_ended(8)
    run_steps(timer, clock, [(0.001, 0.0, 0.010, 0.0)] * 2)  # the new config, steady
    s = timer.take_window()
    assert s.steps == 2 and s.wait_s == pytest.approx(0.002)
    assert s.startup_s == pytest.approx(3 * 0.010 + 0.020)  # 10 ms a step beyond the old pace, and the wait
    assert timer.take_log_window().steps == 4 + 3 + 1 + 2  # every served step is logged, the hand-over's too


def test_a_loader_built_inside_a_fetch_is_timed_on_the_timers_clock(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.030, 0.0, 0.010, 0.0)] * 2)
    timer.take_window()
    timer.overlap_started()
    timer.fetch_started()
    created = timer.build_loader(lambda: clock.advance(0.025) or iter([1]))  # forking the workers: 25 ms
    clock.advance(0.030)  # the old loader's batch, as before
    timer.fetch_ended()
    timer.step_started()
    clock.advance(0.010)
    timer.step_ended(8)
    timer.fetch_started()
    timer.rebuilt_in_fetch()
    timer.fetch_ended()
    timer.step_started()
    timer.step_ended(8)
    s = timer.take_window()
    assert next(created) == 1
    assert s.build_s == pytest.approx(0.025) and s.startup_behind == 1
    assert s.startup_s == pytest.approx(0.025)  # the overlap's step was 25 ms beyond the old 40 ms pace


def test_an_abandoned_background_start_charges_nothing(timer_and_clock):
    timer, clock = timer_and_clock
    timer.epoch_started()
    run_steps(timer, clock, [(0.030, 0.0, 0.010, 0.0)] * 4)
    timer.take_window()
    timer.overlap_started()
    run_steps(timer, clock, [(0.040, 0.0, 0.010, 0.0)] * 3)
    timer.overlap_ended()
    run_steps(timer, clock, [(0.030, 0.0, 0.010, 0.0)] * 2)
    s = timer.take_window()
    assert s.steps == 2 and s.startup_s == 0.0


@pytest.mark.parametrize(
    "batch",
    [
        torch.zeros(16, 3),
        (torch.zeros(16, 3), torch.zeros(16)),
        [torch.zeros(8)],
        {"x": torch.zeros(5, 2)},
        torch.tensor(3.0),
        ("a", torch.zeros(4)),
        (),
    ],
    ids=["tensor", "tuple", "list", "dict", "0-d", "text first", "empty"],
)
def test_batch_size_reads_what_lightning_reads(batch):
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        expected = extract_batch_size(batch)
    except Exception:
        expected = 1
    assert batch_size(batch) == expected


def _burn(seconds):
    _spin(seconds)
    time.sleep(30)


def _reap_a_burner(seconds: float) -> None:
    pid = os.fork()
    if pid == 0:  # the grandchild burns, and this child reaps it: its CPU is in the child's cutime
        _spin(seconds)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(30)


def _spin(seconds: float) -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass


def test_a_childs_cpu_seconds_are_read_from_proc_as_psutil_reads_them_reaped_children_included():
    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=_reap_a_burner, args=(0.3,), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 20
        t = psutil.Process(child.pid).cpu_times()
        while t.children_user + t.children_system < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
            t = psutil.Process(child.pid).cpu_times()
        assert t.children_user + t.children_system >= 0.2  # the reaped grandchild's: fields 16-17 of its stat
        by_psutil = t.user + t.system + t.children_user + t.children_system
        assert _stat_cpu_seconds(child.pid) == pytest.approx(by_psutil, abs=0.03)
    finally:
        child.kill()
        child.join()
    assert _stat_cpu_seconds(child.pid) is None  # gone: psutil is asked, and tells it


def _burn_beside_a_sleeper(seconds: float) -> None:
    if os.fork() == 0:  # a child of its own, as a launched rank's workers are
        time.sleep(30)
        os._exit(0)
    _burn(seconds)


def test_cpu_seconds_count_live_children_found_through_proc():
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=f, args=(0.3,), daemon=True) for f in (_burn_beside_a_sleeper, _burn)]
    _, kids0 = process_cpu_seconds()
    for p in procs:
        p.start()
    try:
        found = descendants(os.getpid())
        assert found is not None and {p.pid for p in procs} <= set(found)
        deadline = time.monotonic() + 20
        while process_cpu_seconds()[1] - kids0 < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_cpu_seconds()[1] - kids0 >= 0.5  # both children's 0.3 s, while they are alive
        # a child apart (another rank Lightning launched from this process) is left out with its own children, by
        # either walk
        one = procs[0].pid
        grandchildren = set(descendants(one) or [])  # forked by now: the child burned after forking it
        found = descendants(os.getpid())
        assert found is not None and len(grandchildren) == 1 and grandchildren <= set(found)
        assert process_cpu_seconds(apart=[one])[1] - kids0 == pytest.approx(
            process_cpu_seconds()[1] - kids0 - 0.3, abs=0.1
        )
        assert (
            set(_psutil_descendants(psutil.Process(), [one]))
            == set(descendants(os.getpid(), [one]))
            == set(found) - {one} - grandchildren
        )
        # this process read through psutil, as through os.times()
        main, _ = process_cpu_seconds(psutil.Process())
        assert main == pytest.approx(process_cpu_seconds()[0], abs=0.05)
    finally:
        for pid in descendants(procs[0].pid) or []:  # before its parent: orphaned, it is no descendant
            os.kill(pid, 9)
        for p in procs:
            p.kill()
            p.join()


def test_the_process_cpu_time_of_each_step_is_kept_apart_from_the_loading():
    """Each step's process CPU time (every thread: a step on 2 intra-op threads takes 2 s of CPU a second) is read
    around the step alone, not the loading's; without the clock it reads 0.0."""
    from lightning_dltune.tuning.model import step_cpus

    clock = FakeClock()
    process = [0.0]
    timer = StepTimer(clock=clock, cpu_clock=lambda: clock.cpu, step_cpu_clock=lambda: process[0])
    timer.epoch_started()
    for _ in range(5):
        timer.fetch_started()
        clock.advance(0.024, 0.024)
        process[0] += 0.024  # loading, in the training process: not the step's
        timer.fetch_ended()
        timer.step_started()
        clock.advance(0.020)
        process[0] += 0.040  # the step computes on 2 CPUs
        timer.step_ended(16)
    stats = timer.take_window()
    assert stats.step_cpu_s == pytest.approx(5 * 0.040)
    assert step_cpus(stats) == pytest.approx(2.0)
    # two of those steps are 40 ms of steps, under the 50 the kernel's tick-sized accounting needs: not read, however
    # long the loading between them
    assert step_cpus(replace(stats, step_s=0.040, step_cpu_s=0.080, other_s=1.0)) == 0.0
    plain = StepTimer(clock=clock, cpu_clock=lambda: clock.cpu)
    run_steps(plain, clock, [(0.030, 0.002, 0.010, 0.001)] * 3)
    assert plain.take_window().step_cpu_s == 0.0
