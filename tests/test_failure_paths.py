"""The failure paths a user hits: a fit that fails leaves no worker behind, a report that cannot be written does not
fail a finished fit, a second tuner is refused, and an IterableDataset that does not shard never repeats a sample."""

import gc
import os
import threading
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.switching import _lightning
from lightning_dltune.switching.switch import ShardCheck
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import Indices, live_children, make_trainer


class Boom(RuntimeError):
    pass


class Loader(SimulatedModel):
    """A model whose ``train_dataloader`` returns a plain loader over ``dataset`` with the user's ``workers``."""

    def __init__(self, dataset, workers, fail_at=None):
        super().__init__(step_ms=1)
        self.dataset, self.workers, self.fail_at = dataset, workers, fail_at

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=16, shuffle=True, num_workers=self.workers)

    def training_step(self, batch, batch_idx):
        if (self.current_epoch, batch_idx) == self.fail_at:
            raise Boom(f"step {batch_idx}")
        return super().training_step(batch, batch_idx)


class RaisesOnceArmed(SyntheticDataset):
    """Raises on sample 300 once ``flag`` exists: the test arms it at an epoch's start, in the workers too."""

    def __init__(self, flag, **kwargs):
        super().__init__(**kwargs)
        self.flag = flag

    def __getitem__(self, index):
        if index == 300 and os.path.exists(self.flag):
            raise Boom(f"sample {index}")
        return super().__getitem__(index)


class ArmAt(pl.Callback):
    def __init__(self, epoch, flag, tuner):
        self.epoch, self.flag, self.tuner = epoch, flag, tuner
        self.workers = None

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self.workers = self.tuner.state.current.num_workers
            open(self.flag, "w").close()


def left_after_failure():
    """Worker processes and queue-feeder threads alive shortly after a failed fit, no garbage collection run."""
    deadline = time.monotonic() + 2
    while True:
        feeders = [t for t in threading.enumerate() if "QueueFeeder" in t.name]
        children = live_children()
        if (not feeders and not children) or time.monotonic() > deadline:
            return len(children), len(feeders)
        time.sleep(0.05)


@pytest.mark.parametrize("where", ["training_step", "dataset"])
def test_a_failed_fit_leaves_no_worker_and_no_queue_thread_without_a_garbage_collection(tmp_path, where):
    tuner = DataLoaderTuner()
    if where == "training_step":  # on the user's 2 workers, before the tuner changed anything
        model, arm = Loader(SyntheticDataset(length=640, latency_ms=2.0), workers=2, fail_at=(0, 7)), None
    else:  # on the workers the tuner chose, after it left the user's 2 (not persistent: nothing else stops them)
        flag = str(tmp_path / "armed")
        model = Loader(RaisesOnceArmed(flag, length=480, latency_ms=5.0), workers=2)
        arm = ArmAt(1, flag, tuner)
    trainer = make_trainer(tmp_path, [tuner] + ([arm] if arm else []), max_epochs=4, logger=False)
    gc.collect()
    gc.disable()  # what is left must be stopped by the tuner, not found by a collection
    try:
        with pytest.raises(Boom) as failure, warnings.catch_warnings():  # the exception's traceback is still held
            # a raise in the first batches of workers the tuner just started is taken for their failing to start: it
            # falls back once, with a warning, and the sample raises again there
            warnings.simplefilter("ignore", DLTuneWarning)
            trainer.fit(model)
        assert left_after_failure() == (0, 0), failure.value
    finally:
        gc.enable()
    if arm is not None:  # the tuner's workers where it moved by then (it does on an idle host), else the user's 2
        assert arm.workers is not None and arm.workers >= 2


@pytest.mark.parametrize("kind", ["missing directory", "existing directory"])
def test_a_report_path_that_cannot_be_written_is_one_warning_and_fit_returns(tmp_path, kind):
    path = tmp_path / "run"
    if kind == "missing directory":
        path = "/proc/no-such-process/dltune_report.json"  # a directory that cannot be created
    tuner = DataLoaderTuner(report_path=path)
    if kind == "existing directory":
        path.mkdir()  # made after the tuner was built, which refuses a directory it can see (tested apart)
    trainer = make_trainer(tmp_path, [tuner], max_epochs=1, logger=False, limit_train_batches=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SimulatedModel(step_ms=1), datamodule=_data())
    said = [str(w.message) for w in caught if issubclass(w.category, DLTuneWarning)]
    assert len(said) == 1 and f"cannot write the report {path}" in said[0] and "report_path" in said[0], said
    assert trainer.state.finished and tuner.report is not None and tuner.report_file is None


def test_a_report_path_that_is_a_directory_is_refused_when_the_tuner_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"`report_path` must be a file path, got the directory .*dltune_report.json"):
        DataLoaderTuner(report_path=tmp_path)


def test_a_second_tuner_is_refused_before_anything_runs(tmp_path):
    trainer = make_trainer(tmp_path, [DataLoaderTuner(), DataLoaderTuner(max_workers=4)], logger=False)
    with pytest.raises(MisconfigurationException, match=r"holds 2 DataLoaderTuner callbacks.*Keep one"):
        trainer.fit(SimulatedModel(step_ms=1), datamodule=_data())
    assert trainer.global_step == 0


class Unsharded(IterableDataset):
    """Every worker yields every sample: it ignores ``get_worker_info()``."""

    def __init__(self, length=320):
        self.length = length

    def __iter__(self):
        for i in range(self.length):
            time.sleep(0.002)
            yield torch.full((8,), float(i)), torch.tensor(i % 4), i


class Sharded(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 64, info.num_workers):
            yield torch.tensor(i)


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("taken", [0, 1])
def test_the_shard_check_compares_two_workers_batches_of_the_same_rank(workers, taken):
    """Whatever the count of workers and of batches the loop took before the check (Lightning's fetcher takes one
    ahead), an unsharded dataset is caught, and a sharded one is served whole and in order."""
    for dataset, sharded in ((Unsharded(64), False), (Sharded(), True)):
        loader = DataLoader(dataset, batch_size=4, num_workers=workers)
        inner = iter(loader)
        try:
            before = [next(inner) for _ in range(taken)]
            repeats = []

            def on_repeat(loader, inner, taken, repeats=repeats):
                repeats.append(taken)
                return iter([])

            served = before + list(ShardCheck(loader, inner, on_repeat, taken, workers))
        finally:
            _lightning.shutdown_iterator(inner)
        if sharded:
            assert not repeats and sorted(torch.cat(served).tolist()) == list(range(64))
        else:
            assert repeats == [taken] and len(served) == taken


@pytest.mark.parametrize("given", [{}, {"tune_iterable": True}], ids=["default", "True"])
def test_an_iterable_dataset_that_does_not_shard_is_caught_before_a_sample_repeats(tmp_path, given):
    """By default, and on the user's word that it shards (``True``): the first round of a config with more workers
    finds two workers' first batches the same, before any of them is served."""

    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(Unsharded(), batch_size=8)

    seen = Indices()
    tuner = DataLoaderTuner(**given)
    trainer = make_trainer(tmp_path, [tuner, seen], max_epochs=4, logger=False)
    with pytest.warns(DLTuneWarning, match=r"does not shard itself: with workers=\d+ .*Went back to workers=0"):
        trainer.fit(M(step_ms=1, features=8))
    assert all(e == list(range(320)) for e in seen.epochs), [len(e) for e in seen.epochs]  # each sample once
    failed = [t for t in tuner.trials if t.failed]
    assert len(failed) == 1 and failed[0].settings.num_workers >= 2 and "does not shard" in failed[0].failed
    assert tuner.best_settings["num_workers"] == 0 and tuner.phase.value == "settled"


class CorruptFromAFlag(IterableDataset):
    """Sharded by worker; once ``flag`` exists, every stream's first sample is corrupt: a data error, whatever the
    worker count."""

    def __init__(self, flag, length=320):
        self.flag, self.length = flag, length

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, self.length, step):
            if self.flag.exists():
                raise KeyError("sample is corrupt")
            time.sleep(0.002)
            yield torch.full((8,), float(i)), torch.tensor(i % 4), i


def test_a_data_error_in_a_new_configs_first_batches_still_reaches_the_user_unchanged(tmp_path):
    flag = tmp_path / "corrupt"

    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(CorruptFromAFlag(flag), batch_size=8)

        def on_train_epoch_end(self):
            flag.touch()  # the data goes bad after the first epoch, which trained on the user's 0 workers

    tuner = DataLoaderTuner(tune_iterable=True)  # the user's word that it shards: the tuner tries workers
    trainer = make_trainer(tmp_path, [tuner], max_epochs=3, logger=False)
    with pytest.warns(DLTuneWarning, match="failed its first batch"), pytest.raises(KeyError) as raised:
        trainer.fit(M(step_ms=1, features=8))
    assert raised.value.args == ("sample is corrupt",)  # as the user's own 0 workers raise it
    assert tuner.trials[0].settings.num_workers == 0 and any(t.failed for t in tuner.trials)


def _data():
    return SyntheticDataModule(SyntheticDataset(length=192, latency_ms=1.0), batch_size=16)
