"""How two measured configs compare: by the time per sample, beyond its measured noise; which one a settle picks."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.tuning.model import Policy, Trial


def faster_by(a: Trial, b: Trial) -> tuple[float, float]:
    """How much less time per sample ``b`` takes than ``a``, and the noise on that (two standard errors): of two
    readings, the one that shows the difference more clearly (the larger difference less its noise).

    * The compared times (:attr:`Trial.compared_sec_per_sample`) and both their errors.
    * Where both are read on the host and ``b``'s busy time is not longer than ``a``'s beyond noise: their wait for
      data and its error, plus what ``b``'s step is shorter beyond its noise. A config changes the busy time only
      beyond noise, while the busy time's noise is alike for both and would hide the loader's difference."""
    sa, sb = a.stats, b.stats
    ta, tb = a.compared_sec_per_sample, b.compared_sec_per_sample
    whole = (ta - tb, 2.0 * math.hypot(ta * a.rel_sem, tb * b.rel_sem))
    if not (a.on_host and b.on_host and sa.samples and sb.samples):
        return whole
    ka, kb = sa.steps / sa.samples, sb.steps / sb.samples  # steps per sample
    (busy_a, sem_a), (busy_b, sem_b) = (busy_per_step(s) for s in (sa, sb))
    busy_noise = 2.0 * math.hypot(sem_a, sem_b)
    if busy_b > busy_a + busy_noise:
        return whole
    busy = busy_a - max(0.0, busy_a - busy_b - busy_noise)  # a's, less b's advantage beyond noise
    waits = (
        (sa.mean_wait_s + busy_a) * ka - (sb.mean_wait_s + busy) * kb,
        2.0 * math.hypot(sa.wait_sem_s * ka, sb.wait_sem_s * kb),
    )
    return max(whole, waits, key=lambda r: r[0] - r[1])


def busy_per_step(s: WindowStats) -> tuple[float, float]:
    """The busy time per step and its error, the slowest block of steps left out where it was measured."""
    if s.busy_trim_s > 0:
        return s.busy_trim_s, s.busy_trim_sem_s
    return (s.step_s + s.other_s) / s.steps, s.busy_sem_s


def step_slowed(base: Trial, t: Trial, policy: Policy = Policy()) -> bool:
    """Whether ``t``'s step (its busy time) took ``min_gain`` longer than ``base``'s beyond two standard errors: the
    workers took CPUs the step needed."""
    (busy0, sem0), (busy, sem) = busy_per_step(base.stats), busy_per_step(t.stats)
    return busy > busy0 * (1 + policy.min_gain) + 2 * math.hypot(sem, sem0)


def pick_best(trials: Sequence[Trial], policy: Policy = Policy(), memory_limit: int | None = None) -> Trial:
    """The cheapest usable trial whose time per sample is within measured noise of the fastest one; the starting
    config unless that one is faster than it beyond noise (by ``min_gain`` at least). Times and their noise leave
    each window's slowest block of steps out (:attr:`Trial.compared_sec_per_sample`). ``memory_limit``: the most
    workers the memory budget holds, once a config went over it (``TuningState.memory_limit``): configs with more
    are not chosen, even one measured before its workers grew (while any config within it was measured)."""
    usable = [t for t in trials if t.usable]
    if not usable:
        raise ValueError("`trials` holds no usable measurement; measure at least one window first.")
    within = [t for t in usable if memory_limit is None or t.settings.num_workers <= memory_limit]
    usable = within or usable
    fastest = min(usable, key=lambda t: t.compared_sec_per_sample)
    best = min(
        (t for t in usable if as_fast(t, fastest, policy)), key=lambda t: (t.settings.cost, t.compared_sec_per_sample)
    )
    start = trials[0]
    if best is start or start not in usable:
        return best
    return best if won_over_start(start, best, policy) else start


def won_over_start(start: Trial, best: Trial, policy: Policy = Policy()) -> bool:
    """Whether ``best`` is faster than where the run started beyond noise (never by less than ``min_gain``), by the
    means or by the sign of every one of the start's steps: what moving away from the start needs."""
    gain, noise = faster_by(start, best)
    return gain > max(policy.min_gain * start.compared_sec_per_sample, noise) or every_step_slower(start, best, policy)


def every_step_slower(a: Trial, b: Trial, policy: Policy = Policy()) -> bool:
    """A sign test: each of ``a``'s steps (``sign_steps`` or more) took longer per sample than ``b``'s mean plus its
    noise, by ``min_gain`` more; were ``a``'s typical step no slower, that has probability 2^-n or less. It shows
    after a few steps what a mean's standard error cannot."""
    sa = a.stats
    if sa.steps < policy.sign_steps or sa.sample_wall_min_s <= 0:
        return False
    least = sa.sample_wall_min_s  # each step's wall over its own batch's samples
    tb = b.compared_sec_per_sample
    return least > tb * (1.0 + 2.0 * b.rel_sem) * (1.0 + policy.min_gain)


def as_fast(t: Trial, fastest: Trial, policy: Policy) -> bool:
    """Whether ``t`` is as fast as ``fastest`` within measured noise, but never so wide a noise that a config slower by
    ``min_gain`` counts as equal."""
    ref = fastest.compared_sec_per_sample
    slower, noise = faster_by(t, fastest)
    return slower <= min(max(policy.noise_floor * ref, noise), policy.min_gain * ref)
