"""GPU utilization and memory from NVML, sampled by a background thread and averaged per logging window.

NVML is optional at run time: without the driver (or the ``pynvml`` module) :func:`open_sampler` returns
``None`` and says why once; an NVML error inside the thread stops sampling, never training.
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType
from typing import Any


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine (no driver, no module, no such device)."""


def _import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as ex:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailableError("the `pynvml` module is missing: `pip install nvidia-ml-py`") from ex
    return pynvml


def nvml_device_id(cuda_index: int, uuid: str | None = None, visible: str | None = None) -> str | int:
    """What NVML should open for CUDA device ``cuda_index``: its UUID when known, else the physical index
    (``CUDA_VISIBLE_DEVICES`` renumbers devices; NVML does not)."""
    if uuid:
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if cuda_index < len(entries):
            entry = entries[cuda_index]
            return int(entry) if entry.isdigit() else entry
    return cuda_index


class NvmlSampler:
    """Samples one GPU at ``interval_s`` in a daemon thread.

    Args:
        device: NVML index or UUID string (see :func:`nvml_device_id`).
        interval_s: seconds between samples (0.1 = 10 Hz).
        nvml: the ``pynvml`` module or a stand-in with the same functions (tests).
    """

    def __init__(self, device: int | str, interval_s: float = 0.1, nvml: Any = None) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        self.interval_s = interval_s
        self.error: str | None = None
        try:
            self._nvml.nvmlInit()
        except Exception as ex:
            raise NvmlUnavailableError(f"NVML could not start ({type(ex).__name__}: {ex})") from ex
        try:
            if isinstance(device, str):
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(device)
            else:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device)
        except Exception as ex:
            self._nvml.nvmlShutdown()
            raise NvmlUnavailableError(f"NVML has no device {device!r} ({ex})") from ex
        self._lock = threading.Lock()
        self._util: list[float] = []
        self._mem: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        with self._lock:
            self._util.append(float(util.gpu))
            self._mem.append(100.0 * float(mem.used) / float(mem.total) if mem.total else 0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as ex:
                self.error = f"{type(ex).__name__}: {ex}"
                return

    def start(self) -> NvmlSampler:
        self._thread = threading.Thread(target=self._run, name="dltune-nvml", daemon=True)
        self._thread.start()
        return self

    def take(self) -> dict[str, float]:
        """Mean utilization and memory use (percent) since the last call; empty when nothing was sampled."""
        with self._lock:
            util, mem = self._util, self._mem
            self._util, self._mem = [], []
        if not util:
            return {}
        return {"gpu_util_pct": sum(util) / len(util), "gpu_mem_pct": sum(mem) / len(mem)}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1.0)
            self._thread = None
        with contextlib.suppress(Exception):  # shutting down a broken NVML is not worth a traceback
            self._nvml.nvmlShutdown()


def open_sampler(cuda_index: int, interval_s: float = 0.1, nvml: Any = None) -> tuple[NvmlSampler | None, str]:
    """Start a sampler for CUDA device ``cuda_index``; ``(None, why)`` when NVML cannot be used."""
    uuid = None
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:
        uuid = None
    try:
        sampler = NvmlSampler(nvml_device_id(cuda_index, uuid), interval_s, nvml)
    except NvmlUnavailableError as ex:
        return None, str(ex)
    return sampler.start(), ""
