"""Every use of a private Lightning (and PyTorch DataLoader) attribute lives here.

``tests/test_lightning_private.py`` fails loudly when a release moves one of them. Checked against
lightning 2.6; see ../shared/LIGHTNING_NOTES.md for how the train loader lives inside ``fit``.
"""

from __future__ import annotations

import inspect
import itertools
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import lightning.pytorch as pl
from torch._utils import ExceptionWrapper
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from torch.utils.data._utils.fetch import _MapDatasetFetcher
from torch.utils.data._utils.worker import _worker_loop
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from lightning_dltune.switching.switch import RecordedBatches, apart_from_global, is_worker_death

# (object path from the Trainer, attribute) pairs this module relies on; the test walks them.
PRIVATE_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("fit_loop", "_data_source"),
    ("fit_loop", "_combined_loader"),
    ("fit_loop", "_data_fetcher"),
    ("fit_loop", "_combined_loader_states_to_load"),
    ("fit_loop", "_last_train_dl_reload_epoch"),
    ("fit_loop", "_should_reload_train_dl"),
    ("fit_loop._data_source", "dataloader"),
    ("fit_loop.epoch_loop", "_on_before_fetch"),
    ("fit_loop.epoch_loop", "_on_after_fetch"),
    # the evaluation loops (see `evaluation_loop`): each has these, and the validation loop of `fit` its reload epoch
    *(
        (loop, attr)
        for loop in ("fit_loop.epoch_loop.val_loop", "validate_loop", "test_loop", "predict_loop")
        for attr in ("_data_source", "_combined_loader", "_data_fetcher", "_on_before_fetch", "_on_after_fetch")
    ),
    ("fit_loop.epoch_loop.val_loop", "_last_val_dl_reload_epoch"),
    ("fit_loop.epoch_loop.val_loop", "_should_reload_val_dl"),  # whether its next pass asks for a new loader
    ("fit_loop.epoch_progress.current", "processed"),  # the epoch a validation pass sets its samplers to
)
# Private parts of the train CombinedLoader: (owner, attribute), the owner being what ``iter(CombinedLoader)`` makes.
COMBINED_LOADER_PRIVATE: tuple[tuple[str, str], ...] = (
    ("CombinedLoader", "_iterator"),
    ("_ModeIterator", "iterators"),
    ("_ModeIterator", "iterables"),
)
# PyTorch DataLoader internals used for in-epoch switching and worker-death recovery: (owner, attribute).
TORCH_PRIVATE: tuple[tuple[str, str], ...] = (
    ("DataLoader", "_iterator"),
    ("DataLoader", "_get_iterator"),
    ("_MultiProcessingDataLoaderIter", "_workers"),
    ("_MultiProcessingDataLoaderIter", "_shutdown_workers"),
    ("_MultiProcessingDataLoaderIter", "_worker_pids_set"),
    ("_MultiProcessingDataLoaderIter", "_prefetch_factor"),
    ("_MultiProcessingDataLoaderIter", "_num_workers"),
    ("_MultiProcessingDataLoaderIter", "_tasks_outstanding"),
    ("_MultiProcessingDataLoaderIter", "_try_put_index"),
    ("_MultiProcessingDataLoaderIter", "_shutdown"),
    ("_MultiProcessingDataLoaderIter", "_reset"),
    ("_MultiProcessingDataLoaderIter", "_get_data"),
    ("_MultiProcessingDataLoaderIter", "_task_info"),
    ("_MultiProcessingDataLoaderIter", "_next_data"),
    ("_BaseDataLoaderIter", "_sampler_iter"),
    ("torch.utils.data._utils.signal_handling", "_remove_worker_pids"),
)
# What a running single-process iterator fetches its batches with (`time_samples`): its attribute, and the fetcher's.
TORCH_FETCHER_STATE: tuple[tuple[str, str], ...] = (
    ("_SingleProcessDataLoaderIter", "_dataset_fetcher"),
    ("_MapDatasetFetcher", "dataset"),
    ("_MapDatasetFetcher", "auto_collation"),
    ("_MapDatasetFetcher", "fetch"),
)
# What a running iterator holds for each worker, and what it starts one with (`add_workers`): its own attributes,
# set in `__init__` and `_reset` (the test checks them on a running iterator), and `_worker_loop`'s parameters.
TORCH_WORKER_STATE: tuple[str, ...] = (
    "_dataset_kind",
    "_dataset",
    "_worker_result_queue",
    "_workers_done_event",
    "_auto_collation",
    "_collate_fn",
    "_drop_last",
    "_base_seed",
    "_worker_init_fn",
    "_persistent_workers",
    "_shared_seed",
    "_index_queues",
    "_workers_status",
    "_task_info",
    "_worker_queue_idx_cycle",
    "_send_idx",
    "_rcvd_idx",
    "_in_order",
    "_num_yielded",
)
# torch 2.14 hands each worker its dataset in a one-item list the worker empties (`dataset_holder`), so that the
# Process object does not keep the dataset; earlier releases pass the dataset itself
_DATASET_HOLDER = "dataset_holder" in inspect.signature(_worker_loop).parameters
WORKER_LOOP_PARAMETERS: tuple[str, ...] = (
    "dataset_kind",
    "dataset_holder" if _DATASET_HOLDER else "dataset",
    "index_queue",
    "data_queue",
    "done_event",
    "auto_collation",
    "collate_fn",
    "drop_last",
    "base_seed",
    "init_fn",
    "worker_id",
    "num_workers",
    "persistent_workers",
    "shared_seed",
)

_SAVED_KWARGS = "__pl_saved_kwargs"
_SAVED_ARGS = "__pl_saved_args"
_SAVED_ARG_NAMES = "__pl_saved_arg_names"
_PARKED_CONTEXT = "_dltune_multiprocessing_context"


_WORKER_COUNT_WARNING = r"This DataLoader will create \d+ worker processes in total"


def _no_check() -> None:
    """Stands in for ``DataLoader.check_worker_number_rationality`` on a loader whose worker count the tuner set."""


def quiet_worker_check(loader: DataLoader) -> None:
    """Leave PyTorch's worker-count warning out of this loader's ``iter()`` calls (the tuner set its count)."""
    loader.check_worker_number_rationality = _no_check  # type: ignore[method-assign]


REMOVE = object()
"""An override value that drops the argument from the rebuilt loader's constructor call."""


class NotRebuildableError(RuntimeError):
    """The train loader cannot be rebuilt with other settings; the tuner leaves it alone."""


def install_loader_transform(
    trainer: "pl.Trainer", transform: Callable[[Any], Any], quiet: Callable[[], bool] = lambda: False
) -> Callable[[], None]:
    """Route every train-loader request of ``fit`` through ``transform(loader) -> loader``.

    The transform runs inside Lightning's argument-recording context, before the distributed sampler is
    injected, so a loader it rebuilds can still be rebuilt by Lightning. While ``quiet()`` (the user's hook
    builds the loader with the tuner's worker count, through the mixin), PyTorch's worker-count warning is
    left out of that call alone. Returns the function that undoes it.
    """
    return install_source_transform(trainer.fit_loop, lambda original: transform(original()), quiet)


def install_source_transform(
    loop: Any, transform: Callable[[Callable[[], Any]], Any], quiet: Callable[[], bool] = lambda: False
) -> Callable[[], None]:
    """Route every loader request of ``loop`` (the fit loop, or an evaluation loop) through
    ``transform(original) -> loaders``, where ``original()`` calls the user's hook (or returns the loaders given to
    the ``Trainer`` method). As :func:`install_loader_transform`; returns the function that undoes it."""
    source = loop._data_source
    original = source.dataloader

    def dataloader() -> Any:
        with warnings.catch_warnings():
            if quiet():
                warnings.filterwarnings("ignore", message=_WORKER_COUNT_WARNING, category=UserWarning)
            return transform(original)

    return patch_attribute(source, "dataloader", dataloader)


def patch_attribute(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``value`` as ``obj``'s own attribute ``name`` and return the undo, which puts back exactly what was there:
    the object's own attribute (a user's, a ``Mock``), or none, so the class's applies again. An undo finding another
    value there (set since, by somebody else) leaves it."""
    had, before = name in obj.__dict__, obj.__dict__.get(name)
    object.__setattr__(obj, name, value)  # past Lightning's record of attribute changes on loaders

    def restore() -> None:
        if obj.__dict__.get(name) is not value:
            return
        if had:
            object.__setattr__(obj, name, before)
        else:
            del obj.__dict__[name]

    return restore


def install_fetch_hooks(
    trainer: "pl.Trainer", before: Callable[[], None], after: Callable[[], None]
) -> Callable[[], None]:
    """Call ``before``/``after`` around every ``next()`` on the train data fetcher (where the profiler times
    ``train_dataloader_next``). Returns the function that undoes it."""
    return install_loop_fetch_hooks(trainer.fit_loop.epoch_loop, before, after)


def install_loop_fetch_hooks(loop: Any, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """As :func:`install_fetch_hooks`, on ``loop``: the train epoch loop or an evaluation loop (whose ``reset`` hands
    the hooks to its fetcher, after the fetcher took the pass's first batch)."""
    orig_before, orig_after = loop._on_before_fetch, loop._on_after_fetch

    def on_before_fetch() -> None:
        before()
        orig_before()

    def on_after_fetch() -> None:
        orig_after()
        after()

    undo_before = patch_attribute(loop, "_on_before_fetch", on_before_fetch)
    undo_after = patch_attribute(loop, "_on_after_fetch", on_after_fetch)

    def restore() -> None:
        undo_after()
        undo_before()

    return restore


_LAUNCHED: set[int] = set()  # every rank a launcher started from this process (a later Trainer launches none)


def launched_ranks(trainer: "pl.Trainer") -> list[int]:
    """The PIDs of the other ranks Lightning's launcher started from this process and still running as its children
    (its subprocess launcher's ``procs``, on the rank that launched them, kept for the process's later Trainers: once
    launched, the ranks set ``LOCAL_RANK`` and a later Trainer's launcher starts none): children whose CPU is not this
    rank's loader's."""
    import psutil

    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or []
    _LAUNCHED.update(int(p.pid) for p in procs if getattr(p, "pid", None) is not None)
    for pid in list(_LAUNCHED):
        try:
            alive = psutil.Process(pid).ppid() == os.getpid()
        except psutil.Error:
            alive = False
        if not alive:
            _LAUNCHED.discard(pid)
    return sorted(_LAUNCHED)


def lightning_reloads_train(trainer: "pl.Trainer") -> bool:
    """Whether Lightning's own ``reload_dataloaders_every_n_epochs`` asks for the train loader now (read inside
    ``setup_data``, before it records this epoch as its latest reload)."""
    return bool(trainer.fit_loop._should_reload_train_dl)


def train_reload_epoch(trainer: "pl.Trainer") -> float:
    """The epoch Lightning last reloaded the train loader at: what its reload schedule counts from."""
    return float(trainer.fit_loop._last_train_dl_reload_epoch)


def set_train_reload_epoch(trainer: "pl.Trainer", epoch: float) -> None:
    """Put back the epoch Lightning's reload schedule counts from (``setup_data`` sets it on every reload)."""
    trainer.fit_loop._last_train_dl_reload_epoch = epoch


def request_train_reload(trainer: "pl.Trainer", keep_workers: bool = False) -> None:
    """Shut the current train loader's workers down (unless ``keep_workers``: the loader goes on through the reload,
    see :func:`kept_through_reload`) and make the next epoch call ``train_dataloader()``."""
    fit_loop = trainer.fit_loop
    if fit_loop._data_fetcher is not None and not keep_workers:
        fit_loop._data_fetcher.teardown()  # shuts the workers of every flattened loader down
    fit_loop._data_fetcher = None  # or fit teardown tears the torn-down fetcher down again and crashes
    fit_loop._combined_loader = None


def kept_through_reload(loader: DataLoader, trainer: "pl.Trainer") -> DataLoader:
    """``loader`` (the one the fit loop ran, Lightning's distributed sampler in it) made to pass Lightning's reload as
    it is: Lightning injects a ``DistributedSampler`` into a loader whose ``sampler`` is not one, and a loader with a
    batch sampler of its own has PyTorch's default ``sampler`` beside it (the batch sampler holds Lightning's). Its
    ``sampler`` is set to the batch sampler's (read by Lightning alone: the batches come from the batch sampler), so
    the next ``iter()`` resets its persistent iterator instead of starting new workers. Lightning calls ``iter()``
    twice in an epoch that reloads (``setup_data`` and the epoch loop): the first resets the iterator, its epoch-seeded
    sampler set to the epoch first (Lightning sets it only after ``setup_data``), the second finds it fresh and keeps
    it (see :func:`_reset_once_used`), so the epoch's order is drawn once, as without the reload (as
    :func:`reset_ahead` does for an evaluation loop's pass, at the reset Lightning asks for)."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(inner, DistributedSampler) and not isinstance(loader.sampler, DistributedSampler):
        object.__setattr__(loader, "sampler", inner)  # past DataLoader's guard on setting it after __init__
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_reset"):
        ref = weakref.ref(iterator)

        def reset_then_keep(loader: Any, first_iter: bool = False) -> None:
            it: Any = ref()
            if it is None:
                return
            _reset_as_pytorch_does(it)
            # what Lightning sets after setup_data (its epoch progress is a processed-tracker at run time)
            reset_ahead(loader, getattr(trainer.fit_loop.epoch_progress.current, "processed", trainer.current_epoch))

        iterator._reset = reset_then_keep
    return loader


def loader_state_pending(trainer: "pl.Trainer", loader: Any) -> bool:
    """Whether Lightning will load a checkpoint's saved loader state into ``loader``, in ``setup_data`` right after
    building it: a resumed ``fit`` whose train loader had a ``state_dict`` (torchdata's ``StatefulDataLoader``,
    litdata's ``StreamingDataLoader``), restarting mid-epoch, or at an epoch's end under ``max_steps``."""
    fit_loop = trainer.fit_loop
    stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return stateful and fit_loop.restarting and bool(fit_loop._combined_loader_states_to_load)


def rebuild_dataloader(loader: DataLoader, overrides: dict[str, Any], quiet: bool = False) -> DataLoader:
    """A new instance of ``loader``'s class with the same constructor arguments except ``overrides``.

    Positional constructor arguments are passed by name, so Lightning can rebuild the result again for its
    distributed sampler. The sampler, batch sampler, ``collate_fn``, ``worker_init_fn``, ``generator`` and
    ``multiprocessing_context`` of the original are kept. An override of :data:`REMOVE` drops an argument.
    ``quiet``: the worker count is the tuner's, measured: PyTorch's "will create N worker processes" warning
    is left out for this loader alone (at construction and at every ``iter()``); the tuner says it once.

    Raises:
        NotRebuildableError: when the loader's constructor arguments cannot be recovered.
    """
    from lightning.fabric.utilities.data import (
        _get_dataloader_init_args_and_kwargs,
        _reinstantiate_wrapped_cls,
    )

    saved = getattr(loader, _SAVED_KWARGS, None)
    if saved is not None:
        # built inside a Lightning hook: replay the recorded constructor call (sampler and batch sampler as given)
        args, kwargs = tuple(getattr(loader, _SAVED_ARGS, ())), dict(saved)
    else:
        # built elsewhere: recover the arguments from the instance, as Lightning does for its sampler injection
        try:
            args, kwargs = _get_dataloader_init_args_and_kwargs(loader, loader.sampler)
        except Exception as ex:
            raise NotRebuildableError(str(ex)) from ex
        if loader.batch_size is None and loader.batch_sampler is not None:  # a user-given batch sampler
            kwargs.update(
                batch_sampler=loader.batch_sampler, batch_size=1, shuffle=False, sampler=None, drop_last=False
            )
    names = tuple(getattr(loader, _SAVED_ARG_NAMES, ()))
    if len(args) > len(names):
        raise NotRebuildableError(
            f"`{type(loader).__name__}` was built with {len(args)} positional arguments that cannot be named."
        )
    kwargs = {**dict(zip(names, args, strict=False)), **kwargs, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not REMOVE}
    # PyTorch rejects a multiprocessing context without workers: park it on the loader for the way back
    context = loader.__dict__.get(_PARKED_CONTEXT, getattr(loader, "multiprocessing_context", None))
    kwargs["multiprocessing_context"] = context if kwargs.get("num_workers", 0) > 0 else None
    try:
        with warnings.catch_warnings():
            if quiet:
                warnings.filterwarnings("ignore", message=_WORKER_COUNT_WARNING, category=UserWarning)
            new = _reinstantiate_wrapped_cls(loader, **kwargs)
    except Exception as ex:
        raise NotRebuildableError(f"rebuilding `{type(loader).__name__}` failed: {ex}") from ex
    if quiet:
        quiet_worker_check(new)
    if context is not None and new.multiprocessing_context is None:
        new.__dict__[_PARKED_CONTEXT] = context
    # attribute assignments replayed from the original must not undo the new settings
    for key in ("num_workers", "prefetch_factor", "pin_memory"):
        if key in overrides and getattr(new, key, overrides[key]) != overrides[key]:
            setattr(new, key, overrides[key])
    return new


def show_sampler(loader: DataLoader) -> None:
    """Make ``loader.sampler`` the sampler its batch sampler draws from, as a loader built with ``shuffle=`` shows it,
    so that Lightning's checks of the train loader (``overfit_batches`` turning shuffling off and warning that it
    did) see what the user's loader had. PyTorch reads ``sampler`` only without a batch sampler."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    if inner is not None:
        object.__setattr__(loader, "sampler", inner)  # DataLoader refuses `sampler` once built


def replace_dataset(loader: DataLoader, dataset: Any) -> None:
    """Give a built ``loader`` another ``dataset`` of the same kind (its iterators read it when created)."""
    object.__setattr__(loader, "dataset", dataset)  # DataLoader refuses `dataset` once built


def recording() -> ExitStack:
    """Lightning's argument-recording context for ``DataLoader``/``BatchSampler`` constructors, so loaders
    built inside it can be rebuilt again (by us or for Lightning's distributed sampler)."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import BatchSampler

    stack = ExitStack()
    stack.enter_context(_replace_dunder_methods(DataLoader, "dataset"))
    stack.enter_context(_replace_dunder_methods(BatchSampler))
    return stack


def _mode_iterator(trainer: "pl.Trainer") -> Any:
    """The ``_ModeIterator`` inside the train ``CombinedLoader`` (``.iterables``/``.iterators``), or ``None``."""
    combined = trainer.fit_loop._combined_loader
    return None if combined is None else combined._iterator


def train_iterator(trainer: "pl.Trainer") -> Any:
    """The iterator the fit loop pulls train batches from (``None`` before ``iter()`` or with several loaders)."""
    mode_iter = _mode_iterator(trainer)
    if mode_iter is None or len(mode_iter.iterators) != 1:
        return None
    return mode_iter.iterators[0]


def wrap_train_iterator(trainer: "pl.Trainer", wrap: Callable[[Any, Iterator[Any]], Iterator[Any]]) -> None:
    """Replace the train iterator by ``wrap(loader, iterator)``: the loop pulls its next batch from the result."""
    mode_iter = _mode_iterator(trainer)
    if mode_iter is None or len(mode_iter.iterators) != 1:
        return
    mode_iter.iterators[0] = wrap(mode_iter.iterables[0], mode_iter.iterators[0])


def replace_train_loader(trainer: "pl.Trainer", loader: DataLoader) -> None:
    """Make ``loader`` the train loader of the running epoch and of the next ones."""
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    combined.flattened = [loader]
    if combined._iterator is not None:
        combined._iterator.iterables = combined.flattened


def shutdown_workers(loader: Any) -> None:
    """Stop ``loader``'s worker processes now (persistent ones included)."""
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

    _even_if_one_dies(lambda: _shutdown_workers_and_reset_iterator(loader))
    if getattr(loader, "_iterator", None) is not None:  # its reset is skipped when a worker died as it stopped
        loader._iterator = None


def shutdown_iterator(iterator: Iterator[Any]) -> None:
    """Stop a multi-process loader iterator's workers now (a non-persistent iterator is not held by its loader,
    so :func:`shutdown_workers` does not reach it)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        _even_if_one_dies(shutdown)


def can_change_prefetch(iterator: Any) -> bool:
    """Whether :func:`change_prefetch` can change ``iterator``'s depth in place (PyTorch's own running workers)."""
    return type(iterator) is _MultiProcessingDataLoaderIter and not iterator._shutdown


def change_prefetch(loader: DataLoader, iterator: Any, prefetch: int) -> bool:
    """Give ``loader`` and its running multi-process ``iterator`` a new ``prefetch_factor`` in place, without
    restarting the workers: deeper, the workers are handed the extra batches at once; shallower, no batch is handed
    while ``prefetch`` per worker or more are outstanding (handed and not yet received). False (nothing changed)
    for any other iterator (a ``StatefulDataLoader``'s, one with other workers, one shut down): that switch
    restarts the loader.

    PyTorch reads the factor from the iterator's ``_prefetch_factor`` wherever it hands a batch to the workers
    (``_try_put_index``, which asserts fewer than ``_prefetch_factor * _num_workers`` tasks are outstanding, and
    ``_reset``, which fills the pipeline at every epoch start), and a new iterator reads the loader's."""
    if not can_change_prefetch(iterator):
        return False
    if iterator._num_workers != loader.num_workers or loader.prefetch_factor is None or prefetch < 1:
        return False
    if "_try_put_index" not in vars(iterator):  # hands no batch over the limit, where PyTorch's own would assert
        ref, strict = weakref.ref(iterator), type(iterator)._try_put_index

        def put() -> None:
            it = ref()
            if it is not None and it._tasks_outstanding < it._prefetch_factor * it._num_workers:
                strict(it)

        iterator._try_put_index = put
    more = (prefetch - iterator._prefetch_factor) * iterator._num_workers
    iterator._prefetch_factor = prefetch
    object.__setattr__(loader, "prefetch_factor", prefetch)  # past Lightning's record (see ResumableBatchSampler)
    for _ in range(max(0, more)):
        iterator._try_put_index()
    return True


def can_add_workers(loader: DataLoader, iterator: Any) -> bool:
    """Whether :func:`add_workers` can start more workers beside ``iterator``'s running ones: PyTorch's own iterator,
    running, of ``loader`` as it stands, over a map-style dataset (an iterable one shards by worker count, which the
    running workers were started with)."""
    if not can_change_prefetch(iterator) or iterator._num_workers != loader.num_workers:
        return False
    return _map_style(iterator._dataset)


def _map_style(dataset: Any) -> bool:
    """Whether workers can be added beside running ones over ``dataset``: map-style (an iterable one, an
    ``IterDataPipe`` among them, shards by worker count) and not a ``MapDataPipe``."""
    from torch.utils.data import IterableDataset, MapDataPipe

    return not isinstance(dataset, (IterableDataset, MapDataPipe))


def add_workers(loader: DataLoader, iterator: Any, workers: int) -> bool:
    """Start worker processes beside ``iterator``'s running ones until it has ``workers``, handing each new one its
    first batch as soon as it has started (it loads while the next one starts) and, once all have, the rest of its
    ``prefetch_factor``; ``loader.num_workers`` says the count running. False where :func:`can_add_workers` says no
    (nothing changed), for no more workers than it runs, or where one could not start: the ones that did serve on,
    with their batches, until that switch replaces the iterator (stopping them all).

    The new workers are started as PyTorch starts a new iterator's (``_worker_loop`` with the iterator's dataset,
    queues, collate function, base seed and ``worker_init_fn``; worker ``i`` seeds ``base_seed + i``), with ids after
    the running ones; each is told the new worker count (``get_worker_info().num_workers``), the running ones keep
    the count they started with. Batches still come back in order: PyTorch hands batches round-robin over
    ``_num_workers`` workers (``_worker_queue_idx_cycle``), tracks each worker's tasks (``_workers_status``,
    ``_task_info``), and at every epoch start of a persistent iterator resumes ``_num_workers`` workers
    (``_reset``); the new ones are in all of them. Only the new workers are forked: a running iterator of 13 workers
    grows to 16 in 3 forks instead of stopping 13 workers and forking 16 (150-250 ms on 2 CPUs)."""
    if workers <= getattr(iterator, "_num_workers", 0) or not can_add_workers(loader, iterator):
        return False
    import torch

    context = loader.multiprocessing_context or torch.multiprocessing
    try:
        started = _start_workers(loader, iterator, workers, context)
        # the rest of their batches (the fewest handed first), then PyTorch's round-robin over all of them
        running = iterator._num_workers
        while _in_flight(iterator) < iterator._prefetch_factor * running:
            handed = iterator._send_idx
            _hand_to(iterator, min(range(running), key=lambda w: (tasks_of(iterator, w), w)))
            if iterator._send_idx == handed:  # the epoch has no batch left to hand
                break
    finally:
        iterator._worker_queue_idx_cycle = itertools.cycle(range(iterator._num_workers))
    return started


def _start_workers(loader: DataLoader, iterator: Any, workers: int, context: Any) -> bool:
    """Start ``iterator``'s workers up to ``workers``, each handed its first batch as it has started; False where
    one could not start (the ones that did run)."""
    for i in range(iterator._num_workers, workers):
        index_queue = None
        try:
            index_queue = context.Queue()
            index_queue.cancel_join_thread()  # as PyTorch's: a worker's queue never blocks the process's exit
            args = dict(
                dataset_kind=iterator._dataset_kind,
                dataset_holder=[iterator._dataset],
                dataset=iterator._dataset,
                index_queue=index_queue,
                data_queue=iterator._worker_result_queue,
                done_event=iterator._workers_done_event,
                auto_collation=iterator._auto_collation,
                collate_fn=iterator._collate_fn,
                drop_last=iterator._drop_last,
                base_seed=iterator._base_seed,
                init_fn=iterator._worker_init_fn,
                worker_id=i,
                num_workers=workers,
                persistent_workers=iterator._persistent_workers,
                shared_seed=iterator._shared_seed,
            )
            ordered = tuple(args[name] for name in WORKER_LOOP_PARAMETERS)
            process = context.Process(target=_worker_loop, args=ordered)
            process.daemon = True
            process.start()
        except OSError:  # out of processes or memory (fork's EAGAIN, ENOMEM): the switch builds a new loader
            if index_queue is not None:
                index_queue.close()
            return False
        iterator._index_queues.append(index_queue)
        iterator._workers.append(process)
        iterator._workers_status.append(True)
        if hasattr(iterator, "_workers_num_tasks"):  # where torch has it, its out-of-order hand-out reads it
            iterator._workers_num_tasks.append(0)
        iterator._num_workers = i + 1
        object.__setattr__(loader, "num_workers", i + 1)  # past Lightning's record (see ResumableBatchSampler)
        _hand_to(iterator, i)
    return True


def _hand_to(iterator: Any, worker: int) -> None:
    """Hand ``iterator``'s next batch to ``worker`` (PyTorch hands it to the next worker of its cycle), unless its
    workers already hold ``prefetch_factor`` batches each (a shallower prefetch set in place drains first)."""
    if _in_flight(iterator) < iterator._prefetch_factor * iterator._num_workers:
        iterator._worker_queue_idx_cycle = itertools.repeat(worker)
        iterator._try_put_index()


def tasks_of(iterator: Any, worker: int) -> int:
    """The batches handed to ``worker`` and not yet served (PyTorch keeps one ``_task_info`` entry for each, from the
    hand-out until the batch is served; releases after 2.6 also count them in ``_workers_num_tasks``)."""
    return sum(1 for info in iterator._task_info.values() if info[0] == worker)


def _in_flight(iterator: Any) -> int:
    """Batches handed to the workers and not yet served: PyTorch keeps ``prefetch_factor`` per worker, handing one
    for each it serves. In order, a batch that arrives before its turn waits, counted (``_tasks_outstanding`` drops
    as it arrives); out of order it is served as it arrives."""
    return iterator._send_idx - iterator._rcvd_idx if in_order(iterator) else iterator._tasks_outstanding


def iterate_growing(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)``, its workers started one by one, each handed its first batch as soon as it has started.

    PyTorch starts all of a new iterator's workers before it hands any of them a batch: 16 workers fork in 150-250
    ms on 2 CPUs, and the first batch is ready only a whole load after the last fork. Here the iterator is created
    with one worker (and one batch in flight), and the rest are added as :func:`add_workers` adds them: the first
    batches are loaded while the last workers start. Worker 0 is told ``get_worker_info().num_workers == 1``. Only
    for a new PyTorch iterator (not a ``StatefulDataLoader``'s) over a map-style dataset that is not a datapipe
    (see :func:`can_add_workers`), with 2 workers or more; any other loader is iterated as PyTorch does, and one
    whose iterator cannot be created keeps the attributes it had. Where a worker cannot start, the iterator runs
    the ones that did, and ``loader.num_workers`` says how many."""
    workers, prefetch = loader.num_workers, loader.prefetch_factor
    # PyTorch's iterator, as PyTorch's __iter__ returns it (not a StatefulDataLoader's, nor one a subclass wraps)
    own = type(loader)._get_iterator is DataLoader._get_iterator and type(loader).__iter__ is DataLoader.__iter__
    if workers < 2 or prefetch is None or not (own and _map_style(loader.dataset)) or loader._iterator is not None:
        return iter(loader)
    object.__setattr__(loader, "num_workers", 1)  # past Lightning's record (see ResumableBatchSampler)
    object.__setattr__(loader, "prefetch_factor", 1)
    try:
        iterator = iter(loader)
    except BaseException:
        object.__setattr__(loader, "num_workers", workers)
        raise
    finally:
        object.__setattr__(loader, "prefetch_factor", prefetch)
    if type(iterator) is not _MultiProcessingDataLoaderIter or iterator._num_workers != 1:  # a carried one
        object.__setattr__(loader, "num_workers", workers)
        return iterator
    iterator._prefetch_factor = prefetch
    try:
        add_workers(loader, iterator, workers)  # where one could not start, the ones that did serve (the loader says)
    except BaseException:
        shutdown_iterator(iterator)
        object.__setattr__(loader, "num_workers", workers)
        raise
    return iterator


def _even_if_one_dies(shutdown: Callable[[], None]) -> None:
    """Run ``shutdown``, letting a worker die while it stops: PyTorch's SIGCHLD handler raises that death into
    the join (seen: a spawned worker aborting at exit, "terminate called without an active exception"), and its
    own clean-up has already terminated the rest. Nothing such a worker held is used any more."""
    from lightning_dltune.switching.switch import is_worker_death

    try:
        shutdown()
    except RuntimeError as ex:
        if not is_worker_death(ex):
            raise


def detach_from_sigchld(iterator: Iterator[Any]) -> None:
    """Unregister a multi-process iterator's workers from PyTorch's SIGCHLD handler.

    That handler raises "worker killed" wherever the main thread happens to be (inside the model's step,
    say); without it the iterator itself raises inside ``next()``, where a dead worker can be replaced.
    """
    if getattr(iterator, "_worker_pids_set", False):
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False  # type: ignore[attr-defined]


def serve_carried_iterator(
    loader: DataLoader,
    take: Callable[[DataLoader], Iterator[Any] | None],
    draws_base: Callable[[], bool] = lambda: True,
) -> None:
    """Make ``iter(loader)`` start from ``take(loader)`` when it returns an iterator (one carried over from the last
    epoch), creating one as PyTorch does otherwise. ``DataLoader.__iter__`` calls ``self._get_iterator()`` for a
    new iterator, and for a persistent loader only while ``_iterator`` is ``None`` (see :func:`release_iterator`).

    A new iterator draws its workers' base seed from the loader's generator (or the global random state) only when
    ``draws_base()``: a run without the tuner makes that draw when it creates an iterator, which a persistent
    user loader does once. The new iterator is kept as created (see :func:`keeps_fresh_iterator`), so what it drew
    is this epoch's own."""
    # past Lightning's record of attribute changes: a loader rebuilt around the DistributedSampler Lightning injects
    # must not create its iterators from this one
    object.__setattr__(loader, "_get_iterator", _CarriedIterators(loader, take, draws_base))


class _CarriedIterators:
    """A loader's ``_get_iterator`` while the tuner serves it (see :func:`serve_carried_iterator`)."""

    def __init__(
        self, loader: DataLoader, take: Callable[[DataLoader], Iterator[Any] | None], draws_base: Callable[[], bool]
    ) -> None:
        self.loader, self.take, self.draws_base = loader, take, draws_base
        self.create = type(loader)._get_iterator.__get__(loader)

    def __call__(self) -> Iterator[Any]:
        carried = self.take(self.loader)
        if carried is not None:
            return carried
        if self.draws_base():
            return _reset_once_used(self.create())
        return _reset_once_used(apart_from_global(self.loader, self.create))


def stop_serving(loader: DataLoader) -> None:
    """Undo :func:`serve_carried_iterator`: new iterators of ``loader`` are PyTorch's again (the tuner let it go)."""
    if isinstance(loader.__dict__.get("_get_iterator"), _CarriedIterators):
        del loader.__dict__["_get_iterator"]


def create_iterators_apart(
    loader: DataLoader, when: Callable[[], bool], loading: AbstractContextManager[Any] | None = None
) -> None:
    """Make a new iterator of ``loader`` draw its workers' base seed from a copy of the global random state
    (:func:`~lightning_dltune.switching.switch.apart_from_global`) whenever ``when()`` says so; a later call replaces
    ``when``. A new iterator that loads in the training process loads inside ``loading`` (:func:`load_apart`). The
    patch holds the loader weakly (a reference cycle would keep its persistent workers alive until a garbage
    collection). A loader whose iterators another patch creates (the train loader's, for seamless epochs) is left
    as it is."""
    if "_get_iterator" in loader.__dict__ and "_dltune_apart" not in loader.__dict__:
        return
    if "_dltune_apart" not in loader.__dict__:
        get, ref = type(loader)._get_iterator, weakref.ref(loader)

        def get_iterator() -> Iterator[Any]:
            dl: Any = ref()
            create = lambda: get(dl)  # noqa: E731
            iterator = apart_from_global(dl, create) if dl.__dict__["_dltune_apart"]() else create()
            if dl.__dict__.get("_dltune_loading") is not None:
                load_apart(iterator, dl.__dict__["_dltune_loading"])
            return iterator

        object.__setattr__(loader, "_get_iterator", get_iterator)  # past Lightning's record, as above
    object.__setattr__(loader, "_dltune_apart", when)
    object.__setattr__(loader, "_dltune_loading", loading)


def undo_iterators_apart(loader: DataLoader) -> None:
    """Undo :func:`create_iterators_apart`: new iterators of ``loader`` draw as PyTorch's do."""
    loader.__dict__.pop("_dltune_loading", None)
    if loader.__dict__.pop("_dltune_apart", None) is not None:
        loader.__dict__.pop("_get_iterator", None)


def _reset_once_used(iterator: Iterator[Any]) -> Iterator[Any]:
    """Make a new persistent iterator ignore a reset asked before it yielded anything. Lightning calls
    ``iter(loader)`` twice in an epoch that reloads its loader (``setup_data`` and the epoch loop), and for a
    persistent loader the second call resets the iterator just created, whose workers were already handed the
    epoch's first batches: the batch sampler would begin a second epoch, and draw its order (a run that never
    reloaded draws one). Fresh, the iterator already is what the reset would make it.

    The patch holds the iterator weakly: a reference cycle would keep its workers alive until a garbage collection
    (a non-persistent iterator is never reset again, and a failed ``fit`` drops it without shutting it down)."""
    if getattr(iterator, "_reset", None) is None or not hasattr(iterator, "_num_yielded"):
        return iterator
    reset = type(iterator)._reset  # type: ignore[attr-defined]
    ref = weakref.ref(iterator)

    def reset_unless_fresh(loader: Any, first_iter: bool = False) -> None:
        it: Any = ref()
        if it is None:
            return
        _reset_as_pytorch_does(it)  # once: later epochs reset as PyTorch does
        if first_iter or it._num_yielded > 0:
            reset(it, loader, first_iter)

    iterator._reset = reset_unless_fresh  # type: ignore[attr-defined]
    return iterator


def keep_start_errors(loader: Any) -> None:
    """Make the next reset of ``loader``'s persistent iterator keep what its workers raised before it served a batch.
    A new iterator hands its workers the epoch's first batches at once; a worker whose ``worker_init_fn`` raised
    answers its first one with that error. Resetting the iterator before it served anything (Lightning's second
    ``iter()`` in an epoch that reloads its loader) drops those answers, and PyTorch then runs the workers
    uninitialized. Kept, the first such error dropped is raised by the iterator's first ``next()``, where a failed
    start is handled (no batch had been served: the epoch starts again from its first one). Only a worker's answer to
    its first batch is kept: a later batch's error is the dataset's, which the reset drops as PyTorch does."""
    iterator: Any = getattr(loader, "_iterator", None)
    if getattr(iterator, "_num_yielded", 1) != 0 or "_reset" in vars(iterator) or not hasattr(iterator, "_get_data"):
        return  # used, not persistent, or its reset already patched (`_reset_once_used` keeps it as created)
    reset, ref = type(iterator)._reset, weakref.ref(iterator)

    def reset_keeping_errors(loader: Any, first_iter: bool = False) -> None:
        it: Any = ref()
        if it is None:
            return
        vars(it).pop("_reset", None)  # once
        if it._num_yielded > 0:  # served since: what is dropped now is the last epoch's batches
            reset(it, loader, first_iter)
            return
        firsts: dict[int, int] = {}  # each worker's first batch: where a start's error comes back
        for idx in sorted(it._task_info):
            firsts.setdefault(it._task_info[idx][0], idx)
        first_batches, get, dropped = set(firsts.values()), it._get_data, []

        def get_data() -> tuple[Any, Any]:
            idx, data = get()
            if isinstance(data, ExceptionWrapper) and idx in first_batches:
                dropped.append(data)
            return idx, data

        it._get_data = get_data
        try:
            reset(it, loader, first_iter)
        finally:
            vars(it).pop("_get_data", None)
        if dropped:

            def raise_dropped() -> Any:  # holds the iterator weakly, as the reset does
                vars(ref()).pop("_next_data", None)
                dropped[0].reraise()

            it._next_data = raise_dropped

    iterator._reset = reset_keeping_errors


def _reset_as_pytorch_does(iterator: Any) -> None:
    """Undo :func:`_reset_once_used`: ``iterator._reset`` is its class's method again."""
    vars(iterator).pop("_reset", None)


def reset_fresh_iterator(loader: Any) -> bool:
    """Let the next ``iter(loader)`` reset a new persistent iterator as PyTorch does, though it yielded nothing
    (undoes :func:`_reset_once_used`): the batches its workers were handed are dropped. True when it will."""
    if not keeps_fresh_iterator(loader):
        return False
    _reset_as_pytorch_does(loader._iterator)
    return True


def keeps_fresh_iterator(loader: Any) -> bool:
    """True when ``loader`` holds a new iterator that the next ``iter(loader)`` keeps as it is (see
    :func:`_reset_once_used`): what it drew when it was created (its base seed, the epoch's order) is final."""
    iterator = getattr(loader, "_iterator", None)
    reset = getattr(iterator, "_reset", None)
    return getattr(reset, "__name__", "") == "reset_unless_fresh" and getattr(iterator, "_num_yielded", 1) == 0


def release_iterator(loader: DataLoader) -> None:
    """Let go of a persistent loader's iterator, so the next ``iter(loader)`` asks for a new one instead of
    resetting it (a reset drains the workers and refills them from the epoch's start)."""
    if getattr(loader, "_iterator", None) is not None:
        loader._iterator = None


def shutdown_unless_owned(loader: DataLoader, iterator: Iterator[Any]) -> None:
    """Stop ``iterator``'s workers unless it is ``loader``'s own persistent iterator, which the loader resets at the
    next ``iter()``."""
    if getattr(loader, "_iterator", None) is not iterator:
        shutdown_iterator(iterator)


def record_batches(loader: DataLoader, iterator: Iterator[Any]) -> RecordedBatches | None:
    """Record the batches of indices ``iterator`` (a running iterator of the user's own ``loader``) is handed from
    now on, in its ``_sampler_iter`` (``_next_index`` draws every batch from it, in ``__next__`` or, with workers,
    as they are handed out), where ``loader`` batches with a plain ``BatchSampler`` and the iterator has drawn
    nothing yet (a loader with workers has drawn its prefetch at ``iter()``); ``None`` elsewhere."""
    batches = getattr(iterator, "_sampler_iter", None)
    drawn = int(getattr(iterator, "_send_idx", 0)) or batches_yielded(iterator)
    if type(loader.batch_sampler) is not BatchSampler or batches is None or drawn:
        return None
    recorded = RecordedBatches(batches, len(loader.batch_sampler))
    iterator._sampler_iter = recorded  # type: ignore[attr-defined]
    return recorded


def in_order(iterator: Iterator[Any]) -> bool:
    """Whether a loader iterator serves its batches in the order they were handed out (PyTorch's default)."""
    return bool(getattr(iterator, "_in_order", True))


def batches_yielded(iterator: Iterator[Any]) -> int:
    """How many batches a loader iterator has yielded since its epoch began (0 for another kind of iterator)."""
    return int(getattr(iterator, "_num_yielded", 0))


def will_reuse_iterator(loader: Any) -> bool:
    """True when ``iter(loader)`` resets an existing persistent-worker iterator instead of creating one."""
    return bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "_iterator", None) is not None


def worker_died(iterator: Iterator[Any], wait_s: float = 2.0) -> bool:
    """True when a worker process of a multi-process loader iterator is dead, waiting up to ``wait_s`` for a
    killed one to be reaped (its broken pipe can reach the main process before its exit does; PyTorch's SIGCHLD
    handler may then raise the death into this wait)."""
    import time

    workers = getattr(iterator, "_workers", None) or []
    deadline = time.monotonic() + wait_s
    try:
        while workers:
            if any(not w.is_alive() for w in workers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
    except RuntimeError as error:
        if is_worker_death(error):
            return True
        raise
    return False


def train_worker_pids(trainer: "pl.Trainer") -> list[int]:
    """PIDs of the worker processes of the running train loader iterator (empty without workers)."""
    it = train_iterator(trainer)
    it = getattr(it, "inner", it)  # unwrap lightning_dltune's GuardedIterator
    return [w.pid for w in getattr(it, "_workers", None) or [] if w.pid is not None]


class _TimedDataset:
    """Stands for a dataset in a single-process iterator's fetcher, timing each sample it loads. Nothing but
    ``__getitem__`` and ``__len__``: the fetcher asks for ``__getitems__``, which it has not, and loads sample by
    sample."""

    def __init__(self, dataset: Any, clock: Callable[[], float]) -> None:
        self.dataset, self.clock = dataset, clock
        self.times: list[float] = []

    def __getitem__(self, index: Any) -> Any:
        t0 = self.clock()
        try:
            return self.dataset[index]
        finally:
            self.times.append(self.clock() - t0)

    def __len__(self) -> int:
        return len(self.dataset)


class SampleTimes:
    """The per-sample load times of one batch of a single-process iterator (see :func:`time_samples`)."""

    def __init__(self, fetcher: Any, timed: _TimedDataset) -> None:
        self._fetcher, self._timed = fetcher, timed

    def finish(self) -> list[float]:
        """Stop timing (the fetcher loads from the dataset itself again) and return the times taken."""
        if self._fetcher.dataset is self._timed:
            self._fetcher.dataset = self._timed.dataset
        return self._timed.times

    @property
    def running(self) -> bool:
        return self._fetcher.dataset is self._timed


def load_apart(iterator: Any, randomness: AbstractContextManager[Any]) -> None:
    """Make the samples ``iterator`` loads in the training process (PyTorch's single-process iterator) load inside
    ``randomness`` (a :class:`~lightning_dltune.switching.randomness.LoadingRandomness`): the dataset's draws are
    then apart from training's random states, and its sampler's are not. Once per iterator; others are left alone."""
    fetcher = getattr(iterator, "_dataset_fetcher", None)
    if type(iterator) is not _SingleProcessDataLoaderIter or fetcher is None or "fetch" in fetcher.__dict__:
        return
    fetch = fetcher.fetch

    def fetch_apart(possibly_batched_index: Any) -> Any:
        with randomness:
            return fetch(possibly_batched_index)

    fetcher.fetch = fetch_apart


def time_samples(iterator: Any, clock: Callable[[], float]) -> SampleTimes | None:
    """Time each sample the next batches of ``iterator`` load, until :meth:`SampleTimes.finish`: a batch loaded in
    the training process (PyTorch's single-process iterator over a map-style dataset with a batch sampler) is
    loaded sample by sample, and a slow first sample (a file opened lazily) shows apart from the rest. ``None``
    where that cannot be seen: workers, an iterable dataset, a dataset that loads whole batches (``__getitems__``)."""
    fetcher = getattr(iterator, "_dataset_fetcher", None)
    if type(iterator) is not _SingleProcessDataLoaderIter or type(fetcher) is not _MapDatasetFetcher:
        return None
    if not fetcher.auto_collation or getattr(fetcher.dataset, "__getitems__", None):
        return None
    timed = _TimedDataset(fetcher.dataset, clock)
    fetcher.dataset = timed
    return SampleTimes(fetcher, timed)


# --- the evaluation loops -------------------------------------------------------------------------------------------
def evaluation_loop(trainer: "pl.Trainer", name: str) -> Any:
    """The loop that runs the ``name`` (``"val"``, ``"test"``, ``"predict"``) loader in the trainer's running
    function: ``fit``'s validation loop, or the ``validate``/``test``/``predict`` loop."""
    if name == "val":
        return trainer.validate_loop if trainer.state.fn == "validate" else trainer.fit_loop.epoch_loop.val_loop
    return trainer.test_loop if name == "test" else trainer.predict_loop


def wrap_loop_method(loop: Any, name: str, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """Call ``before``/``after`` around ``loop.<name>()``: an evaluation loop's ``reset``, where a pass creates its
    iterator (forking its workers, unless persistent ones are reset) and its fetcher takes the first batch, or its
    ``run``, the whole pass (its loader's request, ``reset`` and hooks). Returns the undo."""
    original = getattr(loop, name)

    def wrapped() -> Any:
        before()
        try:
            return original()
        finally:
            after()

    return patch_attribute(loop, name, wrapped)


def loop_loaders(loop: Any) -> list[Any]:
    """The loaders ``loop`` runs (after Lightning processed them), ``[]`` before its first request."""
    combined = getattr(loop, "_combined_loader", None)
    return [] if combined is None else list(combined.flattened)


def loop_worker_pids(loop: Any) -> list[int]:
    """PIDs of the workers of ``loop``'s running loader iterator (empty without workers)."""
    combined = getattr(loop, "_combined_loader", None)
    mode_iter = None if combined is None else combined._iterator
    iterators = [getattr(it, "inner", it) for it in getattr(mode_iter, "iterators", None) or []]  # guards unwrapped
    return [w.pid for it in iterators for w in getattr(it, "_workers", None) or [] if w.pid is not None]


def request_loop_reload(loop: Any) -> None:
    """Stop the workers of ``loop``'s loaders and make its next pass request them again (``setup_data``)."""
    for loader in loop_loaders(loop):
        shutdown_workers(loader)
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
    loop._data_fetcher = None
    loop._combined_loader = None


def loop_reloads_next(loop: Any) -> bool:
    """Whether ``fit``'s validation loop asks for a new loader at its next pass (``reload_dataloaders_every_n_epochs``;
    ``False`` for another loop)."""
    return bool(getattr(loop, "_should_reload_val_dl", False))


def loop_reload_epoch(loop: Any) -> float | None:
    """The epoch ``fit``'s validation loop last requested its loader at (``None`` for another loop)."""
    return getattr(loop, "_last_val_dl_reload_epoch", None)


def set_loop_reload_epoch(loop: Any, epoch: float | None) -> None:
    """Put back what :func:`loop_reload_epoch` read (``setup_data`` sets it at every request)."""
    if epoch is not None and hasattr(loop, "_last_val_dl_reload_epoch"):
        loop._last_val_dl_reload_epoch = epoch


def validation_epoch(trainer: "pl.Trainer") -> int:
    """The epoch ``fit``'s validation loop sets its loaders' samplers to at a pass's start."""
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def batches_done(trainer: "pl.Trainer") -> tuple[int, int]:
    """Training batches done in this epoch and in the whole ``fit``, read in ``on_train_batch_end``."""
    loop = trainer.fit_loop.epoch_loop
    return loop.batch_idx + 1, loop.total_batch_idx + 1


def reset_ahead(loader: Any, epoch: int) -> bool:
    """Begin the next pass over ``loader`` now: its sampler set to ``epoch`` (as Lightning's evaluation loop does),
    its idle persistent iterator reset as the next ``iter(loader)`` would (its workers load the pass's first
    batches), and that ``iter(loader)`` made to keep it as it is (see :func:`_reset_once_used`). False where the
    loader holds no persistent iterator with workers."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    iterator = getattr(loader, "_iterator", None)
    if not will_reuse_iterator(loader) or not isinstance(iterator, _MultiProcessingDataLoaderIter):
        return False
    _set_sampler_epoch(loader, epoch)
    type(iterator)._reset(iterator, loader)
    _reset_once_used(iterator)
    return True


def loop_iterator(loop: Any) -> Any:
    """The iterator ``loop``'s running pass pulls its batches from (``None`` before its pass, or past its loaders)."""
    combined = getattr(loop, "_combined_loader", None)
    mode_iter = None if combined is None else combined._iterator
    iterators = getattr(mode_iter, "iterators", None) or []
    return iterators[0] if len(iterators) == 1 else None


def replace_loop_iterator(loop: Any, iterator: Any, loader: Any = None) -> None:
    """The running pass of ``loop`` pulls its next batches from ``iterator``; with ``loader``, that loader also serves
    the loop's next passes (its only loader)."""
    combined = loop._combined_loader
    combined._iterator.iterators[0] = iterator
    if loader is not None:
        combined.flattened = [loader]
        combined._iterator.iterables = combined.flattened
