"""The decision: an ordered table of named rules (:data:`RULES`, then :data:`SETTLE_OVERRIDES` for a settle), each a
small function of one :class:`Situation` that decides or passes. Each rule's evidence: ``docs/how-it-decides.md``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

from lightning_dltune.measurement import memory
from lightning_dltune.measurement.memory import MiB
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.compare import as_fast, faster_by, pick_best, step_slowed
from lightning_dltune.tuning.model import (
    Bound,
    Budget,
    Decision,
    Estimate,
    Policy,
    Prediction,
    Trial,
    ahead_config,
    ahead_epoch_s,
    bound_words,
    bursty,
    busy_time,
    contended_s,
    contends_in_lockstep,
    contention_eats_the_gain,
    estimate,
    handover_s,
    life_batches,
    predict,
    read_workers,
    start_s,
    worker_cap,
    worker_memory,
)
from lightning_dltune.tuning.windows import judged_early


def enforce_memory(
    trials: Sequence[Trial], budget: Budget, policy: Policy = Policy(), tuning: bool = True
) -> Decision | None:
    """When the last window's workers (with their batches in flight) held more than the memory budget, or would
    have with what they grow before a switch down stops them (``worker_mem_lead_bytes``): go down, at once, to the
    most workers the measured size and growth predict to fit (``"try"`` while ``tuning``, else ``"settle"``); the
    config left is recorded as failed. ``None`` when within the budget. Checked by
    :meth:`~lightning_dltune.tuning.state.TuningState.decide` before :func:`decide`, in every switching phase."""
    if not trials or budget.memory_bytes is None:
        return None
    last = trials[-1]
    s, cur = last.stats, last.settings
    flight = memory.in_flight_bytes(s.batch_bytes, cur.prefetch_factor, cur.pin_memory)
    lead = s.worker_mem_lead_bytes
    if last.failed is not None or not memory.over_budget(
        s.worker_mem_total_bytes, cur.num_workers, flight, budget.memory_bytes, lead
    ):
        return None
    mem, _ = worker_memory(trials, policy)
    life = life_batches(cur, s.epoch_batches)
    ceiling = s.main_mem_bytes or None
    fit = memory.max_workers(mem, budget.memory_bytes, life, ceiling, flight, cur.num_workers - 1)
    cand = cur.with_workers(fit)
    held = s.worker_mem_total_bytes + cur.num_workers * flight
    over = f"over the memory budget ({held / MiB:.0f} MiB of {budget.memory_bytes / MiB:.0f} MiB"
    over += f", {lead / MiB:.1f} MiB more before its workers stop)" if lead > 0 else ")"
    went = "went" if held > budget.memory_bytes else "was about to go"
    reason = (
        f"{cur.describe()} {went} {over}: {memory.describe_growth(mem, life, cur.num_workers)}; "
        f"{fit} workers are predicted to fit"
    )
    return Decision("try" if tuning else "settle", cand, reason, failed=over, rule="over_memory_budget")


def stay_on_running(
    trials: Sequence[Trial],
    best: Trial,
    policy: Policy = Policy(),
    in_place: bool = False,
    remaining: int | None = None,
    in_epoch: bool = False,
) -> tuple[Trial, str, bool]:
    """The running config (the last trial) instead of ``best`` where they differ in workers or prefetch only and
    going back would restart the workers for no measured gain (it is as fast within noise) or for less than the
    restart costs over the ``remaining`` steps (:func:`_wasted`). Not where ``best`` is a start at 0 workers (leaving
    it needs a measured win, :func:`pick_best`), nor where going back changes only the prefetch on the running workers
    (``in_place``). Returns the config to run on, why it stays ("" where it does not), and whether only for the steps
    left (then ``best`` is the result a longer run goes on to: a hold)."""
    last = trials[-1]
    user_default = best is trials[0] and best.settings.num_workers == 0
    if best is last or user_default or not last.usable or last.settings.pin_memory != best.settings.pin_memory:
        return best, "", False
    if in_place and last.settings.only_prefetch_differs(best.settings):
        return best, "", False
    fastest = min((t for t in trials if t.usable), key=lambda t: t.compared_sec_per_sample)
    if as_fast(last, fastest, policy):
        why = (
            f"{best.settings.describe()} was as fast within noise, and going back would restart the workers for nothing"
        )
        return last, why, False
    samples_per_step = last.stats.samples / last.stats.steps
    gain = (last.compared_sec_per_sample - best.compared_sec_per_sample) * samples_per_step
    cost = start_s(trials, best.settings, policy, in_epoch, in_place)
    wasted = _wasted(best.settings, gain, cost, remaining)
    return (last, f"going back to {wasted}", True) if wasted is not None else (best, "", False)


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
        epoch_steps: float | None = None,
    ) -> None:
        self.trials, self.budget, self.policy, self.remaining = trials, budget, policy, remaining_steps
        self.probed, self.in_epoch, self.in_place, self.memory_limit = probed, in_epoch, in_place, memory_limit
        finite = epoch_steps is not None and math.isfinite(epoch_steps) and epoch_steps > 0
        self.epoch = int(epoch_steps) if epoch_steps is not None and finite else None  # batches an epoch (or unknown)
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

    def predict(self, cand: LoaderSettings, base: Trial | None = None) -> Prediction:
        """The model's prediction for ``cand`` from ``base`` (the last trial) (:func:`predict`)."""
        return predict(cand, self.est, self.trials, self.policy, base, self.in_epoch, self.in_place)

    def try_(self, rule: str, cand: LoaderSettings, reason: str) -> Decision:
        """A trial of ``cand``; held where what the model predicts it saves a step, over the steps left, does not pay
        for its start (:func:`_wasted`)."""
        if (cand.prefetch_factor or 0) > self.budget.max_prefetch:  # from 0 workers: PyTorch's default 2
            cand = cand.with_prefetch(self.budget.max_prefetch)
        p = self.predict(cand)
        wasted = _wasted(cand, self.last.stats.mean_wall_s - p.step_s, p.start_s, self.remaining)
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


def config_failed(s: Situation) -> Decision | None:
    """A config that failed, or a window that measured nothing usable, is left for the best measured config (the
    starting one where none was measured)."""
    last = s.last
    if last.failed is None and s.usable:
        return None
    if not s.usable:
        failed = f" ({last.settings.describe()} failed: {last.failed})" if last.failed else ""
        reason = f"no config could be measured{failed}; keeping the starting config"
        return Decision("settle", s.trials[0].settings, reason, rule="config_failed")
    reason = f"{last.settings.describe()} failed ({last.failed})"
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


def loaded_ahead_paid(s: Situation) -> Decision | None:
    """A trial that loaded its epoch ahead (:func:`load_epoch_ahead`) and paid (:func:`change_did_not_pay` passed)
    settles on it: more workers or deeper prefetch would load the same epoch ahead again."""
    if len(s.trials) < 2 or s.trials[-2].rule != "load_epoch_ahead" or s.picked is not s.last:
        return None
    prev = s.trials[-2]
    return s.settle(
        "loaded_ahead_paid",
        f"loading the epoch ahead took {s.last.compared_sec_per_sample * 1e3:.2f} ms a sample against "
        f"{prev.compared_sec_per_sample * 1e3:.2f} ms with {prev.settings.describe()}",
    )


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
    if not bursty(last.stats, est.busy_s, s.policy):
        return None
    return s.try_(
        "bursty_waits",
        s.deeper,
        f"waits are bursty (p90 {last.stats.wait_p90_s * 1e3:.1f} ms vs median {last.stats.wait_p50_s * 1e3:.1f} ms): "
        "deeper prefetch",
    )


def past_the_cpu_cap(s: Situation) -> Decision | None:
    """Where the CPU budget alone stops the model and the workers used under ``cpu_used_share`` of the CPUs, twice
    the workers are tried once (:func:`_past_the_cpu_cap`)."""
    if s.sized > s.w:
        return None
    past = _past_the_cpu_cap(s.trials, s.est, s.budget, s.cap[1], s.policy)
    if past is None:
        return None
    cand, used = past
    est = s.est
    return s.try_(
        "past_the_cpu_cap",
        cand,
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
        f"{s.w} workers load a batch every {est.batch_s / s.w * 1e3:.1f} ms on average and the step takes "
        f"{est.busy_s * 1e3:.1f} ms ({why}), yet training waited {s.stall:.0%} of the time: slow batches hold up "
        "the hand-over; deeper prefetch",
    )


def no_more_workers(s: Situation) -> Decision | None:
    """Where the budgets or the model ask for no more workers than run, or for a count already measured, it
    settles."""
    if s.sized > s.w:
        cand = s.cur.with_workers(_measure_memory_first(s.est, s.budget, s.w, s.sized) or s.sized)
        if cand not in s.tried:
            return None
        return s.settle("no_more_workers", f"{cand.describe()} was already measured")
    why = bound_words(s.cap[1], s.est, s.budget)
    if s.est.needed_workers <= s.w:
        why = "the model (the wait is not from too few workers)"
    return s.settle("no_more_workers", f"no more workers to add within {why}")


def workers_would_contend(s: Situation) -> Decision | None:
    """From 0 workers, where the step computes on the CPUs the workers would load on, and stretched by the loading
    its idle CPUs cannot hold (:func:`~.model.contended_s`) it is not ``min_gain`` faster than now: settle without a
    trial (with workers running, what more of them do is measured)."""
    now = s.last.stats.mean_wall_s
    if s.w != 0 or s.w >= s.sized or now <= 0 or not contention_eats_the_gain(s.est, now, s.hand, s.policy.min_gain):
        return None
    cand = s.cur.with_workers(s.sized)
    return s.settle(
        "workers_would_contend",
        f"the step computes on {s.est.step_cpus:.1f} of the {s.est.worker_cpus:g} CPUs and loading a batch takes "
        f"{s.est.cpu_per_batch_s * 1e3:.1f} ms of CPU: with {cand.describe()} the step is predicted to take "
        f"{contended_s(s.est) * 1e3:.1f} ms against {now * 1e3:.1f} ms now, not {s.policy.min_gain:.0%} faster",
    )


def load_epoch_ahead(s: Situation) -> Decision | None:
    """Where workers contend with a step that computes on the CPUs in lockstep (two threads or more): predicted from 0
    workers, as :func:`workers_would_contend` reads it, or measured (the last trial's workers slowed the step beyond
    noise, :func:`~.compare.step_slowed`), but the budgets hold an epoch in flight (:func:`~.model.ahead_config`):
    those workers load it in a burst at its start, while the step waits, and the step then runs alone. Tried where
    the epoch is predicted ``min_gain`` faster than the best config measured (:func:`~.model.ahead_epoch_s`, from
    the 0 workers' window), judged on its whole epoch at the epoch's end (:func:`~.windows.whole_epoch`); seamless
    epochs are off for it."""
    zero = next((t for t in s.usable if t.settings.num_workers == 0), None)  # the step alone, and the loading's CPU
    if s.epoch is None or zero is None or zero.stats.mean_wall_s <= 0 or s.probed:
        return None
    est, now = estimate([zero], s.budget, s.policy), s.picked.stats.mean_wall_s
    if round(est.step_cpus) < 2:  # a step on one thread is slowed toward a fair share, not in lockstep
        return None
    if s.w == 0:  # the better of staying and steady workers, the step stretched by the loading beside it
        if not contends_in_lockstep(est, s.hand):
            return None
        now = min(now, contended_s(est))
    elif not step_slowed(zero, s.last, s.policy):
        return None
    cand = ahead_config(s.est, s.budget, zero.settings, s.epoch)  # the memory caps read every window
    if cand is None or cand in s.tried:
        return None
    p = s.predict(cand)
    if not _fits(p, s.est, cand, s.budget, s.policy):
        return None
    epoch_s = ahead_epoch_s(est, s.epoch)
    if epoch_s > (1 - s.policy.min_gain) * s.epoch * now:
        return None
    seen = "would contend with the step" if s.w == 0 else f"contend with the step ({s.cur.describe()} slowed it)"
    reason = (
        f"workers {seen}, which computes on {est.step_cpus:.1f} of the {est.worker_cpus:g} CPUs; "
        f"{cand.describe()} hold the epoch's {s.epoch} batches in flight: loaded ahead, an epoch is predicted to "
        f"take {epoch_s:.2f} s against {s.epoch * now:.2f} s without it"
    )
    wasted = _wasted(cand, now - epoch_s / s.epoch, p.start_s, s.remaining)
    if wasted:
        return Decision("hold", cand, wasted, rule="start_costs_more")
    return Decision("try", cand, reason, rule="load_epoch_ahead", whole_epoch=True)


def _fits(p: Prediction, est: Estimate, cand: LoaderSettings, budget: Budget, policy: Policy) -> bool:
    """Whether ``cand``'s workers and their batches in flight fit the /dev/shm and memory budgets: as predicted once a
    worker's memory was read, before that only if each came to hold what the training process holds."""
    if budget.shm_bytes is not None and p.shm_bytes > policy.shm_fraction * budget.shm_bytes:
        return False
    if budget.memory_bytes is None:
        return True
    if not est.mem_measured and est.mem_ceiling_bytes > 0:
        flight = memory.in_flight_bytes(est.batch_bytes, cand.prefetch_factor, cand.pin_memory)
        return cand.num_workers <= memory.safe_workers(est.mem_ceiling_bytes, budget.memory_bytes, flight)
    return p.memory_bytes <= budget.memory_bytes


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
    decision = s.try_(
        "jump_to_the_model",
        s.cur.with_workers(target),
        f"a batch takes {est.batch_s * 1e3:.1f} ms to load{_slowest(est)} and the step {est.busy_s * 1e3:.1f} "
        f"ms: {est.needed_workers} workers hide it{limit}",
    )
    return replace(decision, probe_memory=first is not None)


Rule = Callable[[Situation], "Decision | None"]


# the rules that judge a window, in the order they are asked; the first that decides makes the decision
RULES: tuple[Rule, ...] = (
    too_few_steps,
    config_failed,
    stall_below_threshold,
    trials_spent,
    load_epoch_ahead,
    change_did_not_pay,
    loaded_ahead_paid,
    running_outgrows_memory,
    handover_eats_the_gain,
    bursty_waits,
    past_the_cpu_cap,
    slow_batches_hold_up,
    no_more_workers,
    workers_would_contend,
    jump_to_the_model,
)


# the rules whose settle lands where it does whatever follows (the others' pass through SETTLE_OVERRIDES)
FINAL = frozenset(rule.__name__ for rule in (config_failed, running_outgrows_memory))


# --- what a settle becomes: each returns another decision or passes -------------------------------------------------
def settle_within_memory(s: Situation, settle: Decision) -> Decision | None:
    """Never settle on workers predicted to outgrow the memory budget, whatever made the tuner settle."""
    best = s.staying[0]
    if s.budget.memory_bytes is None or best.settings.num_workers == 0 or not any(map(read_workers, s.trials)):
        return None
    outgrown = _outgrown(s.est, best.settings, s.budget)
    return None if outgrown is None else replace(outgrown, rule="settle_within_memory")


def pinned_memory_first(s: Situation, settle: Decision) -> Decision | None:
    """Before settling, try pinned memory where host-to-device copies take a share of the GPU's time."""
    best = s.staying[0]
    cand = None if len(s.trials) >= s.policy.max_trials else _pin_candidate(s.trials, best, s.policy)
    if cand is None:
        return None
    p = s.predict(cand, base=best)
    if s.budget.memory_bytes is not None and p.memory_bytes > s.budget.memory_bytes:
        return None
    if _wasted(cand, best.stats.mean_wall_s - p.step_s, p.start_s, s.remaining):
        return None
    stats = best.stats
    reason = (
        f"host-to-device copies take {stats.copy_frac:.0%} of the GPU's time ({stats.gpu.mean_copy_s * 1e3:.1f} ms "
        "per step): pinned memory"
    )
    return Decision("try", cand, reason, rule="pinned_memory_first")


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
    epoch_steps: float | None = None,
) -> Decision:
    """What to do after the last trial: keep measuring it, try another config, settle, or hold. The first of
    :data:`RULES` that decides makes the decision (its name is ``Decision.rule``); a settle then passes through
    :data:`SETTLE_OVERRIDES`, unless its rule is :data:`FINAL`.

    ``probed``: the last trial was a smaller config tried to read its workers' memory before a far jump (see
    ``Decision.probe_memory``); it was not expected to pay, so it not paying does not settle.
    ``remaining_steps`` (``None``: unknown): training steps left. A config is tried only where the time it is
    predicted to save over them exceeds what starting its loader costs (``Prediction.start_s``); otherwise the
    decision is ``"hold"``: stay on the current config for the rest of this run, with the config that would be
    tried next in ``settings``. ``in_epoch``: the switch would happen inside an epoch on one process, where more
    workers start in the background. ``in_place``: a change of ``prefetch_factor`` alone is made on the running
    workers, and more workers start beside them. ``memory_limit``: see :func:`pick_best`. ``epoch_steps``: batches an
    epoch (``None`` or infinite: unknown).

    Raises:
        ValueError: if ``trials`` is empty.
    """
    if not trials:
        raise ValueError("`trials` is empty; measure the starting config first.")
    s = Situation(trials, budget, policy, remaining_steps, probed, in_epoch, in_place, memory_limit, epoch_steps)
    decision = next(d for d in map(lambda rule: rule(s), RULES) if d is not None)
    if decision.action != "settle" or decision.rule in FINAL:
        return decision
    return next((d for d in (o(s, decision) for o in SETTLE_OVERRIDES) if d is not None), decision)


def _past_the_cpu_cap(
    trials: Sequence[Trial], est: Estimate, budget: Budget, bound: Bound, policy: Policy
) -> tuple[LoaderSettings, float] | None:
    """Twice the workers (within the other budgets), once, right after the jump from 0 workers, where the CPU budget
    alone stops the model at the running count and the workers used under ``cpu_used_share`` of the CPUs: the OS
    shares the CPUs with the training process, so more workers get more of them. With the CPUs they used."""
    last = trials[-1]
    cur, s = last.settings, last.stats
    w = cur.num_workers
    if w == 0 or bound != "cpu" or est.needed_workers <= w or s.wall_s <= 0:
        return None
    if len(trials) < 2 or any(t.settings.num_workers > 0 for t in trials[:-1]):  # once, after the jump from 0
        return None
    used = s.worker_cpu_s / s.wall_s
    if used <= 0 or used >= policy.cpu_used_share * est.worker_cpus:
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


def own_need(trials: Sequence[Trial], budget: Budget, policy: Policy = Policy(), pace_s: float | None = None) -> int:
    """The workers one rank's own windows ask for: the model's count within the budgets (as the jump sizes it), at
    least one; sized to keep up with ``pace_s`` where it is shorter than the rank's own busy time (see
    :func:`~lightning_dltune.tuning.model.estimate`). A window with workers that served no more steps than it has
    workers is left out where another remains: each of its batches was a worker's first, so it measured how fast they
    start, not how fast they load (on the agreed config, sized for the neediest rank, every rank starts its workers at
    once). So is one on ``policy.own_spare`` times the workers this rank's windows at 0 workers ask for or more, where
    its waits were even (not :func:`~lightning_dltune.tuning.model.bursty`): twice the workers a batch's time needs,
    waiting alike at every step, waited to receive batches and for the CPUs the agreed config's workers share, not for
    a batch they lacked (slow batches that the few steps at 0 workers missed show as uneven waits). The count is
    applied without a window that tries it."""
    usable = [t for t in trials if t.usable]
    if not usable:
        return 1
    steady = [t for t in usable if t.stats.steps > t.settings.num_workers]
    usable = steady or usable
    alone = [t for t in usable if t.settings.num_workers == 0]
    if alone and len(alone) < len(usable):
        spare = policy.own_spare * _model_count(alone, budget, policy, pace_s)
        usable = [t for t in usable if t.settings.num_workers < spare or bursty(t.stats, busy_time(t), policy)]
    return _model_count(usable, budget, policy, pace_s)


def _model_count(usable: Sequence[Trial], budget: Budget, policy: Policy, pace_s: float | None) -> int:
    """The model's worker count on ``usable`` windows within the budgets (as the jump sizes it), at least one."""
    est = estimate(usable, budget, policy, pace_s)
    return max(1, min(worker_cap(est, budget, usable[-1].settings.prefetch_factor or 2)[0], est.needed_workers))


def _wasted(cand: LoaderSettings, gain_s: float, start_cost_s: float, remaining: int | None) -> str | None:
    """Why switching to ``cand`` would not pay: what it saves a step over the ``remaining`` steps is not more than its
    start costs (``None`` when it would pay, or when the run's length is unknown)."""
    if remaining is None:
        return None
    saved = max(0.0, gain_s) * remaining
    if saved > start_cost_s:
        return None
    return (
        f"{cand.describe()} would save about {saved:.2f} s over the {remaining} steps left, less than the "
        f"{start_cost_s:.2f} s its loader takes to start"
    )


def _pin_candidate(trials: Sequence[Trial], best: Trial, policy: Policy) -> LoaderSettings | None:
    """``best`` with ``pin_memory=True`` where host-to-device copies take more than ``stall_threshold`` of the GPU's
    time and it was not measured yet."""
    copy = best.stats.copy_frac
    if copy is None or copy <= policy.stall_threshold or best.settings.pin_memory:
        return None
    cand = replace(best.settings, pin_memory=True)
    # tried already, persistent or not (a loader Lightning reloads gets pinned memory without persistent workers)
    same = (cand.num_workers, cand.prefetch_factor, True)
    if any((t.settings.num_workers, t.settings.prefetch_factor, t.settings.pin_memory) == same for t in trials):
        return None
    return cand


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
    if budget.memory_bytes is not None:  # what this window's workers were read to hold (no prior: a reading)
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
