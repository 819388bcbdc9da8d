"""Per-step accounting of data wait, step time and other host time, with an injectable clock.

The training loop calls :class:`StepTimer` at five points (fetch start/end, step start/end, epoch start) and,
around validation, :meth:`StepTimer.pause`/:meth:`StepTimer.resume`. For step ``i``::

    gap_i   = step_start_i - step_end_{i-1}          (or the epoch start)
    wait_i  = time inside fetches during gap_i       (training blocked on the loader)
    other_i = gap_i - wait_i - paused_i              (host-to-device copy, logging, checkpoint hooks ...)
    step_i  = step_end_i - step_start_i              (forward/backward/optimizer as the host sees it)
    wall_i  = wait_i + other_i + step_i              (validation excluded and reported apart)

The first step after a loader is (re)built is charged, with the build itself, to ``startup_s`` and kept out
of the steady-state statistics: it pays for worker start-up and for filling the pipeline.

On CUDA the same steps are also measured as the GPU saw them (``gpu_*`` fields, from
:class:`~lightning_dltune.measurement.gpu.GpuTimeline`); decisions then use the GPU's idle gap
(``effective_stall_frac``).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from lightning_dltune._stats import block_means, few, sem, trimmed_mean_sem
from lightning_dltune.measurement.gpu import GpuStats
from lightning_dltune.measurement.memory import WorkerMemory

Clock = Callable[[], float]

_TAIL_SIZE = 20_000


@dataclass(frozen=True)
class WindowStats:
    """What a window of training steps measured. Sums are in seconds; ``*_p50_s``/``*_p90_s`` are per step."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    step_s: float = 0.0
    other_s: float = 0.0
    excluded_s: float = 0.0
    wait_p50_s: float = 0.0
    wait_p90_s: float = 0.0
    wall_sem_s: float = 0.0
    # the mean wall per step and its standard error with the slowest block of steps left out (see _Accumulator):
    # what configs are compared on (0.0: not measured, e.g. a window read from an older cache)
    wall_trim_s: float = 0.0
    wall_trim_sem_s: float = 0.0
    wait_sem_s: float = 0.0  # standard error of the mean per-step wait (batch means, widened: see _Accumulator)
    busy_sem_s: float = 0.0  # standard error of the mean per-step busy time (step and other)
    busy_trim_s: float = 0.0  # the mean busy time per step and its error, the slowest block left out (as wall_trim_s)
    busy_trim_sem_s: float = 0.0
    busy_p50_s: float = 0.0  # the median busy time per step (0.0: not measured, e.g. a window from an older cache)
    busy_min_s: float = 0.0  # the least busy time of the steps with the window's largest batch (0.0: not measured)
    # the least wait of any step of the window, and the least wall per sample (0.0: not measured): every step took
    # at least this (a sign test: `compare.every_step_slower`)
    wait_min_s: float = 0.0
    sample_wall_min_s: float = 0.0
    fetch_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    main_cpu_s: float = 0.0
    step_cpu_s: float = 0.0  # the training process's CPU time, all its threads, during its steps (0.0: not measured)
    startup_s: float = 0.0
    build_s: float = 0.0  # of startup_s, building the loader and starting its workers (in the training process)
    startup_behind: int = 0  # 1: started in the background; startup_s is what its overlap cost beyond the old pace
    # the first step after the build (start-up, not one of the steady steps): its wait and its busy time (0.0: none
    # in this window). At 0 workers it loads its batch as every later step does (`windows.stalled_from_the_start`)
    startup_wait_s: float = 0.0
    startup_busy_s: float = 0.0
    startup_fetch_cpu_s: float = 0.0  # the start-up step's fetch, on the training process's CPU
    startup_step_samples: int = 0  # the start-up step's batch size, as every step's is read
    # the start-up step's batch, loaded in the training process sample by sample (`_lightning.time_samples`; 0: not
    # timed): how many samples, the first one's time, and the others' mean time and its standard error. A first
    # sample that opened a file lazily shows apart from the rest (`windows.steady_from_the_start`)
    startup_samples: int = 0
    startup_first_sample_s: float = 0.0
    startup_sample_mean_s: float = 0.0
    startup_sample_sem_s: float = 0.0
    worker_mem_bytes: float = 0.0  # largest unique memory (USS) of one worker, sampled during the window
    worker_mem_total_bytes: float = 0.0  # the workers' USS summed, its peak during the window
    worker_mem_base_bytes: float = 0.0  # a worker's USS at its start, fitted (see lightning_dltune.measurement.memory)
    worker_mem_growth_bytes: float = 0.0  # what a worker's USS grows per batch it loads (copy-on-read), fitted
    worker_mem_jump_bytes: float = 0.0  # what a fresh worker copies in its first batches, saturating, fitted
    worker_mem_saturation: float = 0.0  # the batches over which that jump saturates (0: no jump), fitted
    worker_mem_lead_bytes: float = 0.0  # what the workers grow before a switch down stops them (memory.lead_bytes)
    main_mem_bytes: float = 0.0  # the training process's own footprint (RSS): what a worker can come to hold
    epoch_batches: float = 0.0  # batches in an epoch of the loader (0: unknown, inf: unbounded)
    batch_bytes: float = 0.0  # tensor bytes of one batch
    gpu_steps: int = 0  # steps the GPU timeline read (CUDA only); the gpu_* sums cover these steps
    gpu_idle_s: float = 0.0  # the GPU idle while the host waited for the loader
    gpu_copy_s: float = 0.0  # host-to-device copy as the GPU saw it
    gpu_other_s: float = 0.0  # the GPU idle while the host did other work between steps
    gpu_step_s: float = 0.0  # the steps as the GPU ran them
    gpu_wall_trim_s: float = 0.0  # the GPU's time per step, the slowest block of steps left out
    gpu_wall_trim_sem_s: float = 0.0

    @property
    def stall_frac(self) -> float:
        """Fraction of training wall time spent blocked on the loader."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def gpu(self) -> GpuStats:
        """The ``gpu_*`` fields as :class:`~lightning_dltune.measurement.gpu.GpuStats` (no steps without a GPU
        timeline)."""
        return GpuStats(
            self.gpu_steps,
            self.gpu_idle_s,
            self.gpu_copy_s,
            self.gpu_other_s,
            self.gpu_step_s,
            self.gpu_wall_trim_s,
            self.gpu_wall_trim_sem_s,
        )

    @property
    def gpu_stall_frac(self) -> float | None:
        """Fraction of the GPU's time spent idle waiting for the loader (``None`` without a GPU timeline)."""
        return self.gpu.stall_frac

    @property
    def copy_frac(self) -> float | None:
        """Fraction of the GPU's time spent on host-to-device copies (``None`` without a GPU timeline)."""
        return self.gpu.copy_frac

    @property
    def effective_stall_frac(self) -> float:
        """The stall decisions use: the GPU's idle gap where it was measured, else the host's wait."""
        gpu = self.gpu_stall_frac
        return self.stall_frac if gpu is None else gpu

    @property
    def mean_gpu_busy_s(self) -> float:
        """What the GPU spends per step when it is fed (copy and step), 0.0 without a GPU timeline."""
        return self.gpu.mean_busy_s

    def stall_lower_bound(self, z: float = 2.0) -> float:
        """A lower confidence bound on :attr:`stall_frac` (0.0 below two steps). The stall is ``W / (W + B)``, the
        mean wait over the mean wait plus the mean busy time (step and other), which grows with ``W`` and falls
        with ``B``: the bound takes ``W`` ``z`` standard errors lower and ``B`` ``z`` higher. (The wall's own
        error is no use here: it carries the wait's, so bounding both counted a bursty wait twice.)"""
        if self.steps < 2 or self.wall_s <= 0:
            return 0.0
        wait = max(0.0, self.mean_wait_s - z * self.wait_sem_s)
        busy = max(0.0, self.mean_wall_s - self.mean_wait_s) + z * self.busy_sem_s
        return wait / (wait + busy) if wait + busy > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_wall_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0

    @property
    def mean_wait_s(self) -> float:
        return self.wait_s / self.steps if self.steps else 0.0

    @property
    def mean_step_s(self) -> float:
        return self.step_s / self.steps if self.steps else 0.0

    @property
    def mean_other_s(self) -> float:
        return self.other_s / self.steps if self.steps else 0.0

    def with_cpu(self, worker_cpu_s: float, main_cpu_s: float) -> WindowStats:
        return replace(self, worker_cpu_s=worker_cpu_s, main_cpu_s=main_cpu_s)

    def with_memory(
        self,
        mem: WorkerMemory,
        batch_bytes: float,
        main_mem_bytes: float = 0.0,
        epoch_batches: float = 0.0,
        lead_bytes: float = 0.0,
    ) -> WindowStats:
        return replace(
            self,
            worker_mem_lead_bytes=lead_bytes,
            worker_mem_bytes=mem.peak_worker_bytes,
            worker_mem_total_bytes=mem.peak_total_bytes,
            worker_mem_base_bytes=mem.base_bytes,
            worker_mem_growth_bytes=mem.growth_bytes,
            worker_mem_jump_bytes=mem.jump_bytes,
            worker_mem_saturation=mem.saturation_batches,
            batch_bytes=batch_bytes,
            main_mem_bytes=main_mem_bytes,
            epoch_batches=epoch_batches,
        )

    @property
    def worker_memory(self) -> WorkerMemory:
        """The window's fit of the workers' memory (:mod:`lightning_dltune.measurement.memory`)."""
        return WorkerMemory(
            self.worker_mem_base_bytes or self.worker_mem_bytes,
            self.worker_mem_growth_bytes,
            self.worker_mem_bytes,
            self.worker_mem_total_bytes,
            1 if self.worker_mem_bytes > 0 else 0,
            self.worker_mem_jump_bytes,
            self.worker_mem_saturation,
        )

    def with_gpu(self, gpu: GpuStats) -> WindowStats:
        return replace(
            self,
            gpu_steps=gpu.steps,
            gpu_idle_s=gpu.idle_s,
            gpu_copy_s=gpu.copy_s,
            gpu_other_s=gpu.other_s,
            gpu_step_s=gpu.step_s,
            gpu_wall_trim_s=gpu.wall_trim_s,
            gpu_wall_trim_sem_s=gpu.wall_trim_sem_s,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self)
        out.update(stall_frac=self.stall_frac, samples_per_s=self.samples_per_s)
        if self.gpu_steps:
            out.update(gpu_stall_frac=self.gpu_stall_frac, copy_frac=self.copy_frac)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class _Accumulator:
    """Exact sums, the running variance of the per-step busy time, and the most recent waits and walls for quantiles
    and for the standard errors of their means, taken over blocks of steps and widened for the few steps or blocks
    they come from (:mod:`lightning_dltune._stats`).

    :meth:`add` runs at every step, inside the training loop, among Lightning's and the model's own work: it is
    written flat (no calls), since each call there costs several times what it costs in a tight loop."""

    def __init__(self, tail_size: int, spread: bool = True) -> None:
        self.tail_size = tail_size
        self.spread = spread  # False: sums only, no variances, standard errors or quantiles (they read 0.0)
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.samples = 0
        self.wall = self.wait = self.step = self.other = self.excluded = self.fetch_cpu = self.step_cpu = 0.0
        self.startup = self.build = self.startup_wait = self.startup_busy = self.startup_fetch_cpu = 0.0
        self.startup_step_samples = 0
        self.startup_samples: list[float] = []
        self.behind = 0
        self.wait_min = self.sample_wall_min = self.busy_min = math.inf
        self._largest = 0  # the largest batch of the window: the least busy time is its (a short last batch's is less)
        # the busy time's sums, shifted by the first step's: a variance without Welford's division at every step; the
        # sums are of deviations of the order of the spread, not of the times, so cancellation loses no precision
        self._busy_shift = self._busy_d = self._busy_d2 = 0.0
        self._waits: deque[float] = deque(maxlen=self.tail_size)
        self._walls: deque[float] = deque(maxlen=self.tail_size)

    def add(
        self, wait: float, step: float, other: float, samples: int, fetch_cpu: float, step_cpu: float = 0.0
    ) -> None:
        wall = wait + step + other
        self.steps += 1
        self.samples += samples
        self.wall += wall
        self.wait += wait
        self.step += step
        self.other += other
        self.fetch_cpu += fetch_cpu
        self.step_cpu += step_cpu
        if not self.spread:  # sums only (a logging window): this runs on every step
            return
        busy = step + other
        if wait < self.wait_min:
            self.wait_min = wait
        if samples >= self._largest:
            if samples > self._largest or busy < self.busy_min:
                self.busy_min = busy
            self._largest = samples
        if samples and wall / samples < self.sample_wall_min:
            self.sample_wall_min = wall / samples
        if self.steps == 1:
            self._busy_shift = busy
        d = busy - self._busy_shift
        self._busy_d += d
        self._busy_d2 += d * d
        self._waits.append(wait)
        self._walls.append(wall)

    def _block_sem(self, recent: deque[float]) -> float:
        n = min(self.steps, len(recent))  # past the tail's size: over the values it still holds
        if n < 2:
            return 0.0
        means = block_means(recent)  # under 6 steps, blocks of 1: the steps themselves
        return sem(means) * few(len(means) - 1)

    def stats(self) -> WindowStats:
        n = self.steps
        busy_var = max(0.0, self._busy_d2 - self._busy_d * self._busy_d / n) / (n - 1) if n > 1 else 0.0
        busy_sem = math.sqrt(busy_var / n) * few(n - 1) if n > 1 else 0.0
        waits = sorted(self._waits)
        trim, trim_sem = trimmed_mean_sem(self._walls)
        busy = [w - x for w, x in zip(self._walls, self._waits, strict=True)]
        busy_trim, busy_trim_sem = trimmed_mean_sem(busy)
        return WindowStats(
            steps=self.steps,
            samples=self.samples,
            wall_s=self.wall,
            wait_s=self.wait,
            step_s=self.step,
            other_s=self.other,
            excluded_s=self.excluded,
            wait_p50_s=quantile(waits, 0.5),
            wait_p90_s=quantile(waits, 0.9),
            wall_sem_s=self._block_sem(self._walls),
            wall_trim_s=trim,
            wall_trim_sem_s=trim_sem,
            wait_sem_s=self._block_sem(self._waits),
            busy_sem_s=busy_sem,
            busy_trim_s=busy_trim,
            busy_trim_sem_s=busy_trim_sem,
            busy_p50_s=quantile(sorted(busy), 0.5),
            busy_min_s=self.busy_min if self.busy_min < math.inf else 0.0,
            wait_min_s=self.wait_min if self.wait_min < math.inf else 0.0,
            sample_wall_min_s=self.sample_wall_min if self.sample_wall_min < math.inf else 0.0,
            fetch_cpu_s=self.fetch_cpu,
            step_cpu_s=self.step_cpu,
            startup_s=self.startup,
            build_s=self.build,
            startup_behind=self.behind,
            startup_wait_s=self.startup_wait,
            startup_busy_s=self.startup_busy,
            startup_fetch_cpu_s=self.startup_fetch_cpu,
            startup_step_samples=self.startup_step_samples,
            **_sample_summary(self.startup_samples),
        )


def _sample_summary(times: list[float]) -> dict[str, Any]:
    """The ``startup_*sample*`` fields of :class:`WindowStats` for the start-up batch's per-sample ``times``."""
    if len(times) < 3:
        return {}
    rest = times[1:]
    return {
        "startup_samples": len(times),
        "startup_first_sample_s": times[0],
        "startup_sample_mean_s": sum(rest) / len(rest),
        "startup_sample_sem_s": sem(rest),
    }


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (0.0 for an empty one)."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class StepTimer:
    """Accumulates step timings into a trial window and a logging window.

    Args:
        clock: wall clock in seconds (default :func:`time.perf_counter`).
        cpu_clock: CPU time of the calling thread in seconds (default :func:`time.thread_time`); it prices the
            loading work done in the main process when there are no workers.
        step_cpu_clock: CPU time of the whole process (every thread) in seconds, read around each step: what the
            step computes on the CPUs (:func:`time.process_time`; ``None``: not measured).
        tail_size: how many recent per-step waits feed the p50/p90 estimates (6 or more).
    """

    def __init__(
        self,
        clock: Clock = time.perf_counter,
        cpu_clock: Clock = time.thread_time,
        tail_size: int = _TAIL_SIZE,
        step_cpu_clock: Clock | None = None,
    ) -> None:
        if tail_size < 6:  # a window's first steps are its errors' own values (see _Accumulator._block_sem)
            raise ValueError(f"StepTimer(tail_size={tail_size}): it must be 6 or more; leave it at its default")
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._step_cpu_clock = step_cpu_clock
        self._step_c0 = 0.0
        self._window = _Accumulator(tail_size)
        self._log = _Accumulator(tail_size, spread=False)  # logged: sums only, over every step
        self._ref: float | None = None
        self._requested_at: float | None = None
        self._first_after_build = False
        self._batches = 0  # every step of the window, start-up steps included
        # a background start (see `overlap_started`): the running config's steps until the hand-over, their wall
        # time and count; and that config's mean wall per step, from the last window taken
        self._overlap: list[float] | None = None
        self._last_mean_wall = 0.0
        self._clear_gap()

    def _clear_gap(self) -> None:
        self._wait = 0.0
        self._fetch_cpu = 0.0
        self._paused = 0.0
        self._fetch_t0: float | None = None
        self._fetch_c0 = 0.0
        self._pause_t0: float | None = None
        self._step_t0: float | None = None

    # --- loader lifecycle -------------------------------------------------------------------------------------
    def loader_requested(self) -> None:
        """A new loader is about to be built: the time until its first batch is start-up cost."""
        self._requested_at = self._clock()

    def rebuilt_in_fetch(self) -> None:
        """The loader was replaced inside the current fetch: this step is start-up cost, not steady state. After
        a background start, so is the time its overlap steps took beyond the old config's pace."""
        self._first_after_build = True
        if self._overlap is not None:
            (wall, steps), self._overlap = self._overlap, None
            # the log window has those steps already (they were served); the trial window pays for them here
            self._window.startup += max(0.0, wall - steps * self._last_mean_wall)
            self._window.behind = 1

    def build_loader(self, create: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Create a new loader's iterator, starting its workers, inside a fetch (a switch in the epoch), and count the
        time as its build: part of the start-up, whether it is charged as the first step's or as a background
        start's overlap."""
        t0 = self._clock()
        try:
            return create()
        finally:
            build = self._clock() - t0
            self._window.build += build
            self._log.build += build

    def startup_samples(self, times: Sequence[float]) -> None:
        """The per-sample load times of the start-up step's batch (after :meth:`step_ended`), where it was loaded in
        the training process (see ``_lightning.time_samples``)."""
        self._window.startup_samples = list(times)

    def overlap_started(self) -> None:
        """A new loader starts in the background; the steps until it takes over (:meth:`rebuilt_in_fetch`) are
        the old config's, left out of the window (it was judged already)."""
        self._overlap = [0.0, 0]

    def overlap_ended(self) -> None:
        """The background start was abandoned: its steps stay out of the window, nothing is charged."""
        self._overlap = None

    def epoch_started(self) -> None:
        now = self._clock()
        if self._requested_at is not None:
            build = now - self._requested_at
            self._window.startup += build
            self._log.startup += build
            self._window.build += build
            self._log.build += build
            self._requested_at = None
            self._first_after_build = True
        self._ref = now
        self._clear_gap()

    # --- per step ---------------------------------------------------------------------------------------------
    def fetch_started(self) -> None:
        if self._requested_at is not None:
            # a loader built with no epoch start after it (Lightning resuming mid-epoch skips that hook): its
            # build is start-up, and the steps from here are measured as after an epoch start
            self.epoch_started()
        self._fetch_t0 = self._clock()
        self._fetch_c0 = self._cpu_clock()

    def fetch_ended(self) -> None:
        if self._fetch_t0 is None:
            return
        self._wait += self._clock() - self._fetch_t0
        self._fetch_cpu += self._cpu_clock() - self._fetch_c0
        self._fetch_t0 = None

    def pause(self) -> None:
        """Stop charging time to the next step (validation, for instance)."""
        if self._pause_t0 is None:
            self._pause_t0 = self._clock()

    def resume(self) -> None:
        if self._pause_t0 is not None:
            paused = self._clock() - self._pause_t0
            self._paused += paused
            self._window.excluded += paused
            self._log.excluded += paused
            self._pause_t0 = None

    def leave_out_fetch(self) -> None:
        """The running fetch's wait so far was no loader's cost (a worker hung in its fork): it is left out of the
        windows, as a pause is, and the fetch is timed from here."""
        if self._fetch_t0 is not None:
            now = self._clock()
            left_out, self._fetch_t0, self._fetch_c0 = now - self._fetch_t0, now, self._cpu_clock()
            self._paused += left_out
            self._window.excluded += left_out
            self._log.excluded += left_out

    def step_started(self) -> None:
        now = self._clock()
        self._step_t0 = now
        self._step_c0 = self._step_cpu_clock() if self._step_cpu_clock is not None else 0.0
        self._gap = (now - self._ref) if self._ref is not None else self._wait

    def step_ended(self, samples: int) -> None:
        if self._step_t0 is None:
            return
        now = self._clock()
        cpu = self._step_cpu_clock() - self._step_c0 if self._step_cpu_clock is not None else 0.0
        self._batches += 1
        step = now - self._step_t0
        wait = self._wait
        other = max(0.0, self._gap - wait - self._paused)
        if self._first_after_build:
            # worker start-up and pipeline fill: priced apart from the steady state, and logged as every step is
            # (what training waited for, a switch's start-up included)
            self._window.startup += wait + other
            self._log.add(wait, step, other, samples, self._fetch_cpu)
            self._window.startup_wait, self._window.startup_busy = wait, step + other
            self._window.startup_fetch_cpu, self._window.startup_step_samples = self._fetch_cpu, samples
            self._first_after_build = False
        elif self._overlap is not None:  # the old config's, while a new loader starts behind it: logged only
            self._overlap[0] += wait + step + other
            self._overlap[1] += 1
            self._log.add(wait, step, other, samples, self._fetch_cpu)
        else:
            self._window.add(wait, step, other, samples, self._fetch_cpu, cpu)
            self._log.add(wait, step, other, samples, self._fetch_cpu, cpu)
        self._ref = now
        self._clear_gap()

    @property
    def steady(self) -> bool:
        """Whether the step about to run counts as steady state (it is not the first after a loader build, nor
        the old config's while a new loader starts behind it)."""
        return not self._first_after_build and self._overlap is None

    @property
    def startup_next(self) -> bool:
        """Whether the step about to run is the first after a loader build (its start-up step)."""
        return self._first_after_build

    # --- windows ----------------------------------------------------------------------------------------------
    @property
    def window_steps(self) -> int:
        return self._window.steps

    def peek_window(self) -> WindowStats:
        return self._window.stats()

    @property
    def window_batches(self) -> int:
        """Every step of the window, start-up steps included: the same on every rank, whatever one rank had to
        rebuild (steady steps are not)."""
        return self._batches

    def take_window(self) -> WindowStats:
        stats = self._window.stats()
        if stats.steps:
            self._last_mean_wall = stats.mean_wall_s
        self._window.reset()
        self._batches = 0
        return stats

    def take_log_window(self) -> WindowStats:
        stats = self._log.stats()
        self._log.reset()
        return stats


def process_cpu_seconds(process: Any = None, apart: Collection[int] = ()) -> tuple[float, float]:
    """CPU seconds used so far by this process and by its child processes, reaped and live (the workers, and a
    forkserver with the workers it started and reaped). ``apart``: live children not counted, nor their descendants
    (the other ranks Lightning's launcher started from this process: their steps and workers are their own)."""
    import psutil

    if process is None:  # this process: os.times() reads what psutil would, without building a Process (~50 us)
        own = os.times()
        main, children, pid = own.user + own.system, own.children_user + own.children_system, os.getpid()
    else:
        times = process.cpu_times()
        main, children, pid = times.user + times.system, times.children_user + times.children_system, process.pid
    pids = descendants(pid, apart)
    if pids is None:
        pids = _psutil_descendants(psutil.Process(pid), apart)
    for kid in pids:
        # what a live child reaped is its own: counted once, here (a live grandchild is counted in the walk)
        spent = _stat_cpu_seconds(kid)
        if spent is None:
            try:
                ct = psutil.Process(kid).cpu_times()
            except psutil.Error:  # gone since: reaped by this process, it is in this process's children times
                continue
            spent = ct.user + ct.system + ct.children_user + ct.children_system
        children += spent
    return main, children


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu_seconds(pid: int) -> float | None:
    """A process's CPU seconds with its reaped children's, from ``/proc/PID/stat`` (one read, where psutil takes
    two and builds a Process: reading this process with 16 live workers went from 1.4 ms to 0.6-0.7 ms); ``None`` where
    it cannot be read (then ask psutil, which also tells a process gone from one it cannot read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # after the command's closing parenthesis: state is field 3, utime, stime, cutime, cstime are 14-17
        fields = data[data.rindex(b")") + 2 :].split()
        return sum(int(x) for x in fields[11:15]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def _psutil_descendants(process: Any, apart: Collection[int]) -> list[int]:
    """:func:`descendants` through psutil: one scan of ``/proc`` for every process's parent."""
    import psutil

    children: dict[int, list[int]] = {}
    for p in psutil.process_iter(["ppid"]):
        children.setdefault(p.info["ppid"], []).append(p.pid)
    found, todo = [], [process.pid]
    while todo:
        kids = [k for k in children.get(todo.pop(), []) if k not in apart]
        found += kids
        todo += kids
    return found


def descendants(pid: int, apart: Collection[int] = ()) -> list[int] | None:
    """The live descendants of ``pid``, from the kernel's per-thread ``/proc/PID/task/TID/children`` lists: tens
    of microseconds, where finding them by parent scans all of ``/proc`` (milliseconds on a busy host, at every
    window). ``None`` where the kernel keeps no such lists (then ask psutil). ``apart``: children left out, with
    their descendants."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        if not os.path.exists(f"/proc/{parent}/task/{parent}/children"):
            if parent == pid:
                return None
            continue  # exited since it was listed
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split() if int(k) not in apart]
            except OSError:  # the thread ended
                continue
            found += kids
            todo += kids
    return found
