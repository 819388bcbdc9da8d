"""The tuner as a good citizen of a Lightning run: it copies and pickles like any callback, puts back what it wrapped,
writes files only where Lightning writes a run's files, and uses up none of Lightning's warnings."""

import copy
import io
import os
import pickle
import random
import warnings
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from lightning_dltune import DataLoaderTuner
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import Indices, make_trainer


class LatencyModel(SimulatedModel):
    """A model whose loader waits on "storage": the tuner rebuilds it with workers (a ResumableBatchSampler in it)."""

    def train_dataloader(self):
        return DataLoader(SyntheticDataset(length=192, latency_ms=2), batch_size=8)


def latency_model() -> SimulatedModel:
    return LatencyModel(step_ms=2)


def test_a_new_tuner_pickles_and_deep_copies_with_its_arguments():
    tuner = DataLoaderTuner(max_trials=3, mode="epoch")
    for copied in (pickle.loads(pickle.dumps(tuner)), copy.deepcopy(tuner)):
        assert isinstance(copied, DataLoaderTuner)
        assert copied.policy.max_trials == 3 and copied.mode == "epoch"
        assert copied.state_key == tuner.state_key


class CopiesDuringFit(pl.Callback):
    """Deep-copies the trainer's callbacks while the tuner runs (as Lightning's tests of callback state do)."""

    def __init__(self):
        self.copies = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 30:
            self.copies = copy.deepcopy(trainer.callbacks)


def test_a_tuner_copies_during_and_after_fit_and_the_trainer_pickles_after(tmp_path):
    tuner, copier = DataLoaderTuner(), CopiesDuringFit()
    model = latency_model()
    trainer = make_trainer(tmp_path, [tuner, copier], max_epochs=3)
    trainer.fit(model)
    assert tuner.best_settings is not None and tuner.best_settings["num_workers"] > 0  # the tuner rebuilt the loader

    copied = next(c for c in copier.copies if isinstance(c, DataLoaderTuner))
    measured = [t.settings for t in copied.trials]  # what the tuner had measured by step 30
    assert measured and measured == [t.settings for t in tuner.trials[: len(measured)]]
    after = copy.deepcopy(tuner)
    assert after.best_settings == tuner.best_settings and after.report == tuner.report
    again = pickle.loads(pickle.dumps(tuner))
    assert again.diagnosis == tuner.diagnosis

    pickle.dumps(trainer)  # the rebuilt loader, its batch sampler and the tuner in it
    copy.deepcopy(trainer)
    torch.save(model, io.BytesIO())


def test_a_copied_batch_sampler_iterates_its_epoch_without_the_tuners_hooks(tmp_path):
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path, [tuner], max_epochs=2)
    trainer.fit(latency_model())
    sampler = trainer.train_dataloader.batch_sampler
    assert type(sampler).__name__ == "ResumableBatchSampler"
    copied = pickle.loads(pickle.dumps(sampler))
    assert not copied.seamless
    batches = list(copied)
    assert len(batches) == len(sampler) and sorted(i for b in batches for i in b) == list(range(192))


class SpawnModel(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=8)


class TunerRan(pl.Callback):
    """Each spawned rank writes its steps and the loader its (unpickled) tuner saw, after the tuner's own fit end."""

    def __init__(self, out):
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        tuner = next(c for c in trainer.callbacks if isinstance(c, DataLoaderTuner))
        (self.out / f"rank{trainer.global_rank}").write_text(f"{trainer.global_step} {tuner.state.current.describe()}")


def test_ddp_spawn_starts_with_a_default_tuner(tmp_path):
    tuner = DataLoaderTuner()
    trainer = pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        default_root_dir=tmp_path,
        callbacks=[tuner, TunerRan(tmp_path)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SpawnModel())
    assert trainer.state.finished
    for rank in (0, 1):  # each rank trained its 4 batches (64 samples / 8 / 2 ranks) with the tuner measuring
        assert (tmp_path / f"rank{rank}").read_text() == "4 workers=0"


class PatchedLoops(pl.Callback):
    """What a user's own instance attributes on Lightning's loops are when ``fit`` ends."""

    def __init__(self, patches):
        self.patches = patches


@pytest.mark.parametrize(
    "where",
    [
        ("fit_loop._data_source", "dataloader"),
        ("fit_loop.epoch_loop", "_on_before_fetch"),
        ("fit_loop.epoch_loop.val_loop", "run"),
        ("fit_loop.epoch_loop.val_loop", "reset"),
    ],
)
def test_a_users_own_attribute_on_a_loop_is_put_back(tmp_path, where):
    path, name = where
    trainer = make_trainer(tmp_path, [DataLoaderTuner()], max_epochs=1, limit_train_batches=4, limit_val_batches=2)
    owner = trainer
    for part in path.split("."):
        owner = getattr(owner, part)
    original = getattr(owner, name)
    users = mock.Mock(wraps=original)  # the user's own, as Lightning's tests set `val_loop.run = Mock(...)`
    setattr(owner, name, users)
    trainer.fit(BoringModel())
    assert owner.__dict__[name] is users
    assert users.called


def run_files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("dltune_report*"))


def test_without_a_logger_nothing_is_written_and_the_report_stays_on_the_tuner(tmp_path, monkeypatch, lightning_log):
    monkeypatch.chdir(tmp_path)  # the working directory: nothing lands there either
    checkpoints = tmp_path / "ckpts"
    tuner = DataLoaderTuner()
    trainer = make_trainer(
        tmp_path,
        [tuner, pl.callbacks.ModelCheckpoint(dirpath=checkpoints)],
        max_epochs=2,
        logger=False,
        enable_checkpointing=True,
    )
    trainer.fit(latency_model())
    assert run_files(tmp_path) == []
    assert sorted(p.suffix for p in checkpoints.iterdir()) == [".ckpt"]
    assert tuner.report is not None and tuner.report["trials"] and tuner.report_file is None
    assert "the report is on `tuner.report`" in lightning_log.text


def test_the_report_goes_to_the_loggers_directory_and_never_into_a_checkpoint_folder(tmp_path):
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path, [tuner], max_epochs=1, limit_train_batches=12)
    trainer.fit(latency_model())
    assert run_files(tmp_path) == ["lightning_logs/version_0/dltune_report.json"]

    logs = tmp_path / "shared"  # a checkpoint folder that is also the logger's directory keeps checkpoints only
    tuner = DataLoaderTuner()
    trainer = make_trainer(
        logs,
        [tuner, pl.callbacks.ModelCheckpoint(dirpath=logs)],
        max_epochs=1,
        limit_train_batches=12,
        logger=pl.loggers.CSVLogger(logs, name="", version=""),
        enable_checkpointing=True,
    )
    assert Path(trainer.log_dir) == logs
    trainer.fit(latency_model())
    assert run_files(logs) == [] and tuner.report is not None


class AmbiguousBatches(BoringModel):
    """Batches whose tensors disagree on their first dimension, as Lightning's own test of its warning has."""

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 16), batch_size=4, collate_fn=ambiguous)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"]).sum()


def ambiguous(samples):
    return {"x": torch.stack(samples), "other": torch.randn(7)}


def test_lightnings_batch_size_warning_is_left_for_the_user(tmp_path):
    from lightning.pytorch.utilities.data import extract_batch_size, warning_cache

    warning_cache.clear()
    trainer = make_trainer(tmp_path, [DataLoaderTuner()], max_epochs=1, limit_train_batches=4, logger=False)
    trainer.fit(AmbiguousBatches())
    with pytest.warns(UserWarning, match="Trying to infer the `batch_size` from an ambiguous collection"):
        extract_batch_size((torch.zeros(4), torch.zeros(7)))  # the user's first `self.log` on such a batch


class RecordsMainProcessLoads(SyntheticDataset):
    """Records each sample loaded in the process that built it: where a file handle opened lazily (h5py, LMDB) would
    be opened before the workers fork."""

    def __init__(self):
        super().__init__(length=192, latency_ms=2)
        self.main_pid, self.loaded_in_main = os.getpid(), []

    def __getitem__(self, index):
        if os.getpid() == self.main_pid:
            self.loaded_in_main.append(index)
        return super().__getitem__(index)


def test_a_loader_with_workers_never_loads_a_sample_in_the_training_process(tmp_path):
    dataset = RecordsMainProcessLoads()

    class Model(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(dataset, batch_size=8, num_workers=2)

    tuner = DataLoaderTuner()  # the cache is on by default: its lookup fingerprints the dataset
    make_trainer(tmp_path, [tuner], max_epochs=2).fit(Model(step_ms=2))
    assert all(t.settings.num_workers > 0 for t in tuner.trials)
    assert dataset.loaded_in_main == []


class RaisingEquality:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        raise TypeError("no truth value")


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ({"x": np.arange(3)}, {"x": np.arange(3)}, True),  # a custom collate's numpy arrays: `==` is elementwise
        ({"x": np.arange(3)}, {"x": np.arange(3) + 1}, False),
        (np.arange(3), np.arange(4), False),
        ([RaisingEquality(1)], [RaisingEquality(1)], True),  # compared by their pickled bytes
        ([RaisingEquality(1)], [RaisingEquality(2)], False),
        ((torch.zeros(2), "a"), (torch.zeros(2), "a"), True),
        (torch.zeros(2), torch.zeros(2, dtype=torch.int64), False),
    ],
)
def test_the_repeat_check_compares_any_collated_batch(a, b, same):
    from lightning_dltune.switching.switch import same_batch

    assert same_batch(a, b) is same


class ShuffledModel(SimulatedModel):
    """A shuffled loader that waits on "storage" (the tuner rebuilds it), recording the samples each epoch trains."""

    def __init__(self):
        super().__init__(step_ms=2)
        self.epochs = []

    def train_dataloader(self):
        return DataLoader(SyntheticDataset(length=160, latency_ms=2), batch_size=8, shuffle=True)

    def on_train_epoch_start(self):
        self.epochs.append([])

    def training_step(self, batch, batch_idx):
        self.epochs[-1].extend(int(i) for i in batch[2])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("flags", [{"overfit_batches": 2}, {"limit_train_batches": 6}])
def test_trainer_flags_that_shape_the_train_loader_train_what_they_train_without_the_tuner(tmp_path, flags):
    def fit(callbacks, where):
        pl.seed_everything(3)
        model = ShuffledModel()
        trainer = make_trainer(tmp_path / where, callbacks, max_epochs=3, logger=False, **flags)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer.fit(model)
        return model.epochs, [str(w.message) for w in said if "overfit" in str(w.message)]

    untuned, untuned_said = fit([], "untuned")
    tuned, tuned_said = fit([DataLoaderTuner()], "tuned")
    assert tuned == untuned
    assert tuned_said == untuned_said  # Lightning's own warning about shuffling under overfit_batches, where it fires
    if "overfit_batches" in flags:
        assert untuned_said and untuned[0] == untuned[1] == list(range(16))


class Augmented(SyntheticDataset):
    """Draws from the global random states as augmentations do (torch's, Python's and numpy's)."""

    def __getitem__(self, index):
        x, y, i = super().__getitem__(index)
        jitter = torch.rand(1) + random.random() + float(np.random.rand())
        return x + jitter, y, i


@pytest.mark.parametrize("dataset", [Augmented, SyntheticDataset])
def test_a_seeded_run_trains_one_order_whatever_the_tuner_chose_and_whenever_it_switched(tmp_path, dataset):
    def run(path, max_workers):
        pl.seed_everything(7, workers=True)
        seen, tuner = Indices(), DataLoaderTuner(max_workers=max_workers)  # runs that settle apart (below)
        dm = SyntheticDataModule(dataset(192, latency_ms=8.0), batch_size=16, num_workers=0)
        make_trainer(path, [tuner, seen], max_epochs=4, logger=False).fit(SimulatedModel(step_ms=2), datamodule=dm)
        return seen.epochs, [(t.settings.num_workers, t.stats.steps) for t in tuner.trials]

    a, trials_a = run(tmp_path / "a", 2)
    b, trials_b = run(tmp_path / "b", 12)
    assert trials_a != trials_b  # other configs, switched at other steps...
    assert a == b  # ...and one order
    assert all(sorted(e) == list(range(192)) for e in a)


class AugmentedModel(SimulatedModel):
    """A validation loader whose samples draw from the global random states, as the train loader's do."""

    def validation_step(self, batch, batch_idx):
        pass

    def val_dataloader(self):
        return DataLoader(Augmented(64, latency_ms=8.0), batch_size=16)


def test_a_validation_loader_drawing_random_numbers_leaves_the_next_epochs_order_alone(tmp_path):
    def run(path, max_workers):
        pl.seed_everything(7, workers=True)
        seen, tuner = Indices(), DataLoaderTuner(max_workers=max_workers)
        dm = SyntheticDataModule(SyntheticDataset(96, latency_ms=1.0), batch_size=16, num_workers=0)
        trainer = make_trainer(path, [tuner, seen], max_epochs=4, logger=False)
        trainer.fit(AugmentedModel(step_ms=2), train_dataloaders=dm.train_dataloader())
        val = tuner.evals.tuners["val"]
        return seen.epochs, [t.settings.num_workers for t in val.state.trials]

    a, val_a = run(tmp_path / "a", 1)
    b, val_b = run(tmp_path / "b", 12)
    assert val_a != val_b  # the validation loader ran on other configs...
    assert a == b  # ...and training drew one order


class CountingLoader(DataLoader):
    """A user's DataLoader subclass with state of its own: the iterators it made, the batches they served (without
    workers: the batches are loaded in ``_next_data``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterators, self.served = 0, 0

    def _get_iterator(self):
        self.iterators += 1
        if self.num_workers:
            return super()._get_iterator()
        return _Counted(self)


class _Counted(_SingleProcessDataLoaderIter):
    def _next_data(self):
        data = super()._next_data()
        self._counting.served += 1
        return data

    def __init__(self, loader):
        super().__init__(loader)
        self._counting = loader


@pytest.mark.parametrize("latency_ms", [0.0, 4.0], ids=["stays", "switches"])
def test_the_users_loader_object_trains_until_a_setting_changes(tmp_path, latency_ms):
    """``trainer.train_dataloader`` is the loader passed to ``fit``, with its own iterators and state, until the tuner
    changes a setting (in-memory samples: never; samples that wait on "storage": inside the first epoch, from the
    batch that loader reached on, every sample once, in the untuned order)."""

    def fit(callbacks, where):
        pl.seed_everything(5)
        loader = CountingLoader(SyntheticDataset(length=192, latency_ms=latency_ms), batch_size=8, shuffle=True)
        seen = Indices()
        trainer = make_trainer(tmp_path / where, [*callbacks, seen], max_epochs=2, logger=False)
        trainer.fit(SimulatedModel(step_ms=2), train_dataloaders=loader)
        return loader, trainer, seen.epochs

    _, _, untuned = fit([], "untuned")
    tuner = DataLoaderTuner()
    loader, trainer, tuned = fit([tuner], "tuned")
    assert tuned == untuned
    if latency_ms == 0.0:
        assert tuner.state.current.num_workers == 0 and trainer.train_dataloader is loader
        assert loader.iterators == 2 and loader.served == 2 * 24  # each epoch its own iterator, every batch its own
    else:
        switch = tuner.trials[0].stats.steps  # the first window's steps ran on the user's loader
        assert trainer.train_dataloader is not loader and trainer.train_dataloader.num_workers > 0
        assert loader.iterators == 1 and switch <= loader.served < 24  # it served the first epoch until the switch
