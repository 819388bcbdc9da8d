"""The GPU timeline's arithmetic and its use in decisions, on a simulated stream (CUDA is absent here; the
same class runs on real ``torch.cuda.Event`` objects in ``tests/test_cuda.py``)."""

from dataclasses import replace

import pytest

from lightning_dltune.measurement.gpu import GpuStats, GpuTimeline
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.diagnose import diagnose
from lightning_dltune.tuning.model import Budget, Policy, Trial, estimate
from lightning_dltune.tuning.rules import decide

from sim_gpu import SimStream


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make(max_ahead_s=float("inf")):
    clock = Clock()
    stream = SimStream(clock, clock.advance, max_ahead_s)
    return GpuTimeline(stream.event), stream, clock


def run(tl, stream, clock, n, *, wait, copy, gpu_step, host_step=0.0, other=0.0, steady=True, pause_at=()):
    """n steps as the loop runs them: other host work, the fetch, the copy, the step."""
    for i in range(n):
        clock.advance(other)
        if i in pause_at:
            tl.pause()
        tl.fetch_started()
        clock.advance(wait)
        tl.fetch_ended()
        stream.launch(copy)  # batch_to_device
        tl.step_started(steady=steady)
        stream.launch(gpu_step)
        clock.advance(host_step)
        tl.step_ended()


def per_step_ms(stats: GpuStats):
    n = stats.steps
    return tuple(round(x / n * 1e3, 6) for x in (stats.idle_s, stats.copy_s, stats.other_s, stats.step_s))


def test_a_starved_gpu_is_idle_for_the_wait_less_its_own_work():
    tl, stream, clock = make()
    tl.epoch_started()
    run(tl, stream, clock, 3, wait=0.030, copy=0.002, gpu_step=0.010)
    tl.take_window()  # warm-up
    run(tl, stream, clock, 10, wait=0.030, copy=0.002, gpu_step=0.010)
    clock.advance(1.0)
    stats = tl.take_window()
    assert stats.steps == 10
    # the host waits 30 ms per step; the GPU works 12 of them (copy + step) and sits idle for 18
    assert per_step_ms(stats) == (18.0, 2.0, 0.0, 10.0)
    assert stream.synchronized == 0


def test_a_busy_gpu_is_not_stalled_while_the_host_waits():
    tl, stream, clock = make(max_ahead_s=0.05)  # the host blocks once 50 ms of work is queued
    tl.epoch_started()
    run(tl, stream, clock, 5, wait=0.010, copy=0.002, gpu_step=0.030)
    tl.take_window()
    run(tl, stream, clock, 10, wait=0.010, copy=0.002, gpu_step=0.030)
    clock.advance(1.0)
    stats = tl.take_window()
    assert stats.steps == 10
    assert per_step_ms(stats) == (0.0, 2.0, 0.0, 30.0)  # the host waited 10 ms a step; the GPU never did


def test_host_work_between_steps_is_kept_apart_from_the_loader_wait():
    tl, stream, clock = make()
    tl.epoch_started()
    run(tl, stream, clock, 4, wait=0.020, copy=0.0, gpu_step=0.002, other=0.004)
    tl.take_window()
    run(tl, stream, clock, 4, wait=0.020, copy=0.0, gpu_step=0.002, other=0.004)
    clock.advance(1.0)
    # the GPU finishes its 2 ms step while the host spends 4 ms on other work: 2 ms of that is idle time
    assert per_step_ms(tl.take_window()) == (20.0, 0.0, 2.0, 2.0)


def test_startup_steps_and_gaps_with_validation_are_left_out():
    tl, stream, clock = make()
    tl.epoch_started()
    run(tl, stream, clock, 1, wait=0.5, copy=0.0, gpu_step=0.01, steady=False)  # first batch of new workers
    run(tl, stream, clock, 6, wait=0.01, copy=0.0, gpu_step=0.01, pause_at=(2,))
    clock.advance(1.0)
    assert tl.take_window().steps == 5
    assert tl.take_log_window().steps == 5


def test_reading_never_waits_and_a_window_waits_once_when_the_host_runs_far_ahead():
    tl, stream, clock = make()  # nothing ever blocks the host
    tl.epoch_started()
    run(tl, stream, clock, 10, wait=0.001, copy=0.0, gpu_step=0.050)
    first_read = tl.take_log_window().steps
    assert first_read < 2  # the GPU has reached almost nothing yet; no waiting for it
    assert stream.synchronized == 0
    stats = tl.take_window()  # fewer than half readable: wait for the window's last step, once
    assert stats.steps == 10 and stream.synchronized == 1
    run(tl, stream, clock, 10, wait=0.001, copy=0.0, gpu_step=0.050)
    assert tl.take_window(wait=False).steps < 2 and stream.synchronized == 1
    clock.advance(10.0)
    tl.poll()  # the steps of a window already taken go to the log, not to the next window
    assert tl.take_window().steps == 0
    assert tl.take_log_window().steps == 20 - first_read


def test_window_stats_carry_the_gpu_view():
    stats = WindowStats(steps=10, samples=80, wall_s=0.3, wait_s=0.1, step_s=0.2)
    assert stats.gpu_stall_frac is None and stats.effective_stall_frac == pytest.approx(1 / 3)
    gpu = stats.with_gpu(GpuStats(steps=8, idle_s=0.0, copy_s=0.04, other_s=0.0, step_s=0.2))
    assert gpu.gpu_stall_frac == 0.0 and gpu.effective_stall_frac == 0.0
    assert gpu.copy_frac == pytest.approx(1 / 6)
    assert gpu.mean_gpu_busy_s == pytest.approx(0.03)
    assert WindowStats.from_dict(gpu.to_dict()) == gpu


# --- decisions ---------------------------------------------------------------------------------------------------
BUDGET = Budget(cpus=2.0, max_workers=16)


def gtrial(workers, wait_ms, step_ms, idle_ms, copy_ms, gpu_step_ms, *, pin=False, steps=40, batch_mib=0.0, sem=0.0):
    """A trial measured on CUDA: host wait/step per step and the GPU's idle/copy/step per step (ms)."""
    wall = (wait_ms + step_ms) * steps / 1e3
    stats = WindowStats(
        steps=steps,
        samples=steps * 16,
        wall_s=wall,
        wait_s=wait_ms * steps / 1e3,
        step_s=step_ms * steps / 1e3,
        wait_p50_s=wait_ms / 1e3,
        wait_p90_s=wait_ms / 1e3,
        wall_sem_s=sem / 1e3,
        fetch_cpu_s=0.001 * steps,
        batch_bytes=batch_mib * 2**20,
    ).with_gpu(GpuStats(steps, idle_ms * steps / 1e3, copy_ms * steps / 1e3, 0.0, gpu_step_ms * steps / 1e3))
    settings = LoaderSettings.normalized(workers, pin_memory=pin)
    return Trial(settings, stats)


def test_a_host_wait_the_gpu_did_not_see_is_no_reason_to_add_workers():
    # the host waited 10 of every 32 ms (31%), the GPU was never idle
    on_gpu = gtrial(0, 10, 22, idle_ms=0.0, copy_ms=0.5, gpu_step_ms=31.5)
    decision = decide([on_gpu], BUDGET)
    assert decision.action == "settle" and decision.settings.num_workers == 0
    assert "GPU's idle gap 0.0%" in decision.reason
    text = diagnose([on_gpu], decision.settings, BUDGET)
    assert text.startswith("accelerator-bound: the GPU sat idle waiting for data 0.0%")
    assert "the host waited 31%" in text
    host_only = Trial(on_gpu.settings, replace(on_gpu.stats, gpu_steps=0))
    assert decide([host_only], BUDGET).action == "try"  # what a host-timestamp tuner would have done


def test_workers_are_sized_against_the_gpu_step_not_the_host_step():
    # 0 workers: a batch takes 40 ms to load; the host queues the step in 2 ms, the GPU runs it in 20 ms
    t = gtrial(0, 40, 2, idle_ms=22, copy_ms=0.0, gpu_step_ms=20)
    assert estimate([t], Budget(cpus=64, max_workers=64)).needed_workers == 3  # ceil(1.25 * 40 / 20), not 25
    assert decide([t], Budget(cpus=64, max_workers=64)).settings.num_workers == 3


def test_copies_that_hold_the_gpu_up_get_pinned_memory_and_keep_it_when_faster():
    start = gtrial(4, 0.5, 11, idle_ms=0.0, copy_ms=6.0, gpu_step_ms=5.0, batch_mib=8)
    first = decide([start], BUDGET)
    assert first.action == "try" and first.settings == replace(start.settings, pin_memory=True)
    assert "host-to-device copies take 55%" in first.reason
    pinned = gtrial(4, 0.5, 7, idle_ms=0.0, copy_ms=2.0, gpu_step_ms=5.0, pin=True, batch_mib=8)
    settled = decide([start, pinned], BUDGET)
    assert settled.action == "settle" and settled.settings.pin_memory
    text = diagnose([start, pinned], settled.settings, BUDGET)
    assert text.startswith("transfer-bound: host-to-device copies take 29%") and "already pinned" in text
    assert "workers=4 prefetch=2 pinned" in settled.settings.describe()


def test_pinned_memory_that_does_not_pay_is_dropped():
    start = gtrial(4, 0.5, 11, idle_ms=0.0, copy_ms=6.0, gpu_step_ms=5.0)
    pinned = gtrial(4, 0.5, 11.2, idle_ms=0.0, copy_ms=6.0, gpu_step_ms=5.0, pin=True)
    settled = decide([start, pinned], BUDGET)
    assert settled.action == "settle" and not settled.settings.pin_memory  # the cheaper of two equals
    assert "pinned memory did not make it faster" in diagnose([start, pinned], settled.settings, BUDGET)


def test_pinned_memory_must_fit_the_memory_budget():
    start = gtrial(4, 0.5, 11, idle_ms=0.0, copy_ms=6.0, gpu_step_ms=5.0, batch_mib=64)
    tight = Budget(cpus=2.0, max_workers=16, memory_bytes=256 * 2**20)  # 9 batches in flight need 576 MiB
    assert decide([start], tight).action == "settle"
    assert decide([start], Budget(cpus=2.0, max_workers=16, memory_bytes=2**30)).action == "try"


def test_no_pinned_memory_trial_without_a_gpu_timeline_or_once_the_budget_is_spent():
    start = gtrial(4, 0.5, 11, idle_ms=0.0, copy_ms=6.0, gpu_step_ms=5.0)
    host_only = Trial(start.settings, replace(start.stats, gpu_steps=0))
    assert decide([host_only], BUDGET).action == "settle"
    assert decide([start], BUDGET, Policy(max_trials=1)).action == "settle"
