"""The GPU path on a real CUDA device: events, the tuner's decisions and NVML. Skipped without CUDA; run by
``scripts/gpu_check.sh``. The same logic is tested on CPU against a simulated stream (``test_gpu_timeline.py``,
``test_gpu_callback.py``) and a stand-in ``pynvml`` (``test_nvml.py``)."""

import gc
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.gpu import CudaEvent, GpuTimeline
from lightning_dltune.tools.synthetic import SyntheticDataset

from helpers import make_trainer, scalars

pytestmark = pytest.mark.gpu


def gpu_work(ms: float, device: torch.device):
    """A function that queues about ``ms`` of GPU work (matrix products), calibrated with CUDA events."""
    a = torch.randn(2048, 2048, device=device)
    out = torch.empty_like(a)

    def one() -> None:
        torch.mm(a, a, out=out)

    for _ in range(3):
        one()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        one()
    end.record()
    end.synchronize()
    n = max(1, round(ms / (start.elapsed_time(end) / 20)))

    def work() -> None:
        with torch.no_grad():
            for _ in range(n):
                one()

    return work


@pytest.fixture
def device():
    return torch.device("cuda", 0)


def host_loop(tl, steps, wait_s, work):
    for _ in range(steps):
        tl.fetch_started()
        time.sleep(wait_s)
        tl.fetch_ended()
        tl.step_started()
        work()
        tl.step_ended()


def test_events_read_back_the_idle_gap_a_host_wait_leaves(device):
    work = gpu_work(5.0, device)
    tl = GpuTimeline(lambda: CudaEvent(device))
    tl.epoch_started()
    host_loop(tl, 3, 0.020, work)
    torch.cuda.synchronize()
    tl.take_window()
    host_loop(tl, 10, 0.020, work)
    torch.cuda.synchronize()
    stats = tl.take_window()
    assert stats.steps == 10
    idle_ms, step_ms = stats.idle_s / 10 * 1e3, stats.step_s / 10 * 1e3
    assert 3.0 < step_ms < 10.0
    # the host waits 20 ms; the GPU spends the step's ~5 ms of it working and the rest idle
    assert 20.0 - step_ms - 3.0 < idle_ms < 20.0 - step_ms + 3.0


def test_events_show_no_idle_gap_while_queued_work_runs(device):
    work = gpu_work(40.0, device)
    tl = GpuTimeline(lambda: CudaEvent(device))
    tl.epoch_started()
    host_loop(tl, 3, 0.010, work)
    tl.take_window(wait=False)  # warm-up; waiting here would drain the queue and idle the GPU once
    host_loop(tl, 10, 0.010, work)
    stats = tl.take_window()  # the host is ahead: this waits once, for the window's last step
    assert stats.steps >= 5
    assert stats.idle_s / stats.steps < 0.001  # the GPU never waited for the host's 10 ms


class GpuModel(pl.LightningModule):
    def __init__(self, step_ms: float, features: int = 32) -> None:
        super().__init__()
        self.step_ms = step_ms
        self.layer = nn.Linear(features, 4)
        self._work = None

    def on_fit_start(self):
        self._work = gpu_work(self.step_ms, self.device)

    def training_step(self, batch, batch_idx):
        self._work()
        x, y = batch[0], batch[1]
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_busy_gpu_is_not_stalled_by_host_waits_and_nvml_sees_it_busy(tmp_path):
    loader = DataLoader(SyntheticDataset(384, latency_ms=1.0), batch_size=8)  # 8 ms per batch on the host
    tuner = DataLoaderTuner()
    trainer = make_trainer(
        tmp_path, [tuner], max_epochs=3, accelerator="gpu", devices=1, logger=TensorBoardLogger(tmp_path, name="tb")
    )
    trainer.fit(GpuModel(step_ms=30.0), train_dataloaders=loader)

    first = tuner.trials[0].stats
    print(f"host stall {first.stall_frac:.1%}, GPU stall {first.gpu_stall_frac:.1%}, {first.gpu_steps} GPU steps")
    assert first.gpu_steps >= first.steps // 2
    assert first.gpu_stall_frac < 0.05 < first.stall_frac
    assert tuner.best_settings["num_workers"] == 0
    assert tuner.diagnosis.startswith("accelerator-bound")
    log_dir = trainer.logger.log_dir
    util = scalars(log_dir, "dltune/gpu_util_pct")
    assert util and max(util) > 50.0, util
    assert scalars(log_dir, "dltune/gpu_mem_pct") and scalars(log_dir, "dltune/gpu_stall_frac")


def test_a_starved_gpu_gets_workers(tmp_path):
    loader = DataLoader(SyntheticDataset(512, latency_ms=3.0), batch_size=8)  # 24 ms per batch, 2 ms on the GPU
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path, [tuner], max_epochs=4, accelerator="gpu", devices=1, logger=False)
    trainer.fit(GpuModel(step_ms=2.0), train_dataloaders=loader)
    first = tuner.trials[0].stats
    assert first.gpu_stall_frac is not None and first.gpu_stall_frac > 0.5
    assert tuner.best_settings["num_workers"] >= 4
    assert tuner.trials[-1].stats.effective_stall_frac < first.gpu_stall_frac / 2


class Slabs(Dataset):
    """Whole batches of float32 images, sliced from one tensor: nothing to decode, much to copy."""

    def __init__(self, batches: int, batch: int = 64, size: int = 256) -> None:
        self.data = torch.randn(batches * batch, 3, size, size)
        self.batch = batch

    def __len__(self) -> int:
        return self.data.shape[0] // self.batch

    def __getitem__(self, i):
        return self.data[i * self.batch : (i + 1) * self.batch], torch.zeros(self.batch, dtype=torch.long)


class ConvModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_copies_that_hold_the_gpu_up_get_a_pinned_memory_trial(tmp_path):
    loader = DataLoader(Slabs(16), batch_size=None)  # 48 MiB per batch, pageable
    # min_steps=6: windows short enough that the worker trials and the pinned-memory trial after them fit in 6 epochs
    # of 16 batches of 48 MiB (each epoch costs seconds of copies); the default's windows are tested on the CPU
    tuner = DataLoaderTuner(min_steps=6)
    trainer = make_trainer(tmp_path, [tuner], max_epochs=6, accelerator="gpu", devices=1, logger=False)
    trainer.fit(ConvModel(), train_dataloaders=loader)
    first = tuner.trials[0].stats
    assert first.copy_frac is not None and first.copy_frac > 0.05
    assert "host-to-device copies take" in tuner.trials[0].decision
    pinned = [t for t in tuner.trials if t.settings.pin_memory]
    assert pinned, [t.decision for t in tuner.trials]
    copy_ms = [t.stats.gpu.mean_copy_s * 1e3 for t in (tuner.trials[0], pinned[0])]
    print(f"48 MiB copy: {copy_ms[0]:.2f} ms pageable, {copy_ms[1]:.2f} ms pinned; settled {tuner.best_settings}")


class CollectsInWorkers(SyntheticDataset):
    """Runs the garbage collector in the loader worker before its first sample: whatever the parent left in
    reference cycles is destroyed there, as a worker's own allocations would make happen at some point."""

    def __getitem__(self, index):
        if not getattr(self, "_collected", False):
            self._collected = True
            if torch.utils.data.get_worker_info() is not None:
                gc.collect()
        return super().__getitem__(index)


def test_a_dropped_tuned_run_leaves_no_cuda_event_for_a_later_runs_workers(tmp_path):
    """A finished run's Trainer is garbage in reference cycles until the collector runs; collected in a forked
    worker of a later loader, a CUDA event among it is destroyed where CUDA cannot be used, and the worker aborts.
    The tuner frees its events when ``fit`` ends, and a second run's workers collect the first run's garbage."""
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path / "first", [tuner], max_epochs=2, accelerator="gpu", devices=1, logger=False)
    loader = DataLoader(SyntheticDataset(128, latency_ms=1.0), batch_size=8)
    trainer.fit(GpuModel(step_ms=2.0), train_dataloaders=loader)
    assert tuner.trials and tuner.trials[0].stats.gpu_steps > 0  # the GPU timeline ran
    left = [o for o in gc.get_objects() if type(o) is CudaEvent]  # isinstance would wake lazy torch modules
    assert not left, f"{len(left)} CUDA events outlived fit"
    gc.disable()  # the first run stays uncollected garbage here until the second run's workers fork
    try:
        del trainer, tuner
        loader = DataLoader(CollectsInWorkers(64), batch_size=8, num_workers=2)
        second = make_trainer(tmp_path / "second", [], max_epochs=1, accelerator="gpu", devices=1, logger=False)
        second.fit(GpuModel(step_ms=1.0), train_dataloaders=loader)  # an aborted worker raises here
    finally:
        gc.enable()
    assert second.global_step == 8
