"""``dltune bench`` measures production, not a prefetched buffer draining: rates on a loader of known cost."""

import json

import pytest

from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tools.bench import (
    BenchRow,
    check_limits,
    in_flight,
    physical_limit,
    steady_rate,
    window_sizes,
)
from lightning_dltune.tools.cli import main

from test_cli import forget_module

SLEEP_MS, BATCH = 2.0, 8  # a batch costs a worker exactly 16 ms of sleep (and a little more in practice)

KNOWN_COST = f"""
import multiprocessing
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Sleepy(Dataset):
    def __init__(self, n=1024, ms={SLEEP_MS}):
        self.n, self.ms = n, ms
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.ms / 1e3)
        return torch.zeros(4), i

def make():
    return Sleepy()

def short():
    return Sleepy(96)

def guide():  # the guide's DummyDataset's shape: 1,000 samples, each a wait (shorter than its 10 ms)
    return Sleepy(1000, ms=0.25)

def spawned():
    return DataLoader(Sleepy(256), batch_size=8, num_workers=1, multiprocessing_context="spawn")
"""


@pytest.fixture
def known(tmp_path):
    path = tmp_path / "known_cost.py"
    path.write_text(KNOWN_COST)
    yield path
    forget_module(path)


def _bench(target, tmp_path, *extra):
    out = tmp_path / "out"
    args = ["bench", target, "--batch-size", str(BATCH), "--repeats", "1", "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads((out / "bench.json").read_text())


def test_no_rate_is_above_what_the_workers_can_produce_and_warmup_grows_with_the_batches_in_flight(known, tmp_path):
    # a factory returning a Dataset (the most common way people build one with arguments) is accepted
    result = _bench(f"{known}:make", tmp_path, "--max-workers", "4", "--prefetch", "2,4", "--batches", "10")
    per_batch_s = SLEEP_MS * BATCH / 1e3
    rows = result["rows"]
    assert [(r["num_workers"], r["prefetch_factor"]) for r in rows] == [
        (0, None), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4)
    ]  # fmt: skip
    for r in rows:
        flight = in_flight(LoaderSettings.normalized(r["num_workers"], r["prefetch_factor"]))
        assert r["warmup_batches"] == max(3, flight)
        # the ends sit where the consumer waited: at most one burst of arrivals (one per worker) is cut at each end
        assert r["window_batches"] >= max(10, 4 * flight) - 2 * max(1, r["num_workers"])
        exact_limit = max(1, r["num_workers"]) / per_batch_s  # sleep-based: nothing can be faster than this
        assert r["batches_per_s"] is not None and r["batches_per_s"] <= 1.03 * exact_limit, r
    four = [r for r in rows if r["num_workers"] == 4]
    assert all(r["batches_per_s"] > 2 * rows[0]["batches_per_s"] for r in four)  # workers do overlap the sleep


def test_every_config_gets_a_rate_on_a_1000_sample_dataset_its_epochs_iterated_as_training_does(known, tmp_path):
    # the default arguments (batch 32, 0 to 16 workers, prefetch 2 and 4): 32 batches an epoch, fewer than the
    # 16-worker configs' warm-up and window together
    out = tmp_path / "out"
    assert main(["bench", f"{known}:guide", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    rows = result["rows"]
    assert [(r["num_workers"], r["prefetch_factor"]) for r in rows][-2:] == [(16, 2), (16, 4)]
    assert all(r["batches_per_s"] is not None and not r["note"] for r in rows), rows
    for r in rows:
        flight = in_flight(LoaderSettings.normalized(r["num_workers"], r["prefetch_factor"]))
        assert r["warmup_batches"] == max(3, flight) and r["window_batches"] >= max(30, 4 * flight) // 2, r
    # the 16-worker windows span several epochs: each epoch's first batch waits for the pipeline to refill
    assert all(r["epoch_start_s"] is not None for r in rows if r["num_workers"] == 16)
    assert "had no rate" not in result["why"]


def test_a_loader_too_short_for_one_window_is_iterated_over_several_epochs(known, tmp_path):
    # 12 batches an epoch: 4 workers x prefetch 4 = 16 in flight, a window of at least 64
    result = _bench(f"{known}:short", tmp_path, "--max-workers", "4", "--prefetch", "4", "--batches", "5")
    four = {r["num_workers"]: r for r in result["rows"]}[4]
    assert four["batches_per_s"] is not None and four["window_batches"] > 12 and four["epoch_start_s"] > 0, four


def test_a_config_whose_batches_in_flight_outgrow_dev_shm_is_not_run_and_the_recommendation_says_so(
    known, tmp_path, monkeypatch, capsys
):
    from lightning_dltune.tools import bench

    # a container's 64 MiB /dev/shm (the real one here has gigabytes): a batch of 8 x 4 floats is 128 bytes plus
    # 64 bytes of indices; 1 worker x prefetch 2 fits in 500 bytes' half, 2 x 2 does not
    monkeypatch.setattr(bench, "shm_free_bytes", lambda: 1000.0)
    result = _bench(f"{known}:make", tmp_path, "--max-workers", "2", "--prefetch", "2", "--batches", "4")
    rows = {r["num_workers"]: r for r in result["rows"]}
    assert rows[1]["batches_per_s"] is not None
    assert rows[2]["batches_per_s"] is None and rows[2]["note"].startswith("not run: its 4 batches in flight need")
    assert "workers=2 prefetch=2 had no rate" in result["why"], result["why"]
    assert "/dev/shm" in capsys.readouterr().out


def test_a_file_target_is_importable_by_spawned_workers(known, tmp_path):
    result = _bench(f"{known}:spawned", tmp_path, "--max-workers", "1", "--prefetch", "2", "--batches", "4")
    assert result["rows"][1]["num_workers"] == 1 and result["rows"][1]["batches_per_s"] > 0


@pytest.mark.parametrize(
    ("waits", "expected_rate", "expected_n"),
    [
        # 0 workers: every read waits one production time (20 ms)
        ([0.02] * 10, 50.0, 9),
        # 4 workers, 80 ms each, in step: a burst of 4 every 80 ms; ends where a burst began
        ([0.08, 0, 0, 0] * 5, 50.0, 16),
        # the same burst seen from another phase: the window starts mid-burst
        ([0, 0, 0.08, 0, 0, 0, 0.08, 0, 0, 0, 0.08, 0, 0, 0, 0.08, 0, 0, 0, 0.08, 0], 50.0, 16),
    ],
)
def test_steady_rate_is_taken_between_reads_that_waited(waits, expected_rate, expected_n):
    times = [0.0]
    for w in waits:
        times.append(times[-1] + w + 1e-5)
    rate, n = steady_rate(times, waits)
    assert n == expected_n
    assert rate == pytest.approx(expected_rate, rel=0.01)


def test_a_buffer_draining_would_read_faster_than_production_but_steady_rate_does_not():
    # 16 prefetched batches arrive at once, then production goes on at 10 batches/s
    waits = [0.0] * 16 + [0.1] * 16
    times = [0.0]
    for w in waits:
        times.append(times[-1] + w + 1e-5)
    naive = len(waits) / times[-1]
    rate, _ = steady_rate(times, waits)
    assert naive > 1.9 * 10 and rate == pytest.approx(10.0, rel=0.01)


def test_window_sizes_are_minimums_that_grow_with_the_batches_in_flight():
    assert window_sizes(LoaderSettings(), 30, 3) == (3, 30)
    assert window_sizes(LoaderSettings.normalized(16, 4), 30, 3) == (64, 256)
    assert window_sizes(LoaderSettings.normalized(2, 2), 100, 10) == (10, 100)


def test_rates_above_the_physical_limit_are_withdrawn():
    def row(w, rate):
        return BenchRow(w, 2 if w else None, 0.1, rate, 0.0, rate * 32, 10.0, worker_cpu_per_batch_s=0.001)

    rows = [row(0, 3.0), row(1, 3.1), row(16, 62.0), row(8, 24.0)]
    check_limits(rows, cpus=2)
    assert rows[2].batches_per_s is None and "above the physical limit 49.6" in rows[2].note
    assert rows[3].batches_per_s == 24.0 and rows[3].limit_batches_per_s == pytest.approx(24.8)
    near = [row(1, 3.0), row(4, 13.0)]  # 8% above 4 x the 1-worker rate: within that rate's own noise
    check_limits(near, cpus=2)
    assert near[1].batches_per_s == 13.0
    # a CPU-bound loader: 2 CPUs and 50 ms of CPU per batch cannot give more than 40 batches/s, however many workers
    assert physical_limit(16, 20.0, 2, 0.05) == pytest.approx(40.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-workers", "-1"], "argument --max-workers: must be an int >= 0, got -1"),
        (["--warmup", "-2"], "argument --warmup: must be an int >= 0, got -2"),
        (["--step-ms", "-5"], "argument --step-ms: must be a positive number of milliseconds, got -5"),
        (["--step-ms", "0"], "argument --step-ms: must be a positive number of milliseconds, got 0"),
        (["--batches", "many"], "argument --batches: must be an int >= 1, got 'many'"),
        (["--prefetch", "0"], "argument --prefetch: must be positive ints like 2,4; got '0'"),
    ],
)
def test_bad_bench_arguments_are_one_line(args, message, known, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", f"{known}:make", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"dltune bench: error: {message} (see dltune bench --help)"]
    assert "_positive" not in err and "_count" not in err


def test_without_matplotlib_the_bench_says_why_it_drew_no_plot(known, tmp_path, capsys, monkeypatch):
    from lightning_dltune import _imports

    monkeypatch.setattr(_imports, "_MATPLOTLIB_AVAILABLE", False)  # a machine without the [view] extra
    _bench(f"{known}:make", tmp_path, "--max-workers", "0", "--batches", "3")
    out = capsys.readouterr().out
    assert "no plot: matplotlib (>=3.7) is not installed" in out and not (tmp_path / "out" / "bench.png").exists()
