"""The rules ``benchmarks/run.py`` reports by: a verdict from the paired interval, one rule for every target, and
an oracle searched over the space the tuner chooses from."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, BENCHMARKS)  # benchmarks/ is not a package: its scripts import each other by name
try:
    import run
finally:
    sys.path.remove(BENCHMARKS)


def paired(low, high):
    return {"ratio": (low + high) / 2, "ratio_low": low, "ratio_high": high, "ratios": [low, high]}


@pytest.mark.parametrize(
    ("low", "high", "target", "said"),
    [
        (0.62, 0.71, 1.0, "beats 1.00x"),
        (0.95, 1.06, 1.0, "within noise of 1.00x"),  # a ratio of medians under 1.0 is not a win on its own
        (1.01, 1.13, 1.0, "misses 1.00x"),
        (0.95, 1.04, 1.05, "meets 1.05x"),
        (0.93, 1.10, 1.05, "within noise of 1.05x"),
        (1.06, 1.20, 1.05, "misses 1.05x"),
    ],
)
def test_a_verdict_follows_the_paired_interval_against_the_target(low, high, target, said):
    assert run.verdict(paired(low, high), target) == said


def test_one_pair_gives_no_verdict():
    assert run.verdict({"ratio": 0.5, "ratio_low": 0.5, "ratio_high": 0.5, "ratios": [0.5]}) == "no verdict"


def test_the_oracle_search_reaches_the_counts_between_and_the_deeper_prefetch():
    # a loader whose best static config is 13 workers at prefetch 8: off the coarse grid in both
    def cost(config):
        workers, prefetch = config
        return abs(workers - 13) + (8 - prefetch) / 10

    times = run.search(cost, [0, 1, 2, 4, 8, 16], max_workers=16, refine=2)
    assert {(12, 2), (10, 2), (14, 2)} <= set(times), sorted(times)  # halfway to the best's neighbours, twice
    assert {(12, 4), (12, 8)} <= set(times), sorted(times)  # the deeper prefetches at the best count
    assert min(times, key=times.get) == (12, 8)  # one worker from the true best, at its prefetch
    assert all(workers <= 16 and prefetch in (2, 4, 8) for workers, prefetch in times)
