"""``dltune demo``: a small model trained by Lightning on a synthetic dataset with a realistic loading cost,
started at ``num_workers=0`` with ``DataLoaderTuner()`` attached. No data, no GPU needed.

It logs to TensorBoard, or without tensorboard installed to a CSV file (and says how to get TensorBoard), and
the tuner draws the run as a PNG next to its report when matplotlib is installed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn

from lightning_dltune import _imports
from lightning_dltune.callback import DataLoaderTuner
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset


class DemoModel(SimulatedModel):
    """On CUDA a real MLP trains on the GPU; elsewhere the accelerator's time is simulated by a sleep."""

    def __init__(self, step_ms: float, features: int = 32) -> None:
        super().__init__(step_ms=step_ms, features=features)
        self.body = nn.Sequential(nn.Linear(features, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU())
        self.layer = nn.Linear(2048, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        if self.step_ms:
            time.sleep(self.step_ms / 1e3)  # simulated accelerator time (no GPU here)
            x = x.new_zeros(x.shape[0], 2048)
            return nn.functional.cross_entropy(self.layer(x), y)
        return nn.functional.cross_entropy(self.layer(self.body(x)), y)


def demo_logger(out: Path) -> Logger:
    """TensorBoard when it is installed, else Lightning's CSV logger, with one line on how to get TensorBoard
    (Lightning's ``TensorBoardLogger`` would stop the demo before training with a ``ModuleNotFoundError``)."""
    if _imports._TENSORBOARD_AVAILABLE:
        return TensorBoardLogger(out, name="tb")
    print(f"dltune demo: logging to CSV instead of TensorBoard; {_imports.TENSORBOARD_MISSING}.")
    return CSVLogger(out, name="csv")


def run_demo(out: Path, quick: bool = False, epochs: int | None = None) -> dict[str, Any]:
    out = Path(out)
    cuda = torch.cuda.is_available()
    samples = 384 if quick else 960
    epochs = epochs or (4 if quick else 6)
    dataset = SyntheticDataset(length=samples, latency_ms=4.0, cpu_ms=0.3)  # storage latency + decode
    step_ms = 0.0 if cuda else 8.0
    print(
        f"dltune demo: {samples} samples, each waits 4 ms (storage) and decodes 0.3 ms (CPU); batch 16; "
        + ("training a real MLP on the GPU." if cuda else "no GPU: the accelerator step is SIMULATED (8 ms sleep).")
    )
    print(
        "Starting from num_workers=0 with DataLoaderTuner() attached. The loader has a generator, so each epoch's "
        "order is known ahead and its first batches load while the last epoch ends (seamless epochs).\n"
    )
    dm = SyntheticDataModule(dataset, batch_size=16, num_workers=0, seed=0)
    tuner = DataLoaderTuner(max_trials=5, cache=False)  # the demo always shows tuning from 0
    epoch_times = _EpochTimes()
    logger = demo_logger(out)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="auto",
        devices=1,
        callbacks=[tuner, epoch_times],
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(DemoModel(step_ms=step_ms), datamodule=dm)

    # the starting config's steady throughput is its trial's (epoch 0 may switch configs part-way through)
    first, last = tuner.trials[0].stats.samples_per_s, epoch_times.samples_per_s[-1]
    log_dir = Path(trainer.log_dir or out)
    plot = tuner.plot_file  # drawn by the tuner next to its report
    print("\n=== dltune demo result ===")
    print(f"Chosen settings ({tuner.phase}): {tuner.best_settings}")
    print(f"Diagnosis: {tuner.diagnosis}")
    carried = tuner.switcher.seamless.carried
    print(f"Seamless epochs: {carried} of {epochs - 1} epoch starts found the next batches already loading.")
    behind = tuner.switcher.background_starts
    print(f"Background starts: {behind} switch(es) started their workers while the running loader served.")
    print(
        f"Throughput: {first:.0f} samples/s with num_workers=0 -> {last:.0f} samples/s in the last epoch: "
        f"{last / first:.1f}x the starting config."
    )
    print(f"Report: {log_dir / 'dltune_report.json'}")
    if plot or not _imports._MATPLOTLIB_AVAILABLE:
        print(f"Plot: {plot}" if plot else f"Plot: skipped ({_imports.MATPLOTLIB_MISSING})")
    if isinstance(logger, TensorBoardLogger):
        print(f"TensorBoard logs: {log_dir}\n  view them with: tensorboard --logdir {out / 'tb'}")
    else:
        print(f"Metrics (CSV): {log_dir / 'metrics.csv'}")
    return {"tuner": tuner, "speedup": last / first, "plot": plot, "log_dir": log_dir}


class _EpochTimes(pl.Callback):
    def __init__(self) -> None:
        self.samples_per_s: list[float] = []

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._t0 = time.perf_counter()
        self._samples = 0

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += int(batch[0].shape[0])

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.samples_per_s.append(self._samples / (time.perf_counter() - self._t0))
