"""Way in #2: nothing changes in the user's code; train_dataloader() returns a plain DataLoader.

python examples/plain_dataloader.py
"""

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset


class MyModel(SimulatedModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(SyntheticDataset(length=480, latency_ms=5.0), batch_size=16, shuffle=True)


if __name__ == "__main__":
    tuner = DataLoaderTuner()
    trainer = pl.Trainer(max_epochs=4, callbacks=[tuner], default_root_dir="dltune_runs/example_plain")
    trainer.fit(MyModel(step_ms=5))
    print("settled:", tuner.best_settings)
