"""An exception inside ``fit`` leaves nothing behind: no sampler thread, no NVML session, no worker, no patched hook."""

import threading

import pytest

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.nvml import NvmlSampler
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import make_trainer
from test_nvml import FakeNvml


class Boom(RuntimeError):
    pass


class FailsAtStep5(SimulatedModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 5:
            raise Boom("step 5")
        return super().training_step(batch, batch_idx)


class WithStandInNvml(DataLoaderTuner):
    """CUDA is absent here, so the NVML sampler the probe opens on a GPU is started by hand, on a stand-in."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.fake = FakeNvml()
        self.probe.nvml = NvmlSampler(0, interval_s=0.01, nvml=self.fake).start()


def test_an_exception_in_training_step_leaves_nothing_behind_and_a_second_fit_works(tmp_path):
    data = SyntheticDataModule(SyntheticDataset(length=320, latency_ms=2.0), batch_size=16, num_workers=2)
    tuner = WithStandInNvml()
    trainer = make_trainer(tmp_path / "a", [tuner], max_epochs=2, logger=False)
    with pytest.raises(Boom):
        trainer.fit(FailsAtStep5(step_ms=1), datamodule=data)

    assert tuner.probe.nvml is None and tuner.fake.shutdowns == 1  # the sampler stopped, NVML shut down
    assert not [t for t in threading.enumerate() if t.name.startswith("dltune")]
    assert "dataloader" not in vars(trainer.fit_loop._data_source)  # the loader transform is gone
    assert not {"_on_before_fetch", "_on_after_fetch"} & set(vars(trainer.fit_loop.epoch_loop))  # fetch hooks too
    # no worker process outlives the failed fit: the autouse `no_leftovers` fixture fails the test otherwise

    again = make_trainer(tmp_path / "b", [tuner], max_epochs=2, logger=False)
    again.fit(SimulatedModel(step_ms=1), datamodule=data)
    assert again.current_epoch == 2 and tuner.trials and tuner.probe.nvml is None
