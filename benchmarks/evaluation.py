"""Evaluation-loader benchmark (issue 36): the loaders of a run other than the train one.

Workloads, each latency-bound (``--latency-ms`` a sample) and started from the Lightning default of 0 workers:

* ``val``: a whole ``fit`` whose validation set is checked every epoch, as Lightning does by default: a DataModule
  (640 training and 320 validation samples, batch 32, 5 epochs) that passes the same ``**loader_kwargs`` to both
  of its loaders;
* ``val_quarter``: the same with ``val_check_interval=0.25`` (validation four times an epoch);
* ``predict``: a ``trainer.predict`` of its own over 320 batches of 16.

Arms, their order rotated every round: the default (0 workers), ``DataLoaderTuner()`` from there, the rule of thumb
(half the CPUs, never above 8) and static configs set by hand on every loader (persistent workers, prefetch 2), the
best of which is the oracle. Whole-run wall times, medians over the rounds; each ratio with its paired range.

    python benchmarks/evaluation.py                 # writes benchmarks/results/evaluation.json
    python benchmarks/evaluation.py --write-md      # ... and its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner
from lightning_dltune.synthetic import SimulatedModel, SyntheticDataset

from sections import write_results, write_section

HERE = Path(__file__).resolve().parent


class TwoLoaders(pl.LightningDataModule):
    def __init__(self, latency_ms: float, **loader_kwargs: Any) -> None:
        super().__init__()
        self.train_set = SyntheticDataset(640, latency_ms=latency_ms)
        self.val_set = SyntheticDataset(320, latency_ms=latency_ms)
        self.loader_kwargs = loader_kwargs

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=32, shuffle=True, **self.loader_kwargs)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=32, **self.loader_kwargs)

    def predict_dataloader(self) -> DataLoader:
        dataset = SyntheticDataset(320 * 16, latency_ms=self.val_set.latency_ms)
        return DataLoader(dataset, batch_size=16, **self.loader_kwargs)


class Model(SimulatedModel):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_ms / 1e3)
        return self.layer(batch[0]).argmax(1)


WORKLOADS = {"val": {}, "val_quarter": {"val_check_interval": 0.25}, "predict": {}}


def run(arm: str, workload: str, latency_ms: float, epochs: int) -> tuple[float, str]:
    pl.seed_everything(0)
    tuner = DataLoaderTuner(cache=False, report_path=False, verbose=False) if arm == "tuned" else None
    workers = 0 if arm in ("default", "tuned") else int(arm.split("=")[1])
    kwargs = {"num_workers": workers, "persistent_workers": True} if workers else {}
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[tuner] if tuner else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **WORKLOADS[workload],
    )
    data, model = TwoLoaders(latency_ms, **kwargs), Model(step_ms=2.0)
    t0 = time.perf_counter()
    trainer.predict(model, datamodule=data, return_predictions=False) if workload == "predict" else trainer.fit(
        model, datamodule=data
    )
    wall = time.perf_counter() - t0
    if tuner is None:
        return wall, str(workers) if workload == "predict" else f"{workers} / {workers}"
    evaluated = tuner.evals.tuners["predict" if workload == "predict" else "val"].state.current
    n = evaluated.num_workers if evaluated else "?"
    return wall, str(n) if workload == "predict" else f"{tuner.state.current.num_workers} / {n}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="val,val_quarter,predict")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--static", default="8,12,16", help="worker counts of the static configs set by hand")
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpus = len(os.sched_getaffinity(0))
    thumb = f"workers={min(8, max(1, cpus // 2))}"
    arms = list(dict.fromkeys(["default", "tuned", thumb, *(f"workers={w}" for w in args.static.split(","))]))
    sections, results = [], {}
    for workload in args.workloads.split(","):
        walls: dict[str, list[float]] = {a: [] for a in arms}
        configs: dict[str, list[str]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                wall, config = run(arm, workload, args.latency_ms, args.epochs)
                walls[arm].append(wall)
                configs[arm].append(config)
                print(f"{workload} round {r}: {arm:12s} {wall:6.2f} s  workers {config}", file=sys.stderr)
        results[workload] = {"walls": walls, "configs": configs}
        sections.append(table(workload, arms, thumb, walls, configs, args, cpus))
        print(sections[-1])
    write_results(HERE / "results", "evaluation.json", results)
    if args.write_md:
        write_section("evaluation", "### Evaluation loaders (issue 36)\n\n" + "\n\n".join(sections))
    return 0


def table(
    workload: str,
    arms: list[str],
    thumb: str,
    walls: dict[str, list[float]],
    configs: dict[str, list[str]],
    args: argparse.Namespace,
    cpus: int,
) -> str:
    static = [a for a in arms if a.startswith("workers=")]
    oracle = min(static, key=lambda a: statistics.median(walls[a]))
    what = {
        "val": f"a whole `fit`, validation every epoch ({args.epochs} epochs, 640 + 320 samples, batch 32)",
        "val_quarter": f"a whole `fit`, validation 4 times an epoch ({args.epochs} epochs, 640 + 320 samples, "
        "batch 32)",
        "predict": "a `trainer.predict` of its own, 320 batches of 16",
    }[workload]
    columns = "workers (train / val), each round" if workload != "predict" else "workers, each round"
    lines = [
        f"**{workload}**: {what}; {args.latency_ms:g} ms a sample; {cpus} CPUs, torch {torch.__version__}, lightning "
        f"{pl.__version__}; {args.rounds} rounds, order rotated. Oracle: the best static config on every loader "
        f"({oracle}).",
        "",
        f"| arm | median s | x oracle | paired range | {columns} |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        ratios = [a / b for a, b in zip(walls[arm], walls[oracle], strict=True)]
        median = statistics.median(walls[arm])
        label = arm + (" (oracle)" if arm == oracle else "") + (" (rule of thumb)" if arm == thumb else "")
        lines.append(
            f"| {label} | {median:.2f} | {median / statistics.median(walls[oracle]):.2f}x "
            f"| {min(ratios):.2f}-{max(ratios):.2f}x | {', '.join(configs[arm])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
