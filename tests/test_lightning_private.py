"""Fails loudly when a Lightning release moves a private attribute that lightning_dltune relies on."""

import inspect
import multiprocessing.context
import multiprocessing.queues
import subprocess
import sys
import time
from functools import reduce

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities import data as fabric_data
from torch.utils.data import DataLoader, RandomSampler

from lightning_dltune.switching import _lightning


@pytest.mark.parametrize(("path", "attr"), _lightning.PRIVATE_ATTRIBUTES)
def test_private_attribute_exists(path, attr):
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    owner = reduce(getattr, path.split("."), trainer)
    assert hasattr(owner, attr), (
        f"lightning {pl.__version__} has no `{path}.{attr}`: update lightning_dltune/switching/_lightning.py "
        "(see ../shared/LIGHTNING_NOTES.md) and the tested range in pyproject.toml"
    )


def test_the_evaluation_loop_sets_its_samplers_epoch_as_reset_ahead_does(tmp_path):
    """``_lightning.reset_ahead`` sets a validation loader's sampler epoch before the pass as the loop's reset does:
    to ``_lightning.validation_epoch``, read in the training steps before the pass."""
    from torch.utils.data import SequentialSampler

    from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset

    epochs, read = [], []

    class Recorded(SequentialSampler):
        def set_epoch(self, epoch):
            epochs.append(epoch)

    class Model(SimulatedModel):
        def on_train_batch_end(self, *args):
            read.append(_lightning.validation_epoch(self.trainer))

        def validation_step(self, batch, batch_idx):
            pass

        def train_dataloader(self):
            return DataLoader(SyntheticDataset(8), batch_size=4)

        def val_dataloader(self):
            dataset = SyntheticDataset(4)
            return DataLoader(dataset, batch_size=4, sampler=Recorded(dataset))

    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_epochs=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False
    )
    trainer.fit(Model(step_ms=0))
    assert epochs == [0, 1] and read == [0, 0, 1, 1]


def test_rebuild_helpers_keep_their_signatures():
    params = inspect.signature(fabric_data._get_dataloader_init_args_and_kwargs).parameters
    assert list(params)[:2] == ["dataloader", "sampler"]
    assert "explicit_cls" in inspect.signature(fabric_data._reinstantiate_wrapped_cls).parameters


def test_fetcher_calls_the_profiler_hooks_around_next():
    """The fetch hooks (``install_fetch_hooks``) time what Lightning's fetcher does between these two calls."""
    from lightning.pytorch.loops.fetchers import _DataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    calls = []
    fetcher = _DataFetcher()
    fetcher.setup(CombinedLoader([[1, 2, 3]], "max_size_cycle"))
    iter(fetcher)
    fetcher._start_profiler = lambda: calls.append("start")
    fetcher._stop_profiler = lambda: calls.append("stop")
    batches = list(fetcher)
    assert len(batches) == 3 and calls[:6] == ["start", "stop"] * 3


def test_combined_loader_reset_shuts_workers_down():
    """``shutdown_workers`` relies on Lightning's reset to stop a loader's persistent workers."""
    from lightning.pytorch.utilities import combined_loader

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    next(iter(loader))
    workers = list(loader._iterator._workers)
    combined_loader._shutdown_workers_and_reset_iterator(loader)
    assert loader._iterator is None
    for w in workers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in workers)


class _StatefulLoader(DataLoader):
    """A loader with a ``state_dict``, as torchdata's ``StatefulDataLoader``: records the states loaded into it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded = []

    def state_dict(self):
        return {"seen": 1}

    def load_state_dict(self, state):
        self.loaded.append(state)


class _PendingModel(pl.LightningModule):
    """Asks ``loader_state_pending`` about each train loader it builds, as the switcher does, before Lightning's
    ``setup_data`` goes on."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.built = []  # (pending, loader)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float().unsqueeze(-1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        loader = _StatefulLoader(torch.arange(32), batch_size=4)
        self.built.append((_lightning.loader_state_pending(self.trainer, loader), loader))
        return loader


def test_loader_state_pending_predicts_the_states_lightning_loads_into_a_new_train_loader(tmp_path):
    """``loader_state_pending`` is True exactly where ``setup_data`` then loads a checkpoint's state into the
    loader it built: in a ``fit`` resumed mid-epoch, not in a fresh one."""

    def trainer(**kwargs):
        return pl.Trainer(
            default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs
        )

    first = _PendingModel()
    trainer(max_steps=3).fit(first)  # stops mid-epoch (8 batches an epoch) and checkpoints there
    ((pending, loader),) = first.built
    assert not pending and loader.loaded == []
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    resumed = _PendingModel()
    trainer(max_steps=5).fit(resumed, ckpt_path=ckpt)
    ((pending, loader),) = resumed.built
    assert pending and loader.loaded == [{"seen": 1}]


def test_recorded_dataloader_arguments_are_where_the_rebuild_reads_them():
    from lightning.fabric.utilities.data import _replace_dunder_methods

    with _replace_dunder_methods(DataLoader, "dataset"):
        dl = DataLoader(list(range(8)), 4, True)
    assert getattr(dl, _lightning._SAVED_ARGS) == (list(range(8)), 4, True)
    assert getattr(dl, _lightning._SAVED_ARG_NAMES) == ("dataset", "batch_size", "shuffle")
    assert isinstance(getattr(dl, _lightning._SAVED_KWARGS), dict)


def test_a_loader_lightning_rebuilds_for_its_distributed_sampler_keeps_none_of_the_seamless_patches():
    # the loader transform runs while Lightning records attribute changes of loaders and batch samplers, and
    # Lightning replays them onto the loader it rebuilds around the DistributedSampler it injects (DDP): a replayed
    # `_get_iterator` would create the old loader's iterators, a replayed seamless hook draw the old sampler's orders
    from lightning.fabric.utilities.data import _replace_dunder_methods, _update_dataloader
    from torch.utils.data import BatchSampler, DistributedSampler

    from lightning_dltune.switching.switch import ResumableBatchSampler

    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        batches = ResumableBatchSampler(RandomSampler(range(8)), batch_size=2, drop_last=False)
        dl = DataLoader(list(range(8)), batch_sampler=batches)
        _lightning.serve_carried_iterator(dl, lambda loader: None)
        batches.carry_on(lambda ahead: None)
        assert batches.seamless and "_get_iterator" in vars(dl)
    shard = DistributedSampler(list(range(8)), num_replicas=2, rank=0, shuffle=False)
    rebuilt = _update_dataloader(dl, shard)
    assert "_get_iterator" not in vars(rebuilt) and not rebuilt.batch_sampler.seamless
    assert [i for b in rebuilt for i in b.tolist()] == [0, 2, 4, 6]  # the shard, from the rebuilt loader


def test_torch_dataloader_internals_used_for_switching_exist():
    from torch.utils.data._utils import signal_handling

    dl = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(dl)
    next(it)
    owners = {cls.__name__: obj for obj in (dl, it) for cls in type(obj).__mro__}
    owners[signal_handling.__name__] = signal_handling
    try:
        for owner, name in _lightning.TORCH_PRIVATE:
            assert owner in owners, f"torch renamed `{owner}`: update _lightning.TORCH_PRIVATE"
            assert hasattr(owners[owner], name), (
                f"torch moved `{owner}.{name}`: update lightning_dltune/switching/_lightning.py"
            )
        assert dl._iterator is it
        assert _lightning.worker_died(it, wait_s=0) is False
        _lightning.detach_from_sigchld(it)
        assert it._worker_pids_set is False
    finally:
        _lightning.shutdown_workers(dl)


@pytest.mark.parametrize("in_order", [True, False])
def test_each_workers_batches_in_flight_are_counted_as_pytorch_counts_them(in_order):
    """``tasks_of`` counts a worker's batches from ``_task_info``, which every supported torch keeps; where torch also
    keeps ``_workers_num_tasks`` (releases after 2.6), both counts agree at every step of an epoch."""
    dl = DataLoader(list(range(64)), batch_size=4, num_workers=2, prefetch_factor=3, in_order=in_order)
    it = iter(dl)
    try:
        for _ in range(len(dl)):
            counts = [_lightning.tasks_of(it, w) for w in range(2)]
            assert sum(counts) == it._send_idx - it._rcvd_idx if in_order else sum(counts) == it._tasks_outstanding
            if hasattr(it, "_workers_num_tasks"):
                assert counts == it._workers_num_tasks
            next(it)
    finally:
        _lightning.shutdown_iterator(it)


def test_a_batch_loaded_in_the_training_process_is_timed_sample_by_sample():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            time.sleep(0.05 if i == 0 else 0.001)  # a file opened on the first sample
            return i

    dl = DataLoader(Slow(), batch_size=4)
    it = iter(dl)
    fetcher = it._dataset_fetcher
    owners = {cls.__name__: obj for obj in (it, fetcher) for cls in type(obj).__mro__}
    for owner, name in _lightning.TORCH_FETCHER_STATE:
        assert owner in owners, f"torch renamed `{owner}`: update _lightning.TORCH_FETCHER_STATE"
        assert hasattr(owners[owner], name), f"torch moved `{owner}.{name}`: update _lightning.time_samples"
    timing = _lightning.time_samples(it, time.perf_counter)
    assert timing is not None and timing.running
    assert next(it).tolist() == [0, 1, 2, 3]
    times = timing.finish()
    assert len(times) == 4 and times[0] > 0.04 and max(times[1:]) < times[0] / 2, times
    assert fetcher.dataset is dl.dataset and not timing.running  # loads from the dataset itself again
    assert next(it).tolist() == [4, 5, 6, 7] and len(times) == 4

    class Batched(Slow):
        def __getitems__(self, indices):  # loads a whole batch at once: no sample apart
            return list(indices)

    assert _lightning.time_samples(iter(DataLoader(Batched(), batch_size=4)), time.perf_counter) is None
    assert _lightning.time_samples(iter(DataLoader(Slow(), batch_size=None)), time.perf_counter) is None
    workers = DataLoader(Slow(), batch_size=4, num_workers=1)
    it = iter(workers)
    try:
        assert _lightning.time_samples(it, time.perf_counter) is None
    finally:
        it._shutdown_workers()


def test_prefetch_changes_in_place_on_running_workers_and_every_batch_comes_once_in_order():
    dl = DataLoader(list(range(64)), batch_size=2, num_workers=2, prefetch_factor=2, persistent_workers=True)
    it = iter(dl)
    try:
        pids = [w.pid for w in it._workers]
        seen = [next(it).tolist() for _ in range(3)]

        def in_flight():  # batches handed to the workers, not yet delivered
            return it._send_idx - it._rcvd_idx

        assert in_flight() == 4
        assert _lightning.change_prefetch(dl, it, 4)
        assert in_flight() == 8 and dl.prefetch_factor == 4  # the extra batches handed over at once
        seen += [next(it).tolist() for _ in range(5)]
        assert _lightning.change_prefetch(dl, it, 1)  # shallower: PyTorch's own hand-out would assert here
        seen += [b.tolist() for b in it]
        assert seen == [[i, i + 1] for i in range(0, 64, 2)]
        assert in_flight() == 0
        again = iter(dl)  # a persistent loader's next epoch: its pipeline refilled at the new depth
        assert again is it and in_flight() == 2
        assert [w.pid for w in it._workers] == pids  # the same workers throughout
        assert [b.tolist() for b in again] == [[i, i + 1] for i in range(0, 64, 2)]
    finally:
        _lightning.shutdown_workers(dl)
    assert not _lightning.change_prefetch(dl, it, 2)  # shut down: a switch restarts the loader instead
    assert not _lightning.change_prefetch(dl, iter(DataLoader(list(range(4)))), 2)  # no workers


def _worker_ids(batch_indices):
    info = torch.utils.data.get_worker_info()
    return [(i, info.id, info.num_workers) for i in batch_indices]


@pytest.mark.parametrize("in_order", [True, False])
def test_workers_added_to_a_running_iterator_serve_every_batch_once_in_order_and_the_next_epoch(in_order):
    from torch.utils.data import _utils

    assert list(inspect.signature(_utils.worker._worker_loop).parameters) == list(_lightning.WORKER_LOOP_PARAMETERS), (
        f"torch {torch.__version__} changed `_worker_loop`'s parameters: update _lightning.add_workers"
    )
    dl = DataLoader(
        list(range(64)),
        batch_size=2,
        num_workers=2,
        prefetch_factor=2,
        persistent_workers=True,
        collate_fn=_worker_ids,
        in_order=in_order,
    )
    it = iter(dl)
    try:
        for name in _lightning.TORCH_WORKER_STATE:
            assert hasattr(it, name), f"torch moved `_MultiProcessingDataLoaderIter.{name}`: update add_workers"
        pids = [w.pid for w in it._workers]
        seen = [next(it) for _ in range(3)]
        sent = it._send_idx
        assert _lightning.add_workers(dl, it, 5)
        assert dl.num_workers == 5 and it._num_workers == 5
        assert [w.pid for w in it._workers][:2] == pids  # the running workers go on
        # the new ones were handed their batches at once (2 each), the pipeline as deep as PyTorch fills it
        assert it._send_idx == sent + 6 and _lightning._in_flight(it) == 2 * 5
        seen += list(it)
        indices = [i for batch in seen for i, _, _ in batch]
        assert sorted(indices) == list(range(64))
        if in_order:
            assert indices == list(range(64))
        by_worker = {(w, n) for batch in seen for _, w, n in batch}
        assert {w for w, _ in by_worker} == set(range(5))  # every new worker loaded batches
        assert {n for w, n in by_worker if w >= 2} == {5} and {n for w, n in by_worker if w < 2} == {2}
        again = iter(dl)  # the next epoch: every worker resumed, the pipeline refilled over all five
        assert again is it and it._send_idx == 10  # counted from the epoch's start
        epoch = [b for b in again]
        assert sorted(i for batch in epoch for i, _, _ in batch) == list(range(64))
        assert {w for batch in epoch for _, w, _ in batch} == set(range(5))
    finally:
        _lightning.shutdown_workers(dl)
    assert all(not w.is_alive() for w in it._workers)
    assert not _lightning.add_workers(dl, it, 8)  # shut down: a switch restarts the loader instead
    assert not _lightning.add_workers(dl, iter(DataLoader(list(range(4)))), 2)  # no workers


class _CountingFork(multiprocessing.context.ForkContext):
    """A fork context that records, as each worker process starts, how many batches were handed to workers before."""

    def __init__(self):
        self.handed, self.at_start = [0], []
        counting = self

        class Queue(multiprocessing.queues.Queue):
            def __init__(self, maxsize=0):
                super().__init__(maxsize, ctx=counting.get_context())

            def put(self, obj, *args, **kwargs):
                if isinstance(obj, tuple) and len(obj) == 2 and obj[1] is not None:  # (batch number, indices)
                    counting.handed[0] += 1
                super().put(obj, *args, **kwargs)

        class Process(multiprocessing.context.ForkProcess):
            def start(self):
                counting.at_start.append(counting.handed[0])
                super().start()

        self.Queue, self.Process = Queue, Process


def test_a_new_iterator_starts_its_workers_one_by_one_each_handed_a_batch_as_it_starts():
    context = _CountingFork()
    dl = DataLoader(
        list(range(40)), batch_size=2, num_workers=4, collate_fn=_worker_ids, multiprocessing_context=context
    )
    it = _lightning.iterate_growing(dl)
    try:
        assert type(it) is torch.utils.data.dataloader._MultiProcessingDataLoaderIter and dl.num_workers == 4
        assert context.at_start == [0, 1, 2, 3]  # PyTorch's own iter(): [0, 0, 0, 0], every batch after every fork
        assert context.handed[0] == 8 and _lightning._in_flight(it) == 8  # then as deep as PyTorch fills it
        batches = list(it)
        assert [i for batch in batches for i, _, _ in batch] == list(range(40))
        assert {w for batch in batches for _, w, _ in batch} == {0, 1, 2, 3}
        # worker 0 was started by PyTorch as the iterator's only one; the added ones are told the count
        assert {(w, n) for batch in batches for _, w, n in batch} == {(0, 1), (1, 4), (2, 4), (3, 4)}
    finally:
        _lightning.shutdown_iterator(it)
    plain = _CountingFork()
    list(iter(DataLoader(list(range(8)), batch_size=2, num_workers=4, multiprocessing_context=plain)))
    assert plain.at_start == [0, 0, 0, 0]  # what the test above tells apart


def test_a_loader_whose_workers_cannot_be_added_is_iterated_as_pytorch_does():
    from torch.utils.data.datapipes.map import SequenceWrapper

    context = _CountingFork()  # a MapDataPipe: no workers added beside running ones (see can_add_workers)
    dl = DataLoader(SequenceWrapper(list(range(8))), batch_size=2, num_workers=3, multiprocessing_context=context)
    it = _lightning.iterate_growing(dl)
    try:
        assert it._num_workers == 3 and dl.num_workers == 3 and context.at_start == [0, 0, 0]
        assert sorted(i for batch in it for i in batch.tolist()) == list(range(8))
    finally:
        _lightning.shutdown_iterator(it)

    class Broken(torch.utils.data.Sampler):
        def __len__(self):
            return 2

        def __iter__(self):
            raise ValueError("broken sampler")
            yield

    dl = DataLoader(list(range(4)), batch_sampler=Broken(), num_workers=3)
    with pytest.raises(ValueError, match="broken sampler"):
        _lightning.iterate_growing(dl)
    assert dl.num_workers == 3 and dl.prefetch_factor == 2  # as the user's loader had them


def test_workers_are_not_added_beside_an_iterable_dataset():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    dl = DataLoader(Stream(), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(dl)
    try:
        assert not _lightning.can_add_workers(dl, it)
        assert not _lightning.add_workers(dl, it, 2) and dl.num_workers == 1
    finally:
        _lightning.shutdown_workers(dl)


def test_a_carried_iterator_is_what_iter_returns_for_persistent_and_new_iterators():
    # seamless epochs: `DataLoader.__iter__` asks `self._get_iterator()` for a new iterator, and a persistent
    # loader asks only while its `_iterator` is None
    carried = iter([("carried",)])
    for persistent in (True, False):
        dl = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=persistent)
        offered = [carried]
        _lightning.serve_carried_iterator(dl, lambda loader, offered=offered: offered.pop() if offered else None)
        try:
            assert iter(dl) is carried
            _lightning.release_iterator(dl)
            assert dl._iterator is None
            fresh = iter(dl)  # nothing offered: PyTorch's own iterator
            assert fresh is not carried and next(fresh).tolist() == [0, 1]
            _lightning.shutdown_unless_owned(dl, fresh)  # a persistent loader holds it: it resets it next epoch
            assert fresh._shutdown is not persistent
            _lightning.shutdown_iterator(fresh)
        finally:
            _lightning.shutdown_workers(dl)


def test_the_train_combined_loaders_iterator_is_where_the_switcher_reaches_it():
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    dl = DataLoader(list(range(8)), batch_size=2)
    combined = CombinedLoader(dl, "max_size_cycle")  # how the fit loop wraps the train loader
    iter(combined)
    owners = {cls.__name__: obj for obj in (combined, combined._iterator) for cls in type(obj).__mro__}
    for owner, name in _lightning.COMBINED_LOADER_PRIVATE:
        assert owner in owners, f"lightning renamed `{owner}`: update _lightning.COMBINED_LOADER_PRIVATE"
        assert hasattr(owners[owner], name), (
            f"lightning moved `{owner}.{name}`: update lightning_dltune/switching/_lightning.py"
        )
    mode_iter = combined._iterator
    assert mode_iter.iterables == [dl] and len(mode_iter.iterators) == 1


def test_the_switcher_wraps_and_finds_the_train_iterator_in_a_real_fit(tmp_path):
    """The fit loop's own objects, between two batches: the iterator the switcher wraps is the one the loop uses."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = []

    class Peek(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                inner = _lightning.train_iterator(trainer)
                _lightning.wrap_train_iterator(trainer, lambda loader, it: Wrapped(loader, it))
                seen.append((inner, _lightning.train_iterator(trainer)))

    class Wrapped:
        def __init__(self, loader, inner):
            self.loader, self.inner, self.calls = loader, inner, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.calls += 1
            return next(self.inner)

    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=4,
        callbacks=[Peek()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    ((inner, wrapped),) = seen
    assert inner is not None and isinstance(wrapped, Wrapped) and wrapped.inner is inner
    assert wrapped.loader is trainer.train_dataloader and wrapped.calls >= 2  # the loop pulled batches through it


def test_only_the_loader_switchers_use_the_private_module():
    """The train loader's switcher and the evaluation loops' (``evaluation.EvalTuner``) are its only users."""
    import ast
    from pathlib import Path

    package = Path(_lightning.__file__).parents[1]
    users = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.module == "lightning_dltune.switching._lightning"
                or (node.module == "lightning_dltune.switching" and any(a.name == "_lightning" for a in node.names))
            ):
                users.append(path.name)
    assert sorted(set(users)) == ["evaluation.py", "loader.py"], users


def test_a_new_persistent_iterator_asked_again_before_it_yielded_begins_one_epoch_not_two():
    # Lightning calls iter(loader) twice in an epoch that reloads its loader; for a persistent loader the second
    # call resets the iterator just created, whose workers were already handed the epoch's first batches
    from lightning_dltune.switching.switch import ResumableBatchSampler

    sampler = ResumableBatchSampler(range(64), 4, False)
    loader = DataLoader(list(range(64)), batch_sampler=sampler, num_workers=2, persistent_workers=True)
    _lightning.serve_carried_iterator(loader, lambda loader: None)
    try:
        first = iter(loader)
        assert iter(loader) is first and sampler._epoch_no == 1
        assert [int(x) for x in next(first)] == [0, 1, 2, 3]
        for _ in first:  # a whole epoch, then the next one resets as PyTorch does
            pass
        iter(loader)
        assert sampler._epoch_no == 2
    finally:
        _lightning.shutdown_iterator(loader._iterator)


def _init_fails(worker_id):
    raise ValueError("cannot open the database in a worker")


@pytest.mark.parametrize("kept", [False, True])
def test_a_reset_before_the_first_batch_keeps_what_the_workers_raised_at_start(kept):
    # Lightning's setup_data and its epoch loop both call iter(loader) in an epoch that reloads the loader: PyTorch's
    # reset drops the first batches' answers, a worker_init_fn's error among them, and runs the workers uninitialized
    loader = DataLoader(
        list(range(16)), batch_size=2, num_workers=2, persistent_workers=True, worker_init_fn=_init_fails
    )
    first = iter(loader)
    if kept:
        _lightning.keep_start_errors(loader)
    try:
        assert iter(loader) is first
        if kept:
            with pytest.raises(ValueError, match="cannot open the database"):
                next(first)
        assert [int(x) for x in next(first)] == [0, 1]  # the error took no batch
    finally:
        _lightning.shutdown_iterator(first)


class _FailsAtFive(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 5:
            raise KeyError(index)
        return index


def test_a_reset_before_the_first_batch_drops_a_later_batchs_error_as_pytorch_does():
    # batch 2 (samples 4, 5) is worker 0's second: its error is the dataset's, and comes when that batch is asked for
    loader = DataLoader(_FailsAtFive(), batch_size=2, num_workers=2, persistent_workers=True)
    first = iter(loader)
    _lightning.keep_start_errors(loader)
    try:
        assert iter(loader) is first  # each worker answers its batches before the reset's marker: all are dropped
        assert [int(x) for x in next(first)] == [0, 1] and [int(x) for x in next(first)] == [2, 3]
        with pytest.raises(KeyError):
            next(first)
    finally:
        _lightning.shutdown_iterator(first)


def _abort_at_exit(worker_id):
    import multiprocessing.util
    import os

    multiprocessing.util.Finalize(None, os.abort, exitpriority=0)  # as a worker that aborts while it exits


def test_a_worker_that_dies_while_it_is_stopped_does_not_fail_the_shutdown():
    # PyTorch's SIGCHLD handler raises the death into the join ("killed by signal: Aborted"); the loader must still
    # let go of the stopped iterator, so the next iter() starts new workers
    loader = DataLoader(
        list(range(16)), batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=_abort_at_exit
    )
    next(iter(loader))
    _lightning.shutdown_workers(loader)
    assert loader._iterator is None
    it = iter(loader)
    next(it)
    _lightning.shutdown_iterator(it)
    assert it._shutdown


def test_a_loader_kept_through_a_reload_gets_no_distributed_sampler_injected():
    # `kept_through_reload` relies on Lightning injecting a DistributedSampler only where a loader's `sampler` is
    # not one: the loader a rank keeps (its batch sampler holding Lightning's) then passes the reload as it is
    from torch.utils.data import DistributedSampler

    from lightning_dltune.switching.switch import ResumableBatchSampler

    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False, enable_progress_bar=False)
    shard = DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    dl = DataLoader(list(range(8)), batch_sampler=ResumableBatchSampler(shard, batch_size=2, drop_last=False))
    connector = trainer._data_connector
    assert connector._requires_distributed_sampler(dl)  # PyTorch's default sampler beside the batch sampler
    assert _lightning.kept_through_reload(dl, trainer) is dl
    assert not connector._requires_distributed_sampler(dl) and dl.sampler is shard


def test_the_ranks_a_ddp_launcher_starts_are_in_its_procs():
    # `launched_ranks` reads the subprocess launcher's `procs` (the DDP test checks rank 0 finds rank 1 there)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False, enable_progress_bar=False)
    assert trainer.strategy.launcher.procs == [] and _lightning.launched_ranks(trainer) == []

    class Launched:
        pid = 4242

    launched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        trainer.strategy.launcher.procs += [Launched(), launched]  # 4242: no child of this process
        assert _lightning.launched_ranks(trainer) == [launched.pid]
        # a later Trainer in this process launches no rank (LOCAL_RANK is set by then): the running ones are kept
        assert _lightning.launched_ranks(pl.Trainer(accelerator="cpu", devices=1, logger=False)) == [launched.pid]
    finally:
        launched.kill()
        launched.wait()
    assert _lightning.launched_ranks(pl.Trainer(accelerator="cpu", devices=1, logger=False)) == []  # gone


def test_a_worker_death_raised_into_the_wait_for_it_reads_as_a_death():
    # PyTorch's SIGCHLD handler raises a killed worker's death into whatever the main thread runs, here the wait
    # that looks for the dead worker (a full-suite run lost a validation pass to it); the timing cannot be forced with
    # a real worker, so the worker here raises as the handler does
    class Worker:
        def __init__(self, error):
            self.error = error

        def is_alive(self):
            raise self.error

    class Iterator:
        def __init__(self, error):
            self._workers = [Worker(error)]

    killed = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    assert _lightning.worker_died(Iterator(killed))
    with pytest.raises(RuntimeError, match="something else"):
        _lightning.worker_died(Iterator(RuntimeError("something else")))
