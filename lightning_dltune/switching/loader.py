"""The loader switcher: the one part that changes the train loader, and the only user of ``_lightning``.

:class:`LoaderSwitcher` intercepts every train-loader request of ``fit`` and rebuilds the loader with the
tuning state's target settings (and a :class:`~lightning_dltune.switching.switch.ResumableBatchSampler`, for in-epoch
switching); it installs the :class:`~lightning_dltune.switching.switch.GuardedIterator` that performs pending switches
between two fetches and recovers from dead workers; it requests epoch-boundary reloads; it keeps the global
random state as an untuned run would; and it knows the epoch's position for checkpoints.

A loader that carries its own state (torchdata's ``StatefulDataLoader``, litdata's ``StreamingDataLoader``) is
restored by Lightning from the checkpoint, and that state fits only the settings it was saved with (a
``StatefulDataLoader`` asserts the same ``num_workers``). So the first loader of a resumed run that Lightning
restores a state into is built on those settings, and the epoch it resumes ends on them; the tuner goes on to
its target from there.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_dltune._warn import info_once, warn_once
from lightning_dltune.measurement.probe import Probe
from lightning_dltune.mixin import TunableDataModuleMixin
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.switching import _lightning
from lightning_dltune.switching._lightning import NotRebuildableError, rebuild_dataloader, shutdown_workers
from lightning_dltune.switching.forkwatch import MAX_FORK_RESTARTS, ForkWatch, stopped_by_watch, watch_forks
from lightning_dltune.switching.randomness import LoadingRandomness
from lightning_dltune.switching.seamless import Seamless, draws_from_global
from lightning_dltune.switching.switch import (
    GuardedIterator,
    GuardHooks,
    RecordedBatches,
    ResumableBatchSampler,
    ShardCheck,
    apart_from_global,
    error_summary,
    same_batch,
)
from lightning_dltune.tuning.state import Phase, TuningState, batches_left

__all__ = [
    "LoaderSwitcher",
    "NotRebuildableError",
    "is_last_epoch",
    "rebuild_dataloader",
    "remaining_steps",
    "shutdown_workers",
]
OnFailure = Callable[[str, str], "LoaderSettings | None"]


@dataclass(frozen=True)
class _Untuned:
    """What a run without the tuner does with its loader in an epoch: ``asked``, it asks Lightning's hook for it and
    iterates it there as the tuner's loader is; ``draws_base``, it creates an iterator, drawing a base seed."""

    asked: bool = False
    draws_base: bool = False


_NOT_ASKED = _Untuned()


@dataclass
class _Pending:
    """A switch decided and not made yet: at the next fetch to ``settings`` (``in_background``: its loader may start
    while the running one serves, see :meth:`LoaderSwitcher.switch`), or by a reload when the epoch ends."""

    settings: LoaderSettings | None = None
    in_background: bool = False
    at_epoch_end: bool = False
    keep: DataLoader | None = None  # the running loader, which goes on through the reload with its workers

    def reset(self) -> None:
        self.settings, self.in_background, self.at_epoch_end, self.keep = None, False, False, None


@dataclass
class _Restored:
    """What a checkpoint says of the epoch it was saved in, for the resumed fit's first loader: ``epoch``, the
    (order, batch) of a mid-epoch checkpoint; ``position``, the (epoch, batch), for an epoch-seeded sampler;
    ``loader``, the settings of the loader that ran (its saved state fits only those); ``deferred``, the target,
    while the resumed epoch ends on those settings."""

    epoch: tuple[list[int], int] | None = None
    position: tuple[int, int] | None = None
    loader: LoaderSettings | None = None
    deferred: LoaderSettings | None = None


@dataclass
class _RandomBookkeeping:
    """What a run without the tuner does with its loader (see :meth:`LoaderSwitcher._as_untuned`), to leave the global
    random state as that run would: for the loader asked for since the running epoch began (``next``, ``None``: none
    was) and for the running epoch's (``now``); the user's last loader object; the epoch Lightning's reload schedule
    counted from when the tuner asked for the latest reload (``asked_reload``, ``None``: it did not), and what to put
    back there once a reload only the tuner asked for is done; the random states before the latest build."""

    next: _Untuned | None = None
    now: _Untuned = _NOT_ASKED
    user_loader: weakref.ref[DataLoader] | None = None
    asked_reload: float | None = None
    put_back_reload: float | None = None
    before_build: list[tuple[torch.Generator | None, torch.Tensor]] | None = None

    def reset(self) -> None:
        self.next, self.now, self.user_loader = None, _NOT_ASKED, None
        self.asked_reload = self.put_back_reload = None


@dataclass
class _StartUp:
    """The running loader's start-up: ``unserved`` until it delivers a batch; its first batch's samples timed as
    they load (``samples``), unless the step fetched twice (``spoiled``); workers added in place to it serve their
    first batches before batch ``grown_until`` (a failure before it is their start-up's), ``growing`` until then."""

    unserved: bool = False
    samples: _lightning.SampleTimes | None = None
    spoiled: bool = False
    grown_until: int = -1
    growing: bool = False


def _iterates_as_pytorch(loader: DataLoader) -> bool:
    """Whether an ``IterableDataset``'s ``loader`` iterates as PyTorch's own does, keeping no state of what it yielded:
    a copy of it can then be iterated apart (the first round, see ``LoaderSwitcher._first_round``). A loader that
    keeps such state (a ``StatefulDataLoader``, litdata's ``StreamingDataLoader``, which shares it with its dataset
    object) or iterates in its own ``__iter__`` cannot."""
    own_state = callable(getattr(loader, "state_dict", None)) or type(loader).__iter__ is not DataLoader.__iter__
    return isinstance(loader.dataset, IterableDataset) and not own_state


def _uncopied_because(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be deep-copied (``None``: it can). A dataset that reads from a queue, a connection or an
    open file holds an object that refuses to be copied; one whose state is its own copies, and the copy iterates
    without taking anything the original object holds (:meth:`LoaderSwitcher._first_round` iterates such a copy)."""
    try:
        copy.deepcopy(dataset)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


class _SameSeed:
    """A ``worker_init_fn`` that seeds every worker's torch, Python and numpy random states alike (then calls the
    loader's own): the first round's workers then draw the same random samples, unless the dataset shards by
    worker. A class, so that it pickles to workers that are spawned."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        import random

        torch.manual_seed(0)
        random.seed(0)
        try:
            import numpy as np
        except ImportError:  # numpy is not one of torch's requirements
            pass
        else:
            np.random.seed(0)
        if self.then is not None:
            self.then(worker_id)


def ranks_alike(loader: DataLoader) -> str | None:
    """Why every rank of a distributed run must build ``loader`` with the same settings (``None``: each rank may run
    its own count of workers: a ``DistributedSampler`` splits by rank, and Lightning's reload needs only that the
    ranks reload together)."""
    if type(loader).__name__ == "StreamingDataLoader":
        return "litdata lays its chunks out over world_size x num_workers: other counts per rank would repeat or drop"
    if callable(getattr(loader, "state_dict", None)):
        return (
            "a StatefulDataLoader's state is saved from rank zero only, and torchdata checks num_workers where "
            "another rank loads it"
        )
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset may split its stream over every rank's workers together"
    return None


class LoaderSwitcher:
    """Builds, switches and recovers the train loader of one tuner.

    Args:
        state: the tuning state (its ``target`` is what loaders are built with; ``start``/``current`` are told).
        probe: told about every loader build and in-fetch switch, and wired to the fetch hooks.
        mode: ``"epoch"`` keeps the loader's own batch sampler (no in-epoch switching).
        tune_iterable: retune an ``IterableDataset``'s loader: ``"auto"`` where its sharding can be checked first
            (see :meth:`_tunes_iterable`), ``True`` always, ``False`` never.
        on_first_loader: called with the user's first loader (the cache lookup).
        on_failure: ``(what failed, why) -> fallback settings | None`` when a worker died or a config the tuner
            chose could not start.
        seamless: seamless epochs (see :mod:`lightning_dltune.switching.seamless`): ``"auto"``, ``True`` or ``False``.
    """

    def __init__(
        self,
        state: TuningState,
        probe: Probe,
        mode: str = "auto",
        tune_iterable: bool | str = "auto",
        on_first_loader: Callable[[DataLoader], None] = lambda loader: None,
        on_failure: OnFailure = lambda kind, why: None,
        seamless: bool | str = "auto",
    ) -> None:
        self.state, self.probe = state, probe
        self.mode, self.tune_iterable = mode, tune_iterable
        self._on_first_loader, self._on_failure = on_first_loader, on_failure
        self.trainer: pl.Trainer | None = None
        # the train loader can switch inside its epoch: it has the tuner's ResumableBatchSampler, or it is the user's
        # own loader, kept as it is until a setting changes (`_keeps_users`), whose batches are recorded as it runs
        self.in_epoch = False
        # the latest train loader request kept the user's loader as given (Lightning may still build it anew around
        # the DistributedSampler it injects: a plain batch sampler too)
        self._as_given = False
        # the id of the latest dataset asked about, and why it cannot be copied (not the dataset: the tuner pickles)
        self._copied: tuple[tuple[int, type], str | None] | None = None
        self._restores: list[Callable[[], None]] = []
        self._guard_needed = False
        self._check_shards = False  # the running loader's first iteration checks that its IterableDataset shards
        self._pending = _Pending()
        self._kept: DataLoader | None = None  # the loader going on through the reload the tuner asked for
        self.background_starts = 0  # switches whose loader started in the background
        self.in_place = 0  # prefetch changes made on the running workers (no restart)
        self.grown = 0  # workers added to the running loader (only the added ones started)
        self._built: weakref.WeakSet[DataLoader] = weakref.WeakSet()  # loaders this switcher built (changed in place)
        # one process (set at setup): only then is a prefetch change made in place; under DDP every rank must take
        # the same path, and a rank whose change could not be made in place would wait at Lightning's reload barrier
        self.single_process = True
        self.alike: str | None = None  # why every rank must run the same settings (``ranks_alike``)
        self._guarded: GuardedIterator | None = None  # the guard of the running epoch (reachable after teardown)
        self._startup = _StartUp()
        self._restored = _Restored()
        self._first_epoch: int | None = None  # the first epoch this fit trains (a resumed fit's is above 0)
        self._random = _RandomBookkeeping()
        self._loading = LoadingRandomness(0)  # seeded anew from the run's seed at `install`
        self._fork_restarts = 0  # loaders started again after a worker hung in its fork, this fit
        self._watch: ForkWatch | None = None  # held from `install` to `restore`
        self._guard_hooks = GuardHooks(
            replace=self._switch_if_pending,
            on_death=self._recover,
            on_error=self._startup_failed,
            prepare=self._prepare,
            worker_dead=_lightning.worker_died,
            close=_lightning.shutdown_iterator,
            ahead=self._lead,
            adopt=self._adopt,
            overlap=self._overlapping,
            build=self.probe.build_loader,
            iterate=_lightning.iterate_growing,
            record=self._record,
        )
        self.seamless = Seamless(
            seamless,
            epoch=lambda: self.trainer.current_epoch if self.trainer is not None else 0,
            base_draws=lambda: self.state.start is None or not self.state.start.persistent_workers,
            serve=_lightning.serve_carried_iterator,
            release=_lightning.release_iterator,
            shutdown=_lightning.shutdown_unless_owned,
            goes_on=lambda ahead: self.trainer is None or fit_goes_on(self.trainer, ahead),
            untuned_creates=lambda: (self._random.next or self._random.now).draws_base,
            bursts=lambda loader: self.state.loads_ahead(loader.num_workers, loader.prefetch_factor),
        )

    # --- set-up ---------------------------------------------------------------------------------------------
    def install(self, trainer: "pl.Trainer") -> None:
        self.trainer, self._first_epoch = trainer, None
        self.probe.apart = _lightning.launched_ranks(trainer)
        self.state.reloads = bool(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))
        self._fork_restarts = 0
        if self._watch is None:
            self._watch = watch_forks()  # before the first worker starts
        self._random.reset()
        self._loading = LoadingRandomness(torch.initial_seed())
        self._restores = [
            _lightning.install_loader_transform(trainer, self._on_loader, self._tuner_sets_workers),
            _lightning.install_fetch_hooks(trainer, self._before_fetch, self.probe.fetch_ended),
        ]

    def restore(self, stop_workers: bool = False) -> None:
        """Undo :meth:`install`; safe to call twice. A background start still running is stopped (a fit that
        ended before its hand-over), and no switch is left pending for another ``fit``. ``stop_workers``: every
        worker set is stopped too (:meth:`shutdown`), for a ``fit`` that failed."""
        if stop_workers:
            self.shutdown()
        self._abandon()
        if self._kept is not None:  # a fit that ended before the reload it asked for
            _lightning.shutdown_workers(self._kept)
        self._pending.reset()
        self._guarded, self._kept = None, None
        self.seamless.drop()
        for loader in self._built:  # the run's loaders outlive it (the trainer holds them): PyTorch's own again
            _lightning.stop_serving(loader)
        for restore in reversed(self._restores):
            restore()
        self._restores = []
        if self._watch is not None:
            self._watch.release()
            self._watch = None

    def shutdown(self) -> None:
        """Stop every worker set this switcher holds or made, now: the running iterator, a background start, one
        carried for seamless epochs, and the persistent workers of the loaders it built. After a failed ``fit``
        nothing else stops them until a garbage collection (the exception's traceback holds the running iterator)."""
        guard = self._guarded
        iterators = [self.seamless.carried_iterator]
        if guard is not None:
            iterators += [guard.inner, guard.next[1] if guard.next is not None else None]
        if self.trainer is not None:  # the loop's own, where the tuner did not guard it
            running = _lightning.train_iterator(self.trainer)
            iterators.append(running.inner if isinstance(running, (GuardedIterator, ShardCheck)) else running)
        for iterator in iterators:
            if iterator is not None:
                _lightning.shutdown_iterator(iterator)
        for loader in [*self._built, *([self._kept] if self._kept is not None else [])]:
            _lightning.shutdown_workers(loader)

    def _tuner_sets_workers(self) -> bool:
        return self.state.switching and self.state.target is not None and self.state.target != self.state.start

    # --- building -------------------------------------------------------------------------------------------
    def _on_loader(self, loader: Any) -> Any:
        """Every train-loader request of ``fit`` passes here (see ``_lightning.install_loader_transform``)."""
        self.probe.loader_requested()
        self.seamless.drop()
        if not isinstance(loader, DataLoader):
            self._disable(
                "unsupported-loader",
                f"the train loader is a {type(loader).__name__}, not one `torch.utils.data.DataLoader`; "
                "it is measured but not retuned",
            )
            return loader
        current = LoaderSettings.from_loader(loader)
        self.alike = ranks_alike(loader)
        self._random.next = self._as_untuned(loader)
        kept, self._kept = self._kept, None
        if kept is not None and self.trainer is not None and not self._random.next.asked:  # the tuner asked alone
            return _lightning.kept_through_reload(kept, self.trainer)  # this rank's settings stay: its loader goes on
        if kept is not None:  # Lightning reloads on its own too: the user's new loader is built, the kept one stops
            _lightning.shutdown_workers(kept)
        if self.state.loader_seen(current):
            self._on_first_loader(loader)
        if isinstance(loader.dataset, IterableDataset) and self.state.tuning and not self._tunes_iterable(loader):
            self._disable("iterable", self._iterable_left_alone(loader))
        self._random.before_build = _random_states(loader)
        if self._tuner_sets_workers() and current == self.state.target:  # built by a mixin with the tuner's count
            _lightning.quiet_worker_check(self._said_why(loader))
        users = loader
        loader = self._rebuilt(users, current, self._build_settings(users))
        if _iterates_as_pytorch(loader) and self._tuner_added_workers(loader):
            loader = self._first_round(users, current, loader)
        self._as_given = loader is users and self._keeps_users(users)
        self.in_epoch = isinstance(loader.batch_sampler, ResumableBatchSampler) or self._as_given
        self._check_shards = isinstance(loader.dataset, IterableDataset) and self._tuner_added_workers(loader)
        self._guard_needed = self.in_epoch or self._check_shards  # also where no epoch start follows (a resume)
        self.seamless.attach(loader)
        self._startup.unserved = True
        if isinstance(loader.batch_sampler, ResumableBatchSampler) and self._restored.epoch is not None:
            self._resume_epoch(loader.batch_sampler)
        self.state.current = LoaderSettings.from_loader(loader)
        self.probe.loader_built(self.state.current.num_workers)
        return loader

    def _tunes_iterable(self, loader: DataLoader) -> bool:
        """Whether the loader of an ``IterableDataset`` is retuned: ``tune_iterable=True``, or ``"auto"`` where its
        sharding by worker is checked before a batch of a config with more workers is served (:meth:`_first_round`:
        PyTorch's own iteration, which undoes the round, over a dataset that can be copied, so that the check takes
        nothing from what the dataset reads)."""
        if self.tune_iterable == "auto":
            return _iterates_as_pytorch(loader) and self._uncopied_because(loader.dataset) is None
        return bool(self.tune_iterable)

    def _uncopied_because(self, dataset: Any) -> str | None:
        """:func:`_uncopied_because`, asked once per dataset object."""
        if self._copied is None or self._copied[0] != (id(dataset), type(dataset)):
            self._copied = ((id(dataset), type(dataset)), _uncopied_because(dataset))
        return self._copied[1]

    def _iterable_left_alone(self, loader: DataLoader) -> str:
        why = self._uncopied_because(loader.dataset) if self.tune_iterable == "auto" else None
        if why is not None:
            return (
                f"the train dataset is an IterableDataset that cannot be copied ({why}): it reads from something a "
                "copy cannot take apart (a queue, a connection, an open file), so a check that more workers shard it "
                "would take samples from what it reads, and the tuner only measures it. If it shards itself with "
                "`get_worker_info()`, opt in with `DataLoaderTuner(tune_iterable=True)`"
            )
        if self.tune_iterable == "auto":
            return (
                "the train dataset is an IterableDataset whose loader keeps its own state of what it served (a "
                "StatefulDataLoader, litdata's, or its own `__iter__`), so the tuner cannot check that more workers "
                "shard it before they serve a batch, and only measures it. If it shards itself with "
                "`get_worker_info()`, opt in with `DataLoaderTuner(tune_iterable=True)`"
            )
        return (
            "the train dataset is an IterableDataset and `tune_iterable=False`: the tuner only measures it. "
            "To let it change `num_workers`, pass `tune_iterable='auto'` (its sharding is checked) or `True`"
        )

    def _first_round(self, users: DataLoader, current: LoaderSettings, loader: DataLoader) -> DataLoader:
        """Check an ``IterableDataset``'s ``loader``, with more workers than the user's (``users``, on ``current``),
        before it serves a batch: a copy of it, over a copy of its dataset, whose workers all start from one seed
        (:class:`_SameSeed`) loads one batch of each worker (PyTorch hands the workers their turns in order), and is
        stopped. ``loader`` itself starts its workers as it would have.

        * A worker that raises fails the config: a dataset sharded by worker with fewer shards than workers
          (webdataset: "No samples found in dataset; perhaps you have fewer shards than workers"), or any error the
          user's config did not meet (:meth:`_round_failed`).
        * Two workers whose first batches are the same (from one seed, a dataset that draws its samples at random
          yields the same too) do not shard the dataset by worker: every config with more workers repeats samples,
          or multiplies the epoch (:meth:`_round_repeated`).

        Then the loader returned is the fallback's, and nothing of the epoch was served. Only for loaders that iterate
        as PyTorch's own (:func:`_iterates_as_pytorch`); elsewhere the first iteration's ``ShardCheck`` is the only
        check."""
        try:
            dataset = copy.deepcopy(loader.dataset)  # what the round's workers take from it is the copy's own
        except Exception:  # only with tune_iterable=True (see `_tunes_iterable`): the first iteration checks it
            return loader
        try:
            probe = _lightning.rebuild_dataloader(
                loader, {"persistent_workers": False, "worker_init_fn": _SameSeed(loader.worker_init_fn)}, quiet=True
            )
        except _lightning.NotRebuildableError:
            return loader
        _lightning.replace_dataset(probe, dataset)
        iterator = apart_from_global(probe, lambda: iter(probe))
        batches: list[Any] = []
        try:
            batches.extend(islice(iterator, probe.num_workers))
        except Exception as error:  # the config's: the user's loaded these batches (the fallback meets a data error)
            return self._round_failed(users, current, loader, error, len(batches))
        finally:
            _lightning.shutdown_iterator(iterator)
        if len(batches) >= 2 and _lightning.in_order(iterator) and same_batch(batches[0], batches[1]):
            return self._round_repeated(users, current, loader)
        return loader

    def _round_repeated(self, users: DataLoader, current: LoaderSettings, loader: DataLoader) -> DataLoader:
        """The first round of ``loader`` found its first two workers' batches the same: its ``IterableDataset`` does
        not shard by worker (``get_worker_info()``), so every config of two workers or more repeats samples (or, drawing
        them at random, multiplies the epoch). That
        config failed, and the loader is built on the fallback (a config measured before, or the user's), before a
        batch of it was served."""
        tried = LoaderSettings.from_loader(loader)
        self.state.current = tried
        why = "the IterableDataset does not shard: two workers loaded the same first batch"
        fallback = self._on_failure("repeated samples", why) or self.state.start or current
        self.aim(fallback)
        warn_once(
            "not-sharded",
            f"DataLoaderTuner: the train IterableDataset does not shard itself: with {tried.describe()} its first two "
            f"workers loaded the same batch, so every worker would yield every sample. Went back to "
            f"{fallback.describe()} before a batch of it was served (nothing trained twice). To let the tuner change "
            "`num_workers`, "
            "shard the dataset with `torch.utils.data.get_worker_info()`; otherwise pass `tune_iterable=False`.",
        )
        return self._rebuilt(users, current, fallback)

    def _round_failed(
        self, users: DataLoader, current: LoaderSettings, loader: DataLoader, error: BaseException, fed: int
    ) -> DataLoader:
        """The first round of ``loader`` failed after ``fed`` of its workers had served a batch each (PyTorch hands
        them their turns in order): where some did, the loader feeds that many (``TuningState.fed_fewer``) and tuning
        goes on there; where none did, the config failed as a whole and the tuner falls back (``on_failure``)."""
        tried = LoaderSettings.from_loader(loader)
        self.state.current, summary = tried, error_summary(error)
        kind = "workers failed their first batches"
        if fed > max(1, current.num_workers) and self.state.tuning:
            fallback: LoaderSettings | None = self.state.fed_fewer(tried, f"{kind}: {summary}", fed)
        else:
            fallback = self._on_failure(kind, summary)
        if fallback is None:
            raise error
        self.aim(fallback)
        warn_once(
            f"first-round-{tried.num_workers}",
            f"DataLoaderTuner: with {tried.describe()} a worker of the train IterableDataset failed its first batch "
            f"({summary}); the epoch starts on {fallback.describe()} instead, and nothing of it was served twice. "
            f"{tried.describe()} will not be used again.",
            every_rank=True,
        )
        rebuilt = self._rebuilt(users, current, fallback)
        if self._tuner_added_workers(rebuilt):
            return self._first_round(users, current, rebuilt)
        return rebuilt

    def _build_settings(self, loader: DataLoader) -> LoaderSettings | None:
        """The settings to build ``loader`` with: the target, except for the first loader of a resumed run into
        which Lightning loads the checkpoint's loader state: that state fits only the settings it was saved with."""
        saved, self._restored.loader = self._restored.loader, None
        target = self.state.target
        if saved is None or saved == target or target is None or self.trainer is None or not self.state.switching:
            return target
        if not _lightning.loader_state_pending(self.trainer, loader):
            return target
        self._restored.deferred = target
        self.aim(saved)
        return saved

    def _rebuilt(self, loader: DataLoader, current: LoaderSettings, target: LoaderSettings | None) -> DataLoader:
        overrides: dict[str, Any] = {}
        if target is not None and target != current and self.state.switching:
            overrides.update(target.to_loader_kwargs())
        if overrides or not self._keeps_users(loader):
            overrides.update(self._resumable_overrides(loader))
        if not overrides:
            return loader
        try:
            quiet = "num_workers" in overrides  # the tuner's count, not the user's
            new = self._mark_built(_lightning.rebuild_dataloader(loader, overrides, quiet=quiet))
            return self._said_why(new) if quiet else new
        except _lightning.NotRebuildableError as ex:
            self._disable("not-rebuildable", f"the train loader cannot be rebuilt ({ex}); it is only measured")
            return loader

    def _said_why(self, loader: DataLoader) -> DataLoader:
        """Say once, in the tuner's words, why a loader it built has more workers than CPUs (PyTorch's own
        warning, twice per loader, is left out for these loaders)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if loader.num_workers > cpus:
            why = next((t.decision for t in reversed(self.state.trials) if t.decision), "")
            info_once(
                "many-workers",
                f"DataLoaderTuner: {LoaderSettings.from_loader(loader).describe()} starts more worker processes "
                f"than the {cpus} CPUs of this process, on purpose: the loader waits on more than its CPU time "
                f"({why or 'measured'}). Each switch is measured; PyTorch's warning about it is left out for "
                "the tuner's loaders.",
            )
        return loader

    def _keeps_users(self, loader: DataLoader) -> bool:
        """Whether the user's own ``loader``, on the settings the tuner would build, serves as it is, the object the
        user returned, until a setting changes: where its iterator hands out batches only as the loop asks for them
        (no workers), so that those it handed can be recorded (``switch.RecordedBatches``) and a switch inside the
        epoch goes on from them; over a map-style dataset with a plain ``BatchSampler``; with no checkpoint's epoch
        to resume (that needs the tuner's batch sampler) and ``seamless_epochs`` not ``True`` (it draws every order
        itself, workers or not). Not where the tuner does not switch inside epochs (``mode="epoch"``, or not
        switching at all), nor where the user's first loader had workers (a loader without them, built later on the
        tuner's settings, would then draw its orders as the user's does not: see ``ResumableBatchSampler``'s
        ``exhaust``)."""
        start = self.state.start
        return (
            self.mode != "epoch"
            and self.state.switching
            and loader.num_workers == 0
            and (start is None or start.num_workers == 0)
            and type(loader.batch_sampler) is BatchSampler
            and not isinstance(loader.dataset, IterableDataset)
            and self._restored.epoch is None
            and self._restored.position is None
            and self.seamless.setting is not True
        )

    def _record(self, loader: DataLoader, inner: Iterator[Any]) -> RecordedBatches | None:
        """The batches the iterator ``inner`` of the user's own loader is handed, recorded (:meth:`_keeps_users`)."""
        return _lightning.record_batches(loader, inner) if self._as_given else None

    def _resumable_overrides(self, loader: DataLoader) -> dict[str, Any]:
        """Constructor arguments that give ``loader`` a ResumableBatchSampler ({} when not wanted/possible)."""
        if self.mode == "epoch" or not self.state.switching:
            return {}
        bs = loader.batch_sampler
        if isinstance(bs, ResumableBatchSampler):
            return {}
        if isinstance(loader.dataset, IterableDataset) or type(bs) is not BatchSampler:
            if self.mode == "in_epoch":
                warn_once(
                    "no-in-epoch",
                    "DataLoaderTuner: in-epoch switching needs a map-style dataset with a plain BatchSampler "
                    f"(this loader has {type(bs).__name__}); switching at epoch boundaries instead, where "
                    "no sample can be lost or repeated.",
                )
            return {}
        resume, self._restored.position = self._restored.position, None
        exhaust = (self.state.start or LoaderSettings.from_loader(loader)).num_workers > 0  # as the user's loader
        return {
            "batch_sampler": ResumableBatchSampler(bs.sampler, bs.batch_size, bs.drop_last, resume, exhaust),
            "batch_size": 1,
            # no `shuffle`: Lightning then reads it from batch_sampler.sampler when it injects its
            # DistributedSampler (an explicit False would turn shuffling off under DDP)
            "shuffle": _lightning.REMOVE,
            "sampler": None,
            "drop_last": False,
        }

    def _resume_epoch(self, sampler: ResumableBatchSampler) -> None:
        order, batch = self._restored.epoch or ([], 0)
        self._restored.epoch = None
        expected = len(sampler) * sampler.batch_size if sampler.drop_last else None
        if (expected is not None and len(order) != expected) or -(-len(order) // sampler.batch_size) != len(sampler):
            warn_once(
                "resume-order",
                "DataLoaderTuner: the checkpoint's epoch order does not fit this loader; "
                "the epoch restarts with a new order.",
            )
            return
        sampler.resume_order(order, batch)

    def _disable(self, key: str, message: str) -> None:
        self.state.disable()
        warn_once(key, f"DataLoaderTuner: {message}.")

    # --- switching ------------------------------------------------------------------------------------------
    def aim(self, settings: LoaderSettings | None) -> None:
        """Mirror the target ``settings`` onto a mixin DataModule (and so into its checkpointed state)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if settings is not None and isinstance(datamodule, TunableDataModuleMixin):
            datamodule.loader_settings = settings

    def switch(
        self, settings: LoaderSettings, now: bool, last_epoch: bool, everywhere: bool = False, behind: bool = False
    ) -> None:
        """Run on ``settings`` from the next fetch (``now``) or the next epoch (no-op if already on them).
        ``everywhere``: reload at the next epoch even if this rank is on them already, as the other ranks do (its
        running loader goes on through the reload, its persistent workers with it: no restart).
        ``behind``: the new loader may start in the background while the running one serves a few more batches
        (both worker sets are alive for a while: the caller checked they fit)."""
        assert self.trainer is not None
        self.state.target = settings  # this rank's own, where ranks differ (``Agreement.own_change``)
        self.aim(settings)
        self._pending.keep = None  # set below where this rank's loader goes on through the reload
        same = settings == self.state.current and not (everywhere and not now)
        if same or (not everywhere and self._in_place(settings, grow=now or not last_epoch)):  # nothing to build
            self._pending.reset()
        elif now:
            self._pending.settings, self._pending.in_background = settings, behind
        elif not last_epoch:
            self._pending.at_epoch_end = True  # at the epoch's end: a teardown now would end this epoch early
            running = getattr(self.trainer, "train_dataloader", None)
            if (
                settings == self.state.current
                and isinstance(running, DataLoader)
                and _lightning.will_reuse_iterator(running)
            ):
                self._pending.keep = running

    @property
    def changes_in_place(self) -> bool:
        """Whether a change of ``prefetch_factor`` alone is made on the running workers, and more workers are started
        beside them (see :meth:`_in_place`), with no restart: one process,
        the running loader's workers are PyTorch's own, serving through the guard (a map-style dataset with a plain
        batch sampler, not ``mode="epoch"``), still running (a loader that is not persistent stops its workers at
        the epoch's end), and no new loader is starting behind them. Only on a loader the tuner built, or a
        ``TunableDataModuleMixin``'s (built from the tuner's settings): the user's own ``DataLoader`` object keeps the
        attributes the user gave it (a switch from it builds a new one)."""
        guard, current = self._guarded, self.state.current
        if not self.single_process or guard is None or guard.next is not None or current is None:
            return False
        mixin = isinstance(getattr(self.trainer, "datamodule", None), TunableDataModuleMixin)
        if not (mixin or guard.loader in self._built):
            return False
        return LoaderSettings.from_loader(guard.loader) == current and _lightning.can_change_prefetch(guard.inner)

    def _in_place(self, settings: LoaderSettings, grow: bool = True) -> bool:
        """Make the change on the running loader, when only its ``prefetch_factor`` changes (on its running workers)
        or it gains workers (started beside the running ones, whose batches go on: ``_lightning.add_workers``; not
        without ``grow``: at the end of the last epoch no batch is left for them). A failure of the first batches
        after the growth (the added workers' first ones among them) falls back as a new loader's start-up does."""
        current, guard = self.state.current, self._guarded
        if current is None or guard is None or settings.prefetch_factor is None or not self.changes_in_place:
            return False  # (to 0 workers: a new loader)
        if current.only_prefetch_differs(settings):
            if not _lightning.change_prefetch(guard.loader, guard.inner, settings.prefetch_factor):
                return False
            self.in_place += 1
        elif grow and current.adds_workers_to(settings) and _lightning.can_add_workers(guard.loader, guard.inner):
            self.probe.pause()  # starting them is not the next step's time
            try:
                added = _lightning.add_workers(guard.loader, guard.inner, settings.num_workers)
            finally:
                self.probe.resume()
            if not added:
                return False
            self._startup.grown_until = guard.position + settings.batches_in_flight  # the added workers' first batches
            # until those are served, the added workers start (on the same CPUs): start-up, as a background start's
            # overlap is, charged its time beyond the old pace, not steady state
            self.probe.overlap_started()
            self._startup.growing = True
            _lightning.change_prefetch(guard.loader, guard.inner, settings.prefetch_factor)
            self.grown += 1
        else:
            return False
        self.state.current = LoaderSettings.from_loader(guard.loader)
        return True

    @property
    def waiting_for_epoch_end(self) -> bool:
        """A new config is decided for a loader that cannot switch inside the epoch: nothing to decide until then."""
        target = self.state.target
        return not self.in_epoch and target is not None and target != self.state.current

    def _as_untuned(self, loader: DataLoader) -> _Untuned:
        """What a run without the tuner does with the user's ``loader`` (just returned by the user's hook) in the
        epoch it is asked for. Where Lightning asked for it on its own (the first epoch of the ``fit``, a resumed
        one's too, or its ``reload_dataloaders_every_n_epochs``), that run asks for it too and iterates it as the
        tuner's is; a new object (or the fit's first) creates an iterator, drawing a base seed. Where only the tuner
        asked for the reload, that run would have gone on with its iterator."""
        last, self._random.user_loader = self._random.user_loader, weakref.ref(loader)
        ours, self._random.asked_reload = self._random.asked_reload, None  # the tuner asked for this reload
        if self._first_epoch is None or self.trainer is None:  # nothing trained yet in this fit
            return _Untuned(asked=True, draws_base=True)
        if ours is not None and not _lightning.lightning_reloads_train(self.trainer):
            # Lightning's schedule counts from its own latest reload, not from the tuner's (put back at epoch start)
            self._random.put_back_reload = ours
            return _NOT_ASKED
        return _Untuned(asked=True, draws_base=last is None or last() is not loader)

    def _train_began(self) -> None:
        """The first batches of an epoch are about to be fetched: the loader asked for before is its loader (a fit
        resumed from the end of epoch k asks for its loader while ``current_epoch`` still says k; one resumed in the
        middle of an epoch starts no epoch, and this runs at its first fetch)."""
        if self._first_epoch is None and self.trainer is not None:
            self._first_epoch = self.trainer.current_epoch
        self._random.now, self._random.next = self._random.next or _NOT_ASKED, None

    def epoch_started(self) -> None:
        """A train epoch begins (after Lightning's ``setup_data``): the guard goes on its iterator, the random state
        is kept as untuned, and Lightning's reload schedule as it was before a reload only the tuner asked for."""
        if self._random.put_back_reload is not None and self.trainer is not None:
            _lightning.set_train_reload_epoch(self.trainer, self._random.put_back_reload)
        self._random.put_back_reload = None
        self._train_began()
        self._keep_rng_as_untuned()
        if self.state.tuner_changed_workers() and self.trainer is not None:  # the user's own config: as PyTorch does
            _lightning.keep_start_errors(self.trainer.train_dataloader)
        self._guard_needed = self.in_epoch or self._check_shards
        self._stop_timing()  # timed for the fetch that ended the last epoch: no step's
        self._startup.spoiled = False

    def epoch_ended(self, last_epoch: bool) -> None:
        """A train epoch ended, after the tuner's decision: a reload asked for during it happens now. An epoch
        resumed on a restored loader's settings goes on to the target its checkpoint had, when tuning had settled
        on it, or when no step on the restored settings is left to judge (no decision has replaced it)."""
        deferred, self._restored.deferred = self._restored.deferred, None
        if self._startup.growing:
            self._grown()
        judged = self.state.tuning and self.probe.window_batches == 0
        if deferred is not None and self.state.target == deferred and (self.state.phase is Phase.SETTLED or judged):
            self.switch(deferred, now=False, last_epoch=last_epoch)
        self._abandon()  # the epoch ended before a background start took over: the next epoch switches
        pending = self._pending
        go_on = not (pending.at_epoch_end or last_epoch or pending.settings is not None)
        if self.trainer is not None:
            self.seamless.epoch_ended(_lightning.train_iterator(self.trainer), go_on)
        if pending.at_epoch_end and not last_epoch:
            assert self.trainer is not None
            self._random.asked_reload = _lightning.train_reload_epoch(self.trainer)
            _lightning.request_train_reload(self.trainer, keep_workers=pending.keep is not None)
            self._kept = pending.keep
        pending.at_epoch_end, pending.keep = False, None

    def batch_done(self) -> None:
        self._startup.unserved, self._startup.spoiled = False, False
        times = self._stop_timing()  # the start-up step's batch, loaded in the training process
        if times is not None:
            self.probe.startup_samples(times)
        if self._startup.growing and self._guarded is not None and self._guarded.position >= self._startup.grown_until:
            self._grown()

    def _grown(self) -> None:
        """Workers added in place have served their first batches (or the epoch ended): steady state from here."""
        self._startup.growing = False
        self.probe.rebuilt_in_fetch()

    def _before_fetch(self) -> None:
        self._random.before_build = None  # only an epoch start right after a build may rewind to it
        if self._first_epoch is None:  # a fit resumed mid-epoch starts no epoch
            self._train_began()
        if self._guard_needed:
            self._guard_needed = False
            assert self.trainer is not None
            _lightning.wrap_train_iterator(self.trainer, self._guard)
        running = _lightning.train_iterator(self.trainer) if self.trainer is not None else None
        _lightning.load_apart(getattr(running, "inner", running), self._loading)
        self.probe.fetch_started()
        if self._stop_timing() is not None:  # a second fetch in one step (a step that pulls its batches itself):
            self._startup.spoiled = True  # the times are no one batch's
        guard = self._guarded
        if self.state.tuning and self.probe.startup_next and guard is not None and not self._startup.spoiled:
            # loaded in the training process (0 workers), sample by sample: a first sample that opened a file
            # lazily shows apart from the rest, and the step can be judged on its own (`windows.steady_from_the_start`)
            self._startup.samples = _lightning.time_samples(guard.inner, self.probe.clock)

    def _prepare(self, inner: Iterator[Any]) -> None:
        """Every new iterator the guard serves from: it loads apart from training's random states (see
        :mod:`~lightning_dltune.switching.randomness`), and its workers' deaths are its own to report."""
        _lightning.detach_from_sigchld(inner)
        _lightning.load_apart(inner, self._loading)

    def _stop_timing(self) -> list[float] | None:
        """Stop timing samples (see ``_lightning.time_samples``); the times taken, or ``None`` when none was timing."""
        timing, self._startup.samples = self._startup.samples, None
        return None if timing is None else timing.finish()

    def _tuner_added_workers(self, loader: DataLoader) -> bool:
        """Whether ``loader`` has two workers or more where the user's loader had fewer."""
        start = self.state.start
        return loader.num_workers >= 2 and start is not None and start.num_workers < loader.num_workers

    def _guard(self, loader: Any, inner: Iterator[Any]) -> Iterator[Any]:
        if self._check_shards and not isinstance(inner, (GuardedIterator, ShardCheck)):
            self._check_shards = False
            if _lightning.in_order(inner):  # out of order, a batch's worker is not known: not checked
                taken = _lightning.batches_yielded(inner)
                return ShardCheck(loader, inner, self._not_sharded, taken, loader.num_workers)
        resumable = isinstance(getattr(loader, "batch_sampler", None), ResumableBatchSampler)
        if isinstance(inner, GuardedIterator) or not (resumable or self._as_given):
            return inner
        guard = GuardedIterator(loader, inner, self._guard_hooks)
        if not resumable and guard.recorded is None:  # its iterator drew before the guard: it switches at epoch end
            return inner
        self._guarded = guard
        return guard

    def _overlapping(self, new: DataLoader | None) -> None:
        self._startup.growing = False  # a new loader's overlap (or its end) takes over the timer's overlap
        if new is None:  # abandoned before it took over
            self.probe.overlap_ended()
            return
        self.background_starts += 1
        self.probe.overlap_started()

    def _switch_if_pending(self, loader: DataLoader) -> DataLoader | None:
        settings, self._pending.settings = self._pending.settings, None
        return None if settings is None else self._build(loader, settings)

    def _build(self, loader: DataLoader, settings: LoaderSettings) -> DataLoader:
        """``loader`` rebuilt with ``settings``; it serves once the guard adopts it (see :meth:`_adopt`). From the
        user's own loader (a plain batch sampler), the new one gets the tuner's, holding the epoch's order as that
        loader drew it (``GuardedIterator.epoch_order``)."""
        overrides = settings.to_loader_kwargs()
        guard = self._guarded
        order = None
        if not isinstance(loader.batch_sampler, ResumableBatchSampler) and guard is not None and guard.loader is loader:
            order = guard.epoch_order()
            overrides.update(self._resumable_overrides(loader))
        with _lightning.recording():
            new = self._said_why(_lightning.rebuild_dataloader(loader, overrides, quiet=True))
        if order is not None and isinstance(new.batch_sampler, ResumableBatchSampler):
            new.batch_sampler.resume_order(order, 0)  # the guard resumes it at its hand-over batch
        self.seamless.attach(new)
        return self._mark_built(new)

    def _mark_built(self, new: DataLoader) -> DataLoader:
        """``new`` is a loader this switcher built (a new object, not the user's own: changed in place, let go of at
        ``restore``); one with a :class:`ResumableBatchSampler` shows Lightning the sampler it draws from."""
        self._built.add(new)
        if isinstance(new.batch_sampler, ResumableBatchSampler):
            _lightning.show_sampler(new)
        return new

    def _lead(self, new: DataLoader) -> tuple[int, int] | None:
        """How far ahead a background start of ``new`` hands over (``GuardedIterator``'s ``ahead``): enough
        batches of the running loader to cover a new worker's first batch (``model.handover_lead``), and before
        the epoch's last batch (``limit_train_batches`` and ``max_steps`` included). ``None``: it takes over at
        once; so does a loader with its own state (a ``StatefulDataLoader``): the state Lightning saves is the
        serving loader's."""
        behind, self._pending.in_background = self._pending.in_background, False
        if not behind or self.trainer is None or callable(getattr(new, "state_dict", None)):
            return None
        end, guard = self.trainer.num_training_batches, self._guarded
        if not isinstance(end, int) or guard is None:
            return None
        left = remaining_steps(self.trainer, guard.position)  # `max_steps` may end the fit inside this epoch
        if left is not None:
            end = min(end, guard.position + left)
        return self.state.handover_lead(), end

    def _adopt(self, old: DataLoader, new: DataLoader) -> None:
        """``new`` serves from this fetch on: the old loader's workers stop, Lightning trains on ``new``, and this
        fetch's wait (with a background start's extra time) is ``new``'s start-up."""
        assert self.trainer is not None
        _lightning.shutdown_workers(old)
        self._startup.growing = False  # the workers added to the old loader are gone
        _lightning.replace_train_loader(self.trainer, new)
        self.state.current = LoaderSettings.from_loader(new)
        self._startup.unserved = True
        self.probe.rebuilt_in_fetch()
        self.probe.loader_built(self.state.current.num_workers)

    @property
    def starting(self) -> LoaderSettings | None:
        """The settings of a loader starting in the background, until it takes over (``None``: none)."""
        guard = self._guarded
        new = guard.next[0] if guard is not None and guard.next is not None else None
        return None if new is None else LoaderSettings.from_loader(new)

    def _abandon(self) -> None:
        """Stop a background start that has not taken over; its switch happens at the next fetch instead, unless
        a later decision replaced it."""
        new = self._guarded.abandon() if self._guarded is not None else None
        settings = LoaderSettings.from_loader(new) if new is not None else None
        if settings is not None and self._pending.settings is None and settings == self.state.target:
            self._pending.settings = settings

    # --- failures -------------------------------------------------------------------------------------------
    def _not_sharded(self, loader: DataLoader, inner: Iterator[Any], taken: int) -> Iterator[Any]:
        """Two workers yielded the same batch (see ``ShardCheck``): the dataset does not shard, so every config with
        more workers than one repeats samples. Go back to the fallback the failure gives (a config measured before,
        or the user's; every config with two workers or more was checked in its first iteration) and go on from where
        the loop is: of the ``taken`` batches it took, batch ``b`` was worker ``b % workers``'s batch
        ``b // workers``, which is the dataset's own batch ``b // workers``."""
        assert self.trainer is not None
        tried = LoaderSettings.from_loader(loader)
        trained = -(-taken // tried.num_workers)  # the dataset's first batches the loop trained, once or more
        why = "the IterableDataset does not shard: two workers yielded the same batch"
        fallback = self._on_failure("repeated samples", why) or self.state.start or LoaderSettings()
        self.aim(fallback)
        new = self._build(loader, fallback)
        _lightning.shutdown_iterator(inner)
        self._adopt(loader, new)
        again = f"{taken - trained} batch(es) had been trained twice" if taken > trained else "no sample trained twice"
        warn_once(
            "not-sharded",
            f"DataLoaderTuner: the train IterableDataset does not shard itself: with {tried.describe()} two workers "
            "yielded the same batch, so every worker would yield every sample. Went back to "
            f"{fallback.describe()} ({again}). To let the tuner change `num_workers`, shard the dataset with "
            "`torch.utils.data.get_worker_info()`; otherwise leave `tune_iterable=False`.",
        )
        replacement = apart_from_global(new, lambda: iter(new))
        for _ in islice(replacement, trained):
            pass
        return replacement

    def _startup_failed(self, error: BaseException, loader: DataLoader, position: int) -> DataLoader | None:
        """A config the tuner chose failed before delivering its first batch (a raising ``worker_init_fn``,
        workers that cannot start), or workers it added in place failed in their first batches: fall back. Errors
        of the user's own config, or after a config has delivered batches, are the user's and propagate."""
        grown = self._guarded is not None and self._guarded.loader is loader and position < self._startup.grown_until
        if not (self._startup.unserved or grown) or not self.state.tuner_changed_workers():
            return None
        return self._fall_back(loader, position, "workers failed to start", error)

    def _recover(self, error: BaseException, loader: DataLoader, position: int) -> DataLoader | None:
        """A worker died: fall back, and continue the epoch at ``position``. A worker stopped for hanging in its fork
        (see :mod:`~lightning_dltune.switching.forkwatch`) says nothing of the settings: the loader starts again on
        them, a few times at most."""
        current = self.state.current
        if stopped_by_watch(error) and current is not None and self._fork_restarts < MAX_FORK_RESTARTS:
            self._fork_restarts += 1
            warn_once(
                f"fork-restart-{self._fork_restarts}",
                f"DataLoaderTuner: a train loader worker hung in its fork and was stopped; started the loader again "
                f"on {current.describe()} at batch {position}: no sample lost or repeated.",
                every_rank=True,
            )
            self.probe.leave_out_fetch()
            return self._build(loader, current)
        return self._fall_back(loader, position, "a DataLoader worker died", error)

    def _fall_back(self, loader: DataLoader, position: int, kind: str, error: BaseException) -> DataLoader | None:
        summary = error_summary(error)
        failed = self.state.current
        if failed is None or self.trainer is None:
            return None
        fallback = self._on_failure(kind, summary)
        if fallback is None:
            return None
        self.aim(fallback)
        warn_once(
            f"fallback-{self.state.recoveries}",
            f"DataLoaderTuner: {kind} ({summary}). Rebuilt the train loader with "
            f"{fallback.describe()} (was {failed.describe()}) and continued epoch {self.trainer.current_epoch} "
            f"at batch {position}: no sample lost or repeated. {failed.describe()} will not be used again.",
            every_rank=True,
        )
        return self._build(loader, fallback)

    # --- the random state and the epoch's position ----------------------------------------------------------
    def _keep_rng_as_untuned(self) -> None:
        """Leave the global random state as a run that never changed the loader would have it, so each
        epoch's sample order depends on the seed and the epoch, not on what the tuner did.

        A loader built for this epoch already created its iterator (drawing a base seed, and for persistent
        workers the epoch's order too): undo that, since the epoch loop's ``iter()`` resets it and draws again.
        A persistent iterator that is reset instead of recreated skips the base-seed draw a new iterator makes:
        make it, if the user's own loader would have. With seamless epochs on, a new iterator is not reset (see
        ``_lightning.keeps_fresh_iterator``) and drew only what this epoch draws (``Seamless.draws_base``): its
        draws stand. In the first epoch of a ``fit`` (a resumed one's too), and in an epoch where Lightning reloads the
        loader on its own (see :meth:`_as_untuned`) while it runs on the user's settings (tested observing), the user's
        loader is asked for and iterated as the tuner's is: what the tuner's drew stands. Where Lightning reloads on
        its own onto a loader of the tuner's (on other settings, or on the user's with the tuner's batch sampler),
        what that loader drew in ``setup_data`` is undone, what the user's loader draws there is drawn instead, and
        the epoch loop's ``iter()`` draws the epoch's order from there as the user's loader does
        (:meth:`_draw_as_untuned_setup`).
        """
        saved, self._random.before_build = self._random.before_build, None
        trainer, start = self.trainer, self.state.start
        loader = trainer.train_dataloader if trainer is not None else None
        if trainer is None or start is None or not isinstance(loader, DataLoader):
            return
        ours = loader in self._built or LoaderSettings.from_loader(loader) != start
        if self._random.now.asked and (self._first_epoch == trainer.current_epoch or not ours):
            return
        # Lightning reloaded on its own, onto a loader of the tuner's (other settings, or only its batch sampler):
        # what that loader drew in setup_data is undone, the user's loader's draws there are made instead, and the
        # epoch loop's iter() draws the epoch's order from there
        reloaded = self._random.now.asked and saved is not None
        if not reloaded and _lightning.keeps_fresh_iterator(loader):  # the epoch loop's iter() keeps it
            return
        for generator, state in saved or []:
            if generator is None:
                torch.set_rng_state(state)
            else:
                generator.set_state(state)
        if reloaded:
            self._draw_as_untuned_setup(loader, start)
        carried = self.seamless.carrying  # its generator's draw was made before the next order's (seamless)
        reused = _lightning.will_reuse_iterator(loader) or carried
        if not start.persistent_workers and reused and not (carried and loader.generator is not None):
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)

    def _draw_as_untuned_setup(self, loader: DataLoader, start: LoaderSettings) -> None:
        """Draw what the user's loader (on ``start``, the user's settings) draws when Lightning's ``setup_data``
        creates or resets its iterator, in an epoch Lightning reloads the loader in on its own: a new iterator (no
        workers, workers that are not persistent, or a new loader object) draws a base seed, and workers are handed
        their first batches at once, drawing the epoch's order (which the epoch loop's ``iter()`` draws again). From
        the sampler ``loader`` (the tuner's) iterates: under DDP, the ``DistributedSampler`` Lightning put in. The
        tuner's own iteration from ``setup_data`` is dropped: the epoch loop's ``iter()`` begins the epoch again
        (a new iterator that has yielded nothing is reset, its workers' first batches dropped). Not exact where the
        tuner's loader has no workers and the user's has persistent ones: that loader's next iterator draws a base
        seed, where the user's is only reset."""
        batches = loader.batch_sampler
        if start.num_workers == 0 or not start.persistent_workers or self._random.now.draws_base:
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        if not isinstance(batches, ResumableBatchSampler):
            return
        sampler: Any = batches.sampler
        if start.num_workers > 0:
            if draws_from_global(sampler):  # not from a generator seamless epochs gave it to draw ahead
                sampler.generator = None
            handed = BatchSampler(sampler, batches.batch_size, batches.drop_last)
            for _ in islice(handed, start.num_workers * (start.prefetch_factor or 2)):  # as PyTorch hands them out:
                pass  # past the epoch's end too, where a sampler with a generator then draws once more
        if _lightning.reset_fresh_iterator(loader):
            batches.redraw_epoch()
        else:
            batches.forget_upcoming()
        self.seamless.forget()

    def position_state(self) -> dict[str, Any]:
        """Where the running epoch is, for a checkpoint: the running loader's settings (a loader state Lightning
        saves fits only those); mid-epoch, with a resumable sampler, the batch the loop reached and the epoch; and
        the epoch's order, unless the sampler derives it from seed and epoch (a DistributedSampler: each rank then
        rebuilds its own shard, where rank 0's order would be wrong)."""
        state = self._loader_state()
        if self.trainer is None or not self.in_epoch:
            return state
        guard = _lightning.train_iterator(self.trainer)
        if not isinstance(guard, GuardedIterator):
            return state
        sampler = guard.loader.batch_sampler
        if not 0 < guard.position < len(sampler):
            return state
        state.update(epoch_batch=guard.position, epoch_index=self.trainer.current_epoch)
        if not hasattr(sampler.sampler, "set_epoch"):
            state["epoch_order"] = guard.epoch_order()
        return state

    def _loader_state(self) -> dict[str, Any]:
        current = self.state.current
        return {} if current is None else {"loader_settings": current.to_loader_kwargs()}

    def load_position(self, state: dict[str, Any]) -> None:
        batch = int(state.get("epoch_batch", 0))
        if "epoch_order" in state:
            self._restored.epoch = (list(state["epoch_order"]), batch)
        elif "epoch_index" in state and batch > 0:
            self._restored.position = (int(state["epoch_index"]), batch)
        saved = state.get("loader_settings")
        if isinstance(saved, dict):
            self._restored.loader = LoaderSettings.from_dict(saved)

    def worker_pids(self) -> list[int]:
        return [] if self.trainer is None else _lightning.train_worker_pids(self.trainer)


def remaining_steps(trainer: "pl.Trainer", done: float) -> int | None:
    """Training batches left in ``fit`` after ``done`` batches of the current epoch (``None``: unbounded)."""
    module = trainer.lightning_module
    by_steps = trainer.accumulate_grad_batches == 1 and module.automatic_optimization
    return batches_left(
        trainer.num_training_batches,
        trainer.max_epochs,
        trainer.current_epoch,
        done,
        trainer.max_steps,
        trainer.global_step,
        by_steps,
    )


def fit_goes_on(trainer: "pl.Trainer", ahead: int = 0) -> bool:
    """Whether ``fit`` trains past the epoch ``ahead`` epochs after the running one, as far as it is known before the
    running one ends: not past ``max_epochs``, not stopping, and more of ``max_steps`` left than the running epoch and
    the ``ahead`` after it hold (near the end of an epoch, a fit that ends within the next one reads as ending here)."""
    max_epochs = trainer.max_epochs
    if trainer.should_stop or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + ahead + 1):
        return False
    left = remaining_steps(trainer, 0)
    return left is None or left > (ahead + 1) * trainer.num_training_batches


def is_last_epoch(trainer: "pl.Trainer") -> bool:
    """Whether the running epoch is the last of ``fit`` (by ``max_epochs``)."""
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs


def _random_states(loader: DataLoader) -> list[tuple[torch.Generator | None, torch.Tensor]]:
    """The random states ``loader``'s iteration draws from, to put back: the global one (``None``), the loader's
    generator, and its sampler's own (not one seamless epochs gave it to draw ahead)."""
    sampler = getattr(loader, "sampler", None)
    own = None if draws_from_global(sampler) else getattr(sampler, "generator", None)
    generators = {id(g): g for g in (loader.generator, own) if isinstance(g, torch.Generator)}
    return [(None, torch.get_rng_state()), *((g, g.get_state()) for g in generators.values())]
