"""Side-by-side benchmark: DataLoaderTuner against static loader configs, in one process.

For each workload the same model trains the same epochs with: the PyTorch default (0 workers), Lightning's
suggested count (cpus - 1), the half-the-cores rule of thumb, every config of a static grid (the best of
which is the oracle), and DataLoaderTuner starting from 0 workers. Whole-run time (``trainer.fit`` wall
time, worker start-up and tuning included) is reported as a ratio to the oracle. The accelerator's time is
SIMULATED by a sleep in ``training_step`` (this machine has no GPU).

    python benchmarks/run.py                 # full run, writes benchmarks/results/latest.json
    python benchmarks/run.py --write-md      # ... and regenerates BENCHMARKS.md
    python benchmarks/run.py --quick --workloads latency   # CI smoke size
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_dltune import DataLoaderTuner
from lightning_dltune.budget import cpu_budget
from lightning_dltune.loader import rebuild_dataloader  # noqa: F401  (documents how configs are applied)
from lightning_dltune.synthetic import (
    ResNetClassifier,
    SimulatedModel,
    SyntheticDataModule,
    SyntheticDataset,
    image_folder,
    in_memory_dataset,
    write_jpeg_folder,
)

from sections import write_results, write_section

HERE = Path(__file__).resolve().parent

WORKLOADS: dict[str, dict[str, Any]] = {
    "latency": {
        "make": lambda n: SyntheticDataset(n, latency_ms=10.0),
        "samples": 320,
        "step_ms": 5.0,
        "what": "10 ms storage wait per sample (the classic sleep)",
    },
    "cpu": {
        "make": lambda n: SyntheticDataset(n, cpu_ms=1.0),
        "samples": 640,
        "step_ms": 5.0,
        "what": "1 ms CPU decode/augment per sample",
    },
    "bursty": {
        "make": lambda n: SyntheticDataset(n, latency_ms=2.0, tail_prob=0.05, tail_factor=25.0),
        "samples": 640,
        "step_ms": 5.0,
        "what": "2 ms wait, 5% of samples 25x slower",
    },
    "in_memory": {
        "make": lambda n: in_memory_dataset(n),
        "samples": 1280,
        "step_ms": 5.0,
        "what": "TensorDataset already in memory",
    },
    "accelerator": {
        "make": lambda n: SyntheticDataset(n, latency_ms=0.3),
        "samples": 320,
        "step_ms": 40.0,
        "what": "light loading, 40 ms simulated step",
    },
}
BATCH = 16


@functools.cache
def _jpegs(images: int) -> Path:
    """A folder of ``images`` JPEG files, written once per run of this script."""
    return write_jpeg_folder(Path(tempfile.mkdtemp(prefix="dltune-bench-images-")), per_class=images // 2)


if importlib.util.find_spec("torchvision") is not None:  # beside torch 2.14.1 (scripts/test-matrix.sh newest)
    WORKLOADS["imagefolder"] = {
        "make": lambda n: image_folder(_jpegs(n)),
        "samples": 192,
        "model": ResNetClassifier,
        "what": "torchvision ImageFolder over JPEG files, RandomResizedCrop/flip/normalize, ResNet-18 step on the CPU",
    }


class EpochStart(pl.Callback):
    """The epoch-boundary stall: host time before each epoch's first ``k`` steps began, beyond the steps' own
    time (what refilling an empty pipeline costs at every epoch start), for epochs after the first."""

    def __init__(self, k: int = 3) -> None:
        self.k = k
        self.waits: list[float] = []
        self._t = 0.0
        self._gap = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t, self._gap = time.perf_counter(), 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i < self.k:
            self._gap += time.perf_counter() - self._t

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, b: Any, i: int) -> None:
        self._t = time.perf_counter()
        if i == self.k - 1 and trainer.current_epoch > 0:
            self.waits.append(self._gap)

    @property
    def mean_ms(self) -> float:
        return statistics.mean(self.waits) * 1e3 if self.waits else 0.0


def fit_once(
    workload: dict[str, Any],
    workers: int,
    epochs: int,
    tuner: DataLoaderTuner | None,
    boundary: EpochStart | None = None,
    seed: int | None = None,
) -> float:
    dm = SyntheticDataModule(
        workload["make"](workload["samples"]),
        batch_size=BATCH,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        seed=seed,
    )
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[c for c in (tuner, boundary) if c is not None],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    model = workload["model"]() if "model" in workload else SimulatedModel(step_ms=workload["step_ms"])
    trainer.fit(model, datamodule=dm)
    return time.perf_counter() - t0


def retimed(static_run: Any, tuner_run: Any, reps: int) -> tuple[list[float], list[float]]:
    """``reps`` interleaved pairs of the oracle's config (``static_run()``) and a fresh tuner (``tuner_run(i)``).

    The oracle is the fastest config of one run each of the grid: the least of several noisy times, which reads it
    low by about a standard deviation on this machine (one run of a config varies by 5-10%). It is timed again
    apart from the run that chose it, as often as the tuner, and both are compared on their medians."""
    statics, tuned = [], []
    for i in range(reps):
        statics.append(static_run())
        tuned.append(tuner_run(i))
    return statics, tuned


def run_workload(name: str, epochs: int, grid: list[int], cache_dir: Path, reps: int) -> dict[str, Any]:
    w = WORKLOADS[name]
    cpus = cpu_budget().cpus
    suggested = max(1, int(cpus) - 1)  # lightning's suggested_max_num_workers
    thumb = max(1, min(8, int(cpus) // 2))  # "half the cores, never above 8"
    counts = sorted(set(grid) | {0, suggested, thumb})
    static, boundary = {}, {}
    for k in counts:
        boundary[k] = EpochStart()
        static[k] = fit_once(w, k, epochs, None, boundary[k])
        print(f"  {name:12s} static workers={k:<3d} {static[k]:7.2f} s", flush=True)
    cache = cache_dir / f"{name}.json"  # a fresh cache per workload: the first run tunes, the second hits it
    tuner = DataLoaderTuner(verbose=False, report_path=False, cache=cache)
    tuned_boundary = EpochStart()
    tuned = fit_once(w, 0, epochs, tuner, tuned_boundary)
    print(f"  {name:12s} tuner -> {tuner.best_settings['num_workers']} workers {tuned:7.2f} s", flush=True)
    again = DataLoaderTuner(verbose=False, report_path=False, cache=cache)
    second = fit_once(w, 0, epochs, again)
    hit = again.best_settings["num_workers"] if again.best_settings else None
    print(f"  {name:12s} tuner, second run (cache hit: {again.cache_hit}) -> {hit} workers {second:7.2f} s", flush=True)
    # the same loader with a generator (`DataLoader(..., generator=g)`): each epoch's order is known before it
    # begins, so the tuner's loader also loads the next epoch's first batches ahead (seamless epochs). A generator
    # changes which order is drawn, not what a static config costs
    seeded_tuner = DataLoaderTuner(verbose=False, report_path=False, cache=cache_dir / f"{name}_seeded.json")
    seeded_boundary = EpochStart()
    seeded = fit_once(w, 0, epochs, seeded_tuner, seeded_boundary, seed=0)
    carried = seeded_tuner.switcher.seamless.carried
    print(f"  {name:12s} tuner, seeded loader ({carried} seamless epoch starts) {seeded:7.2f} s", flush=True)
    oracle_k = min(static, key=static.get)

    def fresh_tuner(i: int) -> float:
        again = DataLoaderTuner(verbose=False, report_path=False, cache=cache_dir / f"{name}_again{i}.json")
        return fit_once(w, 0, epochs, again)

    statics, tuners = retimed(lambda: fit_once(w, oracle_k, epochs, None), fresh_tuner, reps)
    oracle, tuned_median = statistics.median(statics), statistics.median(tuners)  # both interleaved
    print(f"  {name:12s} re-timed: oracle ({oracle_k}w) {statics}, tuner {[tuned, *tuners]}", flush=True)
    return {
        "workload": name,
        "what": w["what"],
        "epochs": epochs,
        "repeats": {"oracle": statics, "tuner": tuners, "tuner_first": tuned, "oracle_in_grid": static[oracle_k]},
        # the re-timed runs in their interleaved pairs: how far this host's noise leaves the medians' ratio
        "paired": ratio_interval(tuners, statics),
        "seconds": {
            "default": static[0],
            "lightning_suggested": static[suggested],
            "rule_of_thumb": static[thumb],
            "oracle": oracle,
            "tuner": tuned_median,
            "tuner_cached": second,
            "tuner_seamless": seeded,
        },
        "workers": {
            "default": 0,
            "lightning_suggested": suggested,
            "rule_of_thumb": thumb,
            "oracle": oracle_k,
            "tuner": tuner.best_settings["num_workers"],
            "tuner_cached": hit,
            "tuner_seamless": seeded_tuner.best_settings["num_workers"],
        },
        "seamless_epoch_starts": carried,
        # the default tuner's loader has no generator: its orders are drawn ahead from a copy of the global random
        # state (SimulatedModel draws nothing from it), checked at each epoch's start
        "tuner_seamless_starts": tuner.switcher.seamless.carried,
        "tuner_cached_seamless_starts": again.switcher.seamless.carried,
        "cache_hit": again.cache_hit,
        "epoch_start_ms": {
            "oracle": boundary[oracle_k].mean_ms,
            "tuner": tuned_boundary.mean_ms,
            "tuner_seamless": seeded_boundary.mean_ms,
        },
        "tuner_prefetch": tuner.best_settings["prefetch_factor"],
        "tuner_trials": len(tuner.trials),
        # the first tuner run's trials as the report has them: a run that settled badly can be read afterwards
        "tuner_decisions": [
            f"{t.settings.describe()}: {t.stats.steps} steps, {t.stats.mean_wall_s * 1e3:.1f} ms a step "
            f"(error {t.stats.wall_sem_s * 1e3:.1f} ms): {t.decision}"
            for t in tuner.trials
        ],
        "static_grid": {str(k): v for k, v in static.items()},
    }


def long_epoch(steps: int, grid: list[int], reps: int) -> dict[str, Any]:
    """One long latency-bound epoch started at 0 workers: where does the tuner settle, and how does the
    whole run compare with the best static config of ``grid`` (re-timed, see :func:`retimed`)? (Lower worker
    counts are left out of the grid: at 0-2 workers this epoch takes minutes, and they cannot be the oracle.)"""
    w = {"make": lambda n: SyntheticDataset(n, latency_ms=10.0), "samples": steps * BATCH, "step_ms": 5.0}
    static = {}
    for k in grid:
        static[k] = fit_once(w, k, 1, None)
        print(f"  long_epoch   static workers={k:<3d} {static[k]:7.2f} s", flush=True)
    tuner = DataLoaderTuner(verbose=False, report_path=False, cache=False)
    tuned = fit_once(w, 0, 1, tuner)
    oracle_k = min(static, key=static.get)
    print(f"  long_epoch   tuner {tuner.phase} at step {tuner.settled_step} of {steps} {tuned:7.2f} s", flush=True)
    fresh = lambda i: fit_once(w, 0, 1, DataLoaderTuner(verbose=False, report_path=False, cache=False))  # noqa: E731
    statics, tuners = retimed(lambda: fit_once(w, oracle_k, 1, None), fresh, reps)
    print(f"  long_epoch   re-timed: oracle ({oracle_k}w) {statics}, tuner {tuners} (first {tuned:.2f})", flush=True)
    first, (oracle, tuned) = tuned, (statistics.median(statics), statistics.median(tuners))  # both interleaved
    return {
        "steps": steps,
        "settled_step": tuner.settled_step,
        "tuner_phase": tuner.phase,
        "settled_frac": (tuner.settled_step or steps) / steps,
        "tuner_workers": tuner.best_settings["num_workers"],
        "tuner_s": tuned,
        "oracle_workers": oracle_k,
        "oracle_s": oracle,
        "ratio": tuned / oracle,
        "repeats": {"oracle": statics, "tuner": tuners, "tuner_first": first, "oracle_in_grid": static[oracle_k]},
        "paired": ratio_interval(tuners, statics),
        "static_grid": {str(k): v for k, v in static.items()},
    }


def tuner_host_time(epochs: int = 4) -> dict[str, float]:
    """Host time spent inside the tuner per step on the observe-only path of a real fit (every hook the callback
    has, and the fetch hooks around each batch), timed from inside: 10 ms simulated step, in-memory data, 0
    workers. Window closes (CPU and memory readings) are included, spread over the steps. While tuning, each
    step also peeks at its window for an early decision (not timed here)."""
    w = {"make": lambda n: in_memory_dataset(n), "samples": 640, "step_ms": 10.0}
    tuner = DataLoaderTuner(observe_only=True, verbose=False, report_path=False)
    spent = [0.0]

    def timed(f: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return call

    for name in dir(pl.Callback):  # the hooks the tuner has (the base class's no-ops are not its cost)
        if name.startswith("on_") and is_overridden(name, tuner, pl.Callback):
            setattr(tuner, name, timed(getattr(tuner, name)))
    # the fetch hooks are bound when the loop is patched (setup): time them from there
    tuner.switcher._before_fetch = timed(tuner.switcher._before_fetch)
    tuner.probe.fetch_ended = timed(tuner.probe.fetch_ended)
    t0 = time.perf_counter()
    fit_once(w, 0, epochs, tuner)
    whole = time.perf_counter() - t0
    steps = epochs * w["samples"] // BATCH
    return {"us_per_step": spent[0] / steps * 1e6, "share_of_run": spent[0] / whole, "steps": steps}


class HooksOnly(pl.Callback):
    """A callback with the hooks the tuner has, each doing nothing: what Lightning charges for calling one more
    callback at every step, whatever it does (the reference for the tuner's own overhead)."""


_TUNER_HOOKS = [
    name for name in dir(pl.Callback) if name.startswith("on_") and is_overridden(name, DataLoaderTuner, pl.Callback)
]
for _hook in ["setup", "teardown", *_TUNER_HOOKS]:
    setattr(HooksOnly, _hook, lambda self, *args, **kwargs: None)


def ratio_interval(runs: list[float], plain: list[float]) -> dict[str, Any]:
    """The ratio of paired runs: the geometric mean of the pairs' ratios, with its 95% interval (t on the log
    ratios)."""
    ratios = [a / b for a, b in zip(runs, plain, strict=True)]
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    half = T_975.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return {
        "ratio": math.exp(mean),
        "ratio_low": math.exp(mean - half),
        "ratio_high": math.exp(mean + half),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "ratios": ratios,
    }


def observe_overhead(epochs: int, reps: int) -> dict[str, Any]:
    """Observe-only tuner vs no callback on a fixed config, 10 ms simulated step, over ``reps`` rounds; each round
    runs no callback, the tuner, and a callback with the tuner's hooks doing nothing (:class:`HooksOnly`), in an
    order that turns from round to round (a drift of the machine within a round then cancels over the rounds).
    Reported for the tuner and for the empty callback: the ratio to no callback of the same round, as the geometric
    mean over the rounds with its 95% interval (single runs vary by a few percent here, more than the 1% the
    target asks to resolve)."""
    w = {"make": lambda n: in_memory_dataset(n), "samples": 640, "step_ms": 10.0}
    arms: dict[str, Callable[[], pl.Callback | None]] = {
        "none": lambda: None,
        # every hook the tuner installs runs; observe-only so that both runs train the same config
        "tuner": lambda: DataLoaderTuner(observe_only=True, verbose=False, report_path=False),
        "hooks_only": HooksOnly,
    }
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        order = names[i % 3 :] + names[: i % 3]
        for name in order[::-1] if (i // 3) % 2 else order:
            gc.collect()  # every run starts from a collected heap: a collection of earlier runs' garbage is no arm's
            times[name].append(fit_once(w, 0, epochs, arms[name]()))
    return {
        **ratio_interval(times["tuner"], times["none"]),
        "hooks_only": ratio_interval(times["hooks_only"], times["none"]),
        "repeats": reps,
        "epochs": epochs,
        "seconds": times,
    }


# Student's t, two-sided 95%, by degrees of freedom (the pairs' count less one)
T_975 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    11: 2.20,
    12: 2.18,
    13: 2.16,
    14: 2.14,
    15: 2.13,
    16: 2.12,
    17: 2.11,
    18: 2.10,
    19: 2.09,
    20: 2.09,
    21: 2.08,
    22: 2.07,
    23: 2.07,
    24: 2.06,
    25: 2.06,
    26: 2.06,
    27: 2.05,
    28: 2.05,
    29: 2.05,
    30: 2.04,
}  # then ~2.0


def overhead_verdict(ov: dict[str, Any], target: float = 1.01) -> str:
    """Whether the whole-run overhead is shown below ``target``: its interval's top must be, not only its mean."""
    if "ratio_high" not in ov:  # a result from before the interval was reported
        return "target below 1.01x"
    if ov["ratio_high"] < target:
        return f"target below {target:.2f}x: met"
    if ov["ratio"] < target:
        return f"target below {target:.2f}x: the mean is, but the interval is not yet narrow enough to show it"
    return f"target below {target:.2f}x: missed"


def paired_text(p: dict[str, Any] | None) -> str:
    """The 95% interval of the tuner's ratio over its interleaved pairs with the oracle, in words ("": one pair)."""
    if not p or len(p["ratios"]) < 2:
        return ""
    return f" (paired runs {p['ratio_low']:.2f}-{p['ratio_high']:.2f}x)"


def prose(results: dict[str, Any]) -> list[str]:
    """How to read the table, from its own numbers (so the words cannot contradict it)."""
    by = {r["workload"]: r for r in results["workloads"]}

    def ratio(name: str, key: str) -> float:
        return by[name]["seconds"][key] / by[name]["seconds"]["oracle"]

    def paired(name: str) -> str:
        return paired_text(by[name].get("paired"))

    def missed(names: list[str], target: float) -> str:
        """The workloads over ``target``, and whether the paired runs leave it within this host's noise."""
        over = [n for n in names if ratio(n, "tuner") > target]
        if not over:
            return ""
        noise = [n for n in over if by[n].get("paired", {}).get("ratio_low", math.inf) <= target]
        said = f" Over the {target:.2f}x target: {', '.join(over)}"
        if noise == over:
            return f"{said}; the 95% interval of the paired runs reaches below it, so this host's noise can explain it."
        return f"{said}; the paired runs' 95% interval lies above it: a miss beyond this host's noise."

    lines = ["How to read it (generated from the numbers below):", ""]
    io = [n for n in ("latency", "bursty") if n in by]
    if io:
        tuned = ", ".join(f"{n} {ratio(n, 'tuner'):.2f}x{paired(n)}" for n in io)
        cached = ", ".join(f"{ratio(n, 'tuner_cached'):.2f}x" for n in io)
        worst = max(max(ratio(n, "default"), ratio(n, "rule_of_thumb")) for n in io)
        best = min(min(ratio(n, "default"), ratio(n, "rule_of_thumb")) for n in io)
        verdict = "beats" if all(ratio(n, "tuner") <= 1.0 for n in io) else "does not yet beat"
        starts = ", ".join(
            f"{n} {by[n]['tuner_seamless_starts']} of {by[n]['epochs'] - 1}"
            for n in io
            if "tuner_seamless_starts" in by[n]
        )
        carried = (
            f" Their loader has no generator: each epoch draws its order from the global random state, which this "
            f"model leaves alone between epochs, so the tuner draws it ahead from a copy of that state, checks it at "
            f"the epoch's start, and loads the next epoch's first batches while this one ends (seamless epochs; "
            f"epoch starts that began with a full pipeline: {starts}); every static config refills its pipeline "
            "at each epoch's start."
            if starts
            else ""
        )
        lines.append(
            f"- I/O-bound workloads (short epochs, the tuner starting at the user's 0 workers): the tuner's whole run "
            f"is {tuned} the oracle's, so it {verdict} the best static config chosen after the fact; a second run "
            f"that starts from the tuning cache is {cached}. The default and the rule of thumb are "
            f"{best:.1f}-{worst:.1f}x.{missed(io, 1.0)}{carried}"
        )
        if all("tuner_seamless" in by[n]["seconds"] for n in io):
            seamless = ", ".join(f"{n} {ratio(n, 'tuner_seamless'):.2f}x" for n in io)
            verdict = "beats" if all(ratio(n, "tuner_seamless") <= 1.0 for n in io) else "does not beat"
            lines.append(
                f"- The same loaders with a generator (each epoch's order known ahead whatever training draws, so the "
                f"tuner's loader loads the next epoch's first batches while this one ends: seamless epochs): "
                f"{seamless} the oracle's whole run, so there it {verdict} the best static config (which, with or "
                "without a generator, refills its pipeline at every epoch start)."
            )
    rest = [n for n in ("cpu", "in_memory", "accelerator") if n in by]
    if rest:
        parts = ", ".join(f"{n} {ratio(n, 'tuner'):.2f}x{paired(n)}" for n in rest)
        lines.append(f"- CPU-bound, in-memory and accelerator-bound: {parts} the oracle.{missed(rest, 1.05)}")

    def edge(n: str, ms: dict[str, float]) -> str:
        seeded = f" / {ms['tuner_seamless']:.0f} ms (tuner, seeded loader)" if "tuner_seamless" in ms else ""
        return f"{n} {ms['oracle']:.0f} ms (oracle) / {ms['tuner']:.0f} ms (tuner){seeded}"

    edges = [edge(n, r["epoch_start_ms"]) for n, r in by.items() if "epoch_start_ms" in r]
    if edges:
        lines.append(
            "- Epoch-boundary stall (host time before the first 3 steps of each epoch after the first, beyond the "
            f"steps themselves: the pipeline refilling): {', '.join(edges)}."
        )
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    lines = prose(results) + table(results["workloads"])
    if "long_epoch" in results:  # absent from a run of the workloads alone (--workloads-only)
        lines += long_epoch_markdown(results["long_epoch"]) + overhead_markdown(results["overhead"])
    return "\n".join(lines + gpu_markdown(HERE / "results" / "gpu_cuda.json"))


def workloads_section(results: dict[str, Any], epochs: int, argv: list[str] | None) -> list[str]:
    """BENCHMARKS.md's section for a run of workloads alone: the command, each workload's ratio, the table."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Workloads run alone, under torch {results['machine']['torch']} (`python benchmarks/run.py {command}`):"]
    for r in results["workloads"]:
        ratio, paired = r["seconds"]["tuner"] / r["seconds"]["oracle"], paired_text(r["paired"])
        lines.append(f"the tuner took {ratio:.2f}x the oracle's whole run on {r['workload']}{paired}.")
    return [" ".join(lines), "", environment(results, epochs), "", *table(results["workloads"])]


def environment(results: dict[str, Any], epochs: int) -> str:
    m = results["machine"]
    return (
        f"Machine: {m['nproc']} CPUs ({m['cpu_bound_by']}), {m['platform']}, Python {m['python']}, torch "
        f"{m['torch']}, lightning {m['lightning']}; accelerator {results['accelerator']}; {epochs} epochs per run; "
        f"whole suite {results['wall_s'] / 60:.1f} min."
    )


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table of ``rows`` (one workload each), with how its cells were timed."""
    lines = [
        "Each cell: whole-run time / oracle's whole-run time (workers used, seconds). The oracle is chosen as the "
        "fastest of one run per static config, then timed again apart from that run, interleaved with as many fresh "
        f"tuner runs (the least of several noisy runs reads low): its cell and the tuner's are medians of the "
        f"{len(rows[0]['repeats']['oracle']) if rows and 'repeats' in rows[0] else 1} re-timed oracle runs and "
        f"{len(rows[0]['repeats']['tuner']) if rows and 'repeats' in rows[0] else 1} interleaved tuner runs; every "
        "other cell is one run (the cache column is the run after the first tuner run, which filled the cache).",
        "",
        "| workload | default (0) | Lightning suggested | rule of thumb | oracle (best static) | DataLoaderTuner | "
        "tuner, second run (cache) | tuner, seeded loader (seamless epochs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, k, o = r["seconds"], r["workers"], r["seconds"]["oracle"]

        def cell(key: str, s: dict = s, k: dict = k, o: float = o) -> str:
            return f"{s[key] / o:.2f}x ({k[key]}w, {s[key]:.1f} s)"

        lines.append(
            f"| {r['workload']}: {r['what']} | {cell('default')} | {cell('lightning_suggested')} | "
            f"{cell('rule_of_thumb')} | 1.00x ({k['oracle']}w, {o:.1f} s) | {cell('tuner')} | {cell('tuner_cached')} | "
            f"{cell('tuner_seamless')} |"
        )
    return lines


def long_epoch_markdown(le: dict[str, Any]) -> list[str]:
    long_paired = paired_text(le.get("paired"))
    return [
        "",
        f"One long latency-bound epoch ({le['steps']} steps, 10 ms per sample, from 0 workers, in-epoch "
        f"switching): the tuner {le['tuner_phase']} on {le['tuner_workers']} workers at step {le['settled_step']} "
        f"({le['settled_frac']:.0%} of the epoch, first run); whole run {le['tuner_s']:.1f} s vs the oracle's "
        f"{le['oracle_s']:.1f} s ({le['oracle_workers']} workers): {le['ratio']:.2f}x{long_paired} (medians of "
        f"{len(le.get('repeats', {}).get('tuner', [1]))} tuner runs and {len(le.get('repeats', {}).get('oracle', [1]))}"
        " re-timed oracle runs).",
    ]


def overhead_markdown(ov: dict[str, Any]) -> list[str]:
    oo, ho = ov["observe_only"], ov["observe_only"].get("hooks_only")
    return [
        "",
        f"Measurement overhead: {ov['tuner_host_time']['us_per_step']:.0f} us of host time per step inside the "
        f"tuner on the observe-only path, fetch hooks and window closes included "
        f"({ov['tuner_host_time']['share_of_run']:.2%} of an observe-only run on a 10 ms step, timed from inside); "
        f"observe-only tuner vs no callback, whole run: {oo['ratio']:.3f}x (95% interval {oo['ratio_low']:.3f}-"
        f"{oo['ratio_high']:.3f}x over {oo['repeats']} interleaved rounds of {oo['epochs']} epochs; single rounds "
        f"{oo['min_ratio']:.3f}-{oo['max_ratio']:.3f}; {overhead_verdict(oo)})."
        + (
            f" For reference, a callback with the same hooks doing nothing, in the same rounds: {ho['ratio']:.3f}x "
            f"({ho['ratio_low']:.3f}-{ho['ratio_high']:.3f}x): what Lightning charges for calling one more callback "
            "at every step."
            if ho
            else ""
        ),
    ]


def gpu_markdown(path: Path) -> list[str]:
    """The GPU benchmark's paragraph: its committed result (from ``scripts/gpu_check.sh``), or that it has none."""
    if not path.exists():
        return [
            "",
            "GPU: `benchmarks/gpu.py` (a small CNN on the GPU fed by CPU-decoded images, DataLoaderTuner from 0 "
            "workers against every static config) has no committed result yet: no GPU machine was available. "
            "`scripts/gpu_check.sh` runs it and writes `benchmarks/results/gpu_cuda.json`.",
        ]
    g = json.loads(path.read_text())
    r, t = g["ratios_to_oracle"], g["tuner"]

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    return [
        "",
        f"GPU ({g['device']}, {g['cpus']:g} CPUs, torch {g['torch']}; `benchmarks/gpu.py`, small CNN, CPU-decoded "
        f"images): DataLoaderTuner {r['tuner']:.2f}x the oracle ({g['oracle_workers']} workers), default "
        f"{r['default']:.2f}x, rule of thumb {r['rule_of_thumb']:.2f}x; settled on {t['settled']['num_workers']} "
        f"workers, GPU stall {pct(t['first_gpu_stall'])} at 0 workers and {pct(t['settled_gpu_stall'])} settled "
        f"(host: {pct(t['first_host_stall'])} and {pct(t['settled_host_stall'])}).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke size: 3 epochs, grid 0,2,8")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved re-timings of the oracle and the tuner (5; 1 --quick)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-md", action="store_true", help="regenerate BENCHMARKS.md from this run")
    parser.add_argument(
        "--workloads-only", action="store_true", help="skip the long epoch and the overhead (a run of workloads alone)"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # PyTorch warns about worker counts above the cores: that is the point
    epochs = args.epochs or (3 if args.quick else 8)
    grid = [0, 2, 8] if args.quick else [0, 1, 2, 4, 8, 16]
    reps = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    t0 = time.perf_counter()
    cache_dir = Path(tempfile.mkdtemp(prefix="dltune-bench-cache-"))
    os.environ["DLTUNE_CACHE"] = str(cache_dir / "default.json")  # never the user's own cache
    results: dict[str, Any] = {
        "machine": {
            "cpus": cpu_budget().cpus,
            "cpu_bound_by": cpu_budget().bound_by,
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "processor": platform.processor() or platform.machine(),
            "nproc": os.cpu_count(),
        },
        "accelerator": "simulated (sleep in training_step)"
        + ("; the imagefolder step runs on the CPU" if "imagefolder" in names else ""),
        "workloads": [run_workload(n, epochs, grid, cache_dir, reps) for n in names if n in WORKLOADS],
    }
    if not args.workloads_only:
        results["long_epoch"] = long_epoch(200, [8, 16], reps) if args.quick else long_epoch(600, [4, 8, 16], reps)
        results["overhead"] = {
            "tuner_host_time": tuner_host_time(),
            "observe_only": observe_overhead(2 if args.quick else 8, 2 if args.quick else 24),
        }
    results["wall_s"] = time.perf_counter() - t0
    if args.workloads_only:  # a section of its own in BENCHMARKS.md, beside the whole run's results
        name = "workloads-" + "-".join(names)
        write_results(args.out, f"{name}{'-quick' if args.quick else ''}.json", results)
        section = workloads_section(results, epochs, argv)
        print("\n".join(section))
        if args.write_md:
            write_section(name, "\n".join(section))
        return 0
    write_results(args.out, "quick.json" if args.quick else "latest.json", results)
    table_md = markdown(results)
    print("\n" + table_md)
    if args.write_md:
        text = (HERE.parent / "BENCHMARKS.md").read_text() if (HERE.parent / "BENCHMARKS.md").exists() else ""
        head = text.split("<!-- results -->")[0] if "<!-- results -->" in text else "# Benchmarks\n\n"
        body = f"<!-- results -->\n{environment(results, epochs)}\n\n" + table_md + "\n"
        (HERE.parent / "BENCHMARKS.md").write_text(head + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
