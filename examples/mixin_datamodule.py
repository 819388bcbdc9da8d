"""Way in #1: an existing DataModule adopts TunableDataModuleMixin (add the base class, pass **self.loader_kwargs).

python examples/mixin_datamodule.py
"""

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner, TunableDataModuleMixin
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset


class MyData(TunableDataModuleMixin, pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.num_workers = 0  # what the user had; the tuner takes it from here

    def setup(self, stage: str) -> None:
        self.train_set = SyntheticDataset(length=480, latency_ms=5.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16, shuffle=True, **self.loader_kwargs)


if __name__ == "__main__":
    tuner = DataLoaderTuner()
    trainer = pl.Trainer(max_epochs=4, callbacks=[tuner], default_root_dir="dltune_runs/example_mixin")
    trainer.fit(SimulatedModel(step_ms=5), datamodule=MyData())
    print("settled:", tuner.best_settings)
