"""The tuner's GPU path inside a real Trainer, on a simulated stream: CUDA is absent here, so the training step
queues simulated GPU work (the host does not wait for it, as with real kernels) and the tuner reads simulated
events. ``tests/test_cuda.py`` runs the same path on a real GPU."""

import statistics

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement import gpu
from lightning_dltune.output.report import summary_table
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tools.synthetic import SyntheticDataset, in_memory_dataset

from helpers import make_trainer, scalars
from sim_gpu import SimStream


class SimGpuModel(pl.LightningModule):
    """Queues ``step_s`` of simulated GPU work per step and ``copy_s`` per host-to-device copy
    (``pinned_copy_s`` when the train loader pins its batches)."""

    def __init__(self, stream: SimStream, loader: DataLoader, step_s: float, copy_s: float, pinned_copy_s: float):
        super().__init__()
        self.stream, self.loader = stream, loader
        self.step_s, self.copy_s, self.pinned_copy_s = step_s, copy_s, pinned_copy_s
        self.layer = nn.Linear(32, 4)

    def train_dataloader(self):
        return self.loader

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        pinned = bool(getattr(self.trainer.train_dataloader, "pin_memory", False))
        self.stream.launch(self.pinned_copy_s if pinned else self.copy_s)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch, batch_idx):
        self.stream.launch(self.step_s)
        x, y = batch[0], batch[1]
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture
def stream(monkeypatch):
    stream = SimStream(max_ahead_s=0.2)  # the host blocks once 0.2 s of work is queued (slack for a busy host)
    monkeypatch.setattr(gpu, "timeline_for", lambda device: gpu.GpuTimeline(stream.event))
    return stream


def test_the_host_waits_but_the_gpu_does_not_so_no_workers_are_added(tmp_path, stream):
    loader = DataLoader(SyntheticDataset(192, latency_ms=1.0), batch_size=8)  # 8 ms per batch in the main process
    model = SimGpuModel(stream, loader, step_s=0.025, copy_s=0.0005, pinned_copy_s=0.0005)
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path, [tuner], max_epochs=3, logger=TensorBoardLogger(tmp_path, name="tb"))
    trainer.fit(model)

    first = tuner.trials[0].stats
    # the steps were read back from the events: never fewer than half the window (take_window waits for the rest
    # only then); a busy 2-core host can let the simulated GPU fall a few 25 ms steps behind the window's end
    assert first.gpu_steps * 2 >= first.steps > 0
    assert first.stall_frac > 0.15  # the host spent 8 of every ~25 ms waiting for the loader ...
    assert first.gpu_stall_frac is not None and first.gpu_stall_frac < 0.05  # ... while the GPU kept working
    assert tuner.phase == "settled" and tuner.best_settings["num_workers"] == 0
    assert [t.settings.num_workers for t in tuner.trials] == [0]
    assert tuner.diagnosis.startswith("accelerator-bound: the GPU sat idle") and "the host waited" in tuner.diagnosis

    log_dir = trainer.logger.log_dir
    # medians over the logging windows: a host delayed by a busy machine can let the queue run dry once
    gpu_stall = scalars(log_dir, "dltune/gpu_stall_frac")
    assert len(gpu_stall) >= 10 and statistics.median(gpu_stall) < 0.05
    assert statistics.median(scalars(log_dir, "dltune/stall_frac")) > 0.15
    assert scalars(log_dir, "dltune/gpu_idle_ms") and scalars(log_dir, "dltune/h2d_ms")
    assert tuner.report["trials"][0]["stats"]["gpu_stall_frac"] < 0.05


def test_a_starved_gpu_gets_workers(tmp_path, stream):
    loader = DataLoader(SyntheticDataset(256, latency_ms=3.0), batch_size=8)  # 24 ms per batch, 4 ms GPU step
    model = SimGpuModel(stream, loader, step_s=0.004, copy_s=0.0005, pinned_copy_s=0.0005)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=3, logger=False).fit(model)

    first = tuner.trials[0].stats
    assert first.gpu_stall_frac is not None and first.gpu_stall_frac > 0.3  # ~0.8 on an idle machine
    assert tuner.best_settings["num_workers"] >= 4
    assert tuner.trials[-1].stats.effective_stall_frac < first.gpu_stall_frac / 2


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # pinning is a no-op without an accelerator
def test_slow_copies_get_pinned_memory_and_a_transfer_bound_diagnosis(tmp_path, stream):
    loader = DataLoader(in_memory_dataset(256), batch_size=8)
    model = SimGpuModel(stream, loader, step_s=0.005, copy_s=0.006, pinned_copy_s=0.002)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=4, logger=False).fit(model)

    assert [t.settings.pin_memory for t in tuner.trials] == [False, True], tuner.trials
    assert tuner.trials[0].decision.startswith("try workers=0 pinned: host-to-device copies take")
    assert tuner.best_settings["pin_memory"] is True and tuner.best_settings["num_workers"] == 0
    assert tuner.trials[1].stats.samples_per_s > 1.2 * tuner.trials[0].stats.samples_per_s
    assert tuner.diagnosis.startswith("transfer-bound") and "already pinned" in tuner.diagnosis
    table = summary_table(tuner.trials, LoaderSettings.from_dict(tuner.best_settings))
    assert "gpu stall" in table.splitlines()[0] and "*workers=0 pinned" in table
