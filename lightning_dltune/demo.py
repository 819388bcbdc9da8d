"""``dltune demo``: a small model trained by Lightning on a synthetic dataset with a realistic loading cost,
started at ``num_workers=0`` with ``DataLoaderTuner()`` attached. No data, no GPU needed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_dltune.callback import DataLoaderTuner
from lightning_dltune.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset


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


def run_demo(out: Path, quick: bool = False, epochs: int | None = None) -> dict[str, Any]:
    from lightning.pytorch.loggers import TensorBoardLogger

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
    print("Starting from num_workers=0 with DataLoaderTuner() attached.\n")
    dm = SyntheticDataModule(dataset, batch_size=16, num_workers=0)
    tuner = DataLoaderTuner(max_trials=5, cache=False)  # the demo always shows tuning from 0
    epoch_times = _EpochTimes()
    logger = TensorBoardLogger(out, name="tb")
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
    log_dir = Path(logger.log_dir)
    plot = plot_run(log_dir, out / "dltune_demo.png")
    print("\n=== dltune demo result ===")
    print(f"Chosen settings ({tuner.phase}): {tuner.best_settings}")
    print(f"Diagnosis: {tuner.diagnosis}")
    print(
        f"Throughput: {first:.0f} samples/s with num_workers=0 -> {last:.0f} samples/s in the last epoch: "
        f"{last / first:.1f}x the starting config."
    )
    print(f"Report: {log_dir / 'dltune_report.json'}")
    print(f"Plot: {plot}" if plot else "Plot: skipped (matplotlib is not installed: pip install matplotlib)")
    print(f"TensorBoard logs: {log_dir}\n  view them with: tensorboard --logdir {out / 'tb'}")
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


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The ``dltune/*`` scalars of a TensorBoard run, as ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith("dltune/")
    }


def plot_run(log_dir: Path, path: Path) -> Path | None:
    """Stall fraction, samples/s and worker count over steps, config changes marked, read back from the logs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    scalars = read_scalars(log_dir)
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for ax, tag, label in zip(
        axes,
        ("dltune/stall_frac", "dltune/samples_per_s", "dltune/num_workers"),
        ("stall fraction", "samples/s", "num_workers"),
        strict=True,
    ):
        points = scalars.get(tag, [])
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".", drawstyle="steps-post")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    workers = scalars.get("dltune/num_workers", [])
    changes = [s for (s, v), (_, prev) in zip(workers[1:], workers[:-1], strict=True) if v != prev]
    for ax in axes:
        for step in changes:
            ax.axvline(step, color="tab:red", linestyle="--", alpha=0.6)
    axes[0].set_title("DataLoaderTuner: dashed lines mark loader rebuilds")
    axes[-1].set_xlabel("global step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
