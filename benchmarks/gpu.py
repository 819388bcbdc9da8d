"""GPU benchmark: a real small CNN on the GPU, fed by a CPU-decoded image dataset, in one process.

The same model trains the same epochs, validating after each on a set of its own (``--val-steps`` batches, as
Lightning does by default; 0: none), with the PyTorch default (0 workers), the half-the-cores rule of thumb, every
config of a static grid set on both loaders (the best of which is the oracle) and DataLoaderTuner starting from 0
workers on both.
Whole-run time (``trainer.fit`` wall time, worker start-up and tuning included) is reported as a ratio to the
oracle, with the GPU utilization NVML saw during each run and the stall the GPU saw (CUDA events) for the
tuner's first and settled configs.

    python benchmarks/gpu.py                 # on a CUDA machine; writes benchmarks/results/gpu.json
    python benchmarks/gpu.py --device cpu --quick   # smoke run of this script on a machine without one
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.budget import cpu_budget
from lightning_dltune.measurement.nvml import open_sampler
from lightning_dltune.tools.synthetic import busy_cpu

from sections import write_results

HERE = Path(__file__).resolve().parent


class DecodedImages(Dataset):
    """``length`` 3x``size``x``size`` images decoded on the CPU: a deterministic uint8 image per index, then
    ``cpu_ms`` of decode work, a random crop and flip, and float conversion with normalization."""

    def __init__(self, length: int, size: int = 64, cpu_ms: float = 0.1) -> None:
        self.length, self.size, self.cpu_ms = length, size, cpu_ms

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(index)
        raw = torch.randint(0, 256, (3, self.size + 8, self.size + 8), dtype=torch.uint8, generator=gen)
        busy_cpu(self.cpu_ms / 1e3)  # the entropy decoding a JPEG would cost
        top, left = (int(v) for v in torch.randint(0, 9, (2,), generator=gen))
        img = raw[:, top : top + self.size, left : left + self.size]
        if index % 2:
            img = img.flip(-1)
        return img.float().div_(255.0).sub_(0.5).div_(0.25), index % 10


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def fit_once(args: argparse.Namespace, workers: int, tuner: DataLoaderTuner | None) -> dict[str, Any]:
    kwargs = {"batch_size": args.batch, "num_workers": workers, "persistent_workers": workers > 0}
    loader = DataLoader(DecodedImages(args.steps * args.batch, cpu_ms=args.cpu_ms), shuffle=True, **kwargs)
    val = (
        DataLoader(DecodedImages(args.val_steps * args.batch, cpu_ms=args.cpu_ms), **kwargs) if args.val_steps else None
    )
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        max_epochs=args.epochs,
        callbacks=[tuner] if tuner else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    sampler, _ = open_sampler(0) if args.device == "cuda" else (None, "")
    t0 = time.perf_counter()
    trainer.fit(SmallCNN(), train_dataloaders=loader, val_dataloaders=val)
    seconds = time.perf_counter() - t0
    util = None
    if sampler is not None:
        util = sampler.take().get("gpu_util_pct")
        sampler.stop()
    return {"seconds": seconds, "gpu_util_pct": util}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="smoke size: 2 epochs of 8 steps, grid 0,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch (long enough to tune in-epoch)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--cpu-ms", type=float, default=0.1, help="CPU decode time per image")
    parser.add_argument("--val-steps", type=int, default=40, help="validation batches after each epoch (0: none)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu for a smoke run")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*(suggested max number of worker|max number of worker).*")
    cpus = cpu_budget().cpus
    grid = [0, 2] if args.quick else sorted({0, 2, 4, 8, 12, 16, int(cpus)} & set(range(int(cpus) + 1)))
    if args.quick:
        args.epochs, args.steps, args.val_steps = 2, 8, min(args.val_steps, 4)
    thumb = max(1, min(8, int(cpus) // 2))
    grid = sorted(set(grid) | {thumb})
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    print(
        f"GPU benchmark on {name}: small CNN, {args.batch} images of 3x64x64 per step, {args.cpu_ms} ms CPU "
        f"decode per image, {args.epochs} epochs x {args.steps} steps, validation {args.val_steps} steps after each, "
        f"{cpus:g} CPUs",
        flush=True,
    )
    static: dict[int, dict[str, Any]] = {}
    for k in grid:
        static[k] = fit_once(args, k, None)
        print(
            f"  static workers={k:<3d} {static[k]['seconds']:7.2f} s  gpu util {static[k]['gpu_util_pct']}", flush=True
        )
    tuner = DataLoaderTuner(verbose=True, report_path=False, cache=False)
    tuned = fit_once(args, 0, tuner)
    oracle_k = min(static, key=lambda k: static[k]["seconds"])
    oracle = static[oracle_k]["seconds"]
    first, final = (
        tuner.trials[0].stats,
        next(
            (
                t.stats
                for t in reversed(tuner.trials)
                if t.usable and t.settings.to_loader_kwargs() == tuner.best_settings
            ),
            tuner.trials[-1].stats,
        ),
    )
    val = tuner.evals.tuners.get("val")
    val_result = (
        None
        if val is None or val.state.current is None
        else {
            "settled": val.state.current.to_loader_kwargs(),
            "passes": val.passes,
            "trials": len(val.state.trials),
            "started_ahead": val.started_ahead,
            "diagnosis": val.state.diagnosis,
        }
    )
    result = {
        "device": name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": cpus,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "static_seconds": {str(k): v["seconds"] for k, v in static.items()},
        "static_gpu_util_pct": {str(k): v["gpu_util_pct"] for k, v in static.items()},
        "oracle_workers": oracle_k,
        "tuner": {
            "seconds": tuned["seconds"],
            "gpu_util_pct": tuned["gpu_util_pct"],
            "settled": tuner.best_settings,
            "settled_step": tuner.settled_step,
            "trials": len(tuner.trials),
            "diagnosis": tuner.diagnosis,
            "first_host_stall": first.stall_frac,
            "first_gpu_stall": first.gpu_stall_frac,
            "settled_host_stall": final.stall_frac,
            "settled_gpu_stall": final.gpu_stall_frac,
            "validation": val_result,
        },
        "ratios_to_oracle": {
            "default": static[0]["seconds"] / oracle,
            "rule_of_thumb": static[thumb]["seconds"] / oracle,
            "tuner": tuned["seconds"] / oracle,
        },
    }
    print(
        f"RESULT tuner {tuned['seconds']:.2f} s = {result['ratios_to_oracle']['tuner']:.2f}x oracle "
        f"(workers={oracle_k}, {oracle:.2f} s); default {result['ratios_to_oracle']['default']:.2f}x; "
        f"rule of thumb ({thumb}) {result['ratios_to_oracle']['rule_of_thumb']:.2f}x; "
        f"tuner settled on {tuner.best_settings} at step {tuner.settled_step}"
    )
    gpu_first = "n/a" if first.gpu_stall_frac is None else f"{first.gpu_stall_frac:.1%}"
    gpu_final = "n/a" if final.gpu_stall_frac is None else f"{final.gpu_stall_frac:.1%}"
    print(
        f"RESULT stall at 0 workers: host {first.stall_frac:.1%}, GPU {gpu_first}; settled: host "
        f"{final.stall_frac:.1%}, GPU {gpu_final}"
    )
    print(f"RESULT diagnosis: {tuner.diagnosis}")
    if val_result is not None:
        print(
            f"RESULT validation: {val_result['passes']} passes, settled on {val_result['settled']} after "
            f"{val_result['trials']} trials, {val_result['started_ahead']} begun while training ran"
        )
    path = write_results(args.out, f"gpu_{args.device}{'_quick' if args.quick else ''}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
