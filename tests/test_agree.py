"""Agreement across ranks with a stand-in strategy: every collective's tensor is on the strategy's root device."""

import dataclasses

import torch

from lightning_dltune.agree import Agreement
from lightning_dltune.decide import Budget, Decision
from lightning_dltune.measure import WindowStats
from lightning_dltune.settings import LoaderSettings

FIELDS = [f.name for f in dataclasses.fields(WindowStats)]


def row(stats: WindowStats, budget: Budget) -> list[float]:
    limits = [budget.cpus, budget.max_workers, budget.memory_bytes or float("inf"), budget.shm_bytes or float("inf")]
    return [float(getattr(stats, f)) for f in FIELDS] + limits


class FakeStrategy:
    """Two ranks: this one and ``other``. The root device is ``meta``, which no CPU tensor matches, so a
    collective handed a tensor made on the CPU (what NCCL rejects) fails here."""

    world_size = 2
    root_device = torch.device("meta")

    def __init__(self, other_row: list[float]) -> None:
        self.other_row = other_row
        self.calls: list[str] = []

    def _check(self, tensor: torch.Tensor) -> None:
        assert tensor.device == self.root_device, f"collective on {tensor.device}, not {self.root_device}"

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        self.calls.append("all_gather")
        if tensor.numel() == 1:  # the per-log stall: this rank 0.8, the other 0.2
            return torch.tensor([[0.8], [0.2]], dtype=torch.float64)
        return torch.tensor([self.mine, self.other_row], dtype=torch.float64)

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self._check(tensor)
        assert reduce_op == "max"
        self.calls.append("reduce")
        return torch.tensor([42.0], dtype=torch.float64)

    def broadcast(self, obj, src=0):
        self.calls.append("broadcast")
        return obj


def test_a_decision_uses_the_slowest_rank_and_the_tightest_node_on_the_root_device():
    fast = WindowStats(steps=10, samples=160, wall_s=1.0, wait_s=0.1)
    slow = WindowStats(steps=10, samples=160, wall_s=3.0, wait_s=2.0)
    mine = Budget(cpus=8.0, max_workers=32, memory_bytes=8e9, shm_bytes=None, bound_by="affinity")
    theirs = Budget(cpus=2.0, max_workers=16, memory_bytes=None, shm_bytes=1e9)
    strategy = FakeStrategy(row(slow, theirs))
    strategy.mine = row(fast, mine)
    agreement = Agreement(strategy)
    seen = []

    def choose(stats, budget):
        seen.append((stats, budget))
        return Decision("try", LoaderSettings.normalized(4), "because")

    stats, budget, decision = agreement.decide(fast, mine, choose)
    assert stats == slow and seen == [(slow, budget)]
    assert (budget.cpus, budget.max_workers, budget.memory_bytes, budget.shm_bytes) == (2.0, 16, 8e9, 1e9)
    assert budget.bound_by.endswith("(tightest node)") and agreement.budget == budget
    assert decision.settings.num_workers == 4
    assert strategy.calls == ["all_gather", "broadcast"]  # one gather and one broadcast per decision point
    assert abs(agreement.stall_spread - (2.0 / 3.0 - 0.1)) < 1e-9


def test_log_spread_and_the_largest_value_go_through_the_root_device():
    strategy = FakeStrategy([])
    agreement = Agreement(strategy)
    assert abs(agreement.spread(0.8) - 0.6) < 1e-9 and agreement.stall_spread == agreement.spread(0.8)
    assert agreement.largest(1.0) == 42.0


def test_a_single_process_sends_nothing():
    agreement = Agreement(None)
    stats = WindowStats(steps=1, samples=1, wall_s=1.0)
    budget = Budget(cpus=1.0, max_workers=4)
    assert agreement.decide(stats, budget, lambda s, b: "x") == (stats, budget, "x")
    assert agreement.spread(0.5) is None and agreement.largest(3.0) == 3.0 and agreement.budget is None
