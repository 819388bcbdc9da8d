"""The probe: everything the tuner measures, and the only part that reads a clock, psutil or CUDA events.

:class:`Probe` owns the host :class:`~lightning_dltune.measure.StepTimer`, the CUDA
:class:`~lightning_dltune.gpu.GpuTimeline` and the NVML sampler (on CUDA devices), the CPU-time snapshot of the
window and the batch size in bytes; the worker processes' memory is read at :meth:`Probe.close`, which returns
the window's :class:`~lightning_dltune.measure.WindowStats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_dltune import gpu
from lightning_dltune._warn import warn_once
from lightning_dltune.measure import Clock, StepTimer, WindowStats, process_cpu_seconds


def worker_uss(pids: list[int]) -> float:
    """Largest unique memory (USS) of the processes ``pids``, 0 for none."""
    import psutil

    sizes = []
    for pid in pids:
        try:
            sizes.append(psutil.Process(pid).memory_full_info().uss)
        except psutil.Error:
            continue
    return float(max(sizes, default=0))


class Probe:
    """Measures one window at a time.

    Args:
        worker_pids: the PIDs of the running train loader's workers (asked when a window closes).
        clock, cpu_clock: as for :class:`~lightning_dltune.measure.StepTimer`.
        cpu_seconds: ``() -> (this process, its children)`` CPU seconds.
        memory_of: ``(pids) -> bytes`` of the largest worker.
    """

    def __init__(
        self,
        worker_pids: Callable[[], list[int]] = list,
        clock: Clock = time.perf_counter,
        cpu_clock: Clock = time.thread_time,
        cpu_seconds: Callable[[], tuple[float, float]] = process_cpu_seconds,
        memory_of: Callable[[list[int]], float] = worker_uss,
    ) -> None:
        self._worker_pids = worker_pids
        self._clock, self._cpu_clock = clock, cpu_clock
        self._cpu_seconds = cpu_seconds
        self._memory_of = memory_of
        self.timer = StepTimer(clock, cpu_clock)
        self.gpu: gpu.GpuTimeline | None = None
        self.nvml: Any = None
        self._nvml_metrics: dict[str, float] = {}
        self._cpu0: tuple[float, float] | None = None
        self._batch_bytes: float | None = None

    def start(self, device: Any, log_gpu: bool = True) -> None:
        """A new ``fit`` on ``device``: fresh windows; on CUDA a GPU timeline and (``log_gpu``) NVML sampling."""
        self.timer = StepTimer(self._clock, self._cpu_clock)
        self.gpu = gpu.timeline_for(device)
        self._cpu0 = self._batch_bytes = None
        if log_gpu and getattr(device, "type", None) == "cuda":
            from lightning_dltune.nvml import open_sampler

            self.nvml, why = open_sampler(device.index or 0)
            if self.nvml is None:
                warn_once("nvml", f"GPU utilization is not logged: {why}.")

    def stop(self) -> None:
        """Stop GPU measurement (the NVML thread included); safe to call twice."""
        self.gpu = None
        if self.nvml is not None:
            if self.nvml.error:
                warn_once("nvml-error", f"GPU sampling stopped early: NVML said {self.nvml.error}.")
            self.nvml.stop()
            self.nvml = None

    # --- the loop's events ----------------------------------------------------------------------------------
    def loader_requested(self) -> None:
        self.timer.loader_requested()

    def rebuilt_in_fetch(self) -> None:
        self.timer.rebuilt_in_fetch()

    def epoch_started(self) -> None:
        self.timer.epoch_started()
        if self.gpu is not None:
            self.gpu.epoch_started()

    def fetch_started(self) -> None:
        self.timer.fetch_started()
        if self.gpu is not None:
            self.gpu.fetch_started()

    def fetch_ended(self) -> None:
        self.timer.fetch_ended()
        if self.gpu is not None:
            self.gpu.fetch_ended()

    def step_started(self) -> None:
        if self.gpu is not None:
            self.gpu.step_started(steady=self.timer.steady)
        self.timer.step_started()

    def step_ended(self, batch: Any, details: bool = True) -> None:
        """``details``: also take the batch's bytes and the window's CPU start (not needed once tuning ended)."""
        if self.gpu is not None:
            self.gpu.step_ended()
        self.timer.step_ended(batch_size(batch))
        if details and self._batch_bytes is None:
            self._batch_bytes = float(tensor_bytes(batch))
        if details and self._cpu0 is None:
            # CPU is counted from the end of a window's first step: worker start-up is not steady state
            self._cpu0 = self._cpu_seconds()

    def pause(self) -> None:
        self.timer.pause()
        if self.gpu is not None:
            self.gpu.pause()

    def resume(self) -> None:
        self.timer.resume()

    # --- windows --------------------------------------------------------------------------------------------
    @property
    def window_steps(self) -> int:
        return self.timer.window_steps

    @property
    def window_batches(self) -> int:
        """Steps of the window, start-up included: what ranks count alike (see ``StepTimer.window_batches``)."""
        return self.timer.window_batches

    def peek(self) -> WindowStats:
        return self.timer.peek_window()

    def close(self) -> WindowStats:
        """The window's statistics, host and GPU, with CPU time, worker memory and batch bytes; starts the next."""
        stats = self.timer.take_window()
        if self.gpu is not None:
            stats = stats.with_gpu(self.gpu.take_window())
        if self._cpu0 is not None:
            (main0, kids0), (main1, kids1) = self._cpu0, self._cpu_seconds()
            stats = stats.with_cpu(worker_cpu_s=max(0.0, kids1 - kids0), main_cpu_s=max(0.0, main1 - main0))
        stats = stats.with_memory(self._memory_of(self._worker_pids()), self._batch_bytes or 0.0)
        self._cpu0 = self._batch_bytes = None
        return stats

    def skip(self) -> None:
        """Drop the window without judging it (tuning has ended)."""
        self.timer.take_window()
        if self.gpu is not None:
            self.gpu.take_window(wait=False)

    def take_log(self) -> tuple[WindowStats, gpu.GpuStats | None, dict[str, float]]:
        """The logging window's host statistics and, on CUDA, the GPU's and NVML's latest means."""
        if self.nvml is not None:
            self._nvml_metrics = self.nvml.take() or self._nvml_metrics
        gpu_stats = self.gpu.take_log_window() if self.gpu is not None else None
        return self.timer.take_log_window(), gpu_stats, self._nvml_metrics


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, dict):
        return sum(tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(tensor_bytes(v) for v in batch)
    return 0


def batch_size(batch: Any) -> int:
    """The batch's size as Lightning reads it (1 when it cannot tell)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:
        return 1
