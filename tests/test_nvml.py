import time
from types import SimpleNamespace

import pytest

from lightning_dltune.measurement.nvml import NvmlSampler, NvmlUnavailableError, nvml_device_id, open_sampler


class FakeNvml:
    """Stand-in for the pynvml module: two devices, utilization rising by 10 per sample."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init=False, fail_after=None):
        self.fail_init = fail_init
        self.fail_after = fail_after
        self.calls = 0
        self.shutdowns = 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        if index > 1:
            raise self.NVMLError("Invalid Argument")
        return ("idx", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("uuid", uuid)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(gpu=10 * self.calls, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=25, total=100, free=75)


def test_samples_are_averaged_per_window():
    fake = FakeNvml()
    sampler = NvmlSampler(0, nvml=fake)
    for _ in range(3):
        sampler.sample()
    assert sampler.take() == {"gpu_util_pct": 20.0, "gpu_mem_pct": 25.0}
    assert sampler.take() == {}
    sampler.stop()
    assert fake.shutdowns == 1


def test_background_thread_samples_and_stops_cleanly():
    sampler = NvmlSampler(1, interval_s=0.01, nvml=FakeNvml()).start()
    time.sleep(0.2)
    sampler.stop()
    assert sampler.take()["gpu_util_pct"] > 0  # the no_leftovers fixture checks the thread is gone


def test_an_nvml_error_in_the_thread_stops_sampling_not_training():
    sampler = NvmlSampler(0, interval_s=0.01, nvml=FakeNvml(fail_after=2)).start()
    time.sleep(0.2)
    assert sampler.error == "NVMLError: GPU is lost"
    sampler.stop()


def test_missing_driver_is_one_clear_message():
    sampler, why = open_sampler(0, nvml=FakeNvml(fail_init=True))
    assert sampler is None and why.startswith("NVML could not start (NVMLError: NVML Shared Library Not Found")
    with pytest.raises(NvmlUnavailableError, match="no device 5"):
        NvmlSampler(5, nvml=FakeNvml())


@pytest.mark.parametrize(
    ("index", "uuid", "visible", "expected"),
    [
        (0, "GPU-abc", None, "GPU-abc"),
        (0, "abc-123", None, "GPU-abc-123"),
        (1, None, "3,5", 5),
        (0, None, "GPU-xyz,GPU-def", "GPU-xyz"),
        (1, None, "", 1),
    ],
)
def test_cuda_device_maps_to_the_nvml_device(index, uuid, visible, expected):
    assert nvml_device_id(index, uuid, visible) == expected


@pytest.mark.parametrize("log_gpu", [True, False])
def test_log_gpu_false_leaves_nvml_alone(monkeypatch, log_gpu):
    """``DataLoaderTuner(log_gpu=False)`` (passed on to ``Probe.start``) opens no NVML sampler on CUDA; the default
    does. NVML and the CUDA device are stand-ins: this machine has neither."""
    from types import SimpleNamespace

    from lightning_dltune.measurement import gpu, nvml
    from lightning_dltune.measurement.probe import Probe

    opened = []
    sampler = SimpleNamespace(error=None, stop=lambda: None)
    monkeypatch.setattr(gpu, "timeline_for", lambda device: None)
    monkeypatch.setattr(nvml, "open_sampler", lambda index: opened.append(index) or (sampler, ""))
    probe = Probe()
    try:
        probe.start(SimpleNamespace(type="cuda", index=0), log_gpu=log_gpu)
        assert probe.nvml is (sampler if log_gpu else None)
    finally:
        probe.stop()
    assert opened == ([0] if log_gpu else [])
