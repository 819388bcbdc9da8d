"""The tuning decision: a pure, deterministic function of measured trials. No torch, no I/O, no clock.

The model (as in tf.data's AUTOTUNE, reduced to one stage): a worker needs ``P`` seconds of wall time to
produce a batch, ``C`` of which are CPU; the trainer is busy ``B`` seconds per step when it is not waiting.
With ``w`` workers the loader delivers at most ``min(w / P, cpus / C)`` batches per second, so the stall
disappears once ``w >= P / B`` as long as the CPUs can feed the workers (``w <= cpus * P / C``). Batches are
handed over in order, so ``P`` is taken at its 90th percentile where it was measured (see :func:`estimate`). A loader
waiting on storage (``C << P``) wants far more workers than cores; a decode-bound one no more than the CPUs.

* With 0 workers, ``P`` is the time the main process spent fetching a batch and ``C`` its CPU time; a window
  judged after a few steps sizes only the first jump (it may have missed a bursty loader's slow batches).
* With ``w`` workers and a stall, all workers are busy, so ``P <= w * T`` (``T`` the wall time per step),
  and ``C`` is the workers' CPU time per batch. The tightest bound over the history is used.

On CUDA the stall is the GPU's idle gap (CUDA events, see :mod:`lightning_dltune.gpu`) rather than the host's
wait, and ``B`` is at least the GPU's time per step: a host that waits while the GPU still works is not a stall.
When host-to-device copies take more than ``stall_threshold`` of the GPU's time and the loader does not pin its
batches, ``pin_memory=True`` is tried, and kept only if it is measurably faster.

Each decision jumps to the predicted worker count (with headroom), then verifies it with the next trial. The
decision is an ordered table of named rules (:data:`RULES`, then :data:`SETTLE_OVERRIDES` for a settle), each a small
function of one :class:`Situation`; the rule that decides names the decision. The settled config is the cheapest one
within measured noise of the fastest, so it is never measurably slower than the user's starting config. What bounds
training is said by the first of :data:`DIAGNOSES` that applies. Each rule's evidence: ``docs/how-it-decides.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from lightning_dltune import memory
from lightning_dltune._stats import few
from lightning_dltune.measure import WindowStats
from lightning_dltune.memory import MiB, WorkerMemory
from lightning_dltune.settings import LoaderSettings

Action = Literal["measure", "try", "settle", "hold"]


@dataclass(frozen=True)
class Budget:
    """The resources the tuner may spend. ``cpus`` is what this training process may use (already divided
    among the local ranks); ``bound_by`` names the limit that set it, for the report."""

    cpus: float
    max_workers: int
    max_prefetch: int = 8
    bound_by: str = "affinity"
    memory_bytes: float | None = None  # what workers and pinned buffers may add
    shm_bytes: float | None = None  # free /dev/shm, where batches cross from workers to the trainer


@dataclass(frozen=True)
class Policy:
    """Knobs of the search. The defaults are what ``DataLoaderTuner`` uses."""

    stall_threshold: float = 0.05
    max_trials: int = 6
    min_steps: int = 8
    early_steps: int = 2  # steady steps enough to act on a stall that is plainly the loader's (its bound decides)
    early_stall: float = 0.5  # ... when even its lower confidence bound is at least this
    # steps enough for a sign test (`every_step_slower`): were a typical step no slower, all n slower has
    # probability 2^-n (1/8 at 3)
    sign_steps: int = 3
    headroom: float = 1.25
    min_gain: float = 0.05
    noise_floor: float = 0.03
    burst_ratio: float = 4.0
    worker_mem_prior: float = 64 * 2**20  # bytes per worker assumed before one was measured
    startup_prior_s: float = 0.05  # seconds to start one worker (and fill its pipeline) before one was measured
    # seconds the training process spends receiving a batch from a worker (the queue, unpickling, mapping its shared
    # memory) before one was measured: 1.0-1.5 ms for a two-tensor batch on the 2-CPU machine of BENCHMARKS.md
    handover_prior_s: float = 1e-3
    shm_fraction: float = 0.5  # share of free /dev/shm that batches in flight may take
    # samples of a start-up batch loaded in the training process, timed one by one, enough to take that step as a
    # steady one (`steady_from_the_start`)
    startup_samples: int = 8
    # what a deeper prefetch is predicted to take off a bursty or held-up wait (a guess: about half), and pinned
    # memory off a host-to-device copy (pinned copies run about twice as fast)
    prefetch_absorbs: float = 0.5
    pinned_copy_saves: float = 0.5


@dataclass(frozen=True)
class Trial:
    """A config and what it measured. ``failed`` says why a config could not run (it is never chosen)."""

    settings: LoaderSettings
    stats: WindowStats
    failed: str | None = None
    decision: str = ""
    rule: str = ""  # the rule that made the decision (see `RULES`), "" before one was taken

    @property
    def usable(self) -> bool:
        return self.failed is None and self.stats.steps > 0 and self.stats.samples > 0

    @property
    def sec_per_sample(self) -> float:
        return self.stats.wall_s / self.stats.samples if self.stats.samples else math.inf

    def _compared_step(self) -> tuple[float, float, bool]:
        """The time per step configs are compared on, its standard error, and whether it is the GPU's: the host's,
        the slowest block of steps left out (``WindowStats.wall_trim_s``), or the GPU's where its timeline read most
        of the window and it is the slower: a host that queues work ahead of the GPU measures its own pace, not the
        run's. The plain mean where neither was measured (a window from an older cache)."""
        s = self.stats
        host = (s.wall_trim_s, s.wall_trim_sem_s) if s.wall_trim_s > 0 else (s.mean_wall_s, s.wall_sem_s)
        if s.gpu_wall_trim_s > host[0] and s.gpu_steps * 2 >= s.steps:
            return s.gpu_wall_trim_s, s.gpu_wall_trim_sem_s, True
        return *host, False

    @property
    def compared_sec_per_sample(self) -> float:
        """The time per sample configs are compared on (see :meth:`_compared_step`)."""
        s = self.stats
        return self._compared_step()[0] * s.steps / s.samples if s.samples else math.inf

    @property
    def rel_sem(self) -> float:
        """The relative standard error of :attr:`compared_sec_per_sample`."""
        mean, err, _ = self._compared_step()
        return err / mean if mean > 0 else 0.0

    @property
    def on_host(self) -> bool:
        """Whether :attr:`compared_sec_per_sample` is the host's time (not the GPU's)."""
        return not self._compared_step()[2]


def faster_by(a: Trial, b: Trial) -> tuple[float, float]:
    """How much less time per sample ``b`` takes than ``a``, and the noise on that difference (two standard errors):
    of two readings of it, the one that shows it more clearly (the larger difference less its noise).

    * The compared times (:attr:`Trial.compared_sec_per_sample`) and both their errors.
    * Where both are read on the host and ``b``'s busy time (the step and the host work between steps, the slowest
      block of steps left out) is not longer than ``a``'s beyond noise: their wait for data and its error, plus
      only what ``b``'s step is shorter beyond its noise. The busy time is the model's: a config changes it only
      beyond noise (loading in the training process slows its step down, workers contending for its CPUs do
      too), while its noise (a shared host, a sleep's overshoot: a 40 ms step measured in phases of 50 and 60 ms
      here) is alike for both configs and, taken in full, would hide the difference the loader makes.

    A step shorter by less than its noise counts in the first reading only: 10 workers that took 1.6 ms off a 13 ms
    step and 0.6 ms off the wait were 14% faster, not 4%."""
    sa, sb = a.stats, b.stats
    ta, tb = a.compared_sec_per_sample, b.compared_sec_per_sample
    whole = (ta - tb, 2.0 * math.hypot(ta * a.rel_sem, tb * b.rel_sem))
    if not (a.on_host and b.on_host and sa.samples and sb.samples):
        return whole
    ka, kb = sa.steps / sa.samples, sb.steps / sb.samples  # steps per sample
    (busy_a, sem_a), (busy_b, sem_b) = (_busy(s) for s in (sa, sb))
    busy_noise = 2.0 * math.hypot(sem_a, sem_b)
    if busy_b > busy_a + busy_noise:
        return whole
    busy = busy_a - max(0.0, busy_a - busy_b - busy_noise)  # a's, less b's advantage beyond noise
    waits = (
        (sa.mean_wait_s + busy_a) * ka - (sb.mean_wait_s + busy) * kb,
        2.0 * math.hypot(sa.wait_sem_s * ka, sb.wait_sem_s * kb),
    )
    return max(whole, waits, key=lambda r: r[0] - r[1])


def _busy(s: WindowStats) -> tuple[float, float]:
    """The busy time per step and its error, the slowest block of steps left out where it was measured."""
    if s.busy_trim_s > 0:
        return s.busy_trim_s, s.busy_trim_sem_s
    return (s.step_s + s.other_s) / s.steps, s.busy_sem_s


@dataclass(frozen=True)
class Estimate:
    """The model's reading of the history, in seconds per batch."""

    batch_s: float
    busy_s: float
    batch_tail_s: float  # what the workers are sized on: the batch time's 90th percentile where it is known
    cpu_per_batch_s: float
    worker_cpus: float
    needed_workers: int
    cpu_cap_workers: int  # the most workers the CPUs can keep busy (may exceed ``Budget.max_workers``)
    mem_cap_workers: int | None = None  # the most workers the memory budget holds (None: unbounded)
    shm_cap_slots: int | None = None  # the most batches in flight /dev/shm holds (workers x prefetch)
    worker_mem_bytes: float = 0.0  # a worker's predicted size at the end of its life, at the memory cap
    batch_bytes: float = 0.0
    memory: WorkerMemory = field(default_factory=WorkerMemory)  # measured (or the prior, see ``mem_measured``)
    mem_measured: bool = False
    safe_workers: int | None = None  # workers that fit even at the ceiling (None: no budget or no ceiling)
    mem_life_batches: float = math.inf
    mem_ceiling_bytes: float = 0.0  # what this process holds (not file-backed): a worker's most

    @property
    def cpu_bound(self) -> bool:
        return self.needed_workers > self.cpu_cap_workers


@dataclass(frozen=True)
class Decision:
    """``failed``: why the config being left failed (it went over the memory budget); it is never chosen again.
    ``probe_memory``: a smaller config tried first to measure its workers' memory (and its growth) before a far
    jump; its window runs its full length."""

    action: Action
    settings: LoaderSettings
    reason: str
    failed: str | None = None
    probe_memory: bool = field(default=False, compare=False)  # the next window is there to read the workers' memory
    rule: str = field(default="", compare=False)  # the rule that made it (see `RULES`)


def estimate(trials: Sequence[Trial], budget: Budget, policy: Policy = Policy()) -> Estimate:
    """Estimate batch production cost from the usable trials, the last one weighing for CPU and busy time."""
    usable = [t for t in trials if t.usable]
    if not usable:
        raise ValueError("`trials` holds no usable measurement; measure at least one window first.")
    last = usable[-1]
    s = last.stats
    # on CUDA the consumer is the GPU: a host that only queues kernels is not what the loader must keep up with
    busy = max(_host_busy(last), s.mean_gpu_busy_s)
    batch, sized, uncontended = _batch_times(usable, policy)
    cpu_per_batch = (s.fetch_cpu_s if last.settings.num_workers == 0 else s.worker_cpu_s) / s.steps
    cpu_per_batch = min(cpu_per_batch, uncontended)
    # workers may use every CPU of the budget: the OS shares them with the training process (docs/how-it-decides.md)
    worker_cpus = max(1.0, budget.cpus)
    needed = math.ceil(policy.headroom * sized / busy) if busy > 0 else budget.max_workers
    if cpu_per_batch > 0.02 * uncontended:
        cpu_cap = max(1, math.floor(worker_cpus * uncontended / cpu_per_batch + 1e-9))
    else:  # waiting on I/O: the CPUs do not limit the worker count
        cpu_cap = max(budget.max_workers, needed)
    est = Estimate(
        batch_s=batch,
        batch_tail_s=sized,
        busy_s=busy,
        cpu_per_batch_s=cpu_per_batch,
        worker_cpus=worker_cpus,
        needed_workers=max(1, needed),
        cpu_cap_workers=cpu_cap,
    )
    return _with_memory_caps(est, trials, usable, budget, policy)


def _batch_times(usable: Sequence[Trial], policy: Policy) -> tuple[float, float, float]:
    """A batch's production time (the tightest bound over the history), what the workers are sized on (its 90th
    percentile where it was measured), and the least time measured (what the CPUs can feed is read on it)."""
    bounds: list[tuple[float, float]] = []
    glimpses: list[tuple[float, float]] = []
    for t in usable:
        w = t.settings.num_workers
        if w == 0:  # an estimate, not a bound (the margin is in sizing on the 90th percentile, below)
            # a window judged after a few steps (see judged_early) may have missed every slow batch of a bursty
            # loader: it sizes the first jump, and a window that stalled with workers overrules it
            seen = (t.stats.mean_wait_s, t.stats.wait_p90_s)
            (bounds if t.stats.steps >= policy.min_steps else glimpses).append(seen)
        elif t.stats.effective_stall_frac > policy.stall_threshold / 2:
            bounds.append((w * t.stats.mean_wall_s, 0.0))
    last = usable[-1]
    fallback = last.settings.num_workers * last.stats.mean_wall_s
    # workers that wait for the CPUs stretch the time (a glimpse that missed slow batches waiting on I/O reads it
    # low too: the CPU cap errs towards fewer workers)
    uncontended = min((b for b, _ in bounds + glimpses), default=fallback)
    bounds = bounds or glimpses
    batch = min((b for b, _ in bounds), default=fallback)
    # batches are handed over in order, so one slow batch stalls training even while the other workers have theirs
    # ready: the workers must cover the slow batches' time, not only the mean (tf.data sizes on the mean: it has no
    # order)
    sized = max(batch, max((p90 for _, p90 in bounds), default=0.0))
    return batch, sized, uncontended


def _with_memory_caps(
    est: Estimate, trials: Sequence[Trial], usable: Sequence[Trial], budget: Budget, policy: Policy
) -> Estimate:
    """``est`` with what the memory and /dev/shm budgets allow: the workers' measured (or prior) memory, the most
    workers that fit, and the batches in flight /dev/shm holds."""
    last = usable[-1]
    s = last.stats
    batch_bytes = max((t.stats.batch_bytes for t in usable), default=0.0)
    mem, measured = worker_memory(trials, policy)
    ceiling = max((t.stats.main_mem_bytes for t in trials), default=0.0) or None
    life = life_batches(last.settings, s.epoch_batches)
    flight = memory.in_flight_bytes(batch_bytes, last.settings.prefetch_factor or 2, last.settings.pin_memory)
    mem_cap = safe = None
    per_worker = mem.base_bytes
    if budget.memory_bytes is not None and ceiling is not None:
        safe = memory.safe_workers(ceiling, budget.memory_bytes, flight)
    # unmeasured, with the ceiling known, the workers are measured before a far jump (see decide); the prior caps
    # only a run that cannot say what its process holds
    if budget.memory_bytes is not None and (measured or ceiling is None):
        limit = max(budget.max_workers, est.needed_workers, 1)
        mem_cap = memory.max_workers(mem, budget.memory_bytes, life, ceiling, flight, limit)
        per_worker = memory.worker_bytes(mem, max(1, mem_cap), life, ceiling)
    shm_cap = None
    if budget.shm_bytes is not None and batch_bytes > 0:
        shm_cap = int(budget.shm_bytes * policy.shm_fraction // batch_bytes)
    return replace(
        est,
        mem_cap_workers=mem_cap,
        shm_cap_slots=shm_cap,
        worker_mem_bytes=per_worker,
        batch_bytes=batch_bytes,
        memory=mem,
        mem_measured=measured,
        safe_workers=safe,
        mem_life_batches=life,
        mem_ceiling_bytes=ceiling or 0.0,
    )


def _host_busy(t: Trial) -> float:
    """The host's busy time per step (step and other host work) the workers are sized on. At 0 workers, the least
    step where it was measured (among the steps with the window's largest batch; the median in a window from an
    older cache): loading in the training process slows
    its steps (intra-op threads contend with it, the first steps warm up), so every step there is an upper bound of
    the step with workers, and the least is the tightest. Sized on the mean or even the median of the 2-3 steps a
    plain stall is judged on, the first jump undershoots and takes a second one (the long-epoch benchmark: steps
    of 13-29 ms at 0 workers, 10 ms with workers, and jumps to 8-14 workers where 16 are needed)."""
    s = t.stats
    mean = (s.step_s + s.other_s) / s.steps
    if t.settings.num_workers != 0:
        return mean
    least = s.busy_min_s or s.busy_p50_s
    return min(mean, least) if least > 0 else mean


def worker_memory(trials: Sequence[Trial], policy: Policy = Policy()) -> tuple[WorkerMemory, bool]:
    """The workers' memory over every trial that measured it (failed ones too: a config over the budget measured
    the most): the fit that predicts the most over one worker's epoch, with the largest peaks; the policy's prior
    when none did. And whether one did."""
    seen = [t.stats.worker_memory for t in trials if _read_workers(t)]
    if not seen:
        prior = policy.worker_mem_prior
        return WorkerMemory(prior, 0.0, prior, 0.0, 0), False
    epochs = [t.stats.epoch_batches for t in trials if 0 < t.stats.epoch_batches < math.inf]
    grows = max(seen, key=lambda m: m.base_bytes + m.grown(max(epochs, default=1000.0)))
    return (
        WorkerMemory(
            grows.base_bytes,
            grows.growth_bytes,
            max(m.peak_worker_bytes for m in seen),
            max(m.peak_total_bytes for m in seen),
            len(seen),
            grows.jump_bytes,
            grows.saturation_batches,
        ),
        True,
    )


def life_batches(settings: LoaderSettings, epoch_batches: float) -> float:
    """Batches a worker set is budgeted for: an epoch (``inf`` when the epoch's length is unknown). Persistent
    workers go on growing in later epochs, up to the ceiling: the budget check at every step catches that."""
    if not epoch_batches or not math.isfinite(epoch_batches):
        return math.inf
    return float(epoch_batches)


def enforce_memory(
    trials: Sequence[Trial], budget: Budget, policy: Policy = Policy(), tuning: bool = True
) -> Decision | None:
    """When the last window's workers (with their batches in flight) held more than the memory budget: go down,
    at once, to the most workers the measured size and growth predict to fit (``"try"`` while ``tuning``, else
    ``"settle"``); the config left is recorded as failed. ``None`` when within the budget. Checked by
    :meth:`~lightning_dltune.state.TuningState.decide` before :func:`decide`, in every switching phase."""
    if not trials or budget.memory_bytes is None:
        return None
    last = trials[-1]
    s, cur = last.stats, last.settings
    flight = memory.in_flight_bytes(s.batch_bytes, cur.prefetch_factor, cur.pin_memory)
    if last.failed is not None or not memory.over_budget(
        s.worker_mem_total_bytes, cur.num_workers, flight, budget.memory_bytes
    ):
        return None
    mem, _ = worker_memory(trials, policy)
    life = life_batches(cur, s.epoch_batches)
    ceiling = s.main_mem_bytes or None
    fit = memory.max_workers(mem, budget.memory_bytes, life, ceiling, flight, cur.num_workers - 1)
    cand = cur.with_workers(fit)
    held = s.worker_mem_total_bytes + cur.num_workers * flight
    over = f"over the memory budget ({held / MiB:.0f} MiB of {budget.memory_bytes / MiB:.0f} MiB)"
    reason = (
        f"{cur.describe()} went {over}: {memory.describe_growth(mem, life, cur.num_workers)}; "
        f"{fit} workers are predicted to fit"
    )
    return Decision("try" if tuning else "settle", cand, reason, failed=over, rule="over_memory_budget")


Bound = Literal["max_workers", "cpu", "memory", "shm"]


def worker_cap(est: Estimate, budget: Budget, prefetch: int) -> tuple[int, Bound]:
    """The most workers every budget allows at ``prefetch``, and the budget that binds (the first listed on a tie:
    ``max_workers``, the CPUs, memory, /dev/shm)."""
    caps: list[tuple[int, Bound]] = [(budget.max_workers, "max_workers"), (est.cpu_cap_workers, "cpu")]
    if est.mem_cap_workers is not None:
        caps.append((est.mem_cap_workers, "memory"))
    if est.shm_cap_slots is not None:
        caps.append((est.shm_cap_slots // max(1, prefetch), "shm"))
    return min(caps, key=lambda c: c[0])


def bound_words(bound: Bound, est: Estimate, budget: Budget) -> str:
    """The budget ``bound`` in words, as the decisions and the diagnosis say it."""
    if bound == "max_workers":
        return f"max_workers={budget.max_workers}"
    if bound == "memory":
        return f"the memory budget ({est.worker_mem_bytes / 2**20:.0f} MiB per worker)"
    return "the CPU budget" if bound == "cpu" else "the shared memory (/dev/shm) budget"


def predict_step_s(est: Estimate, load_s: float, hand_s: float = 0.0) -> float:
    """The model's step time on a config whose loader delivers a batch every ``load_s``: the step's busy time (with
    ``hand_s`` to receive each batch from a worker, from 0 workers) or the loader's pace, whichever is longer."""
    return max(est.busy_s + hand_s, load_s)


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
        (t for t in usable if _as_fast(t, fastest, policy)), key=lambda t: (t.settings.cost, t.compared_sec_per_sample)
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
    """A sign test: each of ``a``'s steps (``policy.sign_steps`` or more) took longer per sample than ``b``'s mean
    plus its noise, by ``min_gain`` more. Were ``a``'s typical step no slower than that, all its n steps would be
    with probability 2^-n or less. It shows what a mean's standard error cannot after a few steps of a bursty wait
    (40-200 ms here): that a short window at 0 workers, which an early decision left after ``sign_steps`` steps
    (:func:`plainly_input_bound`), was slower than a loader whose steps take 10 ms."""
    sa = a.stats
    if sa.steps < policy.sign_steps or sa.sample_wall_min_s <= 0:
        return False
    least = sa.sample_wall_min_s  # each step's wall over its own batch's samples
    tb = b.compared_sec_per_sample
    return least > tb * (1.0 + 2.0 * b.rel_sem) * (1.0 + policy.min_gain)


def _as_fast(t: Trial, fastest: Trial, policy: Policy) -> bool:
    """Whether ``t`` is as fast as ``fastest`` within measured noise, but never so wide a noise that a config slower by
    ``min_gain`` counts as equal."""
    ref = fastest.compared_sec_per_sample
    slower, noise = faster_by(t, fastest)
    return slower <= min(max(policy.noise_floor * ref, noise), policy.min_gain * ref)


def stay_on_running(
    trials: Sequence[Trial],
    best: Trial,
    policy: Policy = Policy(),
    in_place: bool = False,
    remaining: int | None = None,
    in_epoch: bool = False,
) -> tuple[Trial, str, bool]:
    """The running config (the last trial) instead of ``best`` where it differs from ``best`` in workers or prefetch
    only and going back would restart the workers for no measured gain, or for less than the restart costs: it is as
    fast within noise, or what ``best`` saves per step over the ``remaining`` steps (when known) is less than its
    loader takes to start (:func:`_wasted`, the run-length rule that every switch up obeys: the bursty benchmark
    went from 13 workers to 16, measured them 1 ms a step slower, and went back to 13 between epochs, a new loader
    and an epoch start with an empty pipeline, with 240 steps left). The workers it keeps fit the budgets (they
    run). Not where ``best`` is a start at 0 workers: moving away from loading in the training process needs a
    measured win (:func:`pick_best`); a start with workers (the user's, or the cache's) is one config among others.
    Nor where going back changes only the prefetch and is made on the running workers (``in_place``): it restarts
    nothing. Returns the config to run on, why it stays on the running one ("" where it does not), and whether it
    stays only for the steps left (then ``best``, measured faster, is the result a longer run goes on to: a hold)."""
    last = trials[-1]
    user_default = best is trials[0] and best.settings.num_workers == 0
    if best is last or user_default or not last.usable or last.settings.pin_memory != best.settings.pin_memory:
        return best, "", False
    if in_place and last.settings.only_prefetch_differs(best.settings):
        return best, "", False
    fastest = min((t for t in trials if t.usable), key=lambda t: t.compared_sec_per_sample)
    if _as_fast(last, fastest, policy):
        why = (
            f"{best.settings.describe()} was as fast within noise, and going back would restart the workers for nothing"
        )
        return last, why, False
    samples_per_step = last.stats.samples / last.stats.steps
    gain = (last.compared_sec_per_sample - best.compared_sec_per_sample) * samples_per_step
    wasted = _wasted(trials, best.settings, gain, remaining, policy, in_epoch, in_place)
    return (last, f"going back to {wasted}", True) if wasted is not None else (best, "", False)


def plainly_input_bound(stats: WindowStats, policy: Policy = Policy()) -> bool:
    """Whether the window already shows, beyond its noise, that training waits for the loader most of the time:
    after ``policy.early_steps`` steady steps, the stall's lower confidence bound (and the GPU's stall, where it
    was measured) is at least ``policy.early_stall``, or after ``policy.sign_steps`` every step's was (a sign
    test: :func:`every_step_slower`). Then no more steps can change the decision to add
    workers, and the window is judged before ``min_steps``; close calls still wait for ``min_steps``."""
    if stats.steps < policy.early_steps:
        return False
    gpu = stats.gpu_stall_frac
    return (stats.stall_lower_bound() >= policy.early_stall or _every_step_stalled(stats, policy)) and (
        gpu is None or gpu >= policy.early_stall
    )


def _every_step_stalled(stats: WindowStats, policy: Policy) -> bool:
    """The sign test's reading of the stall (see :func:`every_step_slower`): after ``policy.sign_steps`` steps or
    more, each step waited at least its least wait, against the mean busy time plus its noise; at least
    ``early_stall`` of the time on the typical step. A bursty wait (40-200 ms, a 10 ms step) shows it after 3 steps,
    where the mean's standard error, widened for so few steps, took 5-6."""
    if stats.steps < policy.sign_steps or stats.wait_min_s <= 0:
        return False
    busy = max(0.0, stats.mean_wall_s - stats.mean_wait_s) + 2.0 * stats.busy_sem_s
    return stats.wait_min_s / (stats.wait_min_s + busy) >= policy.early_stall


def stalled_from_the_start(trials: Sequence[Trial], budget: Budget, policy: Policy = Policy()) -> bool:
    """Whether the last window, at 0 workers, shows a plain stall after one steady step, with its start-up step as
    the second (see :func:`plainly_input_bound`), and the model's worker count already reaches ``budget.max_workers``.

    At 0 workers the first step after the build loads its batch in the training process as every later one does,
    so its wait is one more sample of the wait, and its busy time (the model's first step: warm-up, on a GPU its
    context and autotuning) an upper bound of the busy time. A wait that was start-up only (a dataset opened
    lazily on its first sample) is far from the steady one, and the two samples' error rules it out. The one
    steady step's busy time is an upper bound too (the fit's second step can still be warming up: 18-20 ms against
    8-9 ms on the latency benchmark), and a jump sized on it could undershoot; so only where the model asks for
    ``max_workers`` already, which a shorter step could not raise. The latency and
    long-epoch benchmarks (170-180 ms waits, 10 ms steps, 16 workers at the cap) then switch a batch earlier."""
    last = trials[-1]
    stats = last.stats
    if last.settings.num_workers != 0 or stats.steps != 1 or policy.early_steps > 2 or stats.startup_wait_s <= 0:
        return False
    if not last.usable:  # a batch of no samples
        return False
    w0, w1 = stats.startup_wait_s, stats.mean_wait_s
    # two standard errors low, over two samples and widened for them, as stall_lower_bound takes them over more
    wait = max(0.0, (w0 + w1) / 2 - 2.0 * few(1) * abs(w0 - w1) / 2)
    busy = max(stats.startup_busy_s, stats.mean_wall_s - stats.mean_wait_s)
    gpu = stats.gpu_stall_frac
    if wait <= 0 or wait / (wait + busy) < policy.early_stall or (gpu is not None and gpu < policy.early_stall):
        return False
    # The cap on worker processes: the memory and /dev/shm caps, read at the window's close, are not consulted, so
    # a window judged on this at its peek is judged so again at its close. Not the CPUs' cap: a loader
    # bound by the CPUs gains little from a batch less at 0 workers (its batch loads in tens of ms there), and the
    # start then has one step to show the final choice's win over it (a CPU-bound benchmark run that was judged
    # on one step settled back on 0 workers: that one step had read fast)
    return estimate(trials, budget, policy).needed_workers >= budget.max_workers


def steady_from_the_start(stats: WindowStats, policy: Policy = Policy()) -> WindowStats:
    """A window at 0 workers that has only its start-up step, as one steady step where that step's samples show it
    is one (else ``stats`` as it is): its batch, timed sample by sample (at least ``policy.startup_samples``), waited
    its samples' count times the mean of all but the first (a file opened lazily shows in the first), two standard
    errors low and never above the step's whole wait; its busy time is the step's own, warm-up and all. The timer's
    window is not changed. Why and what showed it: ``docs/how-it-decides.md`` (``too_few_steps``)."""
    n, rest, samples = stats.startup_samples, stats.startup_samples - 1, stats.startup_step_samples
    if stats.steps != 0 or n < max(3, policy.startup_samples) or stats.startup_wait_s <= 0 or samples <= 0:
        return stats
    low = stats.startup_sample_mean_s - 2.0 * few(rest - 1) * stats.startup_sample_sem_s
    wait = min(stats.startup_wait_s, n * low)
    if wait <= 0:
        return stats
    busy = stats.startup_busy_s
    return replace(
        stats,
        steps=1,
        samples=samples,
        wall_s=wait + busy,
        wait_s=wait,
        step_s=busy,
        other_s=0.0,
        wait_p50_s=wait,
        wait_p90_s=wait,
        wall_trim_s=wait + busy,
        busy_trim_s=busy,
        busy_p50_s=busy,
        busy_min_s=busy,
        wait_min_s=wait,
        sample_wall_min_s=(wait + busy) / samples,
        fetch_cpu_s=stats.startup_fetch_cpu_s,
        startup_wait_s=wait,
        startup_busy_s=busy,
    )


def sized_on_a_longer_step(trials: Sequence[Trial], policy: Policy = Policy()) -> bool:
    """Whether the last config, jumped to from loading in the training process (0 workers), was sized on a step
    much longer than it has now, and still stalls beyond noise after ``policy.early_steps`` steps.

    Loading in the training process slows its step down (intra-op threads contend with it: a 5 ms step measured
    9 ms there), so the first jump is sized on an upper bound of the step and undershoots; the window with
    workers measures the real step, and is judged at once to land the next jump instead of after ``min_steps``.
    """
    usable = [t for t in trials if t.usable]
    if len(usable) < 2 or usable[-1] is not trials[-1]:
        return False
    last, before = usable[-1], usable[-2]
    if before.settings.num_workers != 0 or last.settings.num_workers == 0 or last.stats.steps < policy.early_steps:
        return False
    busy_now, busy_then = _host_busy(last), _host_busy(before)  # the step the jump was sized on
    return busy_now < 0.75 * busy_then and last.stats.stall_lower_bound() > policy.stall_threshold


def stalls_with_workers(trials: Sequence[Trial], policy: Policy = Policy()) -> bool:
    """Whether the last config, with workers, stalls beyond noise after ``policy.min_steps`` steps: the lower
    confidence bound of its stall is above ``stall_threshold``. Then a short epoch need not run to its end before
    the next move (more workers, deeper prefetch, or settling): it is taken while enough of the epoch is left for a
    loader with more workers to start behind the running one. A window that shows no stall yet (a new loader's
    first round of batches, loaded in parallel, can hide one) still runs to the epoch's end."""
    last = trials[-1]
    s = last.stats
    return (
        last.settings.num_workers > 0 and s.steps >= policy.min_steps and s.stall_lower_bound() > policy.stall_threshold
    )


def still_open(trials: Sequence[Trial], policy: Policy = Policy()) -> bool:
    """Whether the last trial's window runs on before it is judged, though it has its steps: against the fastest
    earlier config, its gain falls short of ``min_gain`` while the gain's noise could still make it one, and it has
    fewer than ``4 * min_steps`` steps. A few slow batches of a bursty loader can make a short window of more
    workers read slower than a long one of fewer (the bursty benchmark: 11 workers over 12 steps at 17.2 ms a step
    against 6 over 35 at 13.4 ms, where 12-16 workers are the best static configs), and "more workers stopped
    paying" would then settle on the fewer for good; a few more steps of the likely better config cost little."""
    last = trials[-1]
    if not last.usable or last.stats.steps >= 4 * policy.min_steps:
        return False
    earlier = [t for t in trials[:-1] if t.usable and t.settings != last.settings]
    if not earlier:
        return False
    prev = min(earlier, key=lambda t: t.compared_sec_per_sample)
    gain, noise = faster_by(prev, last)
    return gain < policy.min_gain * prev.compared_sec_per_sample <= gain + noise


def win_not_yet_shown(trials: Sequence[Trial], policy: Policy = Policy()) -> bool:
    """Whether the last trial, the fastest so far and short of ``4 * min_steps`` steps, reads faster than a start at
    0 workers but not yet beyond noise, where more of its steps could show it. Asked where judging the window now
    would settle back on that start (``TuningState.undecided``): leaving it needs a win beyond noise
    (:func:`won_over_start`), and going back is for good. On a busy host a window with workers is noisy, and a start
    judged after a few steps is short: one tuner run of the CPU-bound benchmark settled back on 0 workers (7.4 s,
    where 4 workers take 5.0-5.3 s). A start with workers is not gone back to for want of a shown win: the running
    config stays where it is as fast (:func:`stay_on_running`)."""
    start, last = trials[0], trials[-1]
    if start is last or not (start.usable and last.usable) or start.settings.num_workers:
        return False
    if last.stats.steps >= 4 * policy.min_steps or start.settings == last.settings:
        return False
    if any(t.usable and t.compared_sec_per_sample < last.compared_sec_per_sample for t in trials[:-1]):
        return False  # another config is the likelier pick: more of this one's steps would not change it
    gain, noise = faster_by(start, last)
    could_win = gain + noise > policy.min_gain * start.compared_sec_per_sample
    return gain > 0 and could_win and not won_over_start(start, last, policy)


def judged_early(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """Whether the last trial's window can be judged before its epoch's end or a full window: its stall is plainly
    the loader's (:func:`plainly_input_bound`; with a ``budget``, at 0 workers, :func:`stalled_from_the_start`
    too), the jump to it was sized on a longer step (:func:`sized_on_a_longer_step`), or with workers it stalls
    beyond noise after ``min_steps`` (:func:`stalls_with_workers`). A start at 0 workers that loads on the training
    process's CPU (half its wait or more) is judged on its stall only after ``policy.sign_steps`` steps: the CPUs cap
    what workers win back there (a fifth of its time on the CPU-bound benchmark, not most of it), and the final
    choice must show that win over the start beyond its noise; over 2 steps that noise is widened 6.5-fold, and the
    benchmark settled back on 0 workers in one run of eight (24.0 ms a step at 0 workers, 19.2 with 2)."""
    last = trials[-1]
    on_the_cpu = last.settings.num_workers == 0 and 0 < 0.5 * last.stats.wait_s <= last.stats.fetch_cpu_s
    start = not on_the_cpu or last.stats.steps >= policy.sign_steps
    return (
        (
            start
            and (
                plainly_input_bound(last.stats, policy)
                or (budget is not None and stalled_from_the_start(trials, budget, policy))
            )
        )
        or sized_on_a_longer_step(trials, policy)
        or stalls_with_workers(trials, policy)
    )


def _bursty(stats: WindowStats, busy: float, policy: Policy) -> bool:
    return stats.wait_p90_s > policy.burst_ratio * stats.wait_p50_s and stats.wait_p90_s > 0.25 * busy


class Situation:
    """What the rules read (see :data:`RULES`): the trials, the budgets and the run, and what the model makes of
    them, each computed once, when a rule first asks."""

    def __init__(
        self,
        trials: Sequence[Trial],
        budget: Budget,
        policy: Policy,
        remaining_steps: int | None = None,
        probed: bool = False,
        in_epoch: bool = False,
        in_place: bool = False,
        memory_limit: int | None = None,
    ) -> None:
        self.trials, self.budget, self.policy, self.remaining = trials, budget, policy, remaining_steps
        self.probed, self.in_epoch, self.in_place, self.memory_limit = probed, in_epoch, in_place, memory_limit
        self.last = trials[-1]
        self.usable = [t for t in trials if t.usable]
        self.cur, self.w = self.last.settings, self.last.settings.num_workers
        self.tried = {t.settings for t in trials}
        self.stall = self.last.stats.effective_stall_frac

    @cached_property
    def picked(self) -> Trial:
        """The best measured config (:func:`pick_best`)."""
        return pick_best(self.trials, self.policy, self.memory_limit)

    @cached_property
    def staying(self) -> tuple[Trial, str, bool]:
        """The config a settle lands on, why it stays on the running one, and whether only for the steps left
        (:func:`stay_on_running`)."""
        return stay_on_running(self.trials, self.picked, self.policy, self.in_place, self.remaining, self.in_epoch)

    @cached_property
    def est(self) -> Estimate:
        return estimate(self.trials, self.budget, self.policy)

    @cached_property
    def hand(self) -> float:
        """What receiving a batch from a worker costs a step, from 0 workers (:func:`handover_s`)."""
        return handover_s(self.trials, self.policy) if self.w == 0 else 0.0

    @cached_property
    def cap(self) -> tuple[int, Bound]:
        """The most workers every budget allows at the running prefetch, and the budget that binds."""
        return worker_cap(self.est, self.budget, self.cur.prefetch_factor or 2)

    @cached_property
    def sized(self) -> int:
        """The workers the model asks for, within the budgets."""
        return min(self.cap[0], self.est.needed_workers)

    @cached_property
    def deeper(self) -> LoaderSettings | None:
        """The running config with twice its prefetch, where that may be tried (``None``: not). Not past the
        budgets' prefetch, /dev/shm or memory cap, nor where the CPUs are what the loader waits for: loading
        further ahead does not add CPU time."""
        w, est, cur = self.w, self.est, self.cur
        if w == 0 or (cur.prefetch_factor or 0) >= self.budget.max_prefetch or est.cpu_bound:
            return None
        deeper = cur.with_prefetch(min(self.budget.max_prefetch, 2 * (cur.prefetch_factor or 1)))
        if deeper in self.tried or (est.shm_cap_slots is not None and deeper.batches_in_flight > est.shm_cap_slots):
            return None
        return None if est.mem_cap_workers is not None and w >= est.mem_cap_workers else deeper

    def try_(self, rule: str, cand: LoaderSettings, gain_s: float, reason: str) -> Decision:
        """A trial of ``cand``, predicted to save ``gain_s`` a step; held where that does not pay for its start over
        the steps left (:func:`_wasted`)."""
        if (cand.prefetch_factor or 0) > self.budget.max_prefetch:  # from 0 workers: PyTorch's default 2
            cand = cand.with_prefetch(self.budget.max_prefetch)
        wasted = _wasted(self.trials, cand, gain_s, self.remaining, self.policy, self.in_epoch, self.in_place)
        if wasted:
            return Decision("hold", cand, wasted, rule="start_costs_more")
        return Decision("try", cand, reason, rule=rule)

    def settle(self, rule: str, reason: str) -> Decision:
        """A settle on the best config (see :data:`SETTLE_OVERRIDES`)."""
        return Decision("settle", self.picked.settings, reason, rule=rule)


# --- the rules that judge a window, in order: each returns a decision or passes (None) ------------------------------
def too_few_steps(s: Situation) -> Decision | None:
    """A window shorter than ``min_steps`` is measured on, unless it can be judged early (:func:`judged_early`)."""
    last, policy = s.last, s.policy
    if last.failed is None and last.stats.steps < policy.min_steps and not judged_early(s.trials, policy, s.budget):
        reason = f"{last.stats.steps} steps measured, need {policy.min_steps}"
        return Decision("measure", last.settings, reason, rule="too_few_steps")
    return None


def nothing_measured(s: Situation) -> Decision | None:
    """With no usable window, the starting config stays."""
    if s.usable:
        return None
    reason = "no config could be measured; keeping the starting config"
    return Decision("settle", s.trials[0].settings, reason, rule="nothing_measured")


def config_failed(s: Situation) -> Decision | None:
    """A config that failed is left for the best measured one."""
    if s.last.failed is None:
        return None
    reason = f"{s.last.settings.describe()} failed ({s.last.failed})"
    return Decision("settle", s.picked.settings, reason, rule="config_failed")


def stall_below_threshold(s: Situation) -> Decision | None:
    """A stall within ``stall_threshold`` is what the tuner aims for: it settles."""
    if s.stall > s.policy.stall_threshold:
        return None
    seen = "the GPU's idle gap" if s.last.stats.gpu_stall_frac is not None else "stall"
    return s.settle(
        "stall_below_threshold", f"{seen} {s.stall:.1%} is below the {s.policy.stall_threshold:.0%} threshold"
    )


def trials_spent(s: Situation) -> Decision | None:
    """After ``max_trials`` windows it settles."""
    if len(s.trials) < s.policy.max_trials:
        return None
    return s.settle("trials_spent", f"tuning budget of {s.policy.max_trials} trials spent")


def change_did_not_pay(s: Situation) -> Decision | None:
    """A change not ``min_gain`` faster than the fastest other config measured stops the search (not after a
    window that was there to read memory)."""
    last, policy = s.last, s.policy
    earlier = [t for t in s.usable[:-1] if t.settings != last.settings]
    if not earlier or s.probed:
        return None
    prev = min(earlier, key=lambda t: t.compared_sec_per_sample)
    if faster_by(prev, last)[0] >= policy.min_gain * prev.compared_sec_per_sample:
        return None
    what = "more workers stopped paying"
    if last.settings.pin_memory != prev.settings.pin_memory:
        what = "pinned memory did not pay"
    elif prev.settings.only_prefetch_differs(last.settings):
        what = "deeper prefetch did not pay"
    reason = f"{last.settings.describe()} was not {policy.min_gain:.0%} faster than {prev.settings.describe()}: {what}"
    return s.settle("change_did_not_pay", reason)


def running_outgrows_memory(s: Situation) -> Decision | None:
    """Workers predicted to outgrow the memory budget within their life settle at once on the most that fit."""
    outgrown = _outgrown(s.est, s.cur, s.budget)
    return None if outgrown is None else replace(outgrown, rule="running_outgrows_memory")


def handover_eats_the_gain(s: Situation) -> Decision | None:
    """From 0 workers, where receiving each batch from a worker would cost most of the wait, workers cannot pay."""
    last, policy = s.last, s.policy
    hideable = max(0.0, s.stall - s.hand / last.stats.mean_wall_s)
    if s.w != 0 or hideable > policy.stall_threshold:
        return None
    return s.settle(
        "handover_eats_the_gain",
        f"a batch takes {last.stats.mean_wait_s * 1e3:.2f} ms to load in the training process and about "
        f"{s.hand * 1e3:.2f} ms to receive from a worker: workers could hide at most {hideable:.1%} of the time, "
        f"within the {policy.stall_threshold:.0%} threshold",
    )


def bursty_waits(s: Situation) -> Decision | None:
    """Once the workers reach the model's count, bursty waits (p90 far above the median) try deeper prefetch."""
    last, est = s.last, s.est
    if s.deeper is None or not (s.w >= s.sized or s.cur.with_workers(s.sized) in s.tried):
        return None
    if not _bursty(last.stats, est.busy_s, s.policy):
        return None
    return s.try_(
        "bursty_waits",
        s.deeper,
        s.policy.prefetch_absorbs * last.stats.mean_wait_s,
        f"waits are bursty (p90 {last.stats.wait_p90_s * 1e3:.1f} ms vs median {last.stats.wait_p50_s * 1e3:.1f} ms): "
        "deeper prefetch",
    )


def past_the_cpu_cap(s: Situation) -> Decision | None:
    """Where the CPU budget alone stops the model and the workers used under 90% of the CPUs, twice the workers
    are tried once (:func:`_past_the_cpu_cap`)."""
    if s.sized > s.w:
        return None
    past = _past_the_cpu_cap(s.trials, s.est, s.budget, s.cap[1])
    if past is None:
        return None
    cand, used = past
    est = s.est
    predicted = predict_step_s(est, est.cpu_per_batch_s / min(est.worker_cpus, 2 * used))
    return s.try_(
        "past_the_cpu_cap",
        cand,
        s.last.stats.mean_wall_s - predicted,
        f"the CPU budget caps the model at {s.w} workers, but they used {used:.1f} of the {est.worker_cpus:.0f} "
        f"CPUs while training waited {s.stall:.0%} of the time: the CPUs are shared with the training process, "
        f"and {cand.num_workers} workers measure what they get",
    )


def slow_batches_hold_up(s: Situation) -> Decision | None:
    """With no more workers to add, where the workers load the mean batch faster than the step takes it, training
    still waits on batches that come back late: deeper prefetch absorbs that."""
    est, bound = s.est, s.cap[1]
    if s.sized > s.w or s.deeper is None:
        return None
    covers_mean = s.w * est.busy_s >= est.batch_s
    if not (est.needed_workers <= s.w or (bound == "max_workers" and covers_mean)):
        return None
    words = bound_words(bound, est, s.budget)
    why = f"{est.needed_workers} needed" if est.needed_workers <= s.w else f"{words}; the mean batch needs fewer"
    return s.try_(
        "slow_batches_hold_up",
        s.deeper,
        s.policy.prefetch_absorbs * s.last.stats.mean_wait_s,
        f"{s.w} workers load a batch every {est.batch_s / s.w * 1e3:.1f} ms on average and the step takes "
        f"{est.busy_s * 1e3:.1f} ms ({why}), yet training waited {s.stall:.0%} of the time: slow batches hold up "
        "the hand-over; deeper prefetch",
    )


def no_more_workers(s: Situation) -> Decision | None:
    """Where the budgets (or the model) allow no more workers than run, it settles."""
    if s.sized > s.w:
        return None
    why = bound_words(s.cap[1], s.est, s.budget)
    if s.est.needed_workers <= s.w:
        why = "the model (the wait is not from too few workers)"
    return s.settle("no_more_workers", f"no more workers to add within {why}")


def already_measured(s: Situation) -> Decision | None:
    """The model's count, already measured, is not tried again: it settles."""
    cand = s.cur.with_workers(_measure_memory_first(s.est, s.budget, s.w, s.sized) or s.sized)
    if cand not in s.tried:
        return None
    return s.settle("already_measured", f"{cand.describe()} was already measured")


def jump_to_the_model(s: Situation) -> Decision | None:
    """The model's count, within the budgets, is tried next (a smaller one first where a worker's memory was not
    read yet and the count would not fit if each came to hold what this process holds)."""
    est, budget, cap = s.est, s.budget, s.cap[0]
    first = _measure_memory_first(est, budget, s.w, s.sized)
    target = first or s.sized
    limit = f" (capped at {target} by {bound_words(s.cap[1], est, budget)})" if target < est.needed_workers else ""
    if first is not None:
        assert budget.memory_bytes is not None and est.safe_workers is not None
        full = min(est.needed_workers, cap)
        limit = (
            f"; {first} first, to measure a worker's memory before going to {full}: {full} workers fit the "
            f"{budget.memory_bytes / MiB:.0f} MiB budget only if each holds under "
            f"{budget.memory_bytes / full / MiB:.0f} MiB, and a worker can come to hold this process's "
            f"{est.mem_ceiling_bytes / MiB:.0f} MiB"
        )
    predicted = predict_step_s(est, est.batch_s / target, s.hand)
    decision = s.try_(
        "jump_to_the_model",
        s.cur.with_workers(target),
        s.last.stats.mean_wall_s - predicted,
        f"a batch takes {est.batch_s * 1e3:.1f} ms to load{_slowest(est)} and the step {est.busy_s * 1e3:.1f} "
        f"ms: {est.needed_workers} workers hide it{limit}",
    )
    return replace(decision, probe_memory=first is not None)


Rule = Callable[[Situation], "Decision | None"]
# the rules that judge a window, in the order they are asked; the first that decides makes the decision
RULES: tuple[Rule, ...] = (
    too_few_steps,
    nothing_measured,
    config_failed,
    stall_below_threshold,
    trials_spent,
    change_did_not_pay,
    running_outgrows_memory,
    handover_eats_the_gain,
    bursty_waits,
    past_the_cpu_cap,
    slow_batches_hold_up,
    no_more_workers,
    already_measured,
    jump_to_the_model,
)
# the rules whose settle lands where it does whatever follows (the others' pass through SETTLE_OVERRIDES)
FINAL = frozenset(rule.__name__ for rule in (nothing_measured, config_failed, running_outgrows_memory))


# --- what a settle becomes: each returns another decision or passes -------------------------------------------------
def settle_within_memory(s: Situation, settle: Decision) -> Decision | None:
    """Never settle on workers predicted to outgrow the memory budget, whatever made the tuner settle."""
    best = s.staying[0]
    if s.budget.memory_bytes is None or best.settings.num_workers == 0 or not any(map(_read_workers, s.trials)):
        return None
    outgrown = _outgrown(s.est, best.settings, s.budget)
    return None if outgrown is None else replace(outgrown, rule="settle_within_memory")


def pinned_memory_first(s: Situation, settle: Decision) -> Decision | None:
    """Before settling, try pinned memory where host-to-device copies take a share of the GPU's time."""
    best = s.staying[0]
    pin = None if len(s.trials) >= s.policy.max_trials else _pin_trial(s.trials, best, s.budget, s.policy)
    gain = s.policy.pinned_copy_saves * best.stats.gpu.mean_copy_s
    if pin is None or _wasted(s.trials, pin.settings, gain, s.remaining, s.policy, s.in_epoch, s.in_place):
        return None
    return replace(pin, rule="pinned_memory_first")


def keep_running_config(s: Situation, settle: Decision) -> Decision | None:
    """Stay on the running config where going back to the best one would restart workers for nothing (it is as
    fast), or for less than the restart costs over the steps left (then a hold: the best is the result)."""
    best, staying, for_the_steps_left = s.staying
    if for_the_steps_left:
        return Decision("hold", s.picked.settings, f"{settle.reason}; {staying}", rule="keep_running_config")
    if staying:
        reason = f"{settle.reason}; staying on {best.settings.describe()}: {staying}"
        return replace(settle, settings=best.settings, reason=reason, rule="keep_running_config")
    return None


SettleOverride = Callable[[Situation, Decision], "Decision | None"]
SETTLE_OVERRIDES: tuple[SettleOverride, ...] = (settle_within_memory, pinned_memory_first, keep_running_config)


def decide(
    trials: Sequence[Trial],
    budget: Budget,
    policy: Policy = Policy(),
    remaining_steps: int | None = None,
    probed: bool = False,
    in_epoch: bool = False,
    in_place: bool = False,
    memory_limit: int | None = None,
) -> Decision:
    """What to do after the last trial: keep measuring it, try another config, settle, or hold. The first of
    :data:`RULES` that decides makes the decision (its name is ``Decision.rule``); a settle then passes through
    :data:`SETTLE_OVERRIDES`, unless its rule is :data:`FINAL`.

    ``probed``: the last trial was a smaller config tried to read its workers' memory before a far jump (see
    ``Decision.probe_memory``); it was not expected to pay, so it not paying does not settle.
    ``remaining_steps`` (``None``: unknown): training steps left. A config is tried only where the time it is
    predicted to save over them exceeds what starting its workers costs (:func:`restart_cost_s`); otherwise the
    decision is ``"hold"``: stay on the current config for the rest of this run, with the config that would be
    tried next in ``settings``. ``in_epoch``: the switch would happen inside an epoch on one process, where more
    workers start in the background. ``in_place``: a change of ``prefetch_factor`` alone is made on the running
    workers, and more workers start beside them. ``memory_limit``: see :func:`pick_best`.

    Raises:
        ValueError: if ``trials`` is empty.
    """
    if not trials:
        raise ValueError("`trials` is empty; measure the starting config first.")
    s = Situation(trials, budget, policy, remaining_steps, probed, in_epoch, in_place, memory_limit)
    decision = next(d for d in map(lambda rule: rule(s), RULES) if d is not None)
    if decision.action != "settle" or decision.rule in FINAL:
        return decision
    return next((d for d in (o(s, decision) for o in SETTLE_OVERRIDES) if d is not None), decision)


def _past_the_cpu_cap(
    trials: Sequence[Trial], est: Estimate, budget: Budget, bound: Bound
) -> tuple[LoaderSettings, float] | None:
    """Twice the workers, tried once, where the CPU budget alone stops the model at the running count and the
    running workers used under 90% of the CPUs they may use (with the CPUs they used). The cap takes the CPUs as the
    workers' own, but the training process runs on them too: its threads (an intra-op pool that spins while it
    waits, the step's own work) take a share, and the OS shares the CPUs among runnable threads, so more workers get
    more of them (measured on 2 CPUs: a 1 ms-per-sample loader, 4 workers 4% faster than 2). Never past the other
    budgets, and only right after the jump from 0 workers the model capped: once."""
    last = trials[-1]
    cur, s = last.settings, last.stats
    w = cur.num_workers
    if w == 0 or bound != "cpu" or est.needed_workers <= w or s.wall_s <= 0:
        return None
    if len(trials) < 2 or any(t.settings.num_workers > 0 for t in trials[:-1]):  # once, after the jump from 0
        return None
    used = s.worker_cpu_s / s.wall_s
    if used <= 0 or used >= 0.9 * est.worker_cpus:
        return None
    caps = [2 * w, est.needed_workers, budget.max_workers]
    if est.mem_cap_workers is not None:
        caps.append(est.mem_cap_workers)
    if est.shm_cap_slots is not None:
        caps.append(est.shm_cap_slots // max(1, cur.prefetch_factor or 2))
    more = min(caps)
    return (cur.with_workers(more), used) if more > w else None


def _slowest(est: Estimate) -> str:
    """The slow batches' time, where it sized the workers (see :func:`estimate`)."""
    if est.batch_tail_s <= 1.1 * est.batch_s:
        return ""
    return f" (one in ten {est.batch_tail_s * 1e3:.1f} ms or more)"


def _read_workers(t: Trial) -> bool:
    """Whether the trial's window read its workers' memory."""
    return t.settings.num_workers > 0 and t.stats.worker_mem_bytes > 0


def _outgrown(est: Estimate, cur: LoaderSettings, budget: Budget) -> Decision | None:
    """Where ``cur``'s workers (running, or about to be settled on) are predicted to outgrow the memory budget
    before the end of their life (their copy-on-read growth, measured): settle at once on the most workers
    predicted to fit, rather than on these and wait for the check at each step to see the overrun."""
    cap, workers = est.mem_cap_workers, cur.num_workers
    if cap is None or cap >= workers or not est.mem_measured or budget.memory_bytes is None:
        return None
    mem = est.memory
    per = memory.worker_bytes(mem, workers, est.mem_life_batches, est.mem_ceiling_bytes or None)
    grows = memory.growth_words(mem)
    return Decision(
        "settle",
        cur.with_workers(cap),
        f"{workers} workers are predicted to outgrow the {budget.memory_bytes / MiB:.0f} MiB memory budget: "
        f"{per / MiB:.0f} MiB each by the end of an epoch{grows}; {cap} fit",
    )


def _measure_memory_first(est: Estimate, budget: Budget, workers: int, target: int) -> int | None:
    """A smaller worker count to measure first, when no worker's memory was measured yet and ``target`` workers
    would not fit the budget if each came to hold all this process holds (``None``: jump to ``target``)."""
    if est.mem_measured or est.safe_workers is None or budget.memory_bytes is None or workers > 0:
        return None
    if target <= est.safe_workers:
        return None
    return max(1, est.safe_workers)


def handover_s(trials: Sequence[Trial], policy: Policy = Policy()) -> float:
    """What receiving a batch from a worker costs the training process per step: the least median wait of a trial
    with workers (at most that: a config that stalls waits longer), else ``policy.handover_prior_s``. Loading in
    the training process costs no hand-over, so workers save at most the wait at 0 workers less this."""
    seen = [t.stats.wait_p50_s for t in trials if t.usable and t.settings.num_workers > 0]
    return min(seen) if seen else policy.handover_prior_s


def restart_cost_s(trials: Sequence[Trial], workers: int, policy: Policy = Policy(), behind: bool = False) -> float:
    """Predicted cost of switching to a loader with ``workers`` workers, per worker as measured on earlier trials
    (the largest), else the policy's prior. In the open: building the loader, starting its workers and waiting
    for its first batch (``startup_s``). ``behind``: the loader starts in the background while the running one
    serves (to more workers, see :func:`handover_lead`), or ``workers`` are added beside the running ones (see
    ``decide``'s ``in_place``); then the first batches load during
    the overlap, and the cost is what earlier background starts cost (their overlap's time beyond the old
    config's pace), or before one was measured, the building of earlier loaders alone (``build_s``)."""
    measured = [t for t in trials if t.usable and t.settings.num_workers > 0 and t.stats.startup_s > 0]
    per_worker = [t.stats.startup_s / t.settings.num_workers for t in measured]
    if behind:
        starts = [t.stats.startup_s / t.settings.num_workers for t in measured if t.stats.startup_behind]
        builds = [t.stats.build_s / t.settings.num_workers for t in measured if t.stats.build_s > 0]
        per_worker = starts or builds or per_worker
    return (max(per_worker) if per_worker else policy.startup_prior_s) * max(1, workers)


def handover_lead(trials: Sequence[Trial]) -> int:
    """Batches the running loader serves while a new loader starts in the background (#13): the running config's
    worker count ``w``, at most 64, no timing read. With ``w`` workers each loading one batch while the loop takes
    ``w`` steps, a batch loads in at most ``w`` steps at the running pace, and one of the new workers' first batch
    costs about what one of theirs does. Starting the workers (forking them) happens in the training process before
    the overlap, so it is not part of it. A lead too short only waits for the rest at the hand-over, as a switch in
    the open waits for all of it, while a lead too long keeps the slower config after the faster one was ready. The
    same for any new worker count: its workers load their first batches in parallel. From 0 workers the switch
    takes over at once: the training process cannot load while it starts the new workers, and each of them loads
    as soon as it has started (``_lightning.iterate_growing``), so the first batch is ready about as the last worker
    has started; a batch loaded in the training process first would only come on top (the long-epoch benchmark:
    16 workers fork in 150-250 ms, a 16-sample batch loads in 165 ms; the switch's fetch took 400 ms that way,
    250 ms at once)."""
    if not trials or not trials[-1].usable:  # the running config's own window: without one, take over at once
        return 0
    workers = trials[-1].settings.num_workers
    if workers == 0 or trials[-1].stats.mean_wall_s <= 0:
        return 0
    return min(64, workers)  # a batch takes at most `workers` steps to load: workers in parallel, one batch each


def _wasted(
    trials: Sequence[Trial],
    cand: LoaderSettings,
    gain_s: float,
    remaining: int | None,
    policy: Policy,
    in_epoch: bool = False,
    in_place: bool = False,
) -> str | None:
    """Why switching to ``cand`` would not pay (``None`` when it would, or when the run's length is unknown).
    ``in_epoch``, ``in_place``: see :func:`decide`."""
    if remaining is None or (in_place and gain_s > 0 and trials[-1].settings.only_prefetch_differs(cand)):
        return None
    running = trials[-1].settings
    current = running.num_workers
    if in_place and running.adds_workers_to(cand):  # only the added workers start, beside the running ones
        starting, behind = cand.num_workers - current, True
    else:
        starting, behind = cand.num_workers, in_epoch and current < cand.num_workers and handover_lead(trials) > 0
    saved, cost = max(0.0, gain_s) * remaining, restart_cost_s(trials, starting, policy, behind)
    if saved > cost:
        return None
    return (
        f"{cand.describe()} would save about {saved:.2f} s over the {remaining} steps left, less than the "
        f"{cost:.2f} s its loader takes to start"
    )


def _pin_trial(trials: Sequence[Trial], best: Trial, budget: Budget, policy: Policy) -> Decision | None:
    """``best`` with ``pin_memory=True`` when host-to-device copies take more than ``stall_threshold`` of the
    GPU's time, it was not measured yet, and its pinned batches fit the memory budget."""
    s = best.stats
    copy = s.copy_frac
    if copy is None or copy <= policy.stall_threshold or best.settings.pin_memory:
        return None
    cand = replace(best.settings, pin_memory=True)
    # tried already, persistent or not (a loader Lightning reloads gets pinned memory without persistent workers)
    same = (cand.num_workers, cand.prefetch_factor, True)
    if any((t.settings.num_workers, t.settings.prefetch_factor, t.settings.pin_memory) == same for t in trials):
        return None
    if budget.memory_bytes is not None:
        w = cand.num_workers
        flight = memory.in_flight_bytes(s.batch_bytes, cand.prefetch_factor, True)
        mem, _ = worker_memory(trials, policy)
        pin_thread = s.batch_bytes  # the batch the pin thread holds
        total = memory.total_bytes(mem, w, life_batches(cand, s.epoch_batches), None, flight) + pin_thread
        if total > budget.memory_bytes:
            return None
    return Decision(
        "try",
        cand,
        f"host-to-device copies take {copy:.0%} of the GPU's time ({s.gpu.mean_copy_s * 1e3:.1f} ms "
        "per step): pinned memory",
    )


def _waited(stats: WindowStats) -> str:
    if stats.gpu_stall_frac is not None:
        return f"the GPU sat idle waiting for data {stats.effective_stall_frac:.1%} of the time"
    return f"training waited for data {stats.stall_frac:.1%} of the time"


def diagnose(
    trials: Sequence[Trial],
    settled: LoaderSettings,
    budget: Budget,
    policy: Policy = Policy(),
    held: Decision | None = None,
) -> str:
    """One sentence that says what bounds training, for the summary and the report. ``held``: the ``"hold"``
    decision that stopped tuning for the rest of the run, if one did (said at the end)."""
    text = diagnosed(trials, settled, budget, policy, held is not None)[1]
    text += memory_diagnosis(trials, budget, policy)
    if held is None:
        return text
    return (
        f"{text} Tuning stopped for this run: {held.reason}; a longer or resumed run goes on to "
        f"{held.settings.describe()}."
    )


def memory_diagnosis(trials: Sequence[Trial], budget: Budget, policy: Policy = Policy()) -> str:
    """A sentence on the workers' memory when a config went over the budget (``""`` otherwise): the cause, the
    measured size and growth, and the fix."""
    over = [t for t in trials if t.rule == "over_memory_budget"]
    if not over or budget.memory_bytes is None:
        return ""
    mem, _ = worker_memory(trials, policy)
    last = over[-1]
    life = life_batches(last.settings, last.stats.epoch_batches)
    return (
        f" Memory: {last.settings.describe()} went {last.failed} and was left at once: "
        f"{memory.describe_growth(mem, life, last.settings.num_workers)}. {_memory_cause(mem)} {_MEMORY_FIX}; "
        "then more workers fit."
    )


_MEMORY_FIX = (
    "Keep the data in numpy arrays or tensors instead of lists of Python objects, memory-map files, load "
    "lazily in `__getitem__`, or call `gc.freeze()` just before `fit` so that garbage collections stop copying "
    "the training process's objects into every worker"
)


def _memory_cause(mem: WorkerMemory) -> str:
    if mem.growth_bytes > 0:
        return (
            "Each worker makes its own copy of the dataset's Python objects as it reads them (copy-on-read), or "
            "keeps what it loaded."
        )
    return "Each worker holds its own copy of the dataset's objects."


class Reading:
    """What the diagnoses read (see :data:`DIAGNOSES`): the trials, the settled config, and the window quoted (the
    settled config's last one, else the last measured)."""

    def __init__(
        self, trials: Sequence[Trial], settled: LoaderSettings, budget: Budget, policy: Policy, held: bool
    ) -> None:
        self.trials, self.settled, self.budget, self.policy, self.held = trials, settled, budget, policy, held
        self.usable = [t for t in trials if t.usable]
        self.th = policy.stall_threshold
        if not self.usable:
            return
        self.start = self.usable[0]
        self.final = next((t for t in reversed(self.usable) if t.settings == settled), self.usable[-1])
        self.fs = self.final.stats
        # a settle on fewer workers than the last measured (the memory budget's prediction) quotes that window under
        # its own config's name, not under the one settled on
        self.on = settled.describe()
        if self.final.settings != settled:
            last = self.final.settings.describe()
            self.on = f"{last}, the last config measured ({settled.describe()}, settled on, was not)"
        per = self.final.sec_per_sample
        self.speedup = self.start.sec_per_sample / per if per > 0 else 1.0
        self.still = f"still {self.fs.effective_stall_frac:.0%} of the time waiting for data with {self.on}"

    @cached_property
    def est(self) -> Estimate:
        return estimate(self.usable, self.budget, self.policy)

    @cached_property
    def cap(self) -> tuple[int, Bound]:
        return worker_cap(self.est, self.budget, self.settled.prefetch_factor or 2)

    @cached_property
    def more(self) -> list[Trial]:
        """Configs with more workers than the quoted one, measured beside it."""
        return [t for t in self.usable if t.settings.num_workers > self.final.settings.num_workers]

    @cached_property
    def no_help(self) -> bool:
        """Whether every config with more workers was not ``min_gain`` faster than the quoted one."""
        per, gain = self.final.sec_per_sample, self.policy.min_gain
        return bool(self.more) and all(t.sec_per_sample >= per * (1.0 - gain) for t in self.more)


def nothing_measured_dx(r: Reading) -> str | None:
    """No window was measured: what failed, if anything."""
    if r.usable:
        return None
    failed = [t for t in r.trials if t.failed]
    if not failed:
        return "unknown: no training step was measured."
    last = failed[-1]
    running = r.settled.describe()
    return (
        f"unknown: {last.settings.describe()} failed ({last.failed}) before a window was measured; "
        f"running on {running}."
    )


def host_bound(r: Reading) -> str | None:
    """Host work between steps (logging, callbacks, copies) takes longer than the step and the wait."""
    fs = r.fs
    if not (fs.mean_other_s > max(fs.mean_step_s, fs.mean_wait_s) and fs.mean_other_s > 0.002):
        return None
    return (
        f"host-bound: {fs.mean_other_s * 1e3:.1f} ms per step go to host work between steps "
        "(logging, callbacks, host-to-device copies), more than to the step or the data wait."
    )


def transfer_bound(r: Reading) -> str | None:
    """Host-to-device copies take more of the GPU's time than the threshold, and more than its wait for data."""
    fs, copy = r.fs, r.fs.copy_frac
    if copy is None or copy <= r.th or fs.gpu_copy_s <= fs.gpu_idle_s:
        return None
    if r.settled.pin_memory:
        pinned = "the batches are already pinned"
    elif any(t.settings.pin_memory for t in r.usable):
        pinned = "pinned memory did not make it faster"
    else:
        pinned = "pinned memory was not tried"
    return (
        f"transfer-bound: host-to-device copies take {copy:.0%} of the GPU's time "
        f"({fs.gpu.mean_copy_s * 1e3:.1f} ms per step for {fs.batch_bytes / 2**20:.1f} MiB batches), "
        f"more than the wait for the loader ({fs.gpu.mean_idle_s * 1e3:.1f} ms); {pinned}. Send "
        "less: uint8 instead of float32 images, decode or augment on the GPU, or drop unused fields."
    )


def accelerator_bound(r: Reading) -> str | None:
    """The starting config already stalled within the threshold: the loader is not the bottleneck."""
    s = r.start.stats
    if s.effective_stall_frac > r.th:
        return None
    host = ""
    if s.gpu_stall_frac is not None and s.stall_frac > r.th:
        host = f" (the host waited {s.stall_frac:.0%} of the time while the GPU still worked)"
    return (
        f"accelerator-bound: {_waited(s)} with {r.start.settings.describe()}{host}; the loader is not the bottleneck."
    )


def loading_hidden(r: Reading) -> str | None:
    """Input-bound at the start, and the settled config hides the loading."""
    if r.fs.effective_stall_frac > r.th:
        return None
    return (
        f"input-bound at the start ({r.start.stats.effective_stall_frac:.0%} of the time waiting for data with "
        f"{r.start.settings.describe()}); {r.on} hides the loading "
        f"(stall {r.fs.effective_stall_frac:.1%}, {r.speedup:.1f}x the throughput)."
    )


def held_by_memory(r: Reading) -> str | None:
    """The memory budget caps the workers below the model's count."""
    (cap, bound), est, memory_bytes = r.cap, r.est, r.budget.memory_bytes
    if bound != "memory" or not cap <= r.settled.num_workers < est.needed_workers or memory_bytes is None:
        return None
    return (
        f"input-bound and held back by the memory budget: {r.still}, the model wants {est.needed_workers} workers "
        f"and {cap} fit {memory_bytes / MiB:.0f} MiB: "
        f"{memory.describe_growth(est.memory, est.mem_life_batches, max(1, cap))}. {_memory_cause(est.memory)} "
        f"{_MEMORY_FIX}, or raise `max_memory`."
    )


def held_by_shm(r: Reading) -> str | None:
    """/dev/shm caps the batches in flight below the model's count."""
    (cap, bound), est = r.cap, r.est
    if bound != "shm" or not cap <= r.settled.num_workers < est.needed_workers:
        return None
    return (
        f"input-bound and held back by {bound_words(bound, est, r.budget)}: {r.still}, the model wants "
        f"{est.needed_workers} workers. Free memory, make the dataset lighter per worker (lazy loading, numpy "
        "arrays instead of Python objects), or raise `max_memory` / the shared memory size (--shm-size, --ipc=host)."
    )


def cpu_bound(r: Reading) -> str | None:
    """The CPUs cannot produce batches as fast as the step takes them."""
    est = r.est
    if not est.cpu_bound:
        return None
    return (
        f"input-bound and CPU-bound: a batch needs {est.cpu_per_batch_s * 1e3:.1f} ms of CPU and "
        f"{r.budget.cpus:g} CPUs ({r.budget.bound_by}) cannot keep up with a {est.busy_s * 1e3:.1f} ms step "
        f"(still {r.fs.effective_stall_frac:.0%} stalled with {r.on}); make decoding cheaper, "
        "cache decoded data or give the job more CPUs."
    )


def built_sample_by_sample(r: Reading) -> str | None:
    """At 0 workers, the wait is the training process's CPU assembling batches, and workers only add copies (or a
    worker's hand-over would cost about what they hide, so none was tried)."""
    fs, settled = r.fs, r.settled
    hand = handover_s(r.usable, r.policy)
    not_tried = not r.more and settled.num_workers == 0 and fs.effective_stall_frac - hand / fs.mean_wall_s <= r.th
    if not (r.no_help or not_tried) or settled.num_workers != 0 or fs.fetch_cpu_s < 0.5 * fs.wait_s:
        return None
    if r.more:
        slower = min(r.more, key=lambda t: t.sec_per_sample)
        how = f"{slower.settings.describe()} was {slower.sec_per_sample / r.final.sec_per_sample:.1f}x slower"
    else:
        how = f"receiving a batch from a worker costs about {hand * 1e3:.1f} ms, so none was tried"
    return (
        f"input-bound by assembling batches sample by sample: {fs.effective_stall_frac:.0%} of the time goes to "
        f"building each batch in the training process ({fs.mean_wait_s * 1e3:.2f} ms of CPU per batch), and "
        f"workers only add inter-process copying ({how}). Fetch whole batches at once: give the "
        "dataset a `__getitems__(indices)` that returns a batch's samples in one call (it keeps the batch "
        "sampler, and with it in-epoch switching and exact resume); a `BatchSampler` passed as `sampler` with "
        "`batch_size=None` works too but loses them."
    )


def more_workers_did_not_help(r: Reading) -> str | None:
    """Configs with more workers were measured and were not faster: the host is saturated."""
    if not r.no_help:
        return None
    return (
        f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput), and more workers did not help: the "
        "host is saturated (CPU contention with the training process, or the storage's own limit)."
    )


def max_workers_too_low(r: Reading) -> str | None:
    """The model wants more workers than ``max_workers``."""
    if r.est.needed_workers <= r.budget.max_workers:
        return None
    return (
        f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput); the model wants {r.est.needed_workers} "
        f"workers but `max_workers` is {r.budget.max_workers}: raise it if memory allows, or cut the storage latency."
    )


def stopped_for_the_run(r: Reading) -> str | None:
    """Tuning held for the rest of the run (the hold's reason is said after)."""
    return f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput)." if r.held else None


def stall_left(r: Reading) -> str:
    """What is left, said as far as it was measured: bursty waits, the trial budget spent, or not measured."""
    fs, policy = r.fs, r.policy
    if _bursty(fs, r.est.busy_s, policy):
        cause = (
            f"waits are bursty (p90 {fs.wait_p90_s * 1e3:.1f} ms against a median of {fs.wait_p50_s * 1e3:.1f} ms): "
            "raise `max_prefetch`, or reduce the latency tail of the storage"
        )
    elif len(r.trials) >= policy.max_trials:
        cause = f"the trial budget ({policy.max_trials}) ran out: raise `max_trials`"
    else:
        cause = "its cause was not measured (the waits are not bursty and the trial budget was not spent)"
    return f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput); {cause}."


Diagnosis = Callable[[Reading], "str | None"]
# what bounds training, asked in order; the first that applies says it, else `stall_left`
DIAGNOSES: tuple[Diagnosis, ...] = (
    nothing_measured_dx,
    host_bound,
    transfer_bound,
    accelerator_bound,
    loading_hidden,
    held_by_memory,
    held_by_shm,
    cpu_bound,
    built_sample_by_sample,
    more_workers_did_not_help,
    max_workers_too_low,
    stopped_for_the_run,
)


def diagnosed(
    trials: Sequence[Trial], settled: LoaderSettings, budget: Budget, policy: Policy = Policy(), held: bool = False
) -> tuple[str, str]:
    """The diagnosis that applies (its name, see :data:`DIAGNOSES`) and its sentence."""
    r = Reading(trials, settled, budget, policy, held)
    for diagnosis in DIAGNOSES:
        text = diagnosis(r)
        if text is not None:
            return diagnosis.__name__, text
    return "stall_left", stall_left(r)


def verify_cached(entry: dict[str, Any], trial: Trial, budget: Budget, policy: Policy) -> Decision | None:
    """The first window of a cache hit: settle on the cached settings if they still hold, else ``None`` (then
    tuning goes on from them). They hold when the stall is below ``stall_threshold`` and they fit the budget
    of this run; a throughput like the cached one is not enough (a cached config that always stalled would
    pass for good). A config that settled just under the threshold measures just over it about half the
    time, so the threshold is raised by ``noise_floor`` for an entry that settled under it when this window
    keeps its throughput (within ``min_gain``): tuning would otherwise start again on noise."""
    s, settings = trial.stats, trial.settings
    limit = policy.stall_threshold
    cached_stall, cached_rate = entry.get("stall_frac"), entry.get("samples_per_s")
    if (
        isinstance(cached_stall, (int, float))
        and isinstance(cached_rate, (int, float))
        and cached_stall <= policy.stall_threshold
        and cached_rate > 0
        and s.samples_per_s >= (1 - policy.min_gain) * cached_rate
    ):
        limit += policy.noise_floor
    if not trial.usable or s.effective_stall_frac > limit:
        return None
    if settings.num_workers > budget.max_workers or (settings.prefetch_factor or 0) > budget.max_prefetch:
        return None
    if budget.memory_bytes is not None:
        flight = memory.in_flight_bytes(s.batch_bytes, settings.prefetch_factor, settings.pin_memory)
        life = life_batches(settings, s.epoch_batches)
        if memory.total_bytes(s.worker_memory, settings.num_workers, life, None, flight) > budget.memory_bytes:
            return None
    cached = entry.get("samples_per_s")
    than = f", cached {float(cached):.0f}" if isinstance(cached, (int, float)) else ""
    return Decision(
        "settle",
        settings,
        f"cached settings verified ({s.samples_per_s:.0f} samples/s{than}, stall {s.effective_stall_frac:.1%})",
        rule="cached_settings_hold",
    )
