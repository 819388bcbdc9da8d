"""Standard errors over blocks of consecutive steps, shared by the host's timer and the GPU's timeline.

Steps are not independent: ``w`` workers deliver their batches in turn, so a window on 2 workers often alternates
between no wait and a long one. Means of blocks of ``floor(sqrt(n))`` consecutive steps (at least 3 blocks)
average such patterns out, while a trend that lasts across blocks still shows. Taken over a few steps or blocks,
an error is widened as Student's t widens an interval (2.2x over 3, 1.15x over 10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_T975 = (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)  # Student's t, 97.5%, 1-9 degrees of freedom


def few(dof: int) -> float:
    """How much wider a confidence interval on ``dof`` degrees of freedom is than the normal one (Student's t):
    a standard error taken over a few steps or blocks is itself uncertain."""
    t = _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.4 / dof
    return t / 1.96


def sem(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (at least two)."""
    k = len(values)
    mean = sum(values) / k
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1) / k)


def block_size(n: int) -> int:
    """Steps per block for ``n`` steps: ``floor(sqrt(n))``, at most ``n // 3`` (at least 3 blocks), at least 1."""
    return max(1, min(math.isqrt(n), n // 3))


def block_means(values: Sequence[float]) -> list[float]:
    """The means of the most recent whole blocks of :func:`block_size` steps."""
    n = len(values)
    size = block_size(n)
    recent = list(values)[n % size :]
    return [sum(recent[i : i + size]) / size for i in range(0, len(recent), size)]


def trimmed_mean_sem(values: Sequence[float]) -> tuple[float, float]:
    """The mean per step and its (widened) standard error over blocks of steps, the slowest block left out when
    there are four or more. What delays a step from outside the loader (a collector's pause, another process on a
    busy host) only ever makes it slower, and one such step would otherwise decide a comparison: its block's mean
    moves the mean and, far more, its error. ``(0.0, 0.0)`` without a value."""
    if not values:
        return 0.0, 0.0
    if len(values) < 2:
        return float(values[0]), 0.0
    means = block_means(values)
    if len(means) >= 4:
        means.remove(max(means))
    return sum(means) / len(means), sem(means) * few(len(means) - 1)
