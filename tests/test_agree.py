"""Agreement across ranks with a stand-in strategy: every collective's tensor is on the strategy's root device."""

import dataclasses
from dataclasses import replace

import pytest
import torch

from lightning_dltune.agreement import Agreement
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Budget, Decision

FIELDS = [f.name for f in dataclasses.fields(WindowStats)]


def row(stats: WindowStats, budget: Budget, failed: LoaderSettings | None = None) -> list[float]:
    limits = [budget.cpus, budget.max_workers, budget.memory_bytes or float("inf"), budget.shm_bytes or float("inf")]
    if failed is None:
        return [float(getattr(stats, f)) for f in FIELDS] + limits + [-1.0, 0.0, 0.0, 0.0] + [0.0, 0.0]
    encoded = [failed.num_workers, failed.prefetch_factor or 0, failed.pin_memory, failed.persistent_workers]
    return [float(getattr(stats, f)) for f in FIELDS] + limits + [float(v) for v in encoded] + [0.0, 0.0]


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
        if tensor.dtype == torch.int64:  # the cache keys' digests: the other rank's is `other_key`
            return torch.stack([torch.tensor(self.mine_key), torch.tensor(self.other_key)])
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
        return getattr(self, "rank0_choice", obj)


def test_a_decision_uses_the_most_stalled_rank_and_the_tightest_node_on_the_root_device():
    fast = WindowStats(steps=10, samples=160, wall_s=1.0, wait_s=0.1)
    slow = WindowStats(steps=10, samples=160, wall_s=3.0, wait_s=2.0)
    mine = Budget(cpus=8.0, max_workers=32, memory_bytes=8e9, shm_bytes=None, bound_by="affinity")
    theirs = Budget(cpus=2.0, max_workers=16, memory_bytes=None, shm_bytes=1e9)
    strategy = FakeStrategy(row(slow, theirs))
    strategy.mine = row(fast, mine)
    agreement = Agreement(strategy)
    seen = []

    def choose(stats, budget, failed):
        seen.append((stats, budget, failed))
        return Decision("try", LoaderSettings.normalized(4), "because")

    stats, budget, decision = agreement.decide(fast, mine, choose)
    assert stats == slow and seen == [(slow, budget, [])]
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
    assert agreement.decide(stats, budget, lambda s, b, f: "x") == (stats, budget, "x")
    assert agreement.spread(0.5) is None and agreement.largest(3.0) == 3.0 and agreement.budget is None


def test_a_config_that_failed_on_one_rank_reaches_every_rank():
    died = LoaderSettings.normalized(4)
    stats, budget = WindowStats(steps=1, samples=1, wall_s=1.0), Budget(cpus=1.0, max_workers=4)
    strategy = FakeStrategy(row(stats, budget, failed=died))  # the other rank lost a worker
    strategy.mine = row(stats, budget)
    agreement = Agreement(strategy)
    _, _, failed = agreement.decide(stats, budget, lambda s, b, f: f, failed=None)
    assert failed == [died] == agreement.failures


def test_a_cache_hit_is_rank_zeros_and_only_when_every_rank_has_the_same_key():
    import hashlib

    def digest(key):
        return [int.from_bytes(hashlib.sha1(key.encode()).digest()[:7], "big")]

    strategy = FakeStrategy([])
    strategy.rank0_choice = ("rank 0's settings", {})
    strategy.mine_key, strategy.other_key = digest("k1"), digest("k1")
    agreement = Agreement(strategy)
    assert agreement.same_start("k1", None) == ("rank 0's settings", {})  # this rank missed, rank 0 hit: follow it
    strategy.other_key = digest("k2")  # another node, another key (its CPUs differ, say)
    assert agreement.same_start("k1", ("mine", {})) is None  # nobody starts from the cache


def test_every_memory_field_is_agreed_on_as_the_largest_rank_s():
    """Memory is held per node: a new memory field of ``WindowStats`` must be in ``agreement._MAX_FIELDS``."""
    import dataclasses

    from lightning_dltune import agreement as agree
    from lightning_dltune.measurement.measure import WindowStats

    memory_fields = {f.name for f in dataclasses.fields(WindowStats) if "mem" in f.name} | {"batch_bytes"}
    assert memory_fields == set(agree._MAX_FIELDS)


def test_ranks_in_lockstep_are_told_apart_by_their_wait_and_each_rank_s_stall_is_kept():
    # both ranks took 2 s (they run in lockstep); this one read fewer samples but waited 0.2 s, the other 1.8 s: the
    # other's loader holds the run up, and the decision is taken on its window
    budget = Budget(cpus=2.0, max_workers=16)
    mine = WindowStats(steps=10, samples=128, wall_s=2.0, wait_s=0.2)
    theirs = WindowStats(steps=10, samples=160, wall_s=2.0, wait_s=1.8)
    strategy = FakeStrategy(row(theirs, budget))
    strategy.mine = row(mine, budget)
    agreement = Agreement(strategy)
    stats, _, _ = agreement.decide(mine, budget, lambda s, b, f: None)
    assert stats == theirs
    assert agreement.rank_stalls == pytest.approx([0.1, 0.9])
    assert agreement.spread(0.8) == pytest.approx(0.6) and agreement.rank_stalls == pytest.approx([0.8, 0.2])


def test_each_rank_s_stall_is_logged_kept_on_the_trial_and_shown_in_the_summary():
    from dataclasses import replace

    from lightning_dltune.output.report import (
        STALL_MAX_RANK,
        summary_table,
        window_metrics,
    )
    from lightning_dltune.tuning.model import Trial

    stats = WindowStats(steps=10, samples=160, wall_s=2.0, wait_s=1.8)
    metrics = window_metrics(stats, None, LoaderSettings(), [0.1, 0.9])
    assert metrics[STALL_MAX_RANK] == 1.0 and metrics["dltune/stall_frac_spread"] == pytest.approx(0.8)
    assert "dltune/stall_frac_max" not in window_metrics(stats, None, LoaderSettings())  # a single process
    trial = replace(Trial(LoaderSettings.normalized(8), stats), ranks=(0.1, 0.9))
    assert Trial.from_dict(trial.to_dict()).ranks == (0.1, 0.9)
    assert "0:10% 1:90%" in summary_table([trial], None)


class TwoRanksCounts(FakeStrategy):
    """Gathers each rank's need, node, share, running workers and widest stall spread: this rank's (which a ``meta``
    tensor cannot show) as ``mine``, the other rank's: it needs its whole share of 8 workers, and runs 8."""

    other_widest = 0.0  # the widest spread of the ranks' stalls the other rank saw

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        self.calls.append("all_gather")
        return torch.tensor([self.mine, [8.0, 0.0, 8.0, 8.0, self.other_widest]], dtype=torch.float64)


def test_once_tuning_ended_a_rank_whose_own_windows_ask_for_fewer_workers_runs_them():
    from lightning_dltune.tuning.model import Policy
    from lightning_dltune.tuning.rules import own_need

    from test_decide import trial

    budget, policy, eight = Budget(cpus=2.0, max_workers=8), Policy(), LoaderSettings.normalized(8)
    settle = Decision("settle", eight, "sized on rank 1, which waits most")
    strategy, alike = TwoRanksCounts([]), [None]
    agreement = Agreement(strategy, policy, lambda: alike[0])
    # this rank's own windows: 16 ms to load a batch against a 10 ms step at 0 workers, no wait with 8
    agreement.own = [trial(0, 16, 10, fetch_cpu_ms=1), trial(8, 0.1, 10)]
    need = own_need(agreement.own, budget, policy)
    assert 1 <= need < 8
    strategy.mine = [float(need), 0.0, 8.0, 8.0, 0.4]
    agreement.widest = 0.4  # the ranks' stalls differed beyond the threshold in some window
    settings, everywhere = agreement.own_change(settle, True, eight, budget)
    assert settings == eight.with_workers(need) and everywhere
    assert agreement.rank_workers == [need, 8] and agreement.report()["rank_workers"] == [need, 8]
    # a hold (no loader change) ends tuning too: the same
    assert agreement.own_change(None, True, eight, budget) == (eight.with_workers(need), True)
    # a loader that needs every rank alike keeps the agreed settings, and says why
    strategy.mine, alike[0] = [8.0, 0.0, 8.0, 8.0, 0.4], "litdata lays"
    assert agreement.own_change(settle, True, eight, budget) == (eight, False)
    assert agreement.report()["ranks_alike"] == "litdata lays"
    # nobody changes: the running settings, nothing rebuilt
    assert agreement.own_change(None, True, eight, budget) == (eight, False)
    # ranks whose stalls never differed beyond the threshold run alike
    agreement.widest, alike[0], strategy.mine = 0.03, None, [8.0, 0.0, 8.0, 8.0, 0.03]
    assert agreement.own_change(settle, True, eight, budget) == (eight, False)
    assert agreement.report()["ranks_alike"] is None
    # ... unless another rank saw them differ (a start from the cache primes only the ranks with their own entry):
    # every rank decides on the widest spread any rank saw, or one would reload alone and wait at Lightning's barrier
    strategy.mine, strategy.other_widest = [float(need), 0.0, 8.0, 8.0, 0.03], 0.4
    assert agreement.own_change(settle, True, eight, budget) == (eight.with_workers(need), True)
    assert agreement.widest == 0.4
    # while tuning goes on, a decision is agreed as it is, with no collective
    calls = len(strategy.calls)
    trial_decision = Decision("try", eight, "the jump")
    assert agreement.own_change(trial_decision, False, eight, budget) == (eight, False)
    assert len(strategy.calls) == calls


def test_a_resumed_rank_gets_its_own_count_back_from_the_checkpoint_of_a_settled_run():
    from lightning_dltune.tuning.state import Phase, TuningState

    eight = LoaderSettings.normalized(8)
    saved = TuningState()
    saved.phase, saved.best_settings, saved.target = Phase.SETTLED, eight.to_loader_kwargs(), eight
    saved.rank_workers = [2, 8]  # gathered on every rank when tuning ended; rank zero saves them
    loaded = TuningState()
    loaded.load_state_dict(saved.state_dict())
    assert loaded.rank_workers == [2, 8] and loaded.target == eight
    for rank, count in ((0, 2), (1, 8)):
        strategy = FakeStrategy([])
        strategy.global_rank = rank
        agreement = Agreement(strategy)
        assert agreement.resumed(loaded.target, loaded.rank_workers) == eight.with_workers(count)
        assert agreement.rank_workers == [2, 8]
    # another world size: every rank on the agreed settings
    assert Agreement(FakeStrategy([])).resumed(eight, [2, 8, 8]) == eight
    # a run resumed mid-tuning tries its plan on every rank alike
    saved.phase = Phase.TUNING
    loaded = TuningState()
    loaded.load_state_dict(saved.state_dict())
    assert loaded.rank_workers == []


@pytest.mark.parametrize(
    ("nodes", "ceilings", "needs", "own", "counts", "unpooled"),
    [
        # rank 1 may have what rank 0 leaves of the node's 16
        ([0, 0], [8, 8], [1, 8], [8, 15], [1, 12], [1, 8]),
        # both need their share: nothing to hand over
        ([0, 0], [8, 8], [8, 8], [8, 8], [8, 8], [8, 8]),
        # the neediest of four gets what three leave
        ([0, 0, 0, 0], [4, 4, 4, 4], [1, 2, 4, 1], [4, 4, 12, 4], [1, 2, 12, 1], [1, 2, 4, 1]),
        # each node's pool is its own
        ([0, 0, 1, 1], [8, 8, 4, 4], [2, 8, 4, 1], [8, 14, 7, 4], [2, 12, 7, 1], [2, 8, 4, 1]),
        # never past the default ceiling's 64 workers for one process, however much its node leaves
        ([0, 0, 0], [48, 48, 48], [1, 1, 48], [48, 48, 64], [1, 1, 12], [1, 1, 12]),
    ],
)
def test_the_rank_that_needs_most_on_its_node_gets_what_the_node_s_other_ranks_leave(
    nodes, ceilings, needs, own, counts, unpooled
):
    from lightning_dltune.agreement import own_ceilings, own_counts

    assert own_ceilings(nodes, ceilings, needs) == own
    # once tuning ended on 12 workers: the neediest rank of each node keeps them within its own ceiling, the others
    # run what they need; without pooling (the user's own max_workers) the neediest stays within its own share
    assert own_counts(12, nodes, ceilings, needs) == counts
    assert own_counts(12, nodes, ceilings, needs, pool=False) == unpooled


class TwoRanksOnANode(FakeStrategy):
    """Two ranks of one node: this one (rank 0, what it sends, read back on the CPU) and the other, which waits far
    more; its row's last column is its need (and, sent first, whether it pools: any need above 0 does)."""

    global_rank, node_rank = 0, 0
    root_device = torch.device("cpu")

    def __init__(self, other_row: list[float]) -> None:
        super().__init__(other_row)
        self.sent: list[list[float]] = []  # what this rank sent, each collective's

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        self.calls.append("all_gather")
        self.sent.append(tensor.tolist())
        if tensor.numel() == 1:  # each rank's need
            return torch.tensor([tensor.tolist(), [self.other_row[-1]]], dtype=torch.float64)
        return torch.stack([tensor, torch.tensor(self.other_row, dtype=torch.float64)])


def test_where_the_ranks_stalls_differ_the_most_stalled_rank_may_take_the_workers_its_neighbour_leaves():
    from lightning_dltune.tuning.rules import own_need

    from test_decide import trial

    budget = Budget(cpus=1.0, max_workers=8)
    theirs = WindowStats(steps=10, samples=160, wall_s=1.0, wait_s=0.9)
    strategy = TwoRanksOnANode([*row(theirs, budget)[:-1], 7.0])  # rank 1 needs 7 of its 8 (within its share)
    seen = []
    agreement = Agreement(strategy)
    own = trial(0, 16, 10, fetch_cpu_ms=1)  # this rank: 16 ms to load a batch against a 10 ms step
    need = own_need([own], budget)
    agreement.decide(own.stats, budget, lambda s, b, f: seen.append(b), running=own.settings)
    assert strategy.sent[-1] == [need]  # both ranks pool: each sends its need in a second gather
    assert seen[0].max_workers == 16 - need > 8 and "its neighbours' need" in seen[0].bound_by
    assert agreement.share == 8  # this rank's own
    # the user's own max_workers, or a loader that needs every rank alike, is not pooled: where this rank does not
    # pool, no rank does (the other rank's row says it would), and no second gather is made
    for users, alike in ((True, None), (False, "litdata lays")):
        agreement, strategy.calls = Agreement(strategy, why_alike=lambda alike=alike: alike), []
        agreement.decide(
            own.stats, replace(budget, users_ceiling=users), lambda s, b, f: seen.append(b), running=own.settings
        )
        assert seen[-1].max_workers == 8 and strategy.calls == ["all_gather", "broadcast"]
    # ... and where the other rank does not pool (its own max_workers), this one makes no second gather either
    strategy.other_row[-1], strategy.calls = 0.0, []
    Agreement(strategy).decide(own.stats, budget, lambda s, b, f: seen.append(b), running=own.settings)
    assert seen[-1].max_workers == 8 and strategy.calls == ["all_gather", "broadcast"]


def test_each_ranks_own_need_is_sized_on_the_step_of_the_rank_that_waits_for_no_one():
    from lightning_dltune.tuning.rules import own_need

    from test_decide import trial

    budget, eight = Budget(cpus=2.0, max_workers=8), LoaderSettings.normalized(8)
    # this rank (rank 0): 16 ms to load a batch at 0 workers, and a 60 ms step that is mostly its wait inside the
    # all-reduce for rank 1, which loads for 90 ms and steps for 10 ms (it waits for no one)
    own = trial(0, 16, 60, fetch_cpu_ms=1)
    theirs = trial(0, 90, 10, fetch_cpu_ms=1)
    strategy = TwoRanksOnANode([*row(theirs.stats, budget)[:-1], 8.0])
    agreement, seen = Agreement(strategy), []
    agreement.decide(own.stats, budget, lambda s, b, f: seen.append(b), running=own.settings)
    assert agreement.pace == pytest.approx(0.010)
    alone = own_need([own], budget)  # on its own step: one worker keeps up with 60 ms
    paced = own_need([own], budget, pace_s=agreement.pace)
    assert alone == 1 and paced >= 2, (alone, paced)  # once rank 1 is fed, steps take 10 ms: 16 ms needs two
    # the need the decision pools is sized on this decision's pace (the first decision has no earlier one), and rank
    # 1, the neediest, may have the node's 16 workers less it
    assert strategy.sent[-1] == [paced] and strategy.calls == ["all_gather", "all_gather", "broadcast"]
    assert seen[0].max_workers == 16 - paced
    # once tuning ended, this rank runs the count the pace asks for; the row it sends is read back here (on the CPU,
    # where the other tests' meta device hides it), beside rank 1's, which needs 8
    strategy.all_gather = lambda row: torch.stack([row, torch.tensor([8.0, 0, 8, 8, 0.5], dtype=torch.float64)])
    agreement.own, agreement.widest = [own], 0.5
    settings, everywhere = agreement.own_change(Decision("settle", eight, "agreed"), True, eight, budget)
    assert settings == eight.with_workers(paced) and everywhere and agreement.rank_workers == [paced, 8]
    # where no window measured a batch (4 workers that kept up: only their count times the step, which holds the same
    # wait), the pace is not applied
    kept_up = trial(4, 0.5, 60, worker_cpu_ms=1)
    assert own_need([kept_up], Budget(16, 32), pace_s=0.010) == own_need([kept_up], Budget(16, 32)) < 8
    # a start from the cache measured no batch at 0 workers: the verification's settle gives this rank the count its
    # entry keeps, not one sized on its windows on the agreed config (whose workers start on every rank at once)
    agreement.cached({"own_workers": 3, "stall_frac_spread": 0.5})
    agreement.own = [trial(8, 2, 10, worker_cpu_ms=1)]  # stalled while 8 workers started: reads as a slow batch
    assert own_need(agreement.own, budget, pace_s=agreement.pace) > 3
    settings, _ = agreement.own_change(Decision("settle", eight, "verified"), True, eight, budget)
    assert settings == eight.with_workers(3) and agreement.rank_workers == [3, 8]


def test_a_ranks_own_need_leaves_out_a_window_that_only_saw_its_workers_start():
    from lightning_dltune.tuning.rules import own_need

    from test_decide import trial

    budget = Budget(cpus=2.0, max_workers=16)
    alone = trial(0, 16, 60, fetch_cpu_ms=1, steps=7)  # 16 ms a batch at 0 workers, while waiting for rank 1
    # the agreed 15 workers, all starting at once: 10 steps, each a worker's first batch, stalled a third of the time
    starting = trial(15, 6, 12, worker_cpu_ms=1, steps=10)
    need = own_need([alone, starting], budget, pace_s=0.011)
    assert need <= 3, need  # 16 ms a batch at an 11 ms pace
    # the same stall over 40 steps, even at every step, on 15 workers (over twice the 2 that 16 ms batches need at an
    # 11 ms pace): the cost of receiving batches on CPUs the agreed config's workers share, not a batch they lacked
    steady = trial(15, 6, 12, worker_cpu_ms=1, steps=40)
    assert own_need([alone, steady], budget, pace_s=0.011) <= 3
    # uneven, it is the workers' own pace (slow batches the 7 steps at 0 workers missed): each batch 15 x 18 ms
    uneven = trial(15, 6, 12, worker_cpu_ms=1, steps=40, p50_ms=1, p90_ms=20)
    assert own_need([alone, uneven], budget, pace_s=0.011) > 8
    # and on 2 workers (not twice the need), an even stall bounds a batch's time too
    assert own_need([alone, trial(2, 6, 12, worker_cpu_ms=1, steps=40)], budget, pace_s=0.011) > 2
