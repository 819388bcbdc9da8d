"""Agreement across ranks: every collective the tuner makes, in one place, with tensors on the strategy's device.

Each rank measures its own windows; at a decision point :meth:`Agreement.decide` gathers every rank's window
statistics and budget in one ``all_gather``, takes the statistics of the rank that waited most for data (ranks run
in lockstep, so their wall times are alike: the wait is what differs) and the tightest node's budget,
decides on them and broadcasts rank 0's decision, so every rank changes its loader at the same step. NCCL only
takes tensors on the GPU: every tensor is made on ``strategy.root_device``. In a single process nothing is sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Budget, Decision, Policy, Trial
from lightning_dltune.tuning.rules import own_need

T = TypeVar("T")
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(WindowStats))
_INT_FIELDS = ("steps", "samples", "gpu_steps", "startup_behind", "startup_samples", "startup_step_samples")
# memory is held per node: the rank whose workers hold the most decides (not the slowest rank's)
_MAX_FIELDS = (
    "worker_mem_bytes",
    "worker_mem_total_bytes",
    "worker_mem_base_bytes",
    "worker_mem_growth_bytes",
    "worker_mem_jump_bytes",
    "worker_mem_saturation",
    "worker_mem_lead_bytes",
    "main_mem_bytes",
    "batch_bytes",
)


class Agreement:
    """The collectives of one ``fit``, over ``strategy`` (anything with ``world_size``, ``root_device``,
    ``all_gather``, ``broadcast`` and ``reduce``, as Lightning's strategies have).

    Attributes:
        budget: the budget last agreed on (the tightest node's), ``None`` before the first decision.
        stall_spread: max minus min stall fraction across ranks at the last decision or log step.
        rank_stalls: each rank's stall fraction at the last decision or log step (empty in a single process).
        own: this rank's own windows (its settings, its statistics), before the ranks' are reduced to one.
        widest: the widest spread of the ranks' stalls at a decision on the train loader.
        rank_workers: each rank's worker count once each runs its own (:meth:`own_settings`; empty before).
        alike: why every rank runs the agreed settings, where they must (``None``: they need not, or did not differ).
    """

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy
        self.budget: Budget | None = None
        self.rank_stalls: list[float] = []
        self.failures: list[LoaderSettings] = []
        self.own: list[Trial] = []
        self.rank_workers: list[int] = []
        self.alike: str | None = None
        self.widest = 0.0

    @property
    def distributed(self) -> bool:
        return self.strategy is not None and int(getattr(self.strategy, "world_size", 1)) > 1

    def _tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.strategy.root_device)

    def decide(
        self,
        stats: WindowStats,
        budget: Budget,
        choose: Callable[[WindowStats, Budget, list[LoaderSettings]], T],
        failed: LoaderSettings | None = None,
        running: LoaderSettings | None = None,
    ) -> tuple[WindowStats, Budget, T]:
        """``choose`` on the most stalled rank's ``stats``, the tightest ``budget`` and every rank's ``failed`` config
        (one that failed on that rank alone since the last decision point), the same on every rank.
        :attr:`failures` keeps the configs gathered; :attr:`own` this rank's window on ``running``."""
        if running is not None and stats.steps and self.distributed:
            self.own.append(Trial(running, stats))
        self.failures = [] if failed is None else [failed]
        if self.distributed:
            stats, budget = self._reduce(stats, budget, failed)
            if running is not None:  # the train loader's (an evaluation loop's agreement passes none)
                self.widest = max(self.widest, self.stall_spread or 0.0)
        choice = choose(stats, budget, self.failures)
        if self.distributed:  # every rank must switch at the same step; once each runs its own count, their
            choice = self.strategy.broadcast(choice, src=0)  # own choices may differ: rank zero's, None included
        return stats, budget, choice

    def _reduce(self, stats: WindowStats, budget: Budget, failed: LoaderSettings | None) -> tuple[WindowStats, Budget]:
        inf = float("inf")
        limits = [budget.cpus, float(budget.max_workers), budget.memory_bytes or inf, budget.shm_bytes or inf]
        row = [float(getattr(stats, f)) for f in _STATS_FIELDS] + limits + _encode(failed)
        table = self.strategy.all_gather(self._tensor(row)).reshape(-1, len(row)).cpu()
        col = _STATS_FIELDS.index
        stall = table[:, col("wait_s")] / table[:, col("wall_s")].clamp(min=1e-9)
        stalled = table[int(stall.argmax())].tolist()
        values: dict[str, Any] = dict(zip(_STATS_FIELDS, stalled[: len(_STATS_FIELDS)], strict=True))
        for name in _INT_FIELDS:
            values[name] = int(values[name])
        for name in _MAX_FIELDS:
            values[name] = float(table[:, col(name)].max())
        self.rank_stalls = [float(x) for x in stall]
        n = len(_STATS_FIELDS)
        tightest = table[:, n : n + 4].min(dim=0).values.tolist()
        self.failures = list(dict.fromkeys(f for r in table[:, n + 4 :].tolist() if (f := _decode(r)) is not None))
        self.budget = dataclasses.replace(
            budget,
            cpus=tightest[0],
            max_workers=int(tightest[1]),
            bound_by=budget.bound_by + " (tightest node)",
            memory_bytes=None if tightest[2] == inf else tightest[2],
            shm_bytes=None if tightest[3] == inf else tightest[3],
        )
        return WindowStats(**values), self.budget

    def own_settings(
        self, agreed: LoaderSettings, running: LoaderSettings, need: int, alike: str | None, threshold: float
    ) -> tuple[LoaderSettings, bool]:
        """This rank's settings once tuning ended on ``agreed``, and whether any rank's settings change: fewer
        workers where its own windows ask for fewer (``need``, :func:`~lightning_dltune.tuning.rules.own_need`) and
        the ranks' stalls differed by more than ``threshold`` in some window (:attr:`widest`); ``agreed`` where the
        loader needs every rank alike (``alike``, the reason, kept in :attr:`alike`) or the ranks never differed.
        Called by every rank at the same decision: each rank's count is gathered (:attr:`rank_workers`)."""
        differ = self.widest > threshold
        mine = agreed
        if alike is None and differ and agreed.num_workers > 0 and need < agreed.num_workers:
            mine = agreed.with_workers(need)
        self.alike = alike if differ else None
        row = self._tensor([float(mine.num_workers), float(mine != running)])
        table = self.strategy.all_gather(row).reshape(-1, 2).cpu()
        self.rank_workers = [int(x) for x in table[:, 0].tolist()]
        return mine, bool(table[:, 1].any())

    def own_change(
        self,
        change: Decision | None,
        ended: bool,
        running: LoaderSettings | None,
        budget: Budget,
        policy: Policy,
        alike: str | None,
    ) -> tuple[LoaderSettings | None, bool]:
        """The settings this rank switches to after an agreed decision (``change``: its loader change, if any;
        ``ended``: tuning ended with it), and whether every rank must reload (after a failure, or where some rank's
        settings change: Lightning's reload waits for them all). Once tuning ended each rank runs its own count
        (:meth:`own_settings`, from its own windows, :attr:`own`), its running settings where no rank changes;
        ``None`` while tuning goes on without a loader change."""
        default = (None if change is None else change.settings), bool(self.failures)
        agreed = running if change is None else change.settings
        if not self.distributed or self.failures or not ended or agreed is None or running is None:
            return default
        need = own_need(self.own, budget, policy)
        mine, anyone = self.own_settings(agreed, running, need, alike, policy.stall_threshold)
        return mine, anyone  # no rank changing: ``mine`` is the running settings, and nothing is rebuilt

    def resumed(self, agreed: LoaderSettings | None, counts: list[int]) -> LoaderSettings | None:
        """This rank's settings on resume: ``agreed`` with its own count of ``counts`` (every rank's, from the
        checkpoint rank zero saved), where the world has as many ranks as then."""
        rank, world = int(getattr(self.strategy, "global_rank", 0)), len(counts)
        if agreed is None or not self.distributed or world != int(self.strategy.world_size) or agreed.num_workers <= 0:
            return agreed
        self.rank_workers = list(counts)
        return agreed.with_workers(counts[rank]) if counts[rank] != agreed.num_workers else agreed

    def report(self) -> dict[str, Any]:
        """The report's part: the agreed budget, the ranks' stall spread, each rank's own workers and why not."""
        agreed = None if self.budget is None else dataclasses.asdict(self.budget)
        return {
            "agreed_budget": agreed,
            "stall_frac_spread": self.stall_spread,
            "rank_workers": self.rank_workers,
            "ranks_alike": self.alike,
        }

    def same_start(self, key: str, choice: T | None) -> T | None:
        """Rank 0's ``choice`` (a cache hit) on every rank, if every rank's ``key`` is the same; else ``None``
        everywhere: ranks that start on different configs would reload at different times and wait forever."""
        if not self.distributed:
            return choice
        digest = int.from_bytes(hashlib.sha1(key.encode()).digest()[:7], "big")
        keys = self.strategy.all_gather(torch.tensor([digest], dtype=torch.int64, device=self.strategy.root_device))
        if bool((keys != keys.reshape(-1)[0]).any()):
            return None
        return self.strategy.broadcast(choice, src=0)

    def largest(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        if not self.distributed:
            return value
        return float(self.strategy.reduce(self._tensor([value]), reduce_op="max").item())

    def spread(self, stall: float) -> float | None:
        """Max minus min of ``stall`` over the ranks (``None`` in a single process); kept in ``stall_spread``, and
        every rank's in ``rank_stalls``."""
        if self.distributed:
            self.rank_stalls = [float(x) for x in self.strategy.all_gather(self._tensor([stall])).reshape(-1)]
        return self.stall_spread

    @property
    def stall_spread(self) -> float | None:
        """Max minus min of :attr:`rank_stalls` (``None`` before they were gathered, and in a single process)."""
        return max(self.rank_stalls) - min(self.rank_stalls) if self.rank_stalls else None


def _encode(settings: LoaderSettings | None) -> list[float]:
    if settings is None:
        return [-1.0, 0.0, 0.0, 0.0]
    s = settings
    return [float(s.num_workers), float(s.prefetch_factor or 0), float(s.pin_memory), float(s.persistent_workers)]


def _decode(row: list[float]) -> LoaderSettings | None:
    workers, prefetch, pin, persistent = row
    if workers < 0:
        return None
    return LoaderSettings.normalized(int(workers), int(prefetch) or None, bool(pin), bool(persistent))
