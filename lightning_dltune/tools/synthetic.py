"""Synthetic workloads with a realistic loading cost, for the demo, the benchmarks and the tests.

Each dataset is deterministic per index (the same index always costs the same and returns the same sample),
so runs with different loader settings can be compared step for step. ``SimulatedModel`` stands in for an
accelerator on machines without one: its ``training_step`` sleeps for ``step_ms``, which frees the CPUs the
way a GPU kernel does, and says so in its name.
"""

from __future__ import annotations

import functools
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dltune.mixin import TunableDataModuleMixin


def busy_cpu(seconds: float) -> int:
    """Spin the CPU (pure Python, one core, no GIL release) for about ``seconds``."""
    end = time.thread_time() + seconds
    acc = 0
    while time.thread_time() < end:
        for i in range(200):
            acc ^= i * i
    return acc


class SyntheticDataset(Dataset):
    """``length`` samples of ``features`` floats; each ``__getitem__`` waits ``latency_ms`` (storage-like,
    frees the CPU) and burns ``cpu_ms`` of CPU (decode/augment-like). With ``tail_prob`` > 0 a sample is
    ``tail_factor`` times slower with that probability (heavy-tailed storage)."""

    def __init__(
        self,
        length: int = 512,
        latency_ms: float = 0.0,
        cpu_ms: float = 0.0,
        features: int = 32,
        tail_prob: float = 0.0,
        tail_factor: float = 20.0,
        num_classes: int = 4,
    ) -> None:
        if length < 1:
            raise ValueError(f"`length` must be >= 1, got {length}.")
        self.length = length
        self.latency_ms = latency_ms
        self.cpu_ms = cpu_ms
        self.features = features
        self.tail_prob = tail_prob
        self.tail_factor = tail_factor
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.length

    def cost_factor(self, index: int) -> float:
        if self.tail_prob <= 0:
            return 1.0
        return self.tail_factor if random.Random(index * 7919 + 17).random() < self.tail_prob else 1.0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        factor = self.cost_factor(index)
        if self.latency_ms:
            time.sleep(self.latency_ms * factor / 1e3)
        if self.cpu_ms:
            busy_cpu(self.cpu_ms * factor / 1e3)
        g = torch.Generator().manual_seed(index)
        x = torch.randn(self.features, generator=g)
        return x, torch.tensor(index % self.num_classes), index


class PythonObjectsDataset(SyntheticDataset):
    """Keeps ``strings`` Python strings and reads a contiguous slice of them per sample: each worker's reference
    count writes copy the pages it reads (copy-on-read), so its unique memory grows as it loads samples. The
    guide's classic out-of-memory story, in small: every worker ends up with its own copy of the dataset."""

    def __init__(
        self, length: int = 480, strings: int = 400_000, latency_ms: float = 6.0, per_sample: int | None = None
    ) -> None:
        super().__init__(length=length, latency_ms=latency_ms)
        self.strings = [f"sample-{i:012d}" for i in range(strings)]
        # by default the samples' slices tile the strings once; a larger ``per_sample`` makes them overlap
        self.per_sample = min(strings, per_sample or strings // length)
        self.stride = (strings - self.per_sample) // max(1, length - 1) if per_sample else self.per_sample

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        touched = self.strings[index * self.stride : index * self.stride + self.per_sample]
        del touched
        return super().__getitem__(index)

    def bytes_per_sample(self) -> int:
        """What one sample's slice can make a worker copy: its string objects and list slots, to whole pages."""
        objects = self.per_sample * (sys.getsizeof(self.strings[0]) + 8)
        return (objects // 4096 + 2) * 4096


class WorkerMemoryWatch:
    """The sum of the unique memory (USS) of this process's descendants started inside the ``with`` block (a loader's
    workers; any alive before it, such as an earlier loader's not yet reaped, are not counted: ``others`` says how
    many), read every ``interval_s`` in a thread, apart from the tuner's own reading: ``peak`` and ``readings`` in
    bytes."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.peak = 0.0
        self.readings: list[float] = []
        self.others: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self.interval_s):
            total = 0.0
            for child in me.children(recursive=True):
                if child.pid in self.others:
                    continue
                try:
                    total += child.memory_full_info().uss
                except psutil.Error:
                    continue
            self.readings.append(total)
            self.peak = max(self.peak, total)

    def __enter__(self) -> WorkerMemoryWatch:
        self.others = {child.pid for child in psutil.Process().children(recursive=True)}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def in_memory_dataset(length: int = 2048, features: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(length, features, generator=g), torch.randint(0, 4, (length,), generator=g))


class SimulatedModel(pl.LightningModule):
    """A tiny classifier whose ``training_step`` also sleeps ``step_ms`` to simulate accelerator time.

    ``seen_indices`` records the dataset index of every sample trained on (batches of ``SyntheticDataset``
    carry them), so tests can check that no sample was lost or repeated.
    """

    def __init__(self, step_ms: float = 5.0, features: int = 32, num_classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.step_ms = step_ms
        self.lr = lr
        self.layer = nn.Linear(features, num_classes)
        self.seen_indices: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        if len(batch) > 2:
            self.seen_indices.extend(int(i) for i in batch[2])
        if self.step_ms:
            time.sleep(self.step_ms / 1e3)  # simulated accelerator time
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class CpuStepModel(SimulatedModel):
    """A classifier whose ``training_step`` computes on the CPUs: ``matmuls`` products of two ``size`` x ``size``
    matrices (a fixed amount of work, spread over torch's intra-op threads), instead of :class:`SimulatedModel`'s
    sleep. What a CPU training step, or a GPU rank's Python on few cores, asks of the host's CPUs."""

    def __init__(self, matmuls: int = 20, size: int = 256, **kwargs: Any) -> None:
        super().__init__(step_ms=0.0, **kwargs)
        self.matmuls = matmuls
        self.mat = torch.randn(size, size)  # on the CPU: the step is the host's work

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        acc = self.mat
        for _ in range(self.matmuls):
            acc = torch.tanh(acc @ self.mat)
        return super().training_step(batch, batch_idx) + 0.0 * acc.mean()


def cpu_step_matmuls(step_ms: float, size: int = 256) -> int:
    """The ``matmuls`` of :class:`CpuStepModel` that take about ``step_ms`` on this machine, idle, now."""
    mat = torch.randn(size, size)
    acc, t0, n = mat, time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.3:
        acc = torch.tanh(acc @ mat)
        n += 1
    per = (time.perf_counter() - t0) / n
    return max(1, round(step_ms / 1e3 / per))


def write_jpeg_folder(root: str | Path, per_class: int = 48, classes: int = 2, size: int = 48) -> Path:
    """Write ``classes`` folders of ``per_class`` JPEG files each (``size`` pixels square, each image its own noise,
    each class its own colours) under ``root``, as ``torchvision.datasets.ImageFolder`` reads them. Needs Pillow."""
    from PIL import Image

    root = Path(root)
    g = torch.Generator().manual_seed(0)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (torch.rand(size, size, 3, generator=g) * 128 + 96 * c / max(1, classes - 1)).to(torch.uint8)
            Image.fromarray(pixels.numpy()).save(folder / f"{i:04d}.jpg", quality=90)
    return root


def _read_image(latency_ms: float, path: str) -> Any:
    """Read one image file as ``ImageFolder`` does, after waiting ``latency_ms`` (storage that answers late)."""
    from torchvision.datasets.folder import default_loader

    if latency_ms:
        time.sleep(latency_ms / 1e3)
    return default_loader(path)


def image_folder(root: str | Path, crop: int = 32, latency_ms: float = 0.0) -> Dataset:
    """The guide's image pipeline over ``root``: ``torchvision.datasets.ImageFolder`` with ``RandomResizedCrop``,
    ``RandomHorizontalFlip``, ``ToTensor`` and ``Normalize``; each sample is ``(image, class, index)``, so the order
    trained can be compared across runs; each file is read after ``latency_ms`` (0: at once). Needs torchvision."""
    from torchvision import datasets, transforms

    class IndexedImageFolder(datasets.ImageFolder):
        def __getitem__(self, index: int) -> tuple[Any, Any, int]:
            image, target = super().__getitem__(index)
            return image, target, index

    augment = transforms.Compose(
        [
            transforms.RandomResizedCrop(crop, antialias=True),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    return IndexedImageFolder(str(root), transform=augment, loader=functools.partial(_read_image, latency_ms))


class ResNetClassifier(SimulatedModel):
    """A torchvision ResNet-18 trained on the CPU (the step competes with the loader's workers for the CPUs);
    ``seen_indices`` as :class:`SimulatedModel` records them. Needs torchvision."""

    def __init__(self, num_classes: int = 2, lr: float = 0.01) -> None:
        from torchvision.models import resnet18

        super().__init__(step_ms=0.0, num_classes=num_classes, lr=lr)
        self.layer = resnet18(num_classes=num_classes)


class SyntheticDataModule(TunableDataModuleMixin, pl.LightningDataModule):
    """A DataModule over a :class:`SyntheticDataset`, tunable through the mixin."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 16,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.seed = seed  # a generator for the loader: each epoch's order known ahead (seamless epochs)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = False
        self.persistent_workers = num_workers > 0
        self.shuffle = shuffle

    def train_dataloader(self) -> DataLoader:
        generator = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=self.shuffle, generator=generator, **self.loader_kwargs
        )
