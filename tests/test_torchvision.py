"""The pipeline the guide describes, with the library people use for it: ``torchvision.datasets.ImageFolder`` over
JPEG files, the usual augmentations, a torchvision ResNet on the CPU, tuned from 0 workers.

torchvision does not load beside the CPU torch 2.13.0 of the main test environment, so these tests skip there;
``scripts/test-matrix.sh newest`` (torch 2.14.1 with torchvision 0.29.1) runs them, in CI too."""

import importlib.util

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner
from lightning_dltune.tools.synthetic import ResNetClassifier, image_folder, write_jpeg_folder

from helpers import make_trainer

if importlib.util.find_spec("torchvision") is None:
    pytest.skip(
        "torchvision is not installed here (it does not load beside the CPU torch 2.13.0): "
        "`scripts/test-matrix.sh newest` runs these tests with torch 2.14.1 and torchvision 0.29.1",
        allow_module_level=True,
    )

IMAGES, EPOCHS = 96, 4


class OnImages(ResNetClassifier):
    """The user's own module: a plain loader from ``train_dataloader``, 0 workers (PyTorch's default), over images
    on storage that answers each read 6 ms late (so that workers pay, even beside a ResNet step on 2 CPUs)."""

    def __init__(self, root):
        super().__init__()
        self.root = root
        self.epoch_workers = {}

    def on_train_batch_end(self, outputs, batch, batch_idx):  # by its last batch: the workers the epoch ended on
        self.epoch_workers[self.current_epoch] = self.trainer.train_dataloader.num_workers

    def train_dataloader(self):
        return DataLoader(image_folder(self.root, latency_ms=6.0), batch_size=16, shuffle=True)


def test_an_imagefolder_pipeline_tuned_from_0_workers_trains_the_untuned_order(tmp_path):
    root = write_jpeg_folder(tmp_path / "images", per_class=IMAGES // 2)

    def fit(callbacks, where):
        pl.seed_everything(7)
        model = OnImages(root)
        make_trainer(tmp_path / where, callbacks, max_epochs=EPOCHS, logger=False).fit(model)
        return model

    untuned, tuner = fit([], "untuned"), DataLoaderTuner()
    tuned = fit([tuner], "tuned")

    epochs = [tuned.seen_indices[e * IMAGES : (e + 1) * IMAGES] for e in range(EPOCHS)]
    assert all(sorted(e) == list(range(IMAGES)) for e in epochs)  # every image once an epoch
    # the first epoch draws its order as the untuned run does. Later ones do not: the untuned run's crops, loaded in
    # the training process at 0 workers, move the random state the next epoch's order is drawn from, and the tuned
    # run's draw from states of their own (switching/randomness.py), so its order does not follow the worker count
    # it chose (tests/test_citizen.py trains one order whatever the choice)
    assert any(workers > 0 for workers in tuned.epoch_workers.values())  # it moved off 0 workers
    assert tuned.seen_indices[:IMAGES] == untuned.seen_indices[:IMAGES]
    assert tuner.trials[0].settings.num_workers == 0 and tuner.report is not None  # no logger: no file, the report kept
