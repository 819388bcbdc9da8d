import gc
import json
import threading
import time
import warnings

import lightning.pytorch as pl
import psutil
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, get_worker_info

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.switching import _lightning
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import Indices, make_trainer

# ---------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------


class HungryDataset(SyntheticDataset):
    """Holds a large list of Python objects; each item touches a stride of it, so every worker touches
    nearly every page each epoch and reference counting turns the copy-on-write pages into each worker's
    own memory (about 40 MiB each)."""

    def __init__(self):
        super().__init__(length=240, latency_ms=10.0)
        self.blob = [float(i) for i in range(1_000_000)]

    def __getitem__(self, index):
        touched = self.blob[index % 97 :: 97]  # INCREFs ~10k objects spread over all pages
        del touched
        return super().__getitem__(index)


def tune_hungry(tmp_path, max_memory):
    dm = SyntheticDataModule(HungryDataset(), batch_size=16, num_workers=0)
    # cache off: both runs must tune from the same start to compare what the budget held back (a hit would
    # settle at once); the default cache path has its own tests in test_cache.py
    tuner = DataLoaderTuner(max_memory=max_memory, cache=False, max_trials=6)
    trainer = make_trainer(tmp_path, [tuner], max_epochs=5, logger=False)
    model = SimulatedModel(step_ms=10)
    # Only the dataset's own objects may decide what a worker holds. Unfrozen, a garbage collection in the
    # training process (or in a worker) touches every object header of this test process, which after a
    # few hundred tests is some 480 MiB: each worker's copy of those pages then depends on what ran before
    # (CI measured 203 MiB for one worker at start-up). Frozen objects are never traversed by a collection.
    gc.collect()
    gc.freeze()
    try:
        trainer.fit(model, datamodule=dm)
    finally:
        gc.unfreeze()
    return tuner


def test_a_tight_memory_budget_stops_the_tuner_below_what_would_exceed_it(tmp_path):
    budget = 150 * 2**20
    tight = tune_hungry(tmp_path / "tight", budget)
    measured = max(t.stats.worker_mem_bytes for t in tight.trials)
    assert measured > 25 * 2**20  # the workers really hold their own copy
    workers = max(t.settings.num_workers for t in tight.trials)
    # what the budget bounds: the workers' unique memory summed, at its peak in each window. One worker's largest
    # reading times the count overstated it (the workers do not all peak at once) and failed a full-suite run at
    # 150.5 MiB (3 x 50.2) where the workers summed less: each one's footprint there depends on what ran before
    peak = max(t.stats.worker_mem_total_bytes for t in tight.trials)
    assert workers >= 1 and peak <= budget, [(t.settings, t.stats.worker_mem_total_bytes) for t in tight.trials]
    loose = tune_hungry(tmp_path / "loose", None)
    assert loose.best_settings["num_workers"] > workers


# ---------------------------------------------------------------------------------------------------------
# configs that fail, loaders that must not be changed blindly
# ---------------------------------------------------------------------------------------------------------


def failing_init(worker_id):
    raise ValueError("cannot open the database in a worker")


class FailingStart(SimulatedModel):
    # 3 ms a sample: a batch takes 48 ms to load against a 2 ms step, a stall far above the threshold, so workers are
    # tried; every epoch after that runs at 0 workers, and a shorter sleep keeps those epochs short
    def train_dataloader(self):
        ds = SyntheticDataset(320, latency_ms=3.0)
        return DataLoader(ds, batch_size=16, shuffle=True, worker_init_fn=failing_init)


def test_a_config_whose_workers_fail_to_start_is_recorded_and_never_chosen(tmp_path):
    # mode="in_epoch", windows of 8: the failing config starts inside the first epoch or at the next one's start,
    # whichever the window's timing gives; both are caught (an epoch boundary's reset drops the error unless kept)
    tuner = DataLoaderTuner(mode="in_epoch", window_steps=8, min_steps=6)
    seen = Indices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [tuner, seen], max_epochs=3, logger=False).fit(FailingStart(step_ms=2))
    said = [str(w.message) for w in caught if issubclass(w.category, DLTuneWarning)]
    tried = [(t.settings.describe(), t.rule, t.failed) for t in tuner.trials]
    assert any("workers failed to start (ValueError: cannot open the database in a worker)" in m for m in said), tried
    failed = [t for t in tuner.trials if t.failed]
    assert failed and failed[0].settings.num_workers > 0 and "cannot open the database" in failed[0].failed
    assert tuner.best_settings["num_workers"] == 0
    assert len(seen.epochs) == 3 and all(sorted(e) == list(range(320)) for e in seen.epochs)


def test_with_mode_epoch_a_config_whose_workers_fail_to_start_fails_with_their_error(tmp_path):
    # mode="epoch" keeps the user's batch sampler, so no epoch goes on on another loader (the default mode recovers:
    # above). PyTorch's reset at the epoch's start would drop the error and train on uninitialized workers
    tuner = DataLoaderTuner(mode="epoch")
    with pytest.raises(ValueError, match="cannot open the database in a worker"):
        make_trainer(tmp_path, [tuner], max_epochs=2, logger=False).fit(FailingStart(step_ms=2))
    assert tuner.state.current.num_workers > 0  # the tuner's config failed, not the user's


class Sharded(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, 96, n):
            yield torch.full((8,), float(i)), torch.tensor(i % 4), i


@pytest.mark.parametrize("tune_iterable", [None, True, False], ids=["default", "True", "False"])
def test_iterable_datasets_are_retuned_where_their_sharding_is_checked(tmp_path, tune_iterable):
    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(Sharded(), batch_size=8)

    given = {} if tune_iterable is None else {"tune_iterable": tune_iterable}
    tuner, seen = DataLoaderTuner(min_steps=4, **given), Indices()
    trainer = make_trainer(tmp_path, [tuner, seen], max_epochs=3, logger=False)
    if tune_iterable is False:
        with pytest.warns(DLTuneWarning, match=r"`tune_iterable=False`: the tuner only measures it"):
            trainer.fit(M(step_ms=1, features=8))
        assert {t.settings.num_workers for t in tuner.trials} == {0}
    else:
        trainer.fit(M(step_ms=1, features=8))
        assert tuner.phase.value != "disabled"
    assert all(sorted(e) == list(range(96)) for e in seen.epochs)  # a sharding dataset never repeats


class QueueFed(IterableDataset):
    """Reads its samples from a queue it shares with whoever fills it (Lightning's test_double_iter_in_iterable_dataset,
    from Lightning issue 19427): each one read is gone for every other reader."""

    def __init__(self, queue, per_epoch):
        self.queue, self.per_epoch = queue, per_epoch

    def __iter__(self):
        for _ in range(self.per_epoch):
            i = self.queue.get(timeout=5)
            time.sleep(0.002)  # a wait more workers would hide: the tuner would try them
            yield torch.full((8,), float(i)), torch.tensor(i % 4), i


def test_by_default_an_iterable_dataset_that_reads_from_a_queue_is_only_measured_and_loses_nothing(tmp_path):
    """A check that more workers shard it would take samples from the queue: the dataset cannot be copied (it holds
    the queue), so by default it is only measured, and every sample the queue held trains once."""
    import multiprocessing

    queue = multiprocessing.get_context().Queue()
    for i in range(3 * 32):
        queue.put(i)

    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(QueueFed(queue, 32), batch_size=4)

    tuner, seen = DataLoaderTuner(min_steps=4), Indices()
    with pytest.warns(DLTuneWarning, match=r"IterableDataset that cannot be copied \(RuntimeError: Queue objects"):
        make_trainer(tmp_path, [tuner, seen], max_epochs=3, logger=False).fit(M(step_ms=1, features=8))
    assert {t.settings.num_workers for t in tuner.trials} == {0} and tuner.phase.value == "disabled"
    assert sorted(i for e in seen.epochs for i in e) == list(range(3 * 32))


class LockedSharded(Sharded):
    """Shards by worker, holds a lock, which cannot be copied, and waits 2 ms a sample: more workers would help."""

    def __init__(self):
        self.lock = threading.Lock()

    def __iter__(self):
        for sample in super().__iter__():
            time.sleep(0.002)
            yield sample


def test_with_tune_iterable_true_a_dataset_that_cannot_be_copied_is_retuned_on_the_users_word(tmp_path):
    # tune_iterable=True: the first round needs a copy of the dataset; without one it is skipped, and the first
    # iteration's check looks at the batches as they are served (by default such a dataset is only measured: above)
    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(LockedSharded(), batch_size=8)

    tuner, seen = DataLoaderTuner(min_steps=4, tune_iterable=True), Indices()
    make_trainer(tmp_path, [tuner, seen], max_epochs=3, logger=False).fit(M(step_ms=1, features=8))
    assert tuner.phase.value != "disabled" and max(t.settings.num_workers for t in tuner.trials) > 0
    assert all(sorted(e) == list(range(96)) for e in seen.epochs)


def test_by_default_an_iterable_loader_that_keeps_its_own_state_is_only_measured(tmp_path):
    """Its sharding cannot be checked before more workers serve a batch: the loop would count the checked batches as
    served (``tune_iterable=True`` opts in: ``test_loader_libraries.py``'s litdata run)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class M(SimulatedModel):
        def train_dataloader(self):
            return StatefulDataLoader(Sharded(), batch_size=8)

    tuner, seen = DataLoaderTuner(min_steps=4), Indices()
    with pytest.warns(DLTuneWarning, match=r"keeps its own state of what it served"):
        make_trainer(tmp_path, [tuner, seen], max_epochs=2, logger=False).fit(M(step_ms=1, features=8))
    assert {t.settings.num_workers for t in tuner.trials} == {0} and tuner.phase.value == "disabled"
    assert all(sorted(e) == list(range(96)) for e in seen.epochs)


def collate_with_flag(batch):
    x, y, i = torch.utils.data.default_collate(batch)
    return x, y, i, torch.ones(1)


def noop_init(worker_id):
    torch.manual_seed(torch.initial_seed() % 2**31)


class TaggedLoader(DataLoader):
    def __init__(self, dataset, tag, **kwargs):
        self.tag = tag
        super().__init__(dataset, **kwargs)


class EveryOther(BatchSampler):
    """A custom batch sampler (not the plain one): the tuner keeps it and switches at epoch boundaries."""


def test_custom_loader_parts_survive_every_rebuild(tmp_path):
    gen = torch.Generator().manual_seed(3)
    ds = SyntheticDataset(192, latency_ms=8.0)

    class M(SimulatedModel):
        def train_dataloader(self):
            return TaggedLoader(
                ds,
                "mine",
                batch_sampler=EveryOther(RandomSampler(ds, generator=gen), 16, False),
                collate_fn=collate_with_flag,
                worker_init_fn=noop_init,
                generator=gen,
            )

    class Check(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_start(self, trainer, pl_module):
            dl = trainer.train_dataloader
            self.seen.append(
                (
                    type(dl),
                    dl.tag,
                    type(dl.batch_sampler),
                    dl.collate_fn,
                    dl.worker_init_fn,
                    dl.generator,
                    dl.num_workers,
                )
            )

    check = Check()
    make_trainer(tmp_path, [DataLoaderTuner(), check], max_epochs=3, logger=False).fit(M(step_ms=2))
    assert len({s[-1] for s in check.seen}) >= 2  # it was rebuilt
    for s in check.seen:
        assert s[:6] == (TaggedLoader, "mine", EveryOther, collate_with_flag, noop_init, gen)


def test_sample_order_depends_on_the_seed_not_on_the_settings_picked(tmp_path):
    def run(path, max_workers):
        pl.seed_everything(21, workers=True)
        # cache off: the two runs share this test's cache file, and the second must tune from 0 workers too
        seen, tuner = Indices(), DataLoaderTuner(max_workers=max_workers, cache=False)
        dm = SyntheticDataModule(SyntheticDataset(192, latency_ms=8.0), batch_size=16, num_workers=0)
        make_trainer(path, [tuner, seen], max_epochs=4, logger=False).fit(SimulatedModel(step_ms=2), datamodule=dm)
        return seen.epochs, tuner.best_settings["num_workers"]

    a, wa = run(tmp_path / "a", 2)
    b, wb = run(tmp_path / "b", 12)
    assert wa != wb  # the two runs settled differently...
    assert a == b  # ...and trained on the same order
    assert all(sorted(e) == list(range(192)) for e in a)


# ---------------------------------------------------------------------------------------------------------
# run shapes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "steps"),
    [
        ({"max_steps": 13}, 13),  # ends mid-epoch
        ({"limit_train_batches": 3}, 3 * 3),
        ({"fast_dev_run": True}, 1),
        ({"max_epochs": 1, "limit_train_batches": 2}, 2),  # very short
        ({"logger": False}, 3 * 10),
        ({"val_check_interval": 0.5, "limit_val_batches": 2}, 3 * 10),
    ],
)
def test_run_shapes_train_what_an_untuned_run_trains_and_report_it(tmp_path, kwargs, steps):
    class M(SimulatedModel):
        def validation_step(self, batch, batch_idx):
            pass

        def val_dataloader(self):
            return DataLoader(SyntheticDataset(32), batch_size=16)

    def fit(callbacks, where, latency_ms=4.0, step_ms=2):
        pl.seed_everything(0)
        dm = SyntheticDataModule(SyntheticDataset(160, latency_ms=latency_ms), batch_size=16)
        model = M(step_ms=step_ms)
        make_trainer(tmp_path / where, callbacks, **{"max_epochs": 3, **kwargs}).fit(model, datamodule=dm)
        return model.seen_indices

    # the untuned run is the reference: its samples load and its steps run at once (the order comes from the seed,
    # not from how long a sample takes); only the tuned run needs the stall
    untuned, tuner = fit([], "untuned", latency_ms=0.0, step_ms=0), DataLoaderTuner()
    tuned = fit([tuner], "tuned")
    assert len(tuned) == steps * 16 and tuned == untuned  # the samples, their count and order, as without the tuner
    # written where Lightning writes the run's files: nowhere without a logger, or with fast_dev_run's stand-in
    written = not (kwargs.get("logger") is False or "fast_dev_run" in kwargs)
    assert (tuner.report_file is not None) is written
    report = json.loads(tuner.report_file.read_text()) if written else tuner.report  # built for every shape
    assert report["phase"] == tuner.phase.value and len(report["trials"]) == len(tuner.trials) >= 1
    assert sum(t["stats"]["steps"] for t in report["trials"]) <= steps  # what it measured, it trained
    assert report["trials"][0]["settings"]["num_workers"] == 0  # the user's config came first


def test_an_empty_loader_is_left_alone(tmp_path):
    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(SyntheticDataset(1), batch_size=4, drop_last=True)  # zero batches

    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=2, logger=False).fit(M())
    assert tuner.trials == [] and tuner.best_settings is None


# ---------------------------------------------------------------------------------------------------------
# soak
# ---------------------------------------------------------------------------------------------------------


def rebuild_many(dl, n=25):
    for i in range(n):
        settings = {
            "num_workers": 1 + i % 3,
            "prefetch_factor": 1 + i % 2,
            "pin_memory": True,
            "persistent_workers": True,
        }
        with _lightning.recording():
            dl = _lightning.rebuild_dataloader(dl, settings)
        it = iter(dl)
        for _ in range(3):
            next(it)
        _lightning.shutdown_workers(dl)
    return dl


def test_many_rebuilds_leak_no_processes_threads_or_file_descriptors():
    proc = psutil.Process()
    with _lightning.recording():
        dl = DataLoader(SyntheticDataset(64), batch_size=8, shuffle=True)
    dl = rebuild_many(dl)  # the first cycle creates one-time resources (semaphore tracker, pin-memory setup)
    before = (len(proc.children(recursive=True)), threading.active_count(), proc.num_fds())
    rebuild_many(dl)
    after = (len(proc.children(recursive=True)), threading.active_count(), proc.num_fds())
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    assert after[2] <= before[2], (before, after)  # file descriptors
