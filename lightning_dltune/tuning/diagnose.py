"""What bounds training, in one sentence: the first of :data:`DIAGNOSES` that applies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

from lightning_dltune.measurement import memory
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.measurement.memory import MiB, WorkerMemory
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.compare import busy_per_step, step_slowed
from lightning_dltune.tuning.model import (
    Bound,
    Budget,
    Decision,
    Estimate,
    Policy,
    Trial,
    bound_words,
    bursty,
    ceiling_words,
    contended_s,
    contention_eats_the_gain,
    estimate,
    handover_s,
    life_batches,
    step_cpus,
    worker_cap,
    worker_memory,
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
    return diagnosis(trials, settled, budget, policy, held)[1]


def diagnosis(
    trials: Sequence[Trial],
    settled: LoaderSettings,
    budget: Budget,
    policy: Policy = Policy(),
    held: Decision | None = None,
) -> tuple[str, str]:
    """:func:`diagnose`'s sentence, with the name of the diagnosis that made it (one of :data:`DIAGNOSES`, or
    ``"stall_left"``)."""
    name, text = diagnosed(trials, settled, budget, policy, held is not None)
    text += memory_diagnosis(trials, budget, policy)
    text += failure_diagnosis(trials)
    if held is not None:
        text += (
            f" Tuning stopped for this run: {held.reason}; a longer or resumed run goes on to "
            f"{held.settings.describe()}."
        )
    return name, text


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


def failure_diagnosis(trials: Sequence[Trial]) -> str:
    """A sentence naming each config that failed in this run, and how (``""`` where none did); the memory budget's
    are :func:`memory_diagnosis`'s."""
    failed = [t for t in trials if t.failed and t.rule == "config_failed"]
    if not failed:
        return ""
    named = "; ".join(f"{t.settings.describe()} ({t.failed})" for t in failed)
    return f" Failed, and not used again: {named}."


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
    def as_fast_with_fewer(self) -> Trial | None:
        """A config with fewer workers than the quoted one that the quoted one was not ``min_gain`` faster than (the
        fastest of them), or ``None``."""
        per, gain = self.final.sec_per_sample, self.policy.min_gain
        fewer = [t for t in self.usable if t.settings.num_workers < self.final.settings.num_workers]
        alike = [t for t in fewer if per > t.sec_per_sample * (1.0 - gain)]
        return min(alike, key=lambda t: t.sec_per_sample) if alike else None

    @cached_property
    def no_help(self) -> bool:
        """Whether more workers were measured not to help: every config with more workers than the quoted one was not
        ``min_gain`` faster than it, or the quoted one was not faster than a config with fewer."""
        per, gain = self.final.sec_per_sample, self.policy.min_gain
        more_no_faster = bool(self.more) and all(t.sec_per_sample >= per * (1.0 - gain) for t in self.more)
        return more_no_faster or self.as_fast_with_fewer is not None


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
    if not (fs.mean_other_s > max(fs.mean_step_s, fs.mean_wait_s) and fs.mean_other_s > r.policy.host_work_min_s):
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


def loaded_ahead(r: Reading) -> str | None:
    """The run settled on a config tried to load each epoch ahead (``rules.load_epoch_ahead``): workers beside the
    step would contend with it, and these load the epoch while the step waits at its start."""
    i = r.trials.index(r.final) if r.final in r.trials else 0
    if i == 0 or r.trials[i - 1].rule != "load_epoch_ahead" or r.final.settings != r.settled:
        return None
    before, k = r.trials[i - 1], step_cpus(r.start.stats)
    return (
        f"CPU contention, avoided by loading ahead: the step computes on {k:.1f} of the {r.budget.cpus:g} CPUs, so "
        f"workers loading beside it would slow it; {r.on} hold {r.settled.batches_in_flight} batches in flight and "
        f"load each epoch's batches in a burst at its start, after which the step runs alone: "
        f"{r.final.compared_sec_per_sample * 1e3:.2f} ms a sample against "
        f"{before.compared_sec_per_sample * 1e3:.2f} ms with {before.settings.describe()} (stall "
        f"{r.fs.effective_stall_frac:.1%}). This holds while an epoch fits in flight; for longer epochs, "
        f"`torch.set_num_threads(n)` with n under {r.budget.cpus:g} leaves CPUs to workers."
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


def one_rank_holds_up(r: Reading) -> str | None:
    """In a distributed run, one rank waits for data beyond ``stall_threshold`` more than another: its loader holds
    every rank up (they run in lockstep and wait for it inside the all-reduce)."""
    ranks = r.final.ranks
    if len(ranks) < 2 or max(ranks) - min(ranks) <= r.th:
        return None
    most = max(range(len(ranks)), key=ranks.__getitem__)
    least = min(range(len(ranks)), key=ranks.__getitem__)
    wants = ""
    if r.est.needed_workers > r.budget.max_workers:
        wants = f"; the model wants {r.est.needed_workers} workers for it, over {ceiling_words(r.budget)}"
    return (
        f"input-bound on rank {most}: its loader holds every rank up (it waited {ranks[most]:.0%} of the time, rank "
        f"{least} {ranks[least]:.0%}, which waits for it inside the all-reduce); every rank runs on "
        f"{r.settled.describe()}{wants}. Balance the shards, or speed up rank {most}'s storage or decoding."
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


def workers_contend(r: Reading) -> str | None:
    """The training step computes on the CPUs the workers need (``step_cpu_min`` or more): a trial with workers made
    the step (its busy time, as at 0 workers) longer beyond noise, and the run settled on fewer workers; or, at 0
    workers and nothing tried, the model predicted the step stretched by the loading as long as it is now
    (``workers_would_contend``)."""
    start, settled = r.start, r.settled
    k = step_cpus(start.stats)
    if start.settings.num_workers != 0 or k < r.policy.step_cpu_min:
        return None
    cpus, busy0 = r.budget.cpus, busy_per_step(start.stats)[0]
    more = [t for t in r.more if t.settings.num_workers > settled.num_workers and step_slowed(start, t, r.policy)]
    slowed = [(t, busy_per_step(t.stats)) for t in more]
    fix = "give the job more CPUs or make loading cheaper"
    if k > 1:
        threads = f"`torch.set_num_threads(n)` with n under {cpus:g} leaves CPUs to workers"
        fix = f"{threads} (the step computes on {k:.1f}), {fix}"
    if slowed:
        t, (busy, _) = max(slowed, key=lambda tb: tb[1][0])
        what = (
            f"with {t.settings.describe()} the step took {busy / busy0:.1f}x longer ({busy * 1e3:.0f} ms against "
            f"{busy0 * 1e3:.0f} ms): workers and training share the {cpus:g} CPUs"
        )
        return f"CPU contention: {what}; {fix}."
    now, est = start.stats.mean_wall_s, r.est
    hand = handover_s(r.usable, r.policy)
    if len(r.usable) > 1 or settled.num_workers or not contention_eats_the_gain(est, now, hand, r.policy.min_gain):
        return None
    return (
        f"CPU contention expected: the step computes on {k:.1f} of the {cpus:g} CPUs, and loading a batch takes "
        f"{est.cpu_per_batch_s * 1e3:.1f} ms of CPU that the CPUs it leaves idle cannot hold: workers would slow "
        f"the step about as much as they hide ({contended_s(est) * 1e3:.0f} ms a step predicted against "
        f"{now * 1e3:.0f} ms now), so none were tried; {fix}."
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
    if not (r.no_help or not_tried) or settled.num_workers != 0 or fs.fetch_cpu_s < r.policy.cpu_wait_share * fs.wait_s:
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
    fewer, gain = r.as_fast_with_fewer, r.policy.min_gain
    if fewer is not None:
        measured = f"{r.final.settings.describe()} was not {gain:.0%} faster than {fewer.settings.describe()}"
    else:
        measured = f"{', '.join(t.settings.describe() for t in r.more)} not {gain:.0%} faster"
    return (
        f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput), and more workers did not help "
        f"({measured}): the host is saturated (CPU contention with the training process, or the storage's own "
        "limit). Make loading cheaper (decode less, cache decoded samples), give the job more CPUs, or use faster "
        "storage."
    )


def max_workers_too_low(r: Reading) -> str | None:
    """The model wants more workers than ``max_workers``."""
    if r.est.needed_workers <= r.budget.max_workers:
        return None
    return (
        f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput); the model wants {r.est.needed_workers} "
        f"workers, over {ceiling_words(r.budget)}: raise it if memory allows, or cut the storage latency."
    )


def stopped_for_the_run(r: Reading) -> str | None:
    """Tuning held for the rest of the run (the hold's reason is said after)."""
    return f"input-bound: {r.still} ({r.speedup:.1f}x the starting throughput)." if r.held else None


def stall_left(r: Reading) -> str:
    """What is left, said as far as it was measured: bursty waits, the trial budget spent, or not measured."""
    fs, policy = r.fs, r.policy
    if bursty(fs, r.est.busy_s, policy):
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
    loaded_ahead,
    loading_hidden,
    one_rank_holds_up,
    held_by_memory,
    held_by_shm,
    workers_contend,
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
