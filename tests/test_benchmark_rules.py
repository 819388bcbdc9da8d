"""The rules ``benchmarks/run.py`` reports by: a verdict from the paired interval, one rule for every target, and
an oracle searched over the space the tuner chooses from."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, BENCHMARKS)  # benchmarks/ is not a package: its scripts import each other by name
try:
    import all as run_all

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


def test_the_headline_reads_each_benchmarks_numbers_over_its_best_static_config(tmp_path):
    """BENCHMARKS.md's headline: every ratio over the best static config's time, the tuner's with its spread, and
    only from the benchmarks this run ran (a result file left from another run is not read)."""
    import json

    workload = {
        "workload": "latency",
        "what": "a wait",
        "seconds": {"default": 30.0, "rule_of_thumb": 27.0, "tuner": 2.4, "oracle": 3.0},
        "paired": {"ratio": 0.8, "ratio_low": 0.7, "ratio_high": 0.9, "ratios": [0.7, 0.9]},
        "workers": {"oracle": "16w p4"},
    }
    (tmp_path / "latest.json").write_text(json.dumps({"workloads": [workload]}))
    walls = {"default": [50.0], "tuned": [4.0, 4.4], "workers=1": [40.0], "workers=8": [5.0, 5.0]}
    (tmp_path / "evaluation.json").write_text(json.dumps({"val": {"walls": walls, "thumb": "workers=1"}}))
    (tmp_path / "ranks.json").write_text("{}")  # not run here: never read
    rows = run_all.headline_rows(tmp_path, quick=False, ran=["workloads", "evaluation"])
    assert [r["workload"] for r in rows] == ["latency", "eval: val"]
    latency, val = rows
    assert (latency["default"], latency["thumb"], latency["tuner"]) == (10.0, 9.0, 0.8)
    assert (val["default"], val["thumb"]) == (10.0, 8.0) and val["best"] == "8w, 5.0 s"
    assert val["tuner"] == pytest.approx((0.8 * 0.88) ** 0.5) and val["low"] < val["tuner"] < val["high"]
    table = run_all.headline(rows)
    assert "| latency: a wait | 10.00x | 9.00x | 0.80x (0.70-0.90x) | 1.00x (16w p4, 3.0 s) |" in table
