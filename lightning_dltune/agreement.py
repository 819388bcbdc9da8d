"""Agreement across ranks: every collective the tuner makes, in one place, with tensors on the strategy's device.

Each rank measures its own windows; at a decision point :meth:`Agreement.decide` gathers every rank's window
statistics and budget in one ``all_gather`` (and, where each rank's loader may follow its own need, each rank's need
sized on the job's pace in a second), takes the statistics of the rank that waited most for data (ranks run
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

from lightning_dltune.measurement.budget import MOST_WORKERS
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Budget, Decision, Policy, Trial, busy_time
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
    ``all_gather``, ``broadcast`` and ``reduce``, as Lightning's strategies have), deciding by ``policy``;
    ``why_alike()``: why the train loader needs every rank alike (``None``: it need not; see
    :func:`~lightning_dltune.switching.loader.ranks_alike`).

    Attributes:
        budget: the budget last agreed on (the tightest node's), ``None`` before the first decision.
        stall_spread: max minus min stall fraction across ranks at the last decision or log step.
        rank_stalls: each rank's stall fraction at the last decision or log step (empty in a single process).
        own: this rank's own windows (its settings, its statistics), before the ranks' are reduced to one.
        widest: the widest spread of the ranks' stalls at a decision on the train loader.
        cached_need: this rank's own count in the cache entry it started from (``None``: none).
        pace: the step every rank keeps once fed, at the last decision on the train loader where a rank measured a
            step: the least busy time of any rank (a rank's own step also holds its wait for the others inside the
            collective, so the rank that waits for no one has the shortest); each rank's own need is sized on it
            (at a decision, on the pace its first gather gave: the needs are gathered in a second).
        share: this rank's own share's worker ceiling (``max_workers`` of its budget; ``None`` before a decision).
        rank_workers: each rank's worker count once each runs its own (:meth:`own_settings`; empty before).
        alike: why every rank runs the agreed settings, where they must (``None``: they need not, or did not differ).
    """

    def __init__(
        self, strategy: Any = None, policy: Policy = Policy(), why_alike: Callable[[], str | None] = lambda: None
    ) -> None:
        self.strategy, self.policy, self.why_alike = strategy, policy, why_alike
        self.budget: Budget | None = None
        self.rank_stalls: list[float] = []
        self.failures: list[LoaderSettings] = []
        self.own: list[Trial] = []
        self.rank_workers: list[int] = []
        self.alike: str | None = None
        self.widest = 0.0
        self.pace: float | None = None
        self.cached_need: int | None = None  # this rank's own count in the cache entry it started from
        self.share: int | None = None
        self.later = False  # the latest own change waits for the epoch's end (see own_change)

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
        :attr:`failures` keeps the configs gathered; :attr:`own` this rank's window on ``running`` (the train
        loader's config: an evaluation loop's agreement passes none). Where the ranks' stalls differ by more than
        ``stall_threshold`` and they need not run alike (:attr:`why_alike`), the worker ceiling follows need: see
        :func:`own_ceilings`."""
        if running is not None and stats.steps and self.distributed:
            self.own.append(Trial(running, stats))
        if running is not None:  # the train loader's share (an evaluation loop's budget is its own)
            self.share = budget.max_workers
        self.failures = [] if failed is None else [failed]
        if self.distributed:
            pool = running is not None and self.why_alike() is None and not budget.users_ceiling
            stats, budget = self._reduce(stats, budget, failed, running, pool)
        choice = choose(stats, budget, self.failures)
        if self.distributed:  # every rank must switch at the same step; once each runs its own count, their
            choice = self.strategy.broadcast(choice, src=0)  # own choices may differ: rank zero's, None included
        return stats, budget, choice

    def _reduce(
        self,
        stats: WindowStats,
        budget: Budget,
        failed: LoaderSettings | None,
        running: LoaderSettings | None,
        pool: bool,
    ) -> tuple[WindowStats, Budget]:
        inf = float("inf")
        limits = [budget.cpus, float(budget.max_workers), budget.memory_bytes or inf, budget.shm_bytes or inf]
        node = float(getattr(self.strategy, "node_rank", 0))
        row = [float(getattr(stats, f)) for f in _STATS_FIELDS] + limits + _encode(failed) + [node, float(pool)]
        table = self.strategy.all_gather(self._tensor(row)).reshape(-1, len(row)).cpu()
        pool = bool(table[:, -1].min() > 0)  # every rank alike (a user's ceiling set on some ranks only: none pool)
        col = _STATS_FIELDS.index
        stall = table[:, col("wait_s")] / table[:, col("wall_s")].clamp(min=1e-9)
        stalled = table[int(stall.argmax())].tolist()
        values = _values(stalled[: len(_STATS_FIELDS)])
        for name in _MAX_FIELDS:
            values[name] = float(table[:, col(name)].max())
        self.rank_stalls = [float(x) for x in stall]
        n = len(_STATS_FIELDS)
        tightest = table[:, n : n + 4].min(dim=0).values.tolist()
        failures = table[:, n + 4 : n + 8].tolist()
        self.failures = list(dict.fromkeys(f for r in failures if (f := _decode(r)) is not None))
        if running is not None:  # the train loader's (an evaluation loop's agreement passes no running config)
            self.widest = max(self.widest, self.stall_spread or 0.0)
            self.pace = _pace(table[:, :n].tolist(), running) or self.pace
        if pool:  # the last column, each rank's pooling, becomes its need: sized on the pace this gather gave
            table[:, -1] = self._needs(budget)
        ceiling, bound = self._ceiling(table[:, n:], int(tightest[1]), pool)
        self.budget = dataclasses.replace(
            budget,
            cpus=tightest[0],
            max_workers=ceiling,
            bound_by=budget.bound_by + bound,
            memory_bytes=None if tightest[2] == inf else tightest[2],
            shm_bytes=None if tightest[3] == inf else tightest[3],
        )
        return WindowStats(**values), self.budget

    def _needs(self, budget: Budget) -> torch.Tensor:
        """Every rank's own need (:func:`~lightning_dltune.tuning.rules.own_need`) on :attr:`pace`, by rank."""
        need = self._tensor([float(own_need(self.own, budget, self.policy, self.pace))])
        return self.strategy.all_gather(need).reshape(-1).cpu()

    def _ceiling(self, table: torch.Tensor, tightest: int, pool: bool) -> tuple[int, str]:
        """The decision's worker ceiling, and what bounds it: the tightest rank's, or where the share follows need
        (``pool`` and the ranks' stalls differ) the largest rank's own (:func:`own_ceilings`: once tuning ends each
        rank runs its own count within its own, :func:`own_counts`). ``table``: every rank's limits, failure, node and
        need."""
        if not pool or self.widest <= self.policy.stall_threshold:
            return tightest, " (tightest node)"
        nodes, ceilings, needs = ([int(x) for x in table[:, i].tolist()] for i in (8, 1, 9))
        own = own_ceilings(nodes, ceilings, needs)
        if max(own) <= tightest:
            return tightest, " (tightest node)"
        return max(own), " (the neediest rank: its node's workers, less its neighbours' need)"

    def own_settings(
        self, agreed: LoaderSettings, running: LoaderSettings, need: int, alike: str | None, pool: bool
    ) -> tuple[LoaderSettings, bool]:
        """This rank's settings once tuning ended on ``agreed``, and whether any rank's settings change. Where the
        ranks' stalls differed by more than ``stall_threshold`` in some window (:attr:`widest`) and the loader need not
        run alike (``alike``, the reason, kept in :attr:`alike`), each rank runs its count of :func:`own_counts` from
        every rank's ``need`` (:func:`~lightning_dltune.tuning.rules.own_need`, within its own share), the share
        following need where ``pool``; else ``agreed``. Called by every rank at the same decision: every rank's count
        is kept in :attr:`rank_workers`."""
        share, node = float(self.share or agreed.num_workers), float(getattr(self.strategy, "node_rank", 0))
        row = self._tensor([float(need), node, share, running.num_workers, self.widest])
        table = self.strategy.all_gather(row).reshape(-1, 5).cpu()
        needs, nodes, shares, runs = ([int(x) for x in table[:, i].tolist()] for i in range(4))
        self.widest = float(table[:, 4].max())  # every rank's (a start from the cache primes only a rank's own)
        differ = self.widest > self.policy.stall_threshold
        self.alike = alike if differ else None
        counts = [agreed.num_workers] * len(needs)
        if alike is None and differ and agreed.num_workers > 0:
            counts = own_counts(agreed.num_workers, nodes, shares, needs, pool)
        self.rank_workers = counts
        mine = agreed.with_workers(counts[int(getattr(self.strategy, "global_rank", 0))])
        return mine, counts != runs or agreed.with_workers(running.num_workers) != running

    def own_change(
        self, change: Decision | None, ended: bool, running: LoaderSettings | None, budget: Budget
    ) -> tuple[LoaderSettings | None, bool]:
        """The settings this rank switches to after an agreed decision (``change``: its loader change, if any;
        ``ended``: tuning ended with it), and whether every rank must reload (after a failure, or where some rank's
        settings change: Lightning's reload waits for them all). Once tuning ended each rank runs its own count
        (:meth:`own_settings`, from its own windows, :attr:`own`), its running settings where no rank changes;
        ``None`` while tuning goes on without a loader change. :attr:`later`: the change waits for the epoch's end (own
        counts alone: a rank-local switch inside an epoch, then a seamless carry, left that rank an empty epoch)."""
        default = (None if change is None else change.settings), bool(self.failures)
        agreed, self.later = (running if change is None else change.settings), False
        if not self.distributed or self.failures or not ended or agreed is None or running is None:
            return default
        self.later = change is None  # own counts alone wait for the epoch's end (an agreed change is made at once)
        share = budget if self.share is None else dataclasses.replace(budget, max_workers=self.share)
        need = own_need(self.own, share, self.policy, self.pace)
        if self.cached_need is not None and all(t.settings.num_workers for t in self.own):
            need = self.cached_need  # a start from the cache measured no batch at 0 workers: its count as cached
        mine, anyone = self.own_settings(agreed, running, need, self.why_alike(), not budget.users_ceiling)
        return mine, anyone  # no rank changing: ``mine`` is the running settings, and nothing is rebuilt

    def resumed(self, agreed: LoaderSettings | None, counts: list[int]) -> LoaderSettings | None:
        """This rank's settings on resume: ``agreed`` with its own count of ``counts`` (every rank's, from the
        checkpoint rank zero saved), where the world has as many ranks as then."""
        rank, world = int(getattr(self.strategy, "global_rank", 0)), len(counts)
        if agreed is None or not self.distributed or world != int(self.strategy.world_size) or agreed.num_workers <= 0:
            return agreed
        self.rank_workers = list(counts)
        return agreed.with_workers(counts[rank]) if counts[rank] != agreed.num_workers else agreed

    def cache_extra(self) -> dict[str, Any]:
        """What this rank's cache entry keeps beside the agreed settings under DDP: its own worker count (where the
        ranks run their own) and the widest spread of the ranks' stalls (empty in a single process)."""
        if not self.distributed:
            return {}
        rank = int(getattr(self.strategy, "global_rank", 0))
        own = self.rank_workers[rank] if rank < len(self.rank_workers) else None
        return {"own_workers": own, "stall_frac_spread": self.widest}

    def cached(self, entry: dict[str, Any] | None) -> None:
        """A start from this rank's cache ``entry`` (``RunCache.own``): the ranks' stalls differed as widely as when
        it was cached, so the verification's settle gives each rank its own count again (:meth:`own_settings`), the
        count the entry keeps where this fit measured no batch at 0 workers (its windows on the agreed config, whose
        workers start on every rank at once, say little of one rank's own need). An evaluation loop's entry keeps no
        spread (its ranks run alike)."""
        spread = None if entry is None else entry.get("stall_frac_spread")
        if self.distributed and isinstance(spread, (int, float)):
            self.widest = max(self.widest, float(spread))
        own = None if entry is None else entry.get("own_workers")
        self.cached_need = own if self.distributed and isinstance(own, int) and own > 0 else None

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

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return self.largest(float(flag)) > 0

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


def own_ceilings(nodes: list[int], ceilings: list[int], needs: list[int]) -> list[int]:
    """Each rank's worker ceiling where the share follows need: the rank that needs most on its node may have the
    node's ceilings together less what the node's other ranks need (each within its own ceiling), up to the default
    ceiling's bound for one process (:data:`~lightning_dltune.measurement.budget.MOST_WORKERS`); every other rank
    its own. By rank: ``nodes`` (its node), ``ceilings`` (its own share's ``max_workers``), ``needs`` (its own count,
    :func:`~lightning_dltune.tuning.rules.own_need`, within its own ceiling)."""
    own = list(ceilings)
    for node in set(nodes):
        ranks = [i for i, n in enumerate(nodes) if n == node]
        neediest = max(ranks, key=lambda i: needs[i])
        others = sum(min(needs[i], ceilings[i]) for i in ranks if i != neediest)
        own[neediest] = max(ceilings[neediest], min(MOST_WORKERS, sum(ceilings[i] for i in ranks) - others))
    return own


def own_counts(agreed: int, nodes: list[int], shares: list[int], needs: list[int], pool: bool = True) -> list[int]:
    """Each rank's worker count once tuning ended on ``agreed`` workers, where the ranks' stalls differed: the rank
    that needs most on its node keeps the agreed count within its own ceiling (:func:`own_ceilings` where ``pool``,
    its own share otherwise; the decisions were sized on it), every other rank the fewer its own windows ask for.
    By rank: ``nodes``, ``shares`` (its own share's ``max_workers``) and ``needs`` (within its share)."""
    ceilings = own_ceilings(nodes, shares, needs) if pool else list(shares)
    counts = []
    for i, node in enumerate(nodes):
        neediest = max((j for j, n in enumerate(nodes) if n == node), key=lambda j: needs[j])
        counts.append(min(agreed, ceilings[i]) if i == neediest else min(agreed, needs[i]))
    return counts


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


def _pace(rows: list[list[float]], running: LoaderSettings) -> float | None:
    """The least busy time of any rank's window (every rank's statistics, as gathered, read as on this rank's
    ``running`` config: only whether it has workers counts, and every rank's has while any runs its own count);
    ``None`` where no rank measured a step."""
    windows = [WindowStats(**_values(r)) for r in rows]
    busy = [busy_time(Trial(running, w)) for w in windows if w.steps > 0]
    return min(busy) if busy else None


def _values(row: list[float]) -> dict[str, Any]:
    """One rank's window statistics from its gathered row (counts back to ``int``)."""
    values: dict[str, Any] = dict(zip(_STATS_FIELDS, row, strict=True))
    return {**values, **{name: int(values[name]) for name in _INT_FIELDS}}
