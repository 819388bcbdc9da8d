"""The memory model: what a loader's workers come to hold, and how many of them fit the budget. Pure: no torch,
no psutil, no clock (:class:`~lightning_dltune.measurement.probe.MemoryWatch` measures).

A DataLoader worker starts as a copy of the training process (``fork``) that shares its pages. Reading a
Python object writes its reference count, so every page of the dataset a worker reads becomes the worker's own
copy (copy-on-read): a worker's unique memory (USS) grows with the batches it produced, up to what the training
process holds (all there is to copy; a spawned worker unpickles the dataset and comes to the same). So, per
worker, at the end of its life of ``life`` batches (one epoch, or the rest of the run with persistent workers)::

    uss(w)   = min(ceiling, base + grown(life / w))                  w workers share the batches of a life
    grown(n) = growth * n + jump * (1 - exp(-n / tau))               jump: 0 unless samples overlap

``base``, ``growth``, ``jump`` and ``tau`` (``saturation_batches``) are fitted on the USS sampled during a window
(:func:`fit`). ``growth`` goes on with every batch a worker loads (each copies pages no batch touched before).
``jump`` is what a fresh worker copies in its first batches and then no more: where samples overlap (each reads
pages its neighbours read too), the share a worker has copied after ``n`` random samples grows as
``1 - exp(-n / tau)``, so fewer batches each leave each worker nearly as large; ``ceiling`` is the training
process's own footprint.

    total(w) = w * (uss(w) + in_flight)                              in_flight: its batches in flight (and pinned)

Before any worker was measured only the ceiling is known: a config whose workers fit
even at the ceiling is safe to jump to; a larger one is measured on fewer workers first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class MemorySample:
    """One reading of the running loader's workers."""

    t: float  # seconds (any clock)
    batches: float  # batches the running workers produced since they started, all of them together
    workers: int
    total_bytes: float  # the workers' USS, summed
    largest_bytes: float  # the largest worker's USS


@dataclass(frozen=True)
class WorkerMemory:
    """A window's fit: a worker's USS is ``base_bytes + grown(batches it produced)``."""

    base_bytes: float = 0.0
    growth_bytes: float = 0.0  # per batch the worker produced
    peak_worker_bytes: float = 0.0
    peak_total_bytes: float = 0.0
    samples: int = 0
    jump_bytes: float = 0.0  # copied in a worker's first batches, saturating over ``saturation_batches``
    saturation_batches: float = 0.0

    def grown(self, batches: float) -> float:
        """What a worker grows over its first ``batches`` batches (``inf`` for an unknown count, where it grows)."""
        if batches <= 0:
            return 0.0
        jump = self.jump_bytes * -math.expm1(-batches / self.saturation_batches) if self.saturation_batches else 0.0
        return (self.growth_bytes * batches if self.growth_bytes > 0 else 0.0) + jump

    def rate(self, batches: float) -> float:
        """What a worker that produced ``batches`` batches grows per batch more."""
        tau = self.saturation_batches
        return self.growth_bytes + (self.jump_bytes / tau * math.exp(-batches / tau) if tau else 0.0)


SATURATIONS = (64.0, 32.0, 16.0, 8.0, 4.0, 2.0)  # tau fitted (batches a worker produced)
SATURATION_GAIN = 0.5  # a fit with a jump is taken where it leaves at most this share of the linear fit's error


def fit(samples: Sequence[MemorySample]) -> WorkerMemory:
    """Least-squares fit of the mean worker's USS against the batches each worker produced, over the samples of
    the latest worker set (a restart at an epoch start or a switch begins a new one: the batch count drops).
    The growth is never negative; with fewer than three distinct points it is 0 and the base is the last mean."""
    readings = [s for s in samples if s.workers > 0 and s.total_bytes > 0]
    if not readings:
        return WorkerMemory()
    peak_worker = max(s.largest_bytes for s in readings)
    peak_total = max(s.total_bytes for s in readings)
    latest = latest_set(readings)
    xs = [s.batches / s.workers for s in latest]
    ys = [s.total_bytes / s.workers for s in latest]
    if len(set(xs)) < 3:
        return WorkerMemory(ys[-1], 0.0, peak_worker, peak_total, len(readings))
    growth = slope(xs, ys) or 0.0
    base = max(0.0, sum(ys) / len(ys) - growth * sum(xs) / len(xs))
    best = WorkerMemory(base, growth, peak_worker, peak_total, len(readings))
    error = SATURATION_GAIN * _error(best, xs, ys)
    for tau in SATURATIONS:
        fitted = _fit_jump(xs, ys, tau)
        fitted_error = math.inf if fitted is None else _error(fitted, xs, ys)
        if fitted is not None and fitted_error < error:
            best = WorkerMemory(
                fitted.base_bytes, fitted.growth_bytes, peak_worker, peak_total, len(readings), fitted.jump_bytes, tau
            )
            error = fitted_error
    return best


def _error(mem: WorkerMemory, xs: Sequence[float], ys: Sequence[float]) -> float:
    return sum((y - mem.base_bytes - mem.grown(x)) ** 2 for x, y in zip(xs, ys, strict=True))


def _fit_jump(xs: Sequence[float], ys: Sequence[float], tau: float) -> WorkerMemory | None:
    """``ys = base + growth * xs + jump * (1 - exp(-xs / tau))`` by least squares, ``growth`` and ``jump`` never
    negative (where the pair would have one so, the jump alone); ``None`` where the fit has no jump."""
    zs = [-math.expm1(-x / tau) for x in xs]
    mx, mz, my = sum(xs) / len(xs), sum(zs) / len(zs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    szz = sum((z - mz) ** 2 for z in zs)
    sxz = sum((x - mx) * (z - mz) for x, z in zip(xs, zs, strict=True))
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    szy = sum((z - mz) * (y - my) for z, y in zip(zs, ys, strict=True))
    det = sxx * szz - sxz**2
    growth = -1.0  # the pair's solution, where the two shapes differ enough to have one
    if det > 1e-12 * max(1.0, sxx * szz):
        growth, jump = (szz * sxy - sxz * szy) / det, (sxx * szy - sxz * sxy) / det
    if growth < 0:
        growth, jump = 0.0, szy / szz if szz > 0 else 0.0
    if jump <= 0.01 * abs(my):  # no jump, or none worth a parameter
        return None
    base = max(0.0, my - growth * mx - jump * mz)
    return WorkerMemory(base, growth, jump_bytes=jump, saturation_batches=tau)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ``ys`` against ``xs``, never negative (``None`` where the xs do not differ)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx) if sxx > 0 else None


def latest_set(samples: Sequence[MemorySample]) -> Sequence[MemorySample]:
    """The readings of the latest worker set: from the last drop in the batch count or change of worker count."""
    start = 0
    for i in range(1, len(samples)):
        if samples[i].batches < samples[i - 1].batches or samples[i].workers != samples[i - 1].workers:
            start = i
    return samples[start:]


def worker_bytes(mem: WorkerMemory, workers: int, life_batches: float, ceiling: float | None) -> float:
    """Predicted USS of one of ``workers`` workers at the end of a life of ``life_batches`` batches (all workers
    together; ``inf``: unknown, then a growing worker is taken to reach the ceiling)."""
    if workers <= 0:
        return 0.0
    size = mem.base_bytes + mem.grown(life_batches / workers)  # inf for an unknown life
    if ceiling is not None and ceiling > 0:
        size = min(size, max(ceiling, mem.base_bytes))
    return size


def total_bytes(
    mem: WorkerMemory, workers: int, life_batches: float, ceiling: float | None, in_flight_bytes: float
) -> float:
    """Predicted memory of ``workers`` workers and their ``in_flight_bytes`` each (batches and pinned copies)."""
    return workers * (worker_bytes(mem, workers, life_batches, ceiling) + in_flight_bytes)


def max_workers(
    mem: WorkerMemory,
    budget_bytes: float,
    life_batches: float,
    ceiling: float | None,
    in_flight_bytes: float,
    limit: int,
) -> int:
    """The most workers (up to ``limit``) whose predicted total stays within ``budget_bytes``."""
    best = 0
    for w in range(1, max(0, limit) + 1):
        if total_bytes(mem, w, life_batches, ceiling, in_flight_bytes) <= budget_bytes:
            best = w
    return best


def safe_workers(ceiling: float, budget_bytes: float, in_flight_bytes: float) -> int:
    """How many workers fit even if each comes to hold ``ceiling`` bytes (nothing measured yet)."""
    per = ceiling + in_flight_bytes
    return int(budget_bytes // per) if per > 0 else 0


def fits_beside(
    running_bytes: float, mem: WorkerMemory, workers: int, in_flight_bytes: float, budget_bytes: float | None
) -> bool:
    """Whether ``workers`` new workers, each holding ``mem``'s base and its batches in flight, fit the budget
    beside the running ones' ``running_bytes`` (their batches in flight included): both sets are alive for the
    few batches a background start overlaps them."""
    if budget_bytes is None:
        return True
    return running_bytes + workers * (mem.base_bytes + in_flight_bytes) <= budget_bytes


def lead_bytes(growth_per_batch: float, workers: int) -> float:
    """What ``workers`` growing workers add before a switch down decided now stops them: the batch each is loading,
    and the batch the next step takes (``growth_per_batch``: all of them together, per batch taken)."""
    return max(0.0, growth_per_batch) * (workers + 1) if workers > 0 else 0.0


def over_budget(
    total_uss: float, workers: int, in_flight_bytes: float, budget_bytes: float | None, lead: float = 0.0
) -> bool:
    """Whether the measured workers (and their batches in flight), grown by ``lead`` (:func:`lead_bytes`), hold
    more than the budget: they are left before a reading crosses it."""
    if budget_bytes is None or workers <= 0 or total_uss <= 0:
        return False
    return total_uss + lead + workers * in_flight_bytes > budget_bytes


def in_flight_bytes(batch_bytes: float, prefetch: int | None, pin_memory: bool) -> float:
    """Bytes one worker keeps in flight: its prefetched batches (in shared memory, or pinned once the pin thread
    copied them: the shared copy is freed then, so pinning does not double them)."""
    del pin_memory  # the pin thread's one extra batch is counted by the caller that trials pinning
    return batch_bytes * (prefetch or 2)


def growth_words(mem: WorkerMemory) -> str:
    """``", 110 MiB of it copied in a worker's first batches, growing 0.8 MiB per batch it loads"`` ("": neither)."""
    text = f", {mem.jump_bytes / MiB:.0f} MiB of it copied in a worker's first batches" if mem.jump_bytes > 0 else ""
    return text + (f", growing {mem.growth_bytes / MiB:.2f} MiB per batch it loads" if mem.growth_bytes > 0 else "")


def describe_growth(mem: WorkerMemory, life_batches: float, workers: int) -> str:
    """``"62 MiB per worker, growing 0.8 MiB per batch it loads"``, for diagnoses."""
    text = f"{mem.peak_worker_bytes / MiB:.0f} MiB per worker" + growth_words(mem)
    if mem.growth_bytes > 0:
        end = worker_bytes(mem, workers, life_batches, None) if math.isfinite(life_batches) and workers > 0 else 0.0
        if end > mem.peak_worker_bytes:
            text += f" (to {end / MiB:.0f} MiB by the end of an epoch)"
    return text
