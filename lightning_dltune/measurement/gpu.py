"""What the GPU saw: its idle gap before each training step and the host-to-device copy, from events read later.

On CUDA, kernels run asynchronously: the host can block on the next batch while the GPU still works through the
previous step, so host timestamps overstate stalls, and synchronizing every step (as Lightning's
``ThroughputMonitor`` does) slows training down. :class:`GpuTimeline` instead records CUDA events on the training
stream at five points of each step and reads them back later with ``query()``, never waiting for them::

    end_{i-1} ..other.. fetch_start_i ..idle.. fetched_i ..copy.. start_i ..step.. end_i

An event completes when the GPU reaches it, i.e. when the GPU has finished everything queued before it, or when the
host records it if the GPU was already idle. So ``idle`` is how long the GPU sat without work while the host waited
for the loader (zero when the GPU was still busy with the previous step), ``copy`` the host-to-device transfer and
whatever ``on_before_batch_transfer`` queued, ``other`` host work between steps the GPU waited for (logging, hooks),
and ``step`` the step as the GPU ran it.

Steps the host timer charges to start-up (the first after a loader is built) and steps whose gap held validation
are left out, as in :class:`~lightning_dltune.measurement.measure.StepTimer`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_dltune._stats import trimmed_mean_sem


class Event(Protocol):
    """What :class:`GpuTimeline` needs of an event (a thin view of ``torch.cuda.Event``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_ms(self, end: Event) -> float: ...

    def synchronize(self) -> None: ...


EventFactory = Callable[[], Event]


class CudaEvent:
    """A timing ``torch.cuda.Event`` recorded on the current stream of ``device``."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: Any) -> None:
        import torch

        self._device = device
        self._event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        import torch

        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._event.query())

    def elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, CudaEvent)
        return float(self._event.elapsed_time(end._event))

    def synchronize(self) -> None:
        self._event.synchronize()


def timeline_for(device: Any) -> GpuTimeline | None:
    """A timeline on ``device``'s current stream when it is a CUDA device, else ``None``."""
    if getattr(device, "type", None) != "cuda":
        return None
    return GpuTimeline(lambda: CudaEvent(device))


@dataclass(frozen=True)
class GpuStats:
    """Sums in seconds over ``steps`` steps, as the GPU saw them."""

    steps: int = 0
    idle_s: float = 0.0
    copy_s: float = 0.0
    other_s: float = 0.0
    step_s: float = 0.0
    # the GPU's time per step (idle, copy, other, step) and its standard error, the slowest block of steps left
    # out (:func:`lightning_dltune._stats.trimmed_mean_sem`)
    wall_trim_s: float = 0.0
    wall_trim_sem_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.idle_s + self.copy_s + self.other_s + self.step_s

    @property
    def stall_frac(self) -> float | None:
        """Fraction of the GPU's time spent idle waiting for the loader (``None`` without a step)."""
        return self.idle_s / self.wall_s if self.steps and self.wall_s > 0 else None

    @property
    def copy_frac(self) -> float | None:
        """Fraction of the GPU's time spent on host-to-device copies (``None`` without a step)."""
        return self.copy_s / self.wall_s if self.steps and self.wall_s > 0 else None

    @property
    def mean_idle_s(self) -> float:
        return self.idle_s / self.steps if self.steps else 0.0

    @property
    def mean_copy_s(self) -> float:
        return self.copy_s / self.steps if self.steps else 0.0

    @property
    def mean_busy_s(self) -> float:
        """What the GPU spends per step when it is fed (copy and step)."""
        return (self.copy_s + self.step_s) / self.steps if self.steps else 0.0


@dataclass
class _Sample:
    marks: tuple[Event, Event, Event, Event, Event]  # end_{i-1}, fetch_start_i, fetched_i, start_i, end_i
    window: int  # the window generation the step belongs to


class _Sums:
    def __init__(self) -> None:
        self.steps = 0
        self.idle = self.copy = self.other = self.step = 0.0
        self.walls: deque[float] = deque(maxlen=20_000)

    def add(self, idle: float, copy: float, other: float, step: float) -> None:
        self.steps += 1
        self.idle += idle
        self.copy += copy
        self.other += other
        self.step += step
        self.walls.append(idle + copy + other + step)

    def stats(self) -> GpuStats:
        trim, trim_sem = trimmed_mean_sem(self.walls)
        return GpuStats(self.steps, self.idle, self.copy, self.other, self.step, trim, trim_sem)


class GpuTimeline:
    """Per-step GPU idle gap, copy and step time from events read without synchronizing.

    Args:
        make_event: creates one timing event (``lambda: CudaEvent(device)`` on CUDA; tests pass simulated ones).
        max_pending: steps kept waiting for the GPU to reach them; older ones are dropped (a host that runs this
            far ahead is not waiting for data).
    """

    def __init__(self, make_event: EventFactory, max_pending: int = 512) -> None:
        self._make = make_event
        self._pending: deque[_Sample] = deque()
        self._max_pending = max_pending
        self._window = _Sums()
        self._log = _Sums()
        self._generation = 0
        self._queued_in_window = 0
        self._prev_end: Event | None = None
        self._clear_gap()

    def _mark(self) -> Event:
        event = self._make()
        event.record()
        return event

    def _clear_gap(self) -> None:
        self._fetch_start: Event | None = None
        self._fetched: Event | None = None
        self._start: Event | None = None
        self._dirty = False
        self._keep = False

    # --- hooks, in the order the loop calls them ------------------------------------------------------------
    def epoch_started(self) -> None:
        self._prev_end = self._mark()
        self._clear_gap()

    def fetch_started(self) -> None:
        if self._fetch_start is None:
            self._fetch_start = self._mark()

    def fetch_ended(self) -> None:
        if self._fetch_start is not None:
            self._fetched = self._mark()

    def pause(self) -> None:
        """Validation (or anything else excluded) runs in this gap: the step is not measured."""
        self._dirty = True

    def step_started(self, steady: bool = True) -> None:
        """``steady``: the host timer counts this step (it is not the first after a loader was built)."""
        self._start = self._mark()
        self._keep = steady and not self._dirty and None not in (self._prev_end, self._fetch_start, self._fetched)

    def step_ended(self) -> None:
        end = self._mark()
        if self._keep and self._start is not None:
            assert self._prev_end is not None and self._fetch_start is not None and self._fetched is not None
            marks = (self._prev_end, self._fetch_start, self._fetched, self._start, end)
            self._pending.append(_Sample(marks, self._generation))
            self._queued_in_window += 1
            if len(self._pending) > self._max_pending:
                self._pending.popleft()
        self._prev_end = end
        self._clear_gap()

    # --- reading --------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every step the GPU has finished (in order; never blocks)."""
        while self._pending and self._pending[0].marks[-1].query():
            self._read(self._pending.popleft())

    def _read(self, sample: _Sample) -> None:
        prev_end, fetch_start, fetched, start, end = sample.marks
        other = max(0.0, prev_end.elapsed_ms(fetch_start)) / 1e3
        idle = max(0.0, fetch_start.elapsed_ms(fetched)) / 1e3
        copy = max(0.0, fetched.elapsed_ms(start)) / 1e3
        step = max(0.0, start.elapsed_ms(end)) / 1e3
        self._log.add(idle, copy, other, step)
        if sample.window == self._generation:
            self._window.add(idle, copy, other, step)

    def take_window(self, wait: bool = True) -> GpuStats:
        """The current window's steps; starts the next window.

        Steps the GPU has not reached yet are read without waiting; only when fewer than half of the window's
        steps are readable (the host runs far ahead of the GPU) does it wait for the window's last step, once
        (never with ``wait=False``).
        """
        self.poll()
        if wait and self._window.steps * 2 < self._queued_in_window:
            last = next((s for s in reversed(self._pending) if s.window == self._generation), None)
            if last is not None:
                last.marks[-1].synchronize()
                self.poll()
        stats = self._window.stats()
        self._window = _Sums()
        self._generation += 1
        self._queued_in_window = 0
        return stats

    def take_log_window(self) -> GpuStats:
        """Steps read since the last call (never blocks)."""
        self.poll()
        stats = self._log.stats()
        self._log = _Sums()
        return stats
