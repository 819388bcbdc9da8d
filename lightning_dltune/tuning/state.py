"""The tuning state: phase, trials, settings and result, advanced by observations. No torch, no lightning, no clock.

:class:`TuningState` is what the tuner knows and decides. The callback feeds it one window at a time::

    decision = state.decide(stats, budget, remaining_steps)   # pure: what to do after this window
    decision = agree(decision)                                  # the same on every rank
    state.apply(decision, stats, step)                          # record the trial, change phase and target

and asks it, when a worker dies, which config to fall back to (:meth:`TuningState.fail`). It saves itself as
primitives (:meth:`TuningState.state_dict`) and gives the report its content (:meth:`TuningState.report_content`).

:class:`WindowPlan` says when a window closes: at the epoch's end, every ``window_steps`` inside long epochs, or
as soon as the loader is plainly the bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from lightning_dltune.measurement import memory
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.compare import pick_best
from lightning_dltune.tuning.diagnose import diagnosis
from lightning_dltune.tuning.model import Budget, Decision, Policy, Trial, handover_lead, worker_memory
from lightning_dltune.tuning.rules import decide, enforce_memory, verify_cached
from lightning_dltune.tuning.windows import (
    RUNS_ON,
    judged_early,
    plainly_input_bound,
    steady_from_the_start,
    still_open,
    whole_epoch,
)

STATE_VERSION = 2  # 2: each trial's "rule"
MAX_RECOVERIES = 3
_LONG_EPOCH_S = 60.0


class Phase(str, Enum):
    """Where tuning stands. A ``str`` enum: ``state.phase == "settled"`` reads as it says."""

    TUNING = "tuning"  # measuring and switching configs
    SETTLED = "settled"  # a config was chosen; no more switches
    HELD = "held"  # switching would not pay in the steps left: stays for this fit, plans the next config
    OBSERVING = "observing"  # ``observe_only``: measures and reports, never switches
    DISABLED = "disabled"  # the loader cannot be retuned (an IterableDataset, a foreign loader): measured only

    def __str__(self) -> str:
        return self.value


class TuningState:
    """Phase, trials, the start / current / target settings and the result of one tuner.

    Args:
        policy: the decision's knobs.
        observe_only: start (and stay) in :attr:`Phase.OBSERVING`.

    Attributes:
        phase: the :class:`Phase`.
        trials: every measured window's :class:`~lightning_dltune.tuning.model.Trial`, with the decision taken after it.
        start: the settings of the user's own loader; ``current``: of the running loader; ``target``: what the
            next loader is built with (``None``: as the user built it).
        held: the ``"hold"`` decision that stopped tuning for this fit (its ``settings`` are the plan for a
            longer or resumed run).
        best_settings, settled_step, diagnosis: the result (``None``/``""`` until tuning ends).
        cache_hit: whether this run started from cached settings.
    """

    def __init__(self, policy: Policy | None = None, observe_only: bool = False) -> None:
        self.policy = policy or Policy()
        self.observe_only = observe_only
        self.phase = Phase.OBSERVING if observe_only else Phase.TUNING
        self.trials: list[Trial] = []
        self.start: LoaderSettings | None = None
        self.current: LoaderSettings | None = None
        # Lightning reloads the loader every few epochs (`reload_dataloaders_every_n_epochs`): see `within_reloads`
        self.reloads = False
        self._target: LoaderSettings | None = None
        self.held: Decision | None = None
        self.best_settings: dict[str, Any] | None = None
        self.settled_step: int | None = None
        self.diagnosis = ""
        self.diagnosed_by = ""  # the diagnosis's name (see `diagnose.DIAGNOSES`)
        self.cache_hit = False
        self.recoveries = 0
        self.unagreed: LoaderSettings | None = None  # a config that failed on this rank, not yet agreed
        self.memory_limit: int | None = None  # the most workers the memory budget held (an earlier run's, cached)
        self.feed_limit: int | None = None  # the most workers the loader fed before one more failed (see below)
        self.rank_workers: list[int] = []  # under DDP, each rank's own count once tuning ended (Agreement.own_change)
        self._cached_entry: dict[str, Any] | None = None
        self._probing_memory = False  # the running config's window reads its workers' memory: never cut short
        self._whole_epoch = False  # the running config's window loads its epoch ahead: judged at the epoch's end
        self._ahead: LoaderSettings | None = None  # the config tried to load each epoch ahead (rules.load_epoch_ahead)
        self._budget: Budget | None = None  # the budget the last window was judged under (see undecided)

    @property
    def whole_epoch(self) -> bool:
        """Whether the running config's window loads its epoch ahead: it closes at the epoch's end, not inside it."""
        return self._whole_epoch

    def loads_ahead(self, workers: int, prefetch: int | None) -> bool:
        """Whether a loader of ``workers`` at ``prefetch`` is the config tried to load each epoch ahead in a burst at
        its start (then it does not go on into the next epoch beside this one's steps: seamless epochs are off)."""
        ahead = self._ahead
        return ahead is not None and (ahead.num_workers, ahead.prefetch_factor) == (workers, prefetch)

    @property
    def probing_memory(self) -> bool:
        """Whether the running config's window is there to read its workers' memory before a far jump."""
        return self._probing_memory

    # --- the loader ---------------------------------------------------------------------------------------------
    @property
    def switching(self) -> bool:
        """Whether loaders are (re)built with the tuner's settings: tuning, settled or held."""
        return self.phase in (Phase.TUNING, Phase.SETTLED, Phase.HELD)

    @property
    def tuning(self) -> bool:
        return self.phase is Phase.TUNING

    @property
    def done(self) -> bool:
        """Tuning ended for this fit (settled or held): windows are only logged."""
        return self.phase in (Phase.SETTLED, Phase.HELD)

    def begin_fit(self) -> None:
        """A new ``fit`` has its own length: a held run judges again."""
        if self.phase is Phase.HELD:
            self.phase, self.held = Phase.TUNING, None

    def loader_seen(self, settings: LoaderSettings) -> bool:
        """The user's loader was built with ``settings``; True the first time (the run's starting config)."""
        if self.start is not None:
            return False
        self.start = settings
        return True

    def disable(self) -> None:
        """The loader cannot be retuned: measure it only."""
        if self.phase is Phase.TUNING:
            self.phase = Phase.DISABLED

    def start_from_cache(self, settings: LoaderSettings, entry: dict[str, Any]) -> bool:
        """Start from cached ``settings``, to be verified by the first window. False when it is too late for that
        (resumed, already aimed elsewhere, or not tuning)."""
        if not self.tuning or self.target is not None or self.trials:
            return False
        self.target, self._cached_entry, self.cache_hit = settings, entry, True
        limit = entry.get("memory_limit_workers")
        if isinstance(limit, int) and limit >= 0:
            self.memory_limit = limit
        if entry.get("loads_ahead") is True:  # settled on loading each epoch ahead (rules.load_epoch_ahead)
            self._ahead, self._whole_epoch = settings, True
        return True

    @property
    def failed_configs(self) -> set[LoaderSettings]:
        """Configs that failed in this run: never chosen again."""
        return {t.settings for t in self.trials if t.failed}

    def tuner_changed_workers(self) -> bool:
        """Whether the running loader's workers are set up otherwise than the user had them."""
        cur, start = self.current, self.start
        if cur is None or start is None or cur == start:
            return False
        return cur.num_workers != start.num_workers or cur.persistent_workers != start.persistent_workers

    # --- deciding -----------------------------------------------------------------------------------------------
    def judge_early(self, stats: WindowStats, budget: Budget | None = None, on_gpu: bool = False) -> bool:
        """Whether the window so far (``stats``: the host's, on the current config) can be judged before it is full:
        a rule of :data:`~lightning_dltune.tuning.windows.JUDGED_EARLY` holds. ``on_gpu``: the GPU's idle gap is read
        only when the window closes, so only a plain stall after ``min_steps``. Never for a window that reads a
        smaller config's memory before a far jump. ``budget``: the tuner's, its worker cap lowered to the memory
        limit (``None``: never after one step)."""
        if self.current is None or not self.tuning or self._probing_memory or self._whole_epoch:
            return False
        if on_gpu:
            return stats.steps >= self.policy.min_steps and plainly_input_bound(stats, self.policy)
        limited = None if budget is None else self._within_limits(budget)
        return judged_early([*self.trials, Trial(self.current, self.judged(stats))], self.policy, limited) is not None

    def judged(self, stats: WindowStats) -> WindowStats:
        """The window ``stats`` as it is judged and recorded: at 0 workers, a start-up step whose samples show it
        steady counts as a steady one (:func:`~lightning_dltune.tuning.windows.steady_from_the_start`)."""
        if self._whole_epoch and self.tuning:
            return whole_epoch(stats)
        if self.current is None or self.current.num_workers != 0 or not self.tuning:
            return stats
        return steady_from_the_start(stats, self.policy)

    @property
    def workers_limit(self) -> int | None:
        """The most workers this run may use, as learnt in it: what the memory budget held (:attr:`memory_limit`),
        what the loader could feed (:attr:`feed_limit`); ``None`` until one is learnt."""
        limits = [limit for limit in (self.memory_limit, self.feed_limit) if limit is not None]
        return min(limits) if limits else None

    def _within_limits(self, budget: Budget) -> Budget:
        """``budget`` with its worker cap lowered to :attr:`workers_limit`, once one was learnt."""
        limit = self.workers_limit
        if limit is None:
            return budget
        return replace(budget, max_workers=max(1, min(budget.max_workers, limit)))

    def undecided(self, stats: WindowStats, distributed: bool = False) -> bool:
        """Whether the window so far (``stats``, on the current config) runs on though it has its steps: a rule of
        :data:`~lightning_dltune.tuning.windows.RUNS_ON` holds (``win_not_yet_shown`` only where judging it now would
        settle back on the start). Only while tuning, and on one process (``distributed``: every rank closes the
        window at the same step, and this test is rank-local)."""
        if distributed or self.current is None or not self.tuning or self._probing_memory or self._whole_epoch:
            return False
        trials = [*self.trials, Trial(self.current, stats)]
        runs_on = next((rule for rule in RUNS_ON if rule(trials, self.policy, self._budget)), None)
        if runs_on is None or runs_on.__name__ == still_open.__name__:
            return runs_on is not None
        if self._budget is None:
            return False
        back = self.decide(stats, self._budget, None)  # (the length left is not known here: holds are not foreseen)
        return back is not None and back.action == "settle" and back.settings == self.trials[0].settings

    def decide(
        self,
        stats: WindowStats,
        budget: Budget,
        remaining_steps: int | None,
        failed: Sequence[LoaderSettings] = (),
        in_epoch: bool = False,
        in_place: bool = False,
        epoch_steps: float | None = None,
    ) -> Decision | None:
        """What to do after a window on the current config (``None`` while observing or disabled, or once tuning
        ended). ``failed``: configs that failed on some rank since the last decision point; then every rank
        settles on the same fallback. ``in_epoch``: a switch would happen inside the epoch on one process;
        ``in_place``: a prefetch change is made on the running workers; ``epoch_steps``: batches an epoch (see
        :func:`~lightning_dltune.tuning.rules.decide`).
        Pure."""
        if failed:
            never = set(failed) | self.failed_configs
            fallback = self._fallback(never, failed[0])
            names = ", ".join(sorted({f.describe() for f in failed}))
            why = f"{names} failed on a rank: every rank falls back to the same config"
            return Decision("settle", fallback, why, rule="failed_on_a_rank")
        if self.current is None or not self.switching:
            return None
        budget = self._within_limits(budget)
        trial = Trial(self.current, self.judged(stats))
        down = enforce_memory([*self.trials, trial], budget, self.policy, tuning=self.tuning)
        if down is not None or not self.tuning:  # the memory budget is held after tuning too
            return down
        cached = self._cached_entry if not self.trials and self.target == trial.settings else None
        verified = verify_cached(cached, trial, budget, self.policy) if cached is not None else None
        run = (remaining_steps, self._probing_memory, in_epoch, in_place, self.workers_limit, epoch_steps)
        return verified or decide([*self.trials, trial], budget, self.policy, *run)

    def handover_lead(self) -> int:
        """Batches the running config serves while a new loader starts behind it (``model.handover_lead``)."""
        return handover_lead(self.trials)

    def starts_behind(
        self, change: Decision, running_bytes: float, batch_bytes: float, budget: Budget, distributed: bool = False
    ) -> bool:
        """Whether the loader of ``change`` may start in the background while the running one serves (#13): on one
        process (``distributed``: every rank switches at the step they agree on), not after a failure, it adds
        workers (a switch down, for memory or to a cheaper config, stops the old workers first), and both worker
        sets fit the memory budget together (the new ones at the base a worker was measured at, or the prior)."""
        current, settings, budget_bytes = self.current, change.settings, budget.memory_bytes
        if distributed or change.failed is not None or current is None or settings.num_workers <= current.num_workers:
            return False
        mem, _ = worker_memory(self.trials, self.policy)
        flight = memory.in_flight_bytes(batch_bytes, settings.prefetch_factor, settings.pin_memory)
        return memory.fits_beside(running_bytes, mem, settings.num_workers, flight, budget_bytes)

    @property
    def target(self) -> LoaderSettings | None:
        """The settings the next loader is built with (:meth:`within_reloads` of what was decided)."""
        return self._target

    @target.setter
    def target(self, settings: LoaderSettings | None) -> None:
        self._target = None if settings is None else self.within_reloads(settings)

    def within_reloads(self, settings: LoaderSettings) -> LoaderSettings:
        """``settings`` as the tuner builds them: where Lightning reloads the loader (:attr:`reloads`), pinned memory
        never comes with persistent workers (their pin thread's memory is not released: PyTorch issue 91252, which
        Lightning warns about), so the workers start afresh with each loader."""
        if self.reloads and settings.pin_memory and settings.persistent_workers:
            return replace(settings, persistent_workers=False)
        return settings

    def apply(
        self,
        decision: Decision | None,
        stats: WindowStats,
        budget: Budget,
        step: int,
        failed: Sequence[LoaderSettings] = (),
        ranks: Sequence[float] = (),
    ) -> Decision | None:
        """Record the window's trial with ``decision`` and act on it: a new target, settled or held. Returns the
        decision when the loader must change (``"try"``/``"settle"``), else ``None``. ``ranks``: each rank's stall in
        the window (a distributed run's; ``stats`` is the most stalled rank's), kept on the trial."""
        assert self.current is not None
        self._budget = budget
        self._cached_entry = None
        if decision is not None:
            decision = replace(decision, settings=self.within_reloads(decision.settings))
        if failed and decision is not None:  # agreed after a failure on some rank: the window mixed configs
            return self._failed_on_a_rank(decision, budget, step, failed)
        if decision is None:
            if not self.done:  # observing or disabled: the window is recorded as it was
                self.trials.append(Trial(self.current, stats, ranks=tuple(ranks)))
            return None
        text = decision_text(decision)
        judged = Trial(self.current, self.judged(stats), decision.failed, text, decision.rule, tuple(ranks))
        self.trials.append(judged)
        self._next_window(decision)
        if decision.failed is not None:  # only the memory budget fails a config by decision
            limit = decision.settings.num_workers
            self.memory_limit = limit if self.memory_limit is None else min(self.memory_limit, limit)
        if decision.action == "try":
            self.target = decision.settings
        elif decision.action == "settle":
            self.target = decision.settings
            self._stop(Phase.SETTLED, decision.settings, budget, step)
        elif decision.action == "hold":
            best = pick_best(self.trials, self.policy, self.workers_limit).settings
            self._stop(Phase.HELD, best, budget, step, held=decision)
            return None
        return decision if decision.action in ("try", "settle") else None

    def _next_window(self, decision: Decision) -> None:
        """How the next window is read: one that reads a smaller config's memory, or loads its epoch ahead, is never
        judged early (the second at its epoch's end)."""
        trying = decision.action == "try"
        self._probing_memory, self._whole_epoch = trying and decision.probe_memory, trying and decision.whole_epoch
        if self._whole_epoch:
            self._ahead = decision.settings

    def _failed_on_a_rank(
        self, decision: Decision, budget: Budget, step: int, failed: Sequence[LoaderSettings]
    ) -> Decision:
        """Record the configs that failed on some rank, and settle on the agreed fallback."""
        known = self.failed_configs
        self.trials += [
            Trial(f, WindowStats(), failed="failed on a rank") for f in dict.fromkeys(failed) if f not in known
        ]
        self.trials[-1] = replace(self.trials[-1], decision=decision_text(decision), rule=decision.rule)
        self.unagreed, self.target = None, decision.settings
        self._stop(Phase.SETTLED, decision.settings, budget, step)
        return decision

    def fail(
        self, stats: WindowStats, why: str, budget: Budget, step: int, agree_later: bool = False
    ) -> LoaderSettings | None:
        """The running config failed (``why``): record it, and return the config to fall back to (``None``: give
        up and let the error propagate). A failed config is never chosen again.

        ``agree_later`` (distributed runs): only this rank saw it, and the others are waiting in a collective of
        the step; fall back on this rank alone and keep the failure in ``unagreed`` for the next decision point,
        where every rank records it and settles on the same fallback."""
        if self.recoveries >= MAX_RECOVERIES or self.current is None:
            return None
        self.recoveries += 1
        failed = self.current
        never = self.failed_configs | {failed}
        fallback = self._fallback(never, failed)
        if agree_later:  # distributed: this rank falls back now, the phase and the trial are agreed later
            self.unagreed = self.unagreed or failed
            return fallback
        self.trials.append(Trial(failed, stats, failed=why, rule="config_failed"))
        if self.tuning or self.result == failed:  # the result may not be a config that failed
            self._stop(Phase.SETTLED, fallback, budget, step)
        self.target = fallback
        return fallback

    def fed_fewer(self, failed: LoaderSettings, why: str, fed: int) -> LoaderSettings:
        """``failed`` failed in its first batches (``why``) after ``fed`` of its workers had each served one, where a
        config of fewer workers did not fail: the loader feeds no more than ``fed`` workers (a dataset sharded by worker
        with fewer shards than workers leaves the others without any). Record it, never use more than ``fed``
        workers in this run, and go on tuning on ``fed`` workers (returned)."""
        self.trials.append(Trial(failed, WindowStats(), failed=why, rule="config_failed"))
        self.feed_limit = fed if self.feed_limit is None else min(self.feed_limit, fed)
        self.target = failed.with_workers(fed)
        return self.target

    def _fallback(self, never: set[LoaderSettings], failed: LoaderSettings) -> LoaderSettings:
        usable = [t for t in self.trials if t.usable and t.settings not in never]
        if usable:
            return pick_best(usable, self.policy, self.workers_limit).settings
        if self.start is not None and self.start not in never:
            return self.start
        return failed.with_workers(failed.num_workers // 2)

    def _stop(
        self, phase: Phase, settings: LoaderSettings, budget: Budget, step: int, held: Decision | None = None
    ) -> None:
        self.phase, self.held = phase, held
        self.settled_step = step
        self.best_settings = settings.to_loader_kwargs()
        self.diagnosed_by, self.diagnosis = diagnosis(self.trials, settings, budget, self.policy, held=held)

    @property
    def result(self) -> LoaderSettings | None:
        return None if self.best_settings is None else LoaderSettings.from_dict(self.best_settings)

    def headline(self) -> str:
        """What the tuner did, for the summary when tuning ends (and when training ends, in any phase)."""
        if self.phase is Phase.HELD and self.held is not None:
            current = self.current.describe() if self.current else "?"
            return f"stays on {current} for the rest of this run: {self.held.reason}"
        result = self.result.describe() if self.result else "?"
        if self.phase is Phase.TUNING:
            return f"had not settled when training ended; best so far {result}"
        if self.phase is Phase.OBSERVING:
            return f"observed {result} without switching (observe_only)"
        if self.phase is Phase.DISABLED:
            return f"measured {result} without switching (this loader cannot be retuned)"
        return f"settled on {result}"

    def cacheable(self) -> LoaderSettings | None:
        """The result to teach the cache: a settled config, or a held one that beat the start."""
        result = self.result
        if result is None or self.phase not in (Phase.SETTLED, Phase.HELD):
            return None
        if self.phase is Phase.HELD and result == self.start:
            return None
        return result

    def final_trial(self, settings: LoaderSettings) -> Trial | None:
        return next((t for t in reversed(self.trials) if t.settings == settings and t.usable), None)

    def finish(self, budget: Budget) -> None:
        """``fit`` ended: make sure there is a result and a diagnosis, even if tuning had not ended. When every
        config measured failed (each went over the memory budget, say), the one running at the end is the result:
        the tuner chose it as the fallback. The diagnosis speaks of the budget the latest window was judged under
        (under DDP the ranks' agreed one), and of ``budget`` where this state has judged none."""
        if self.phase is Phase.SETTLED or not self.trials:
            return
        budget = self._budget or budget
        usable = any(t.usable for t in self.trials)
        if not usable and (not self.tuning or self.current is None):
            return
        best = pick_best(self.trials, self.policy, self.workers_limit).settings if usable else self.current
        assert best is not None
        if not self.tuning or self.best_settings is None:
            self.best_settings = best.to_loader_kwargs()
        self.diagnosed_by, self.diagnosis = diagnosis(self.trials, best, budget, self.policy, held=self.held)
        if self.tuning:
            self.diagnosis += " (tuning had not settled when training ended.)"

    # --- checkpoints and the report -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        target = self.held.settings if self.held else self.target  # a held run's plan: a resumed run tries it
        return {
            "version": STATE_VERSION,
            "phase": self.phase.value,
            "trials": [t.to_dict() for t in self.trials],
            "best_settings": self.best_settings,
            "start": None if self.start is None else self.start.to_loader_kwargs(),
            "target": None if target is None else target.to_loader_kwargs(),
            "settled_step": self.settled_step,
            "diagnosis": self.diagnosis,
            "diagnosed_by": self.diagnosed_by,
            "memory_limit": self.memory_limit,
            "feed_limit": self.feed_limit,
            "rank_workers": self.rank_workers,
            "loads_ahead": None if self._ahead is None else self._ahead.to_loader_kwargs(),  # rules.load_epoch_ahead
            "whole_epoch": self._whole_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        phase = state.get("phase", Phase.TUNING.value)
        self.trials = [Trial.from_dict(t) for t in state.get("trials", [])]
        self.best_settings = state.get("best_settings")
        self.settled_step = state.get("settled_step")
        self.diagnosis = state.get("diagnosis", "")
        self.diagnosed_by = state.get("diagnosed_by", "")
        limit = state.get("memory_limit")
        self.memory_limit = limit if isinstance(limit, int) else None
        fed = state.get("feed_limit")
        self.feed_limit = fed if isinstance(fed, int) else None
        self.rank_workers = [int(n) for n in state.get("rank_workers", [])]
        start, target = state.get("start"), state.get("target")
        self.start = None if start is None else LoaderSettings.from_dict(start)
        ahead = state.get("loads_ahead")
        self._ahead, self._whole_epoch = None if ahead is None else LoaderSettings.from_dict(ahead), False
        if self.observe_only:
            return
        settled = phase == Phase.SETTLED.value and self.best_settings is not None  # settled on nothing: tune again
        self.phase = Phase.SETTLED if settled else Phase.TUNING
        if not settled:  # a run that goes on tuning tries its plan on every rank alike
            self.rank_workers, self._whole_epoch = [], bool(state.get("whole_epoch"))
        if settled and self.best_settings is not None:
            target = self.best_settings
        if target is not None:
            self.target = LoaderSettings.from_dict(target)

    def report_content(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~lightning_dltune.output.report.build_report` this state provides."""
        return {
            "trials": self.trials,
            "start": self.start,
            "settled": self.result,
            "phase": self.phase.value,
            "diagnosis": self.diagnosis,
            "diagnosed_by": self.diagnosed_by,
        }


def decision_text(decision: Decision) -> str:
    if decision.action == "try":
        return f"try {decision.settings.describe()}: {decision.reason}"
    if decision.action == "settle":
        return f"settle on {decision.settings.describe()}: {decision.reason}"
    if decision.action == "hold":
        return f"stay for the rest of this run: {decision.reason}"
    return f"keep measuring: {decision.reason}"


def batches_left(
    batches: float, max_epochs: int | None, epoch: int, done: float, max_steps: int, global_step: int, by_steps: bool
) -> int | None:
    """Training batches left in ``fit`` after ``done`` batches of epoch ``epoch`` (``None``: unbounded).
    ``by_steps``: one optimizer step per batch, so ``max_steps`` bounds the batches too."""
    if not math.isfinite(batches):
        return None
    left: float | None = None
    if max_epochs is not None and max_epochs >= 0:
        left = (max_epochs - epoch) * batches - done
    if max_steps >= 0 and by_steps:
        left = max_steps - global_step if left is None else min(left, max_steps - global_step)
    return None if left is None else max(0, int(left))


@dataclass
class WindowPlan:
    """When a measurement window closes. ``"epoch"``: at epoch ends (short epochs pooled until ``min_steps``).
    ``"in_epoch"``: every ``window_steps``. ``"auto"``: in-epoch in long epochs (``8 * window_steps`` batches, or
    a first window predicting over a minute), and at once in any epoch whose window can be judged early (see
    :meth:`TuningState.judge_early`)."""

    mode: str = "auto"
    window_steps: int = 20
    min_steps: int = 8
    in_epoch: bool = field(default=False)
    early_steps: int = Policy().early_steps  # under DDP a window is judged early only past this many steps
    whole: Callable[[], bool] = field(default=lambda: False)  # the window is judged at its epoch's end (whole_epoch)

    def epoch_started(self, resumable: bool, tuning: bool, epoch_batches: float) -> None:
        long_epoch = self.mode == "auto" and epoch_batches >= 8 * self.window_steps
        self.in_epoch = resumable and tuning and (self.mode == "in_epoch" or long_epoch or self.in_epoch)

    def close_at_epoch_end(self, steps: int, last_epoch: bool, undecided: Callable[[], bool] = lambda: False) -> bool:
        """Whether the window closes at this epoch's end: not an in-epoch window (it carries over into the next
        epoch) unless it is judged on its whole epoch (:attr:`whole`), and it has ``min_steps`` (short epochs pool
        into one window) and is not ``undecided()`` (:meth:`TuningState.undecided`, asked only then), or this is the
        last epoch."""
        return (self.whole() or not self.in_epoch) and (last_epoch or (steps >= self.min_steps and not undecided()))

    def close_in_epoch(
        self,
        steps: int,
        early: bool,
        left: float,
        any_rank: Callable[[bool], bool] | None,
        epoch_seconds: Callable[[], float],
        undecided: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Whether the window closes now, ``left`` batches before the epoch's end. ``early``: the window can be judged
        already (:meth:`TuningState.judge_early`); ``any_rank(flag)``: whether ``flag`` holds on any rank
        (``None``: one process); ``epoch_seconds`` predicts the epoch's length (called at most once a window,
        and on every rank alike); ``undecided()``: it runs on instead (:meth:`TuningState.undecided`, asked only
        of a full or plainly judged window). A window judged on its whole epoch (:attr:`whole`) never closes
        inside it. Under DDP a window is judged early only as its steps (which every rank counts alike) reach a
        power of two or a multiple of ``window_steps``, past ``early_steps`` (or from ``min_steps``, where that
        is fewer), where any rank judges it so (``early``: on the CPU one process judges from ``early_steps``
        on, the stall's confidence bound deciding; on a GPU from ``min_steps``): a rank-local test would split
        the ranks, and a few collectives a window are all the tuner adds."""
        obvious = any_rank is None and early
        if any_rank is not None and self.mode == "auto" and not self.in_epoch and left > self.min_steps:
            past = steps > self.early_steps or steps >= self.min_steps
            due = past and (steps % self.window_steps == 0 or steps & (steps - 1) == 0)
            obvious = due and any_rank(early)
        if not (steps >= self.window_steps or obvious) or self.whole() or undecided():
            return False
        if not self.in_epoch and self.mode == "auto" and left > 2 * self.window_steps:
            self.in_epoch = epoch_seconds() >= _LONG_EPOCH_S
        # long epochs switch every window; a short one once the loader is plainly the bottleneck
        return left > self.min_steps and (self.in_epoch or (self.mode == "auto" and obvious))
