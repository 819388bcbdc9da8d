"""The probe: everything the tuner measures, and the only part that reads a clock, psutil or CUDA events.

:class:`Probe` owns the host :class:`~lightning_dltune.measurement.measure.StepTimer`, the CUDA
:class:`~lightning_dltune.measurement.gpu.GpuTimeline` and the NVML sampler (on CUDA devices), the CPU-time snapshot of
the
window, the batch size in bytes, and the :class:`MemoryWatch` that reads the workers' memory in the background
(every 0.25 s, so growth inside an epoch is seen and the budget can be held at the next step).
:meth:`Probe.close` returns the window's :class:`~lightning_dltune.measurement.measure.WindowStats`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_dltune._warn import warn_once
from lightning_dltune.measurement import gpu
from lightning_dltune.measurement.measure import Clock, StepTimer, WindowStats, process_cpu_seconds
from lightning_dltune.measurement.memory import (
    MemorySample,
    WorkerMemory,
    fit,
    in_flight_bytes,
    latest_set,
    lead_bytes,
    slope,
)


def worker_uss(pids: list[int]) -> list[float]:
    """The unique memory (USS) of each of the processes ``pids`` still alive."""
    import psutil

    sizes = []
    for pid in pids:
        try:
            sizes.append(float(psutil.Process(pid).memory_full_info().uss))
        except psutil.Error:
            continue
    return sizes


def own_footprint() -> float:
    """This process's resident memory that is not file-backed (its heap: the dataset's objects, tensors): the most
    a forked worker can come to copy of it. Code and mapped files stay shared."""
    import psutil

    try:
        info = psutil.Process().memory_info()
    except psutil.Error:
        return 0.0
    return float(max(0, info.rss - getattr(info, "shared", 0)))


# Reading a worker's USS walks its page tables while its page faults wait (docs/how-it-decides.md, "Reading the
# workers' memory"). The workers of one loader are dealt batches in turn and load alike, so a few stand for all (a
# different few each reading): the thread reads THREAD_READ_WORKERS, a window that closes without a reading from it
# SYNC_READ_WORKERS, in the open.
THREAD_READ_WORKERS = 4
SYNC_READ_WORKERS = 2
CPU_SHARE_FAR = 0.02  # of one CPU the memory readings may take while the workers are far from the budget
CPU_SHARE_NEAR = 0.10  # ... and once they hold 3/4 of it
RECENT_READINGS = 6  # the running workers' growth is read over their latest readings, of any window
# A worker loads about one batch in each `workers` taken, in whole batches: readings fewer batches apart than
# GROWTH_SPAN_LOADS such turns each may differ by none of its loads, and their growth is not taken as measured
GROWTH_SPAN_LOADS = 2


def _worker_growth(
    before: dict[int, tuple[float, int]], sizes: dict[int, float], batches: int, span: int = 1
) -> float | None:
    """One worker's growth per batch taken (by any worker), the mean over the workers read now that were read at
    least ``span`` batches before, each between its own two readings (``before``: size and batches then); ``None``
    where none was. A total over a reading of a few workers holds the others' older readings, so its slope reads the
    growth too low (half of it, for a leaking loader read two workers of four at a time)."""
    rates = [
        (size - before[pid][0]) / (batches - before[pid][1])
        for pid, size in sizes.items()
        if pid in before and batches - before[pid][1] >= max(1, span)
    ]
    return max(0.0, sum(rates) / len(rates)) if rates else None


class MemoryWatch:
    """Samples the running loader's workers' USS every ``interval_s`` (or less often, see :meth:`next_interval`) in
    a thread, so memory that grows during an epoch (copy-on-read) is seen while it grows, not only when a window
    closes.

    The training loop counts the batches it took (:meth:`batch_taken`); a sample records, for the worker set it
    read (the same PIDs), the batches taken since that set started. :meth:`take` fits the window's samples
    (:func:`.memory.fit`) and starts the next window; :attr:`latest` is the newest reading of the
    current window, and :meth:`held` what the workers hold now for the budget check at each step: their newest
    reading (of any window, since the loader was built) plus the growth measured per batch (copy-on-read) times
    the batches taken since, up to the training process's own size per worker. Readings come every ``interval_s`` at
    best and far apart while the workers are far from the budget (see :meth:`next_interval`): in the memory
    tests a copy-on-read loader went 20-27 MiB past a 90 MiB budget, and a leaking one to 380-395 MiB of a 160 MiB
    one, between two of them, so the check does not wait for the next one to see the workers grow (and a reading
    taken then confirms it, see :meth:`Probe.over_budget`).
    """

    def __init__(
        self,
        worker_pids: Callable[[], list[int]] = list,
        interval_s: float = 0.25,
        read: Callable[[list[int]], list[float]] = worker_uss,
        clock: Clock = time.monotonic,
    ) -> None:
        self._worker_pids, self._read, self._clock = worker_pids, read, clock
        self.interval_s = interval_s
        # Reading USS walks each worker's page tables (/proc/PID/smaps_rollup, see THREAD_READ_WORKERS). The reads
        # take at most CPU_SHARE of one CPU, the larger share once the workers are near the budget (``pressure``:
        # their latest total over the budget, set by the step's check).
        self.pressure = 1.0
        self.measuring = False  # the window is there to read the workers' memory (its growth): the larger share
        self._read_s = 0.0
        self._lock = threading.Lock()
        self._samples: list[MemorySample] = []
        self._window = 0  # bumped by take(): a reading begun before it belongs to no window
        self._pids: frozenset[int] = frozenset()
        self._each: dict[int, tuple[float, int]] = {}  # each running worker's latest reading, and `batches` then
        self._anchor: dict[int, tuple[float, int]] = {}  # ... and the one its growth is read from (see _span)
        self._rotation = 0  # where the next partial reading starts among the workers (see sample)
        self._newest: MemorySample | None = None  # the latest reading of any window (of the workers in `_pids`)
        self._set_start = 0
        self.batches = 0
        self.latest: MemorySample | None = None
        self._held_from: tuple[MemorySample, int] | None = None  # the newest reading since the loader was built,
        self._built = 0  # with `batches` at its time; bumped by loader_built: a reading begun before is not of it
        self._built_at = 0  # `batches` when the running loader was built
        self._recent: list[MemorySample] = []  # the running worker set's latest readings, of any window
        self._set_growth: float | None = None  # their growth per batch taken (None: not read, see _growth_read)
        self._rated = False  # ... from workers read twice (see _worker_growth), not from the totals' slope
        self._set_rate = 0.0  # ... and per second
        self._batch_rate = 0.0  # batches taken per second over those readings
        self._fitted_growth = 0.0  # the growth per batch the latest window with enough readings fitted
        self._first_growth = 0.0  # ... and a fresh worker's, at its start (what a jump adds to it, see fit)
        self.budget_bytes: float | None = None  # the memory budget (set by the budget check)
        self.ceiling_bytes = 0.0  # what one worker can come to hold: the training process's own footprint
        self.flight_bytes = 0.0  # one worker's batches in flight (set by the budget check)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def batch_taken(self) -> None:
        self.batches += 1

    def sample(self, most: int | None = None) -> MemorySample | None:
        """Read the workers now, at most ``most`` of them; the thread calls this, and a window that saw no reading at
        its end. The workers' total is the sum of each one's latest reading (workers differ: one may have copied
        far more than the others), grown since as a worker grows per batch (:meth:`_unread`), a worker never read
        counted at the mean of those read now."""
        window, built = self._window, self._built
        pids = self._pids_now()
        read = pids
        if most is not None and len(pids) > most:  # a different few each time: each is read over time
            with self._lock:
                first, self._rotation = self._rotation % len(pids), self._rotation + most
            read = (pids[first:] + pids[:first])[:most]
        sizes = {pid: got[0] for pid in read if (got := self._read([pid]))}  # the live ones
        if not sizes:
            return None
        batches = self.batches
        with self._lock:
            if frozenset(pids) != self._pids:
                self._pids, self._set_start = frozenset(pids), batches
                self._recent, self._set_growth, self._set_rate, self._each = [], None, 0.0, {}
                self._batch_rate, self._rated, self._anchor = 0.0, False, {}
            rate = _worker_growth(self._anchor, sizes, batches, self._span)
            if rate is not None:  # each worker read again: the set grows as they do, however few were read now
                self._set_growth, self._rated = rate * len(pids), True
            self._each.update({pid: (size, batches) for pid, size in sizes.items()})
            self._anchor.update(
                {p: self._each[p] for p in sizes if p not in self._anchor or batches - self._anchor[p][1] >= self._span}
            )
            mean, per_worker = sum(sizes.values()) / len(sizes), self.measured_growth / len(pids)
            each = sizes if read is pids else {pid: self._unread(pid, mean, per_worker) for pid in pids}
            workers, total = len(each), sum(each.values())
            if self.budget_bytes:  # the pace of the next readings follows this one, not the last step's check
                self.pressure = (total + workers * self.flight_bytes) / self.budget_bytes
            reading = MemorySample(self._clock(), batches - self._set_start, workers, total, max(each.values()))
            self._newest = reading
            self._recent = [*self._recent[-(RECENT_READINGS - 1) :], reading]
            if not self._growth_read and batches > self._built_at and self._fitted_growth <= 0:
                # the first workers read, their growth not known: at most all they hold per batch taken
                self._set_growth = total / (batches - self._built_at)
            if len(self._recent) >= 2:
                if not self._rated and self._growth_read:  # a total with workers not read now holds older readings
                    self._set_growth = slope([r.batches for r in self._recent], [r.total_bytes for r in self._recent])
                self._set_rate = slope([r.t for r in self._recent], [r.total_bytes for r in self._recent]) or 0.0
                self._batch_rate = slope([r.t for r in self._recent], [r.batches for r in self._recent]) or 0.0
            if built == self._built:
                self._held_from = reading, batches
            if window == self._window:
                self._samples.append(reading)
                self.latest = reading
        return reading

    def _unread(self, pid: int, mean: float, per_worker: float) -> float:
        """A worker not read now: its latest reading, grown as a worker grows per batch taken since (``per_worker``);
        one never read, at ``mean`` (of those read now)."""
        if pid not in self._each:
            return mean
        size, at = self._each[pid]
        return size + max(0.0, per_worker) * max(0, self.batches - at)

    @property
    def _span(self) -> int:
        """The fewest batches taken between two readings whose difference measures the running workers' growth."""
        return GROWTH_SPAN_LOADS * max(1, len(self._pids))

    @property
    def _growth_read(self) -> bool:
        """Whether the running workers' growth was read: each of a worker's two readings (:func:`_worker_growth`),
        or their latest readings' totals, at least :attr:`_span` batches apart (nearer readings read a growth of none
        where the workers loaded nothing between them, and the check at each step then let them past the budget)."""
        recent = self._recent
        return self._rated or (len(recent) >= 2 and recent[-1].batches - recent[0].batches >= self._span)

    @property
    def newest_in_window(self) -> bool:
        """Whether the workers' newest reading (the one :meth:`held` counts from) is one of this window's."""
        held_from = self._held_from
        return held_from is not None and held_from[0] is self.latest

    @property
    def growth_bytes(self) -> float:
        """What the running workers grow, all together, per batch taken: the larger of the growth over their latest
        readings (two or more) and the latest window's fit (of these workers or the ones before them: copy-on-read
        grows per batch loaded, by any set; two readings alone can read none); for the first workers read once and
        nothing fitted, at most all they hold over the batches taken (the reading that a crossing asks for corrects
        it, see :meth:`Probe.over_budget`)."""
        growth = self._set_growth
        return self._fitted_growth if growth is None else max(growth, self._fitted_growth)

    @property
    def measured_growth(self) -> float:
        """:attr:`growth_bytes` as measured: over readings far enough apart (:attr:`_growth_read`), or fitted by a
        window; not the at-most bound of readings before that (all they hold over the batches taken), which only
        asks for a reading."""
        fitted = self._fitted_growth
        return max(self._set_growth or 0.0, fitted) if self._growth_read else fitted

    @property
    def lead_bytes(self) -> float:
        """What the running workers grow before a switch down decided now stops them (:func:`memory.lead_bytes`, at
        the :attr:`measured_growth`), up to what they can come to hold (:attr:`ceiling_bytes` each)."""
        held_from = self._held_from
        if held_from is None:
            return 0.0
        lead = lead_bytes(self.measured_growth, held_from[0].workers)
        if self.ceiling_bytes > 0:
            lead = min(lead, max(0.0, held_from[0].workers * self.ceiling_bytes - held_from[0].total_bytes))
        return lead

    def held(self, workers: int | None = None, grown: bool = True) -> float | None:
        """What the running workers hold now, their batches in flight included (``None``: no loader built and nothing
        read, or the reading is of another worker count than ``workers``, the running loader's): their newest
        reading (nothing, at the loader's build, see :meth:`loader_built`), grown (``grown``) by
        :attr:`growth_bytes` for each batch taken since, to at most :attr:`ceiling_bytes` a worker (not below the
        reading)."""
        held_from = self._held_from
        if held_from is None or (workers is not None and held_from[0].workers != workers):
            return None
        latest, at = held_from
        total = latest.total_bytes
        if grown and self.growth_bytes > 0:
            more = total + self.growth_bytes * max(0, self.batches - at)
            if self.ceiling_bytes > 0:
                more = min(more, max(total, latest.workers * self.ceiling_bytes))
            total = more
        return total + latest.workers * self.flight_bytes

    def take(self, decision_waits: bool = True) -> WorkerMemory:
        """The fit of the window's readings; starts the next window. A window the thread read nothing in (it reads
        at most a small share of a CPU: every 2 s or so for torch workers, far from the budget) reads
        ``SYNC_READ_WORKERS`` of the workers now, in the training process; unless no decision waits on it
        (``decision_waits`` false: tuning ended, or only observing), where the latest reading of the same workers
        stands, if any."""
        if not self._samples:
            newest = self._newest
            if not decision_waits and newest is not None and self._pids == frozenset(self._pids_now()):  # read before
                with self._lock:
                    self._samples.append(newest)
            else:
                self.sample(most=SYNC_READ_WORKERS)
        with self._lock:
            samples, self._samples, self.latest = self._samples, [], None
            self._window += 1
        fitted = fit(samples)
        readings = [s for s in samples if s.workers > 0 and s.total_bytes > 0]
        latest = latest_set(readings)
        if len({s.batches for s in latest}) >= 3:  # fewer fit no growth
            self._fitted_growth = fitted.rate(latest[-1].batches / latest[-1].workers)  # per batch, from here on
            self._first_growth = fitted.rate(0)
        return fitted

    def loader_built(self, workers: int) -> None:
        """A new train loader of ``workers`` workers serves from its next fetch: this window's readings of another
        worker count (read after the decision that replaced them), and any reading under way, are not its own. Until
        its workers are read, the check at each step counts them from nothing, growing as the workers before them
        did per batch (copy-on-read and leaks grow per batch loaded, by any number of workers): in the full suite a
        leaking loader's new workers grew 60 MiB past the budget before their second reading."""
        with self._lock:
            self._samples = [s for s in self._samples if s.workers == workers]
            if self.latest is not None and self.latest.workers != workers:
                self.latest = None
            self._window += 1
            self._built += 1
            # what the new workers' growth is taken to be until read: fresh, they copy their jump again
            self._fitted_growth = max(self.growth_bytes, self._first_growth)
            self._built_at = self.batches
            start = MemorySample(self._clock(), 0, workers, 0.0, 0.0)
            self._held_from, self._pids = ((start, self.batches) if workers > 0 else None), frozenset()
            self._recent, self._set_growth, self._set_rate, self._batch_rate = [], None, 0.0, 0.0
            self._rated = False

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dltune-memory", daemon=True)
            self._thread.start()

    def next_interval(self) -> float:
        """Seconds to the next reading: ``interval_s``, stretched so that reading takes at most 2% of a CPU while
        the workers hold under 3/4 of the budget, 10% above that, while :attr:`measuring` (a window that exists
        to fit the workers' growth needs three readings or more: on a busy host at 2% it could get two), and until
        a new loader's workers' growth was read (:attr:`_growth_read`: not known before). Between the two, half the time
        the workers take to reach the budget, growing per second as their latest readings did, or as
        :attr:`growth_bytes` per batch at the pace batches were taken between them, whichever is faster."""
        near = max(self.interval_s, self._read_s / CPU_SHARE_NEAR)
        far = max(self.interval_s, self._read_s / CPU_SHARE_FAR)
        if self.pressure >= 0.75 or self.measuring or not self._growth_read:
            return near
        held, budget = self.held(), self.budget_bytes
        rate = max(self._set_rate, self.growth_bytes * self._batch_rate)  # per second
        if held is None or budget is None or rate <= 0:
            return far
        return min(far, max(near, (budget - held) / rate / 2))

    def _pids_now(self) -> list[int]:
        try:
            return list(self._worker_pids())
        except Exception:  # the loader is being rebuilt
            return []

    def _run(self) -> None:
        """Reads when :meth:`next_interval` has passed since the last reading, asked again every ``interval_s``: a
        reading far from the budget must not hold the next one off once the workers near it."""
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - last < self.next_interval():
                continue
            t0 = time.perf_counter()
            self.sample(most=THREAD_READ_WORKERS)
            self._read_s, last = time.perf_counter() - t0, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 5 * self._read_s + 1.0)
            self._thread = None


class Probe:
    """Measures one window at a time.

    Args:
        worker_pids: the PIDs of the running train loader's workers (asked by the memory readings).
        clock, cpu_clock, step_cpu_clock: as for :class:`~lightning_dltune.measurement.measure.StepTimer`.
        cpu_seconds: ``() -> (this process, its children)`` CPU seconds (the default leaves out :attr:`apart`).
        memory_of: ``(pids) -> [bytes]``, each worker's unique memory.
        footprint: ``() -> bytes`` this process holds (what a forked worker can come to hold).
        memory_interval_s: how often the workers' memory is read during a window.

    Attributes:
        apart: child processes whose CPU is not this process's loading, with their descendants: the other ranks
            Lightning's launcher started from this one (set when a loader is installed).
    """

    def __init__(
        self,
        worker_pids: Callable[[], list[int]] = list,
        clock: Clock = time.perf_counter,
        cpu_clock: Clock = time.thread_time,
        cpu_seconds: Callable[[], tuple[float, float]] | None = None,
        step_cpu_clock: Clock | None = time.process_time,
        memory_of: Callable[[list[int]], list[float]] = worker_uss,
        footprint: Callable[[], float] = own_footprint,
        memory_interval_s: float = 0.25,
    ) -> None:
        self._clock, self._cpu_clock, self._step_cpu_clock = clock, cpu_clock, step_cpu_clock
        self.apart: list[int] = []
        self._cpu_seconds = cpu_seconds or (lambda: process_cpu_seconds(apart=self.apart))
        self.memory = MemoryWatch(worker_pids, memory_interval_s, memory_of, clock)
        self._footprint = footprint
        self.epoch_batches = 0.0
        self.timer = StepTimer(clock, cpu_clock, step_cpu_clock=step_cpu_clock)
        self.gpu: gpu.GpuTimeline | None = None
        self.nvml: Any = None
        self._nvml_metrics: dict[str, float] = {}
        self._cpu0: tuple[float, float] | None = None
        self._cpu_paused: tuple[float, float] | None = None  # the CPU seconds when counting paused
        self._paused = 0  # pauses not resumed yet (they nest)
        self._batch_bytes: float | None = None
        self._known_batch_bytes = 0.0  # the last batch measured, kept once tuning ended (memory's in flight)

    def start(self, device: Any, log_gpu: bool = True) -> None:
        """A new ``fit`` on ``device``: fresh windows; on CUDA a GPU timeline and (``log_gpu``) NVML sampling."""
        self.timer = StepTimer(self._clock, self._cpu_clock, step_cpu_clock=self._step_cpu_clock)
        self._paused, self._cpu_paused = 0, None
        self.gpu = gpu.timeline_for(device)
        self._cpu0 = self._batch_bytes = None
        self.memory.start()
        if log_gpu and getattr(device, "type", None) == "cuda":
            from lightning_dltune.measurement.nvml import open_sampler

            self.nvml, why = open_sampler(device.index or 0)
            if self.nvml is None:
                warn_once("nvml", f"GPU utilization is not logged: {why}.")

    def stop(self) -> None:
        """Stop GPU and memory measurement (their threads included); safe to call twice."""
        self.memory.stop()
        self.gpu = None
        if self.nvml is not None:
            if self.nvml.error:
                warn_once("nvml-error", f"GPU sampling stopped early: NVML said {self.nvml.error}.")
            self.nvml.stop()
            self.nvml = None

    # --- the loop's events ----------------------------------------------------------------------------------
    def loader_requested(self) -> None:
        self.timer.loader_requested()

    def loader_built(self, workers: int) -> None:
        """The train loader just built (of ``workers`` workers) serves next (see :meth:`MemoryWatch.loader_built`)."""
        self.memory.loader_built(workers)

    def rebuilt_in_fetch(self) -> None:
        """A new loader serves from this fetch on: the window's CPU and memory are counted from here (after a
        background start, the steps before were the old config's)."""
        self.timer.rebuilt_in_fetch()
        self._cpu0 = self._batch_bytes = None
        self.memory.take()

    def build_loader(self, create: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        return self.timer.build_loader(create)

    def leave_out_fetch(self) -> None:
        """The running fetch waited for a worker hung in its fork: that wait is no config's (see the timer's)."""
        self.timer.leave_out_fetch()

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def startup_next(self) -> bool:
        """Whether the step about to run is a loader's start-up step (the first after its build)."""
        return self.timer.startup_next

    def startup_samples(self, times: Sequence[float]) -> None:
        """The per-sample load times of the start-up step's batch, where it loaded in the training process."""
        self.timer.startup_samples(times)

    def overlap_started(self) -> None:
        self.timer.overlap_started()

    def overlap_ended(self) -> None:
        self.timer.overlap_ended()

    def epoch_started(self, batches: float = 0.0) -> None:
        """An epoch of ``batches`` batches begins (0: unknown)."""
        self.epoch_batches = float(batches)
        self.timer.epoch_started()
        if self.gpu is not None:
            self.gpu.epoch_started()

    def fetch_started(self) -> None:
        self.timer.fetch_started()
        if self.gpu is not None:
            self.gpu.fetch_started()

    def fetch_ended(self) -> None:
        self.timer.fetch_ended()
        if self.gpu is not None:
            self.gpu.fetch_ended()

    def step_started(self) -> None:
        if self.gpu is not None:
            self.gpu.step_started(steady=self.timer.steady)
        self.timer.step_started()

    def step_ended(self, batch: Any, details: bool = True) -> None:
        """``details``: also take the batch's bytes and the window's CPU start (not needed once tuning ended)."""
        if self.gpu is not None:
            self.gpu.step_ended()
        self.timer.step_ended(batch_size(batch))
        self.memory.batch_taken()
        if details and self._batch_bytes is None:
            self._batch_bytes = self._known_batch_bytes = float(tensor_bytes(batch))
        if details and self._cpu0 is None:
            # CPU is counted from the end of a window's first step: worker start-up is not steady state
            self._cpu0 = self._cpu_seconds()

    def pause(self) -> None:
        """Stop counting (validation, for instance): its time, and the CPU its workers spend, are not the window's.
        Pauses nest: counting resumes at the :meth:`resume` of the outermost."""
        self._paused += 1
        if self._paused > 1:
            return
        self.timer.pause()
        if self.gpu is not None:
            self.gpu.pause()
        if self._cpu0 is not None and self._cpu_paused is None:
            self._cpu_paused = self._cpu_seconds()

    def resume(self) -> None:
        self._paused = max(0, self._paused - 1)
        if self._paused:
            return
        self.timer.resume()
        paused, self._cpu_paused = self._cpu_paused, None
        if paused is not None and self._cpu0 is not None:
            (main0, kids0), (main_p, kids_p), (main1, kids1) = self._cpu0, paused, self._cpu_seconds()
            self._cpu0 = (main0 + main1 - main_p, kids0 + kids1 - kids_p)

    # --- windows --------------------------------------------------------------------------------------------
    @property
    def window_steps(self) -> int:
        return self.timer.window_steps

    @property
    def window_batches(self) -> int:
        """Steps of the window, start-up included: what ranks count alike (see ``StepTimer.window_batches``)."""
        return self.timer.window_batches

    def peek(self) -> WindowStats:
        return self.timer.peek_window()

    def close(self, decision_waits: bool = True) -> WindowStats:
        """The window's statistics, host and GPU, with CPU time, worker memory and batch bytes; starts the next.
        ``decision_waits``: a decision waits on the workers' memory (see :meth:`MemoryWatch.take`)."""
        stats = self.timer.take_window()
        if self.gpu is not None:
            stats = stats.with_gpu(self.gpu.take_window())
        if self._cpu0 is not None:
            (main0, kids0), (main1, kids1) = self._cpu0, self._cpu_seconds()
            stats = stats.with_cpu(worker_cpu_s=max(0.0, kids1 - kids0), main_cpu_s=max(0.0, main1 - main0))
        stats = self._with_memory(stats, self.memory.take(decision_waits), self._batch_bytes or 0.0)
        self._cpu0 = self._batch_bytes = None
        return stats

    def memory_only(self) -> WindowStats:
        """The memory part of a window once tuning ended (the budget is still held); starts the next."""
        return self._with_memory(WindowStats(), self.memory.take(decision_waits=False), self._known_batch_bytes)

    def _with_memory(self, stats: WindowStats, mem: WorkerMemory, batch_bytes: float) -> WindowStats:
        """``stats`` with the window's worker memory and this process's footprint, which is also the most a worker is
        counted to grow to by the check at each step (:attr:`MemoryWatch.ceiling_bytes`)."""
        stats = stats.with_memory(mem, batch_bytes, self._footprint(), self.epoch_batches, self.memory.lead_bytes)
        self.memory.ceiling_bytes = stats.main_mem_bytes
        return stats

    @property
    def batch_bytes(self) -> float:
        """The last batch's tensor bytes (0 before one was measured)."""
        return self._known_batch_bytes

    def held_bytes(self, settings: Any, grown: bool = True) -> float:
        """What the running workers hold now (:meth:`MemoryWatch.held`), their batches in flight included (0: not
        read yet)."""
        if settings is None:
            return 0.0
        flight = in_flight_bytes(self._known_batch_bytes, settings.prefetch_factor, settings.pin_memory)
        self.memory.flight_bytes = flight
        return self.memory.held(settings.num_workers, grown) or 0.0

    def over_budget(self, settings: Any, budget_bytes: float | None) -> bool:
        """Whether the workers, grown since their latest reading (:meth:`MemoryWatch.held`) and by what they grow
        before a switch down stops them (:attr:`MemoryWatch.lead_bytes`), with their batches in flight, hold more
        than ``budget_bytes``: they are left before a reading crosses it. Where only the growth counted since the
        reading crosses it, or the reading is of an earlier window, the workers are read now (``SYNC_READ_WORKERS``
        of them, in the training process) and that reading decides: a config is left on what its workers were read
        to hold in the window that judges it, never on the estimate alone."""
        if budget_bytes is None or settings is None:
            return False
        lead = self.memory.lead_bytes
        held = self.held_bytes(settings)
        if held + lead > budget_bytes and not (
            self.memory.newest_in_window and self.held_bytes(settings, grown=False) + lead > budget_bytes
        ):
            self.memory.sample(most=SYNC_READ_WORKERS)
            held = self.held_bytes(settings, grown=False)  # the reading just taken (or the latest, if none)
            lead = self.memory.lead_bytes  # of the growth that reading measured
        self.memory.pressure = held / budget_bytes if budget_bytes else 1.0
        self.memory.budget_bytes = budget_bytes
        return held > 0 and held + lead > budget_bytes

    def skip(self) -> None:
        """Drop the window without judging it (tuning has ended)."""
        self.timer.take_window()
        if self.gpu is not None:
            self.gpu.take_window(wait=False)

    def take_log(self) -> tuple[WindowStats, gpu.GpuStats | None, dict[str, float]]:
        """The logging window's host statistics and, on CUDA, the GPU's and NVML's latest means."""
        if self.nvml is not None:
            self._nvml_metrics = self.nvml.take() or self._nvml_metrics
        gpu_stats = self.gpu.take_log_window() if self.gpu is not None else None
        return self.timer.take_log_window(), gpu_stats, self._nvml_metrics


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, dict):
        return sum(tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(v) for v in batch)
    return 0


def batch_size(batch: Any) -> int:
    """The batch's size as Lightning reads it (1 when it cannot tell): its first tensor's first dimension, found in
    the order Lightning's ``extract_batch_size`` walks a batch (mappings' values, sequences, dataclass fields). Read
    here rather than through Lightning, whose function warns once per process about an ambiguous batch: that
    warning is the user's, for their own ``self.log``."""
    found = _first_size(batch, depth=0)
    return 1 if found is None else found


def _first_size(batch: Any, depth: int) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.size(0)) if batch.ndim else 1
    if depth > 32 or isinstance(batch, (str, bytes)):
        return None
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if not isinstance(batch, Iterable):
        return None
    try:
        for item in batch:
            found = _first_size(item, depth + 1)
            if found is not None:
                return found
    except Exception:  # an iterable that cannot be walked twice, or raises: Lightning reads nothing from it either
        return None
    return None
