"""Side-by-side benchmark: DataLoaderTuner against static loader configs, in one process.

For each workload the same model trains the same epochs with: the PyTorch default (0 workers), Lightning's
suggested count (cpus - 1), the half-the-cores rule of thumb, the static configs of a coarse-to-fine search over
the space the tuner chooses from (the best of which is the oracle), the oracle's config with seamless epochs, and
DataLoaderTuner starting from 0 workers. Whole-run time (``trainer.fit`` wall time, worker start-up and tuning
included) is reported as a ratio to the oracle, with a verdict from the paired rounds' 95% interval. The
accelerator's time is SIMULATED by a sleep in ``training_step`` (this machine has no GPU).

    python benchmarks/run.py                 # full run, writes benchmarks/results/latest.json
    python benchmarks/run.py --write-md      # ... and regenerates BENCHMARKS.md
    python benchmarks/run.py --quick --workloads latency   # CI smoke size
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib.util
import inspect
import itertools
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
from lightning_dltune.measurement.budget import cpu_budget, default_max_workers
from lightning_dltune.switching.loader import rebuild_dataloader  # noqa: F401  (documents how configs are applied)
from lightning_dltune.tools.synthetic import (
    CpuStepModel,
    ResNetClassifier,
    SimulatedModel,
    SyntheticDataModule,
    SyntheticDataset,
    cpu_step_matmuls,
    image_folder,
    in_memory_dataset,
    write_jpeg_folder,
)

from sections import BENCHMARKS_MD, write_results, write_section

HERE = Path(__file__).resolve().parent

WORKLOADS: dict[str, dict[str, Any]] = {
    "latency": {
        "make": lambda n: SyntheticDataset(n, latency_ms=10.0),
        "samples": 320,
        "step_ms": 5.0,
        "what": "10 ms storage wait per sample (the classic sleep)",
        "target": 1.0,
    },
    "cpu": {
        "make": lambda n: SyntheticDataset(n, cpu_ms=1.0),
        "samples": 640,
        "step_ms": 5.0,
        "what": "1 ms CPU decode/augment per sample",
        "target": 1.05,
    },
    "bursty": {
        "make": lambda n: SyntheticDataset(n, latency_ms=2.0, tail_prob=0.05, tail_factor=25.0),
        "samples": 640,
        "step_ms": 5.0,
        "what": "2 ms wait, 5% of samples 25x slower",
        "target": 1.0,
    },
    "in_memory": {
        "make": lambda n: in_memory_dataset(n),
        "samples": 1280,
        "step_ms": 5.0,
        "what": "TensorDataset already in memory",
        "target": 1.05,
    },
    "cpu_step": {
        "make": lambda n: SyntheticDataset(n, cpu_ms=1.5),
        # 64 steps an epoch, 128 steps: with 16-step epochs, 4-10 persistent workers at prefetch 4 load a whole
        # epoch before its first step and the step then runs alone (a shape of tiny epochs, see BENCHMARKS.md)
        "samples": 1024,
        "epochs": 2,
        "step_ms": 20.0,
        "model": lambda: CpuStepModel(matmuls=_cpu_step_matmuls()),
        "what": "1.5 ms CPU decode per sample, a 20 ms step that computes on the CPUs",
        "target": 1.05,
    },
    "accelerator": {
        "make": lambda n: SyntheticDataset(n, latency_ms=0.3),
        "samples": 320,
        "step_ms": 40.0,
        "what": "light loading, 40 ms simulated step",
        "target": 1.05,
    },
}
BATCH = 16
TUNER_MAX_PREFETCH = inspect.signature(DataLoaderTuner).parameters["max_prefetch"].default


@functools.cache
def _cpu_step_matmuls() -> int:
    """The cpu_step workload's work per step, measured once per run of this script (every arm does the same)."""
    return cpu_step_matmuls(WORKLOADS["cpu_step"]["step_ms"])


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
        "target": 1.05,
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


Config = tuple[int, int]  # (num_workers, prefetch_factor); the prefetch of 0 workers is unused and kept at 2


def describe(config: Config) -> str:
    """``16w`` at PyTorch's default prefetch of 2, ``16w p4`` otherwise."""
    k, p = config
    return f"{k}w" if k == 0 or p == 2 else f"{k}w p{p}"


def fit_once(
    workload: dict[str, Any],
    workers: int,
    epochs: int,
    tuner: DataLoaderTuner | None,
    boundary: EpochStart | None = None,
    seed: int | None = None,
    prefetch: int = 2,
) -> float:
    dm = SyntheticDataModule(
        workload["make"](workload["samples"]),
        batch_size=BATCH,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
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
    gc.collect()  # every run starts from a collected heap: a collection of earlier runs' garbage is no arm's
    t0 = time.perf_counter()
    model = workload["model"]() if "model" in workload else SimulatedModel(step_ms=workload["step_ms"])
    trainer.fit(model, datamodule=dm)
    return time.perf_counter() - t0


def timed_run(
    workload: dict[str, Any], config: Config, epochs: int, tuner: DataLoaderTuner | None = None, seed: int | None = None
) -> tuple[float, float]:
    """One whole run and its mean epoch-start stall (ms). Every run of every arm has the same :class:`EpochStart`
    callback, so no arm pays for a timing callback the others do not."""
    boundary = EpochStart()
    wall = fit_once(workload, config[0], epochs, tuner, boundary, seed, config[1])
    return wall, boundary.mean_ms


def search(time_config: Callable[[Config], float], coarse: list[int], max_workers: int, refine: int) -> dict:
    """The oracle's search, over the space the tuner chooses from (0 to ``max_workers`` workers, prefetch 2 to the
    tuner's default ``max_prefetch``), coarse to fine, one run per config: ``coarse`` counts at prefetch 2, then
    ``refine`` rounds of the counts halfway between the best count and its nearest neighbours tried, then the
    deeper prefetches at the best count. Returns every config's time."""
    times: dict[Config, float] = {}

    def run(config: Config) -> None:
        if config not in times:
            times[config] = time_config(config)

    for k in coarse:
        run((min(k, max_workers), 2))
    for _ in range(refine):
        best = min(times, key=times.__getitem__)[0]
        counts = sorted({k for k, _ in times})
        i = counts.index(best)
        for other in counts[max(0, i - 1) : i] + counts[i + 1 : i + 2]:
            run(((best + other) // 2, 2))
    best = min(times, key=times.__getitem__)[0]
    for p in (4, TUNER_MAX_PREFETCH) if best else ():
        run((best, p))
    return times


def rounds(arms: dict[str, Callable[[], tuple[float, float, str]]], reps: int) -> dict[str, dict[str, list]]:
    """``reps`` rounds of every arm, the order turning from round to round (and reversed every other turn), so
    that a drift of the machine within a round, and which arm runs first, cancel over the rounds. Each arm returns
    its wall time, its epoch-start stall and the config it ran."""
    names = list(arms)
    out: dict[str, dict[str, list]] = {n: {"s": [], "epoch_start_ms": [], "config": []} for n in names}
    for i in range(reps):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order[::-1] if (i // len(names)) % 2 else order:
            wall, ms, config = arms[name]()
            out[name]["s"].append(wall)
            out[name]["epoch_start_ms"].append(ms)
            out[name]["config"].append(config)
    return out


def median_config(arm: dict[str, list]) -> str:
    """The config of the run whose time is the median (the lower middle of an even count), and the range of the
    others where they differ: the workers shown beside a median time are those of the runs it was taken over."""
    order = sorted(range(len(arm["s"])), key=arm["s"].__getitem__)
    shown = arm["config"][order[(len(order) - 1) // 2]]
    others = sorted(set(arm["config"]) - {shown})
    return shown + (f"; others {', '.join(others)}" if others else "")


def tuned_config(tuner: DataLoaderTuner) -> str:
    s = tuner.best_settings or tuner.state.current.to_loader_kwargs()
    return describe((s["num_workers"], s.get("prefetch_factor") or 2)) + (" pinned" if s.get("pin_memory") else "")


def rules_fired(tuner: DataLoaderTuner) -> collections.Counter[str]:
    """The rules that made the tuner's decisions (one count per decision) and the diagnosis that made its summary."""
    fired = collections.Counter(t.rule for t in tuner.trials if t.rule)
    if tuner.state.diagnosed_by:
        fired[tuner.state.diagnosed_by] += 1
    return fired


def run_workload(name: str, epochs: int, grid: list[int], cache_dir: Path, reps: int, refine: int) -> dict[str, Any]:
    w = WORKLOADS[name]
    epochs = w.get("epochs", epochs)  # a workload whose shape needs epochs of its own length
    cpus = cpu_budget().cpus
    max_workers = default_max_workers(cpus)  # the tuner's ceiling with its default arguments
    suggested = max(1, int(cpus) - 1)  # lightning's suggested_max_num_workers
    thumb = max(1, min(8, int(cpus) // 2))  # "half the cores, never above 8"
    boundary: dict[Config, float] = {}

    def static_run(config: Config) -> float:
        wall, boundary[config] = timed_run(w, config, epochs)
        print(f"  {name:12s} static {describe(config):8s} {wall:7.2f} s", flush=True)
        return wall

    static = search(static_run, sorted(set(grid) | {0, suggested, thumb}), max_workers, refine)
    oracle_c = min(static, key=static.__getitem__)
    above = None
    if oracle_c[0] >= max_workers:  # the best count is the cap: what the cap costs, from one run above it
        config = (2 * max_workers, oracle_c[1])
        above = {"config": describe(config), "s": timed_run(w, config, epochs)[0]}
        print(f"  {name:12s} static {above['config']:8s} {above['s']:7.2f} s (above max_workers)", flush=True)
    cache = cache_dir / f"{name}.json"  # a fresh cache per workload: the first run tunes, the second hits it
    tuner = DataLoaderTuner(verbose=False, report_path=False, cache=cache)
    tuned, tuned_ms = timed_run(w, (0, 2), epochs, tuner)
    print(f"  {name:12s} tuner -> {tuned_config(tuner)} {tuned:7.2f} s", flush=True)
    again = DataLoaderTuner(verbose=False, report_path=False, cache=cache)
    second = timed_run(w, (0, 2), epochs, again)[0]
    print(f"  {name:12s} tuner, second run (cache hit: {again.cache_hit}) {tuned_config(again)} {second:7.2f} s")
    # the same loader with a generator (`DataLoader(..., generator=g)`): each epoch's order is known before it
    # begins, so the tuner's loader also loads the next epoch's first batches ahead (seamless epochs). A generator
    # changes which order is drawn, not what a static config costs
    seeded_tuner = DataLoaderTuner(verbose=False, report_path=False, cache=cache_dir / f"{name}_seeded.json")
    seeded, seeded_ms = timed_run(w, (0, 2), epochs, seeded_tuner, seed=0)
    carried = seeded_tuner.switcher.seamless.carried
    print(f"  {name:12s} tuner, seeded loader ({carried} seamless epoch starts) {seeded:7.2f} s", flush=True)
    fired = rules_fired(tuner) + rules_fired(again) + rules_fired(seeded_tuner)
    arms = round_arms(w, name, epochs, oracle_c, cache_dir, fired=fired)
    timing = rounds(arms, reps)
    for arm, got in timing.items():
        print(f"  {name:12s} re-timed {arm}: {[round(s, 2) for s in got['s']]} ({got['config']})", flush=True)
    return {
        "workload": name,
        "what": w["what"],
        "target": w["target"],
        "epochs": epochs,
        "rounds": timing,
        "repeats": {"tuner_first": tuned, "oracle_in_grid": static[oracle_c]},
        # the re-timed runs in their rounds: how far this host's noise leaves each ratio
        "paired": ratio_interval(timing["tuner"]["s"], timing["oracle"]["s"]),
        "paired_seamless": (
            ratio_interval(timing["oracle_seamless"]["s"], timing["oracle"]["s"]) if "oracle_seamless" in arms else None
        ),
        "paired_tuning": (  # what tuning wins beyond seamless epochs: the tuner against the oracle with them
            ratio_interval(timing["tuner"]["s"], timing["oracle_seamless"]["s"]) if "oracle_seamless" in arms else None
        ),
        "seconds": {
            "default": static[(0, 2)],
            "lightning_suggested": static[(suggested, 2)],
            "rule_of_thumb": static[(thumb, 2)],
            **{arm: statistics.median(got["s"]) for arm, got in timing.items()},
            "tuner_cached": second,
            "tuner_seamless": seeded,
        },
        "workers": {
            "default": "0w",
            "lightning_suggested": describe((suggested, 2)),
            "rule_of_thumb": describe((thumb, 2)),
            **{arm: median_config(got) for arm, got in timing.items()},
            "tuner_cached": tuned_config(again),
            "tuner_seamless": tuned_config(seeded_tuner),
        },
        "above_max_workers": above,
        "max_workers": max_workers,
        "search": {"coarse": sorted(set(grid) | {0, suggested, thumb}), "refine": refine},
        "seamless_epoch_starts": carried,
        # the default tuner's loader has no generator: its orders are drawn ahead from a copy of the global random
        # state (SimulatedModel draws nothing from it), checked at each epoch's start
        "tuner_seamless_starts": tuner.switcher.seamless.carried,
        "tuner_cached_seamless_starts": again.switcher.seamless.carried,
        "cache_hit": again.cache_hit,
        "epoch_start_ms": {
            **{arm: statistics.median(got["epoch_start_ms"]) for arm, got in timing.items()},
            "tuner_first": tuned_ms,
            "tuner_seamless": seeded_ms,
        },
        "tuner_trials": len(tuner.trials),
        # the first tuner run's trials as the report has them: a run that settled badly can be read afterwards
        "tuner_decisions": [
            f"{t.settings.describe()}: {t.stats.steps} steps, {t.stats.mean_wall_s * 1e3:.1f} ms a step "
            f"(error {t.stats.wall_sem_s * 1e3:.1f} ms): {t.decision}"
            for t in tuner.trials
        ],
        "static_grid": {describe(c): v for c, v in static.items()},
        # every tuner run of the workload (first, cache, seeded, the rounds'): each rule's decisions, and diagnoses
        "rules_fired": dict(fired.most_common()),
    }


def round_arms(
    w: dict[str, Any],
    name: str,
    epochs: int,
    oracle: Config,
    cache_dir: Path,
    seamless: bool = True,
    fired: collections.Counter[str] | None = None,
) -> dict[str, Callable[[], tuple[float, float, str]]]:
    """The arms re-timed in rounds: the oracle's config, a fresh tuner from 0 workers, and (where the oracle has
    workers to load ahead with) the oracle's config with seamless epochs, the documented way to have them alone:
    ``DataLoaderTuner(max_trials=1, cache=False)`` keeps the loader's config and only measures it. ``fired``: counts
    the rules of each tuner run (:func:`rules_fired`)."""
    count = itertools.count()

    def oracle_arm() -> tuple[float, float, str]:
        return (*timed_run(w, oracle, epochs), describe(oracle))

    def tuner_arm() -> tuple[float, float, str]:
        tuner = DataLoaderTuner(verbose=False, report_path=False, cache=cache_dir / f"{name}_again{next(count)}.json")
        timed = timed_run(w, (0, 2), epochs, tuner)
        if fired is not None:
            fired.update(rules_fired(tuner))
        return (*timed, tuned_config(tuner))

    def seamless_arm() -> tuple[float, float, str]:
        tuner = DataLoaderTuner(max_trials=1, cache=False, verbose=False, report_path=False)
        return (*timed_run(w, oracle, epochs, tuner), tuned_config(tuner))

    arms = {"oracle": oracle_arm, "tuner": tuner_arm}
    if seamless and oracle[0] > 0:
        arms["oracle_seamless"] = seamless_arm
    return arms


def long_epoch(steps: int, grid: list[int], reps: int, refine: int) -> dict[str, Any]:
    """One long latency-bound epoch started at 0 workers: where does the tuner settle, and how does the whole run
    compare with the best static config (searched as for the workloads, from the counts of ``grid``, and re-timed
    in rounds)? (Lower worker counts are left out of the grid: at 0-2 workers this epoch takes minutes, and they
    cannot be the oracle.) One epoch has no epoch start to hide: seamless epochs add nothing here."""
    w = {"make": lambda n: SyntheticDataset(n, latency_ms=10.0), "samples": steps * BATCH, "step_ms": 5.0}
    max_workers = default_max_workers(cpu_budget().cpus)

    def static_run(config: Config) -> float:
        wall = timed_run(w, config, 1)[0]
        print(f"  long_epoch   static {describe(config):8s} {wall:7.2f} s", flush=True)
        return wall

    static = search(static_run, grid, max_workers, refine)
    oracle_c = min(static, key=static.__getitem__)
    above = None
    if oracle_c[0] >= max_workers:
        config = (2 * max_workers, oracle_c[1])
        above = {"config": describe(config), "s": timed_run(w, config, 1)[0]}
    tuner = DataLoaderTuner(verbose=False, report_path=False, cache=False)
    first = timed_run(w, (0, 2), 1, tuner)[0]
    print(f"  long_epoch   tuner {tuner.phase} at step {tuner.settled_step} of {steps} {first:7.2f} s", flush=True)
    timing = rounds(round_arms(w, "long_epoch", 1, oracle_c, Path(tempfile.mkdtemp()), seamless=False), reps)
    print(f"  long_epoch   re-timed: {timing}", flush=True)
    oracle, tuned = statistics.median(timing["oracle"]["s"]), statistics.median(timing["tuner"]["s"])
    return {
        "steps": steps,
        "settled_step": tuner.settled_step,
        "tuner_phase": tuner.phase,
        "settled_frac": (tuner.settled_step or steps) / steps,
        "tuner_workers": median_config(timing["tuner"]),
        "tuner_s": tuned,
        "oracle_workers": describe(oracle_c),
        "oracle_s": oracle,
        "ratio": tuned / oracle,
        "above_max_workers": above,
        "rounds": timing,
        "repeats": {"tuner_first": first, "oracle_in_grid": static[oracle_c]},
        "paired": ratio_interval(timing["tuner"]["s"], timing["oracle"]["s"]),
        "static_grid": {describe(c): v for c, v in static.items()},
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


def verdict(p: dict[str, Any] | None, target: float = 1.0) -> str:
    """One rule for every target: "beats" (1.0) or "meets" (any other target) where the paired runs' 95% interval
    lies below ``target``, "within noise of" where it spans it, "misses" where it lies above; no verdict from one
    pair."""
    if not p or len(p.get("ratios", [])) < 2:
        return "no verdict"
    if p["ratio_high"] < target:
        return f"{'beats' if target == 1.0 else 'meets'} {target:.2f}x"
    if p["ratio_low"] > target:
        return f"misses {target:.2f}x"
    return f"within noise of {target:.2f}x"


def overhead_verdict(ov: dict[str, Any], target: float = 1.01) -> str:
    """The observe-only overhead against its target, by :func:`verdict`'s rule."""
    if "ratio_high" not in ov:  # a result from before the interval was reported
        return "target below 1.01x"
    return f"target below {target:.2f}x: {verdict({'ratios': [0, 0], **ov}, target)}"


def interval(p: dict[str, Any] | None) -> str:
    """A paired ratio and its 95% interval, ``0.68x (0.66-0.72x)`` (no interval from one pair)."""
    if not p:
        return "n/a"
    if len(p["ratios"]) < 2:
        return f"{p['ratio']:.2f}x (one pair)"
    return f"{p['ratio']:.2f}x ({p['ratio_low']:.2f}-{p['ratio_high']:.2f}x)"


def paired_text(p: dict[str, Any] | None) -> str:
    """The 95% interval of the tuner's ratio over its interleaved pairs with the oracle, in words ("": one pair)."""
    if not p or len(p["ratios"]) < 2:
        return ""
    return f" (paired runs {p['ratio_low']:.2f}-{p['ratio_high']:.2f}x)"


def prose(results: dict[str, Any]) -> list[str]:
    """How to read the tables, from their own numbers (so the words cannot contradict them)."""
    by = {r["workload"]: r for r in results["workloads"]}

    def ratio(name: str, key: str) -> float:
        return by[name]["seconds"][key] / by[name]["seconds"]["oracle"]

    def said(names: list[str]) -> str:
        return ", ".join(f"{n} {interval(by[n]['paired'])}: {verdict(by[n]['paired'], by[n]['target'])}" for n in names)

    lines = [
        "How to read it (generated from the numbers below). Verdicts, one rule for every target: the tuner's whole "
        "run against the oracle's over the interleaved rounds, as the geometric mean of the rounds' ratios with its "
        "95% interval; it beats (or meets) a target where the whole interval lies below it, is within noise where "
        "the interval spans it, and misses where the interval lies above.",
        "",
    ]
    io = [n for n in ("latency", "bursty") if n in by]
    if io:
        cached = ", ".join(f"{ratio(n, 'tuner_cached'):.2f}x" for n in io)
        worst = max(max(ratio(n, "default"), ratio(n, "rule_of_thumb")) for n in io)
        best = min(min(ratio(n, "default"), ratio(n, "rule_of_thumb")) for n in io)
        lines.append(
            f"- I/O-bound workloads (short epochs, the tuner starting at the user's 0 workers), the tuner against the "
            f"best static config chosen after the fact: {said(io)}; a second run that starts from the tuning cache "
            f"is {cached} (one run each). The default and the rule of thumb are {best:.1f}-{worst:.1f}x."
        )
        apart = [n for n in io if by[n].get("paired_seamless")]
        if apart:
            lines.append(
                "- What seamless epochs win apart from what tuning wins: the oracle's own config with seamless epochs "
                "(`DataLoaderTuner(max_trials=1, cache=False)`: the loader's config kept, measured, each epoch's first "
                "batches loaded while the last one ends) against the oracle: "
                + ", ".join(f"{n} {interval(by[n]['paired_seamless'])}" for n in apart)
                + "; the tuner against that: "
                + ", ".join(f"{n} {interval(by[n]['paired_tuning'])}" for n in apart)
                + " (what tuning from 0 workers adds or costs beyond seamless epochs)."
            )
    rest = [n for n in by if n not in io]
    if rest:
        lines.append(f"- The other workloads, the tuner against the oracle: {said(rest)}.")
    capped = [n for n in by if by[n].get("above_max_workers")]
    if capped:
        above = {n: by[n]["above_max_workers"] for n in capped}
        parts = ", ".join(f"{n} {a['config']} {a['s'] / by[n]['seconds']['oracle']:.2f}x" for n, a in above.items())
        lines.append(
            f"- Where the oracle's count is the tuner's ceiling (`max_workers`, {by[capped[0]]['max_workers']} here), "
            f"one static run above it, against the oracle: {parts}: what the ceiling costs there."
        )

    def edge(n: str, ms: dict[str, float]) -> str:
        seamless = f" / {ms['oracle_seamless']:.0f} ms (oracle, seamless epochs)" if "oracle_seamless" in ms else ""
        return f"{n} {ms['oracle']:.0f} ms (oracle){seamless} / {ms['tuner']:.0f} ms (tuner)"

    edges = [edge(n, r["epoch_start_ms"]) for n, r in by.items() if "epoch_start_ms" in r]
    if edges:
        lines.append(
            "- Epoch-boundary stall (host time before the first 3 steps of each epoch after the first, beyond the "
            f"steps themselves: the pipeline refilling; medians over the rounds): {', '.join(edges)}."
        )
    return [*lines, ""]


def fired_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The rules fired per workload, over every tuner run of it: each decision's rule, and the diagnosis."""
    if not any("rules_fired" in r for r in rows):
        return []
    lines = [
        "",
        "Rules fired per workload, over every tuner run of it (the first, the cache's, the seeded loader's and the "
        "rounds'): each decision counts its rule, each run's summary its diagnosis (`docs/how-it-decides.md`):",
        "",
        "| workload | rules fired (times) |",
        "|---|---|",
    ]
    for r in rows:
        fired = r.get("rules_fired", {})
        lines.append(f"| {r['workload']} | {', '.join(f'`{k}` {v}' for k, v in fired.items()) or '-'} |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = prose(results) + table(results["workloads"]) + fired_markdown(results["workloads"])
    if "long_epoch" in results:  # absent from a run of the workloads alone (--workloads-only)
        lines += long_epoch_markdown(results["long_epoch"]) + overhead_markdown(results["overhead"])
    return "\n".join(lines + gpu_markdown(HERE / "results" / "gpu_cuda.json"))


def workloads_section(results: dict[str, Any], epochs: int, argv: list[str] | None) -> list[str]:
    """BENCHMARKS.md's section for a run of workloads alone: the command, each workload's verdict, the tables."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Workloads run alone, under torch {results['machine']['torch']} (`python benchmarks/run.py {command}`):"]
    for r in results["workloads"]:
        lines.append(
            f"the tuner took {interval(r['paired'])} the oracle's whole run on {r['workload']} "
            f"({verdict(r['paired'], r['target'])})."
        )
    rows = results["workloads"]
    return [" ".join(lines), "", environment(results, epochs), "", *table(rows), *fired_markdown(rows)]


def environment(results: dict[str, Any], epochs: int) -> str:
    m = results["machine"]
    own = ", ".join(f"{name} {w['epochs']}" for name, w in WORKLOADS.items() if "epochs" in w)
    own = f" ({own}: their own)" if own else ""
    return (
        f"Machine: {m['nproc']} CPUs ({m['cpu_bound_by']}), {m['platform']}, Python {m['python']}, torch "
        f"{m['torch']}, lightning {m['lightning']}; accelerator {results['accelerator']}; {epochs} epochs per run"
        f"{own}; "
        f"whole suite {results['wall_s'] / 60:.1f} min."
    )


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The side-by-side tables of ``rows`` (one workload each), with how their cells were timed."""
    reps = len(rows[0]["rounds"]["oracle"]["s"]) if rows else 0
    coarse, refine = rows[0]["search"]["coarse"], rows[0]["search"]["refine"]
    lines = [
        "Each cell: whole-run time / oracle's whole-run time (config, seconds; `16w p4`: 16 workers, prefetch 4). "
        "The oracle is searched over the space the tuner chooses from, one run per config (the counts "
        f"{', '.join(map(str, coarse))} at prefetch 2, then the counts halfway to the best one's neighbours, "
        f"{refine} time(s), then prefetch 4 and {TUNER_MAX_PREFETCH} at the best count; `max_workers` is "
        f"{rows[0]['max_workers'] if rows else '?'}), then timed again in rounds with a fresh tuner from 0 workers "
        "and with its own config "
        f"given seamless epochs, the order of the arms turned every round: those three cells are medians of {reps} "
        "runs, shown with the config of the median run (the least of several noisy runs reads low, so the run that "
        "chose the oracle is not its time). The cells marked one run are single runs, with the same callbacks as "
        "every other run (the cache column is the run after the first tuner run, which filled the cache).",
        "",
        "| workload | default (0), one run | Lightning suggested, one run | rule of thumb, one run | oracle (best "
        "static) | oracle + seamless epochs | DataLoaderTuner | tuner, second run (cache), one run | tuner, seeded "
        "loader, one run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, k, o = r["seconds"], r["workers"], r["seconds"]["oracle"]

        def cell(key: str, s: dict = s, k: dict = k, o: float = o) -> str:
            return (
                f"{s[key] / o:.2f}x ({k[key]}, {s[key]:.1f} s)"
                if key in s
                else "n/a (0 workers: nothing to load ahead)"
            )

        lines.append(
            f"| {r['workload']}: {r['what']} | {cell('default')} | {cell('lightning_suggested')} | "
            f"{cell('rule_of_thumb')} | 1.00x ({k['oracle']}, {o:.1f} s) | {cell('oracle_seamless')} | "
            f"{cell('tuner')} | {cell('tuner_cached')} | {cell('tuner_seamless')} |"
        )
    lines += [
        "",
        f"Paired ratios over the {reps} rounds (geometric mean, 95% interval) and their verdicts:",
        "",
        "| workload | tuner / oracle | target | verdict | (oracle + seamless) / oracle | tuner / (oracle + seamless) | "
        "configs searched | above `max_workers`, one run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        above = r.get("above_max_workers")
        cap = f"{above['config']}: {above['s'] / r['seconds']['oracle']:.2f}x" if above else "-"
        lines.append(
            f"| {r['workload']} | {interval(r['paired'])} | {r['target']:.2f}x | {verdict(r['paired'], r['target'])} | "
            f"{interval(r.get('paired_seamless'))} | {interval(r.get('paired_tuning'))} | {len(r['static_grid'])} | "
            f"{cap} |"
        )
    return lines


def long_epoch_markdown(le: dict[str, Any]) -> list[str]:
    above = le.get("above_max_workers")
    cap = (
        f" One static run above the ceiling, {above['config']}: {above['s'] / le['oracle_s']:.2f}x the oracle."
        if above
        else ""
    )
    return [
        "",
        f"One long latency-bound epoch ({le['steps']} steps, 10 ms per sample, from 0 workers, in-epoch "
        f"switching): the tuner {le['tuner_phase']} at step {le['settled_step']} ({le['settled_frac']:.0%} of the "
        f"epoch, first run); whole run {le['tuner_s']:.1f} s ({le['tuner_workers']}) vs the oracle's "
        f"{le['oracle_s']:.1f} s ({le['oracle_workers']}, searched over {len(le['static_grid'])} configs): "
        f"{interval(le['paired'])}, {verdict(le['paired'])} (medians and paired ratios of "
        f"{len(le['rounds']['tuner']['s'])} rounds).{cap}",
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
    parser.add_argument("--quick", action="store_true", help="CI smoke size: 3 epochs, grid 0,2,8, one refinement")
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
    cap = default_max_workers(cpu_budget().cpus)
    grid = [0, 2, 8] if args.quick else [0, 1, 2, 4, 8, cap]
    refine = 1 if args.quick else 2
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
        "workloads": [run_workload(n, epochs, grid, cache_dir, reps, refine) for n in names if n in WORKLOADS],
    }
    if not args.workloads_only:
        results["long_epoch"] = long_epoch(200 if args.quick else 600, [4, 8, cap], reps, refine)
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
        text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
        head = text.split("<!-- results -->")[0] if "<!-- results -->" in text else "# Benchmarks\n\n"
        body = f"<!-- results -->\n{environment(results, epochs)}\n\n" + table_md + "\n"
        BENCHMARKS_MD.write_text(head + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
