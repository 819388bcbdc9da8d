"""The cost model: what the measured trials say of the loader (:func:`estimate`), and what the model predicts a
config does (:func:`predict`). Pure and deterministic: no torch, no I/O, no clock.

A worker needs ``P`` seconds of wall time to produce a batch, ``C`` of them on a CPU; the step is busy ``B`` seconds
when it does not wait (as in tf.data's AUTOTUNE, reduced to one stage). With ``w`` workers the loader delivers at
most ``min(w / P, cpus / C)`` batches a second, so the wait goes once ``w >= P / B`` while the CPUs can feed the
workers. Batches are handed over in order, so ``P`` is read at its 90th percentile where it was measured.

* At 0 workers, ``P`` is the training process's time to fetch a batch and ``C`` its CPU time.
* With ``w`` workers and a stall, all workers are busy, so ``P <= w * T`` (``T`` the wall time per step); ``C`` is
  the workers' CPU time per batch. The tightest bound over the history is used.

On CUDA the stall is the GPU's idle gap and ``B`` at least the GPU's time per step. The model's guesses are named
fields of :class:`Policy`; the rules that use its predictions: :mod:`~lightning_dltune.tuning.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from lightning_dltune.measurement import memory
from lightning_dltune.measurement.budget import Budget
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.measurement.memory import WorkerMemory
from lightning_dltune.settings import LoaderSettings

Action = Literal["measure", "try", "settle", "hold"]


@dataclass(frozen=True)
class Policy:
    """The search's knobs and the model's parameters; the defaults are what ``DataLoaderTuner`` uses.

    Knobs: ``stall_threshold``, ``max_trials`` and ``min_steps``, set through ``DataLoaderTuner``'s arguments of the
    same names (and so through LightningCLI). The other fields are the model's parameters: ``DataLoaderTuner`` does
    not take them; each is set by the measurements in ``docs/how-it-decides.md`` ("The model's parameters")."""

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
    # memory) before one was measured
    handover_prior_s: float = 1e-3
    shm_fraction: float = 0.5  # share of free /dev/shm that batches in flight may take
    # samples of a start-up batch loaded in the training process, timed one by one, enough to take that step as a
    # steady one (`steady_from_the_start`)
    startup_samples: int = 8
    # what a deeper prefetch is predicted to take off a bursty or held-up wait (a guess: about half), and pinned
    # memory off a host-to-device copy (pinned copies run about twice as fast)
    prefetch_absorbs: float = 0.5
    pinned_copy_saves: float = 0.5
    # a loader whose CPU time per batch is under this share of its batch time waits on I/O: the CPUs do not cap it
    io_cpu_share: float = 0.02
    # bursty waits (``burst_ratio``) count only where the slow ones (p90) take at least this share of the step
    burst_min_share: float = 0.25
    # a jump from 0 workers was sized on a longer step where the step with workers is under this share of it
    longer_step_share: float = 0.75
    # the CPU cap is tried past (twice the workers, once) where the workers used under this share of the CPUs
    cpu_used_share: float = 0.9
    # a window runs on for a possible win until this many times ``min_steps`` steps (``still_open``)
    open_windows: int = 4
    # a wait at 0 workers is the training process's CPU where its CPU time is at least this share of it
    cpu_wait_share: float = 0.5
    # host work between steps bounds training (``host_bound``) only from this much per step
    host_work_min_s: float = 2e-3
    # the training step computes on the CPUs (``workers_contend``) where it uses at least this many of them
    step_cpu_min: float = 0.5
    # under DDP a rank's window on this many times the workers its windows at 0 workers ask for, its waits even,
    # waited for no batch its workers lacked (``rules.own_need``)
    own_spare: float = 2.0


@dataclass(frozen=True)
class Trial:
    """A config and what it measured. ``failed`` says why a config could not run (it is never chosen)."""

    settings: LoaderSettings
    stats: WindowStats
    failed: str | None = None
    decision: str = ""
    rule: str = ""  # the rule that made the decision (see `RULES`), "" before one was taken
    ranks: tuple[float, ...] = ()  # each rank's stall in this window (distributed runs; ``stats`` is the most stalled)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's, a report's, the cache's): :meth:`from_dict` reads them back."""
        return {
            "settings": self.settings.to_loader_kwargs(),
            "stats": self.stats.to_dict(),
            "failed": self.failed,
            "decision": self.decision,
            "rule": self.rule,
            "ranks": list(self.ranks),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        """The trial :meth:`to_dict` wrote. One saved before rules had names (report version 2, state version 1)
        gets the memory budget's rule where its words say so (the diagnosis reads it), no rule otherwise."""
        failed = data.get("failed")
        older = "over_memory_budget" if isinstance(failed, str) and "memory budget" in failed else ""
        return cls(
            settings=LoaderSettings.from_dict(data.get("settings", {})),
            stats=WindowStats.from_dict(data.get("stats", {})),
            failed=failed,
            decision=data.get("decision", ""),
            rule=data.get("rule") or older,
            ranks=tuple(float(x) for x in data.get("ranks") or ()),
        )

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
    step_cpus: float = 0.0  # the CPUs the training process uses while it steps (:func:`step_cpus`)
    waits_on_io: bool = False  # a batch's CPU time is under ``Policy.io_cpu_share`` of its time: the CPUs set no cap

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
    whole_epoch: bool = field(default=False, compare=False)  # the next window is judged at its epoch's end, never early


def estimate(
    trials: Sequence[Trial], budget: Budget, policy: Policy = Policy(), pace_s: float | None = None
) -> Estimate:
    """Estimate batch production cost from the usable trials, the last one weighing for CPU and busy time.
    ``pace_s``: the busy time a step takes once every rank is fed, where it is shorter than this process's own
    (:attr:`~lightning_dltune.agreement.Agreement.pace`: under DDP a rank's step also holds its wait for the
    others inside the collective); used only where a batch's time was measured (a window at 0 workers, or one that
    stalled with workers): the fallback, the workers times the step, holds the same wait."""
    usable = [t for t in trials if t.usable]
    if not usable:
        raise ValueError("`trials` holds no usable measurement; measure at least one window first.")
    last = usable[-1]
    s = last.stats
    batch, sized, uncontended, measured = _batch_times(usable, policy)
    busy = busy_time(last)
    busy = min(busy, pace_s) if pace_s and measured else busy
    cpu_per_batch = (s.fetch_cpu_s if last.settings.num_workers == 0 else s.worker_cpu_s) / s.steps
    cpu_per_batch = min(cpu_per_batch, uncontended)
    # workers may use every CPU of the budget: the OS shares them with the training process (docs/how-it-decides.md)
    worker_cpus = max(1.0, budget.cpus)
    needed = math.ceil(policy.headroom * sized / busy) if busy > 0 else budget.max_workers
    on_io = cpu_per_batch <= policy.io_cpu_share * uncontended
    if not on_io:
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
        step_cpus=min(step_cpus(s), worker_cpus),  # the process's CPU time holds more than its steps: at most all
        waits_on_io=on_io,
    )
    return _with_memory_caps(est, trials, usable, budget, policy)


def busy_time(t: Trial) -> float:
    """The time per step the loader must keep up with: the host's busy time (:func:`host_busy`), or the GPU's where
    it is longer (on CUDA the consumer is the GPU: a host that only queues kernels is not what the loader must keep
    up with)."""
    return max(host_busy(t), t.stats.mean_gpu_busy_s)


# the least time a window's steps must take in all for their CPU time to read how many CPUs they use (see step_cpus)
STEP_CPU_SPAN_S = 0.05


def step_cpus(s: WindowStats) -> float:
    """The CPUs the training process uses while it steps: its CPU time during its steps over their time, where that
    was measured (``step_cpu_s``); else its CPU time over the window less what loading took in it, over its busy
    time (that also holds what is not its steps', such as forking workers); 0 where neither was measured, or where
    the time it divides by is under ``STEP_CPU_SPAN_S``: the kernel adds another thread's CPU time to the process's
    at its scheduler ticks, so a few milliseconds of steps can read several CPUs where they used none."""
    if s.step_cpu_s > 0 and s.step_s > 0:
        return s.step_cpu_s / s.step_s if s.step_s >= STEP_CPU_SPAN_S else 0.0
    busy = s.step_s + s.other_s
    if s.main_cpu_s <= 0 or busy < STEP_CPU_SPAN_S:
        return 0.0
    return max(0.0, s.main_cpu_s - s.fetch_cpu_s) / busy


def _batch_times(usable: Sequence[Trial], policy: Policy) -> tuple[float, float, float, bool]:
    """A batch's production time (the tightest bound over the history), what the workers are sized on (its 90th
    percentile where it was measured), the least time measured (what the CPUs can feed is read on it), and whether
    any window measured it (else each is the last window's workers times its step)."""
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
    return batch, sized, uncontended, bool(bounds)


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
        # up to every count measured too: a cap at the limit reads as "no more fit" (a ceiling that shrank between
        # decisions, under DDP where the share follows need, made the running workers read as outgrowing memory)
        limit = max(budget.max_workers, est.needed_workers, *(t.settings.num_workers for t in trials), 1)
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


def host_busy(t: Trial) -> float:
    """The host's busy time per step (step and other host work) the workers are sized on. At 0 workers, the least
    step where it was measured (among the steps with the window's largest batch; the median from an older cache):
    loading in the training process slows its steps, so each is an upper bound of the step with workers."""
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
    seen = [t.stats.worker_memory for t in trials if read_workers(t)]
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
        return ceiling_words(budget)
    if bound == "memory":
        return f"the memory budget ({est.worker_mem_bytes / 2**20:.0f} MiB per worker)"
    return "the CPU budget" if bound == "cpu" else "the shared memory (/dev/shm) budget"


def ceiling_words(budget: Budget) -> str:
    """The worker ceiling in words: the user's ``max_workers``, or the tuner's own (its CPUs' default, or under DDP a
    share of its node's), which a ``max_workers`` of the user's replaces."""
    if budget.users_ceiling:
        return f"max_workers={budget.max_workers}"
    return f"the tuner's ceiling of {budget.max_workers} workers (set `max_workers` to change it)"


def bursty(stats: WindowStats, busy: float, policy: Policy) -> bool:
    return stats.wait_p90_s > policy.burst_ratio * stats.wait_p50_s and stats.wait_p90_s > policy.burst_min_share * busy


def read_workers(t: Trial) -> bool:
    """Whether the trial's window read its workers' memory."""
    return t.settings.num_workers > 0 and t.stats.worker_mem_bytes > 0


def handover_s(trials: Sequence[Trial], policy: Policy = Policy()) -> float:
    """What receiving a batch from a worker costs the training process per step: the least median wait of a trial
    with workers (at most that: a config that stalls waits longer), else ``policy.handover_prior_s``. Loading in
    the training process costs no hand-over, so workers save at most the wait at 0 workers less this."""
    seen = [t.stats.wait_p50_s for t in trials if t.usable and t.settings.num_workers > 0]
    return min(seen) if seen else policy.handover_prior_s


def restart_cost_s(trials: Sequence[Trial], workers: int, policy: Policy = Policy(), behind: bool = False) -> float:
    """Predicted cost of starting a loader with ``workers`` workers: per worker, the largest measured on earlier
    trials, else ``startup_prior_s``. In the open: building it, starting its workers and its first batch
    (``startup_s``). ``behind`` (it starts in the background, or its workers are added beside the running ones):
    what earlier background starts cost beyond the old config's pace, else the building of earlier loaders
    (``build_s``)."""
    measured = [t for t in trials if t.usable and t.settings.num_workers > 0 and t.stats.startup_s > 0]
    per_worker = [t.stats.startup_s / t.settings.num_workers for t in measured]
    if behind:
        starts = [t.stats.startup_s / t.settings.num_workers for t in measured if t.stats.startup_behind]
        builds = [t.stats.build_s / t.settings.num_workers for t in measured if t.stats.build_s > 0]
        per_worker = starts or builds or per_worker
    return (max(per_worker) if per_worker else policy.startup_prior_s) * max(1, workers)


MAX_LEAD = 64  # batches a background start may overlap the running loader


def handover_lead(trials: Sequence[Trial]) -> int:
    """Batches the running loader serves while a new loader starts in the background: the running config's worker
    count ``w`` (at most :data:`MAX_LEAD`), in which each of its workers loads a batch, as each new worker does its
    first. From 0 workers (or without a window of the running config), 0: the switch takes over at once, the new
    workers loading as each starts."""
    if not trials or not trials[-1].usable:  # the running config's own window: without one, take over at once
        return 0
    workers = trials[-1].settings.num_workers
    if workers == 0 or trials[-1].stats.mean_wall_s <= 0:
        return 0
    return min(MAX_LEAD, workers)


@dataclass(frozen=True)
class Prediction:
    """What the model predicts of one config: a step's wall time and the wait left in it; what its workers and their
    batches in flight hold at the end of their life; the /dev/shm its batches in flight take; and what starting its
    loader costs the training process. Every prediction a rule makes is one of these (:func:`predict`)."""

    step_s: float
    wait_s: float
    memory_bytes: float
    shm_bytes: float
    start_s: float


def predict(
    cand: LoaderSettings,
    est: Estimate,
    trials: Sequence[Trial],
    policy: Policy = Policy(),
    base: Trial | None = None,
    in_epoch: bool = False,
    in_place: bool = False,
) -> Prediction:
    """The model's :class:`Prediction` for ``cand``, from the measured ``base`` (the last trial by default). The step:

    * pinned memory where ``base`` had none: ``base``'s step less ``policy.pinned_copy_saves`` of its copy;
    * a deeper prefetch alone: ``base``'s step less ``policy.prefetch_absorbs`` of its wait;
    * another worker count: the step's busy time (with a worker's hand-over, :func:`handover_s`, from 0 workers;
      stretched where the step and the loading need more CPU than there is, :func:`contended_s`) or the loader's
      pace (:func:`pace_s`), whichever is longer.

    ``in_epoch``, ``in_place``: where the switch is made (:func:`start_s`)."""
    base = base or trials[-1]
    s, was, w = base.stats, base.settings, cand.num_workers
    if cand.pin_memory and not was.pin_memory:
        step = s.mean_wall_s - policy.pinned_copy_saves * s.gpu.mean_copy_s
    elif was.only_prefetch_differs(cand):
        step = s.mean_wall_s - policy.prefetch_absorbs * s.mean_wait_s
    elif w == 0:
        step = est.busy_s + est.batch_s
    else:
        hand = handover_s(trials, policy) if was.num_workers == 0 else 0.0
        step = max(est.busy_s + hand, pace_s(est, base, w), contended_s(est))
    flight = memory.in_flight_bytes(est.batch_bytes, cand.prefetch_factor, cand.pin_memory)
    held = memory.total_bytes(est.memory, w, est.mem_life_batches, est.mem_ceiling_bytes or None, flight)
    return Prediction(
        step_s=step,
        wait_s=max(0.0, step - est.busy_s),
        memory_bytes=held + (est.batch_bytes if cand.pin_memory else 0.0),  # the pin thread holds one batch more
        shm_bytes=cand.batches_in_flight * est.batch_bytes,
        start_s=start_s(trials, cand, policy, in_epoch, in_place),
    )


def pace_s(est: Estimate, base: Trial, workers: int) -> float:
    """How often ``workers`` workers deliver a batch: a batch's time over the workers, or its CPU time over the CPUs
    they get, whichever is longer. They get the CPUs ``base``'s workers used, in proportion to their count, within
    the budget's (the OS shares the CPUs among runnable threads, the training process's among them); the budget's
    where ``base`` ran none."""
    if est.waits_on_io:  # the CPUs do not set its pace
        return est.batch_s / workers
    s, running = base.stats, base.settings.num_workers
    used = s.worker_cpu_s / s.wall_s if running and s.wall_s > 0 else 0.0
    cpus = min(est.worker_cpus, used * workers / running) if used > 0 else est.worker_cpus
    return max(est.batch_s / workers, est.cpu_per_batch_s / cpus)


def contended_s(est: Estimate) -> float:
    """The step's busy time where workers load beside it. A step that computes on ``step_cpus`` CPUs runs that many
    threads, rounded (1.8 CPUs: two threads, each busy most of the time; 1.05: one). One thread is slowed toward a
    fair share (all the CPU work, the step's and the loading's, over the CPUs), in the share of the CPUs it uses.
    Several run in lockstep (a parallel region waits for its slowest thread): the loading's CPU time a batch that the
    CPUs none of them needs can hold for the busy time is free; the rest lands on a CPU one of them needs (a thread's
    short idle gaps do not hold a worker's batch) and delays the step by as much, never more than the fair share
    times the threads (each thread more can stall the others once). A step that computes on no CPU is not slowed."""
    cpus, k = est.worker_cpus, min(est.step_cpus, est.worker_cpus)
    if k <= 0:
        return est.busy_s
    threads = max(1, round(k))
    fair = max(est.busy_s, (est.cpu_per_batch_s + k * est.busy_s) / cpus)
    if threads == 1:
        return est.busy_s + (fair - est.busy_s) * min(1.0, k / cpus)
    idle = max(0.0, cpus - max(k, float(threads)))
    lockstep = est.busy_s + max(0.0, est.cpu_per_batch_s - idle * est.busy_s)
    return min(lockstep, fair * threads)


def contention_eats_the_gain(est: Estimate, now_s: float, hand_s: float, min_gain: float) -> bool:
    """Whether the step stretched by workers loading beside it (:func:`contended_s`), longer than the step and a
    worker's hand-over (``hand_s``), is not ``min_gain`` shorter than the step now (``now_s``, its wall time)."""
    stretched = contended_s(est)
    return est.step_cpus > 0 and stretched > est.busy_s + hand_s and stretched >= now_s * (1 - min_gain)


def contends_in_lockstep(est: Estimate, hand_s: float) -> bool:
    """Whether the step runs threads in lockstep (two or more: one thread is slowed toward a fair share instead) and
    workers loading beside it would stretch it (:func:`contended_s` longer than the step and a worker's hand-over,
    ``hand_s``)."""
    return round(est.step_cpus) >= 2 and contended_s(est) > est.busy_s + hand_s


def ahead_config(est: Estimate, budget: Budget, cur: LoaderSettings, epoch_steps: int) -> LoaderSettings | None:
    """``cur`` with the fewest workers, at the deepest prefetch the budgets allow, whose batches in flight hold an
    epoch of ``epoch_steps`` batches (``None``: ``max_workers``, memory or /dev/shm cannot hold one). Not the CPU cap:
    workers loading ahead wait for the CPUs in turn; what counts is that they hold the epoch."""
    prefetch = max(1, budget.max_prefetch)
    workers = math.ceil(epoch_steps / prefetch)
    caps = [budget.max_workers, est.mem_cap_workers, est.shm_cap_slots and est.shm_cap_slots // prefetch]
    if workers < 1 or any(cap is not None and cap < workers for cap in caps):
        return None
    return cur.with_workers(workers).with_prefetch(prefetch)


def ahead_epoch_s(est: Estimate, epoch_steps: int) -> float:
    """An epoch's predicted time where workers load it ahead (:func:`ahead_config`): its batches are loaded in a burst
    on every CPU (their loading's CPU time over the CPUs) while the step waits, then the step runs alone. Optimistic:
    the burst still overlaps the first steps (docs/how-it-decides.md, "Loading an epoch ahead"); the trial decides."""
    return epoch_steps * (est.cpu_per_batch_s / est.worker_cpus + est.busy_s)


def start_s(
    trials: Sequence[Trial],
    cand: LoaderSettings,
    policy: Policy = Policy(),
    in_epoch: bool = False,
    in_place: bool = False,
) -> float:
    """What moving from the running config to ``cand`` costs the training process: nothing for a prefetch change
    made on the running workers (``in_place``); the added workers' start where they start beside the running ones;
    else the whole loader's start, in the background where more workers start inside an epoch (``in_epoch``, with
    a running loader to serve meanwhile) (:func:`restart_cost_s`)."""
    running = trials[-1].settings
    current = running.num_workers
    if in_place and running.only_prefetch_differs(cand):
        return 0.0
    if in_place and running.adds_workers_to(cand):
        return restart_cost_s(trials, cand.num_workers - current, policy, behind=True)
    behind = in_epoch and current < cand.num_workers and handover_lead(trials) > 0
    return restart_cost_s(trials, cand.num_workers, policy, behind)
