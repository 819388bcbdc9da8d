"""Agreement across ranks: every collective the tuner makes, in one place, with tensors on the strategy's device.

Each rank measures its own windows; at a decision point :meth:`Agreement.decide` gathers every rank's window
statistics and budget in one ``all_gather``, takes the slowest rank's statistics and the tightest node's budget,
decides on them and broadcasts rank 0's decision, so every rank changes its loader at the same step. NCCL only
takes tensors on the GPU: every tensor is made on ``strategy.root_device``. In a single process nothing is sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lightning_dltune.decide import Budget
from lightning_dltune.measure import WindowStats

T = TypeVar("T")
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(WindowStats))
_INT_FIELDS = ("steps", "samples", "gpu_steps")


class Agreement:
    """The collectives of one ``fit``, over ``strategy`` (anything with ``world_size``, ``root_device``,
    ``all_gather``, ``broadcast`` and ``reduce``, as Lightning's strategies have).

    Attributes:
        budget: the budget last agreed on (the tightest node's), ``None`` before the first decision.
        stall_spread: max minus min stall fraction across ranks at the last decision or log step.
    """

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy
        self.budget: Budget | None = None
        self.stall_spread: float | None = None

    @property
    def distributed(self) -> bool:
        return self.strategy is not None and int(getattr(self.strategy, "world_size", 1)) > 1

    def _tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.strategy.root_device)

    def decide(
        self, stats: WindowStats, budget: Budget, choose: Callable[[WindowStats, Budget], T]
    ) -> tuple[WindowStats, Budget, T]:
        """``choose`` on the slowest rank's ``stats`` and the tightest ``budget``, the same on every rank."""
        if self.distributed:
            stats, budget = self._reduce(stats, budget)
        choice = choose(stats, budget)
        if self.distributed and choice is not None:
            choice = self.strategy.broadcast(choice, src=0)  # every rank must switch at the same step
        return stats, budget, choice

    def _reduce(self, stats: WindowStats, budget: Budget) -> tuple[WindowStats, Budget]:
        inf = float("inf")
        limits = [budget.cpus, float(budget.max_workers), budget.memory_bytes or inf, budget.shm_bytes or inf]
        row = [float(getattr(stats, f)) for f in _STATS_FIELDS] + limits
        table = self.strategy.all_gather(self._tensor(row)).reshape(-1, len(row)).cpu()
        col = _STATS_FIELDS.index
        per_sample = table[:, col("wall_s")] / table[:, col("samples")].clamp(min=1)
        slowest = table[int(per_sample.argmax())].tolist()
        values: dict[str, Any] = dict(zip(_STATS_FIELDS, slowest[: len(_STATS_FIELDS)], strict=True))
        for name in _INT_FIELDS:
            values[name] = int(values[name])
        stall = table[:, col("wait_s")] / table[:, col("wall_s")].clamp(min=1e-9)
        self.stall_spread = float(stall.max() - stall.min())
        tightest = table[:, len(_STATS_FIELDS) :].min(dim=0).values.tolist()
        self.budget = dataclasses.replace(
            budget,
            cpus=tightest[0],
            max_workers=int(tightest[1]),
            bound_by=budget.bound_by + " (tightest node)",
            memory_bytes=None if tightest[2] == inf else tightest[2],
            shm_bytes=None if tightest[3] == inf else tightest[3],
        )
        return WindowStats(**values), self.budget

    def largest(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        if not self.distributed:
            return value
        return float(self.strategy.reduce(self._tensor([value]), reduce_op="max").item())

    def spread(self, stall: float) -> float | None:
        """Max minus min of ``stall`` over the ranks (``None`` in a single process); kept in ``stall_spread``."""
        if not self.distributed:
            return self.stall_spread
        stalls = self.strategy.all_gather(self._tensor([stall]))
        self.stall_spread = float(stalls.max() - stalls.min())
        return self.stall_spread
