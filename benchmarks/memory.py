"""Memory benchmark: the guide's copy-on-read out-of-memory story, with the workers' memory read apart.

A dataset keeps 2 million Python strings (about 250 MB in the training process) and reads a slice of them per
sample, so each worker's unique memory grows as it loads samples (copy-on-read); it is latency-bound (6 ms per
sample), so the tuner wants many workers. ``DataLoaderTuner(max_memory=600 MiB)`` from 0 workers against a
static config of as many workers as the latency alone would call for. The workers' total unique memory (USS)
is sampled every 250 ms by this script, apart from the tuner's own reading.

    python benchmarks/memory.py               # writes benchmarks/results/memory.json
    python benchmarks/memory.py --write-md    # ... and its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.memory import MiB
from lightning_dltune.tools.synthetic import (
    PythonObjectsDataset,
    SimulatedModel,
    SyntheticDataModule,
    WorkerMemoryWatch,
)

from sections import QUIET, publish, write_results

HERE = Path(__file__).resolve().parent
BUDGET = 600 * MiB


def run(dataset: PythonObjectsDataset, workers: int, epochs: int, tuner: DataLoaderTuner | None) -> dict[str, Any]:
    model = SimulatedModel(step_ms=10.0)
    dm = SyntheticDataModule(dataset, batch_size=16, num_workers=workers, prefetch_factor=2 if workers else None)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[tuner] if tuner else [],
        **QUIET,
    )
    t0 = time.perf_counter()
    with WorkerMemoryWatch() as watch:
        trainer.fit(model, datamodule=dm)
    counts = collections.Counter(model.seen_indices)
    return {
        "seconds": time.perf_counter() - t0,
        "peak_worker_mib": watch.peak / MiB,
        "exact": counts == collections.Counter({i: epochs for i in range(len(dataset))}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-md", action="store_true", help="write its section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    epochs = 12  # persistent workers go on copying what they read: the later epochs hold the most
    static_workers = 8  # 96 ms per batch against a 10 ms step: about 8 workers hide the latency
    shapes = {
        # each sample reads its own slice of the strings (2,083 of them): a worker's copy grows with what it loads
        "tiled": PythonObjectsDataset(length=960, strings=2_000_000, latency_ms=6.0),
        # each sample reads 40,000 strings, overlapping its neighbours' (the shape of #34): a fresh worker copies
        # most of what it will hold in its first batches
        "overlapping": PythonObjectsDataset(length=960, strings=2_000_000, latency_ms=6.0, per_sample=40_000),
    }
    result: dict[str, Any] = {"budget_mib": BUDGET / MiB, "epochs": epochs, "shapes": {}}
    for name, dataset in shapes.items():
        static = run(dataset, static_workers, epochs, None)
        print(
            f"{name}: static {static_workers} workers: peak {static['peak_worker_mib']:.0f} MiB, "
            f"{static['seconds']:.1f} s"
        )
        tuner = DataLoaderTuner(max_memory=BUDGET, verbose=False, report_path=False, cache=False)  # a fresh run
        tuned = run(dataset, 0, epochs, tuner)
        over = [t for t in tuner.trials if t.failed and "memory budget" in t.failed]
        result["shapes"][name] = {
            "static": {"workers": static_workers, **static},
            "tuner": {
                **tuned,
                "workers": tuner.best_settings["num_workers"] if tuner.best_settings else None,
                "trials": [(t.settings.num_workers, t.decision) for t in tuner.trials],
                "left_over_budget": [t.settings.num_workers for t in over],
                "diagnosis": tuner.diagnosis,
            },
        }
    write_results(args.out, "memory.json", result)
    parts = []
    for name, shape in result["shapes"].items():
        t, static, budget = shape["tuner"], shape["static"], result["budget_mib"]
        parts.append(
            f"{name} slices: tuner peak {t['peak_worker_mib']:.0f} MiB ({t['peak_worker_mib'] / budget:.2f}x"
            f" the budget), settled on {t['workers']} workers, samples {'exact' if t['exact'] else 'NOT exact'}, "
            f"{t['seconds']:.1f} s; a static {static_workers} workers peaked at {static['peak_worker_mib']:.0f} MiB "
            f"({static['peak_worker_mib'] / budget:.2f}x), {static['seconds']:.1f} s"
        )
    section = (
        f"Memory budget (`benchmarks/memory.py`): 2 million Python strings, each sample reading a slice of them "
        f"(copy-on-read), its own 2,083 (tiled) or 40,000 overlapping its neighbours' (overlapping, the seed "
        f"guide's shape in #34); 6 ms per sample, batch 16, {epochs} epochs, `DataLoaderTuner(max_memory=600 MiB)` "
        f"from 0 workers (target: peak at most 1.05x the budget). The workers' total unique memory, sampled every "
        f"250 ms by the benchmark: " + "; ".join(parts) + "."
    )
    publish("memory", section, args.write_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
