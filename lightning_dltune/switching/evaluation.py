"""The evaluation loaders: validation (inside ``fit`` and in ``trainer.validate``), test and predict.

:class:`EvalLoaders` holds one :class:`EvalTuner` per loop name (``"val"``, ``"test"``, ``"predict"``) and forwards the
callback's hooks to the running stage's. An :class:`EvalTuner` measures its loader pass by pass, as the train loader
is measured (the wait for each batch against the step, in a :class:`~lightning_dltune.measurement.probe.Probe` of its
own: the
pass's first batch, with the creation of its iterator, is its start-up), pools passes until a window has
``min_steps`` steady steps, and between passes decides with the train loader's model
(:class:`~lightning_dltune.tuning.state.TuningState`), over the batches of the passes left. A switch takes effect at the
next pass: its loader is rebuilt from the user's last one (the user's hook is not called for it, and Lightning's
reload schedule is kept). On one process a pass of a map-style loader also switches inside, as soon as its window
can be judged, going on from the batch its iterator reached (:class:`SkipOnce`). A loop with several loaders (a list,
tuple or dict of them, which Lightning runs one after the other) gets one config for all of them: their persistent
workers are alive together, so the loop's share of the memory budget is split between them.

Hand-overs: in ``fit``, where the next validation pass begins at a training batch known ahead (its batch-count
schedule) and its loader holds persistent workers over a sampler that draws nothing, the pass's iterator is reset
while training runs its last steps before it (:meth:`EvalTuner.start_ahead`, as many steps as the pass's first batch
took to arrive when last seen in the open, with a margin of :data:`AHEAD`): its workers load the pass's first
batches meanwhile. Lightning's own reset at the pass's start then keeps that iterator, after setting the sampler's
epoch to the one set ahead (an iterator set ahead for another epoch is reset again).

The global random state stays as an untuned run leaves it: at a pass's start, each loader whose persistent iterator
is reset where the user's loader would create one (and draw a base seed) draws that seed; a new iterator of the
tuner's loader where the user's loader would reset its own draws its seed from a copy of the global state
(``switch.apart_from_global``), so the global state and the loader's generator are left as the user's reset leaves
them. With several loaders, the seeds of the later ones are drawn at the pass's start, not as Lightning reaches
them (the same state after the pass, where the steps draw nothing from it between).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from itertools import islice
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_dltune._warn import info_once, warn_once
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.measurement.probe import Probe
from lightning_dltune.mixin import TunableDataModuleMixin
from lightning_dltune.output.cache import RunCache
from lightning_dltune.output.report import PREFIX, WindowSeries, build_report, summary_table, window_metrics
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.switching import _lightning
from lightning_dltune.switching.forkwatch import MAX_FORK_RESTARTS, ForkWatch, stopped_by_watch, watch_forks
from lightning_dltune.switching.randomness import LoadingRandomness
from lightning_dltune.switching.switch import apart_from_global
from lightning_dltune.tuning.model import Budget, Decision, Policy
from lightning_dltune.tuning.state import TuningState

EVAL_LOOPS: tuple[str, ...] = ("val", "test", "predict")
AHEAD = 1.5  # a pass's first batches begin loading this many times their last measured load time before the pass


def loop_name(trainer: "pl.Trainer") -> str | None:
    """The evaluation loop running now (``"val"`` in a sanity check too), ``None`` in training or outside a loop."""
    prefix = getattr(trainer.state.stage, "dataloader_prefix", None)
    return prefix if prefix in EVAL_LOOPS else None


def passes_left(trainer: "pl.Trainer") -> int | None:
    """Validation passes ``fit`` runs after the running one (``None``: unbounded): the training batches left over the
    batches between two validations."""
    from lightning_dltune.switching.loader import remaining_steps

    batches = trainer.num_training_batches
    every = trainer.check_val_every_n_epoch
    per = trainer.val_check_batch if isinstance(trainer.val_check_batch, int) else batches
    if not isinstance(per, (int, float)) or per <= 0 or math.isinf(per):
        return None
    if every is not None and (math.isinf(batches) or per >= batches):
        per = every * batches  # once every `every` epochs
    left = remaining_steps(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.ready)
    return None if left is None or math.isinf(per) else int(left // per)


def steps_to_validation(trainer: "pl.Trainer") -> int | None:
    """Training steps ``fit`` runs after the one that just ended before its next validation pass, within this epoch
    (0: right after it; ``None``: not known, as for a time-based ``val_check_interval`` or an epoch that does not
    validate)."""
    per, every = trainer.val_check_batch, trainer.check_val_every_n_epoch
    if not trainer.enable_validation or not isinstance(per, int) or per <= 0:
        return None
    if every is not None and (trainer.current_epoch + 1) % every:
        return None
    in_epoch, total = _lightning.batches_done(trainer)
    steps = -(total if every is None else in_epoch) % per
    batches = trainer.num_training_batches
    return None if (isinstance(batches, float) and math.isinf(batches)) or in_epoch + steps > batches else steps


class PassGuard(Iterator[Any]):
    """The iterator an evaluation pass pulls its batches from: ``inner`` until a switch inside the pass replaces it,
    and ``recover(error, guard)`` asked on an error (True: it replaced ``inner``, and the batch is fetched again).
    Each ``inner`` is taken off PyTorch's SIGCHLD handler, so that a worker's death is raised inside ``next()``,
    where it can be recovered, not wherever the main thread is (inside ``validation_step``, say)."""

    def __init__(self, inner: Iterator[Any], recover: Callable[[BaseException, PassGuard], bool]) -> None:
        self.inner, self._recover = inner, recover

    @property
    def inner(self) -> Iterator[Any]:
        return self._inner

    @inner.setter
    def inner(self, iterator: Iterator[Any]) -> None:
        _lightning.detach_from_sigchld(iterator)
        self._inner = iterator

    def __next__(self) -> Any:
        while True:
            try:
                return next(self.inner)
            except StopIteration:
                raise
            except Exception as error:
                if not self._recover(error, self):
                    raise


class SkipOnce:
    """A batch sampler over ``batches`` that leaves out its first ``skip`` batches the first time it is iterated
    (a generator: creating an iterator that is never advanced, as PyTorch does once before its reset, consumes
    nothing), and yields them all after. Iterating ``batches`` itself, it keeps what that sampler records (Lightning's
    ``_IndexBatchSamplerWrapper`` records every batch's indices, the left-out ones too)."""

    def __init__(self, batches: Any, skip: int) -> None:
        self.batches, self.skip = batches, skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        yield from islice(iter(self.batches), skip, None)

    def __len__(self) -> int:
        return len(self.batches) - self.skip


def _draws_nothing(loader: DataLoader) -> bool:
    """Whether iterating ``loader``'s sampler draws no random number (an unshuffled or a distributed one)."""
    return isinstance(loader.sampler, (SequentialSampler, DistributedSampler))


class EvalTuner:
    """Measures and tunes the loader of one evaluation loop (``name``) across its passes.

    Args:
        name: ``"val"``, ``"test"`` or ``"predict"``.
        policy: the decision's knobs (the train loader's).
        observe_only: measure and report, never rebuild.
        tune_iterable: also rebuild an ``IterableDataset``'s loader (one that shards itself): only ``True``
            (``"auto"`` checks the sharding of a train loader only).
        cache: the tuner's ``cache`` argument: the loop's settled settings are remembered under its own key.
        limits: the tuner arguments that bound the search (part of the cache's key).
        window_steps: steady steps after which a window inside a pass is judged (sooner where
            :meth:`~lightning_dltune.tuning.state.TuningState.judge_early` says so).
    """

    def __init__(
        self,
        name: str,
        policy: Policy,
        observe_only: bool = False,
        tune_iterable: bool | str = "auto",
        cache: Any = False,
        limits: dict[str, Any] | None = None,
        window_steps: int = 20,
    ) -> None:
        self.name, self.policy, self.tune_iterable, self.window_steps = name, policy, tune_iterable, window_steps
        self.cache, self.limits = RunCache(cache), {**(limits or {}), "loop": name}
        self.budget: Budget | None = None
        self._agreement: Any = None  # the run's Agreement: every rank starts from the same cached config
        # called as each run of the loop (a pass, its loader's request and set-up included) begins and ends: in `fit`,
        # the train loader's measurement pauses (see `EvalLoaders.install`)
        self.around: tuple[Callable[[], None], Callable[[], None]] = (lambda: None, lambda: None)
        self.state = TuningState(policy, observe_only)
        self.probe = Probe(worker_pids=lambda: _lightning.loop_worker_pids(self.loop))
        self._loading = LoadingRandomness(0, name)  # seeded anew from the run's seed at `install`
        self.series = WindowSeries()
        self.passes = 0  # passes measured (sanity checks are not)
        self.loop: Any = None
        self.trainer: pl.Trainer | None = None
        self._restores: list[Callable[[], None]] = []
        self._user_loader: Any = None  # what the user's hook returned last: a switch rebuilds it
        self._switch = False  # the next request is the tuner's: the user's last loader is rebuilt
        self._reload_epoch: float | None = None  # Lightning's reload epoch, kept across the tuner's requests
        self._user_new = False  # Lightning asked the user's hook since the last pass: its iterator would be new
        self._user_resets = False  # in the running pass, the user's loaders would reset their iterators
        self._counting = False  # the running pass is measured
        self._pass_loader: DataLoader | None = None  # the loader the running pass iterates (until a switch in it)
        self._in_pass = False  # the running pass may switch inside (one process, a map-style loader that draws nothing)
        self._done = 0  # batches of the running pass done
        self._pending: LoaderSettings | None = None  # a switch inside the pass, made at the next fetch
        self._stale = False  # the running pass decided on a switch it ends without: its last steps are not measured
        self.pass_budget: Budget | None = None  # what the running pass's decisions are taken within
        self._draws: list[DataLoader] = []  # loaders that draw the base seed the user's would, after the reset
        self._sample_times: _lightning.SampleTimes | None = None  # the start-up batch's samples, timed as they load
        self.started_ahead = 0  # passes whose first batches began loading while training ran
        self._fetch_at = 0.0  # when the running fetch began
        self._patched: weakref.WeakSet[DataLoader] = weakref.WeakSet()  # loaders that draw as the user's (restored)
        self.fill_s: float | None = None  # from a pass's iterator request to its first batch, when last seen in full
        self._reset_at: float | None = None  # when the running pass requested its iterator
        # when, at which sampler epoch and on which loader the next pass began early
        self._ahead: tuple[float, int, weakref.ref[DataLoader]] | None = None
        self._first_wait_s = 0.0  # the running pass's first fetch's wait
        self._fork_restarts = 0  # loaders started again after a worker hung in its fork, this run
        self._watch: ForkWatch | None = None  # held from `install` to `restore`

    # --- set-up ---------------------------------------------------------------------------------------------
    def install(self, trainer: "pl.Trainer", budget: Budget, agreement: Any) -> None:
        """A run of the loop begins (``fit``, ``validate``, ``test`` or ``predict``): route its loader requests, its
        pass starts and its fetches here. A run held before tries its plan now. ``agreement``: the run's
        :class:`~lightning_dltune.agreement.Agreement` (every rank starts from the same cached config)."""
        self.budget, self._agreement = budget, agreement
        self._fork_restarts = 0
        if self._watch is None:
            self._watch = watch_forks()  # before the first worker starts
        reloads = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        self.state.reloads = trainer.state.fn == "fit" and bool(reloads)
        if self.state.held is not None:
            self.state.target = self.state.held.settings
        self.state.begin_fit()
        self.trainer, self.loop = trainer, _lightning.evaluation_loop(trainer, self.name)
        self._loading = LoadingRandomness(torch.initial_seed(), self.name)
        self.probe.start(torch.device("cpu"), log_gpu=False)
        self.probe.apart = _lightning.launched_ranks(trainer)
        self._switch, self._counting, self._draws, self._pending = False, False, [], None
        self._ahead = self._reset_at = None
        self._restores = [
            _lightning.install_source_transform(self.loop, self._on_request, self.state.tuner_changed_workers),
            _lightning.wrap_loop_method(self.loop, "reset", self._before_reset, self._after_reset),
            _lightning.wrap_loop_method(self.loop, "run", *self.around),
            _lightning.install_loop_fetch_hooks(self.loop, self._before_fetch, self._fetch_ended),
        ]

    def restore(self) -> None:
        """Undo :meth:`install`, letting go of the run's loaders; safe to call twice."""
        for restore in reversed(self._restores):
            restore()
        self._restores = []
        self.probe.stop()
        if self._watch is not None:
            self._watch.release()
            self._watch = None
        for loader in list(self._patched):
            _lightning.undo_iterators_apart(loader)
        self._patched = weakref.WeakSet()
        self._stop_timing()
        self._user_loader = self._pass_loader = None
        self._draws = []

    def shutdown(self) -> None:
        """Stop the workers of the loop's loaders and of its running iterator now (after a failed run)."""
        if self.loop is None:
            return
        iterator = _lightning.loop_iterator(self.loop)
        if iterator is not None:
            _lightning.shutdown_iterator(getattr(iterator, "inner", iterator))
        for loader in _lightning.loop_loaders(self.loop):
            _lightning.shutdown_workers(loader)

    def _measure_only(self, why: str) -> None:
        if self.state.tuning:
            self.state.disable()
            info_once(f"eval-{self.name}-measured", f"DataLoaderTuner: the {self.name} loader is measured only: {why}.")

    # --- building -------------------------------------------------------------------------------------------
    def _on_request(self, original: Callable[[], Any]) -> Any:
        """Every loader request of the loop passes here (see ``_lightning.install_source_transform``)."""
        switch, self._switch = self._switch, False
        if switch and self._user_loader is not None:
            _lightning.set_loop_reload_epoch(self.loop, self._reload_epoch)  # the request was the tuner's
            requested = self._user_loader
        else:
            requested = self._user_loader = original()
            self._user_new = True
        loaders = dataloaders_in(requested)
        if not loaders:
            self._measure_only(f"it is a {type(requested).__name__}, not `torch.utils.data.DataLoader`s")
            return requested
        settings = {LoaderSettings.from_loader(loader) for loader in loaders}
        if len(settings) > 1:
            self._measure_only("its loaders have different settings")
            return requested
        (current,) = settings
        self._start_from_cache(current, loaders)
        if any(isinstance(loader.dataset, IterableDataset) for loader in loaders) and self.tune_iterable is not True:
            self._measure_only("its dataset is an IterableDataset (see `tune_iterable`: True retunes it)")
        target = self.state.target if self.state.switching else None
        if target is not None and target != current:
            try:
                requested = with_each_dataloader(requested, lambda loader: self._build(loader, target))
            except _lightning.NotRebuildableError as ex:
                self._measure_only(f"it cannot be rebuilt ({ex})")
        self.state.current = LoaderSettings.from_loader(dataloaders_in(requested)[0])
        self.probe.loader_built(self.state.current.num_workers)
        return requested

    def _start_from_cache(self, current: LoaderSettings, loaders: list[DataLoader]) -> None:
        """On the loop's first loader, start from the cached settings where there are some (the key counts the
        loaders where there are several)."""
        if not self.state.loader_seen(current) or self.budget is None:
            return
        assert self.trainer is not None
        limits = self.limits if len(loaders) == 1 else {**self.limits, "loaders": len(loaders)}
        hit = self.cache.start(self.state, loaders[0], self.budget.cpus, self.trainer, limits, self._agreement)
        if hit is not None:
            rank_zero_info(f"DataLoaderTuner: the {self.name} loader starts from cached settings {hit.describe()}.")

    @staticmethod
    def _build(loader: DataLoader, settings: LoaderSettings, **overrides: Any) -> DataLoader:
        return _lightning.rebuild_dataloader(loader, {**settings.to_loader_kwargs(), **overrides}, quiet=True)

    def _before_reset(self) -> None:
        """A pass creates (or resets) its iterator: its start-up begins, and what it draws is noted."""
        assert self.trainer is not None
        self._counting = True  # a sanity check too: its batches are the loader's first measurement
        self._reset_at, self._first_wait_s = self.probe.clock(), 0.0
        loaders = _lightning.loop_loaders(self.loop)
        ahead = self._ahead
        if ahead is not None and (ahead[1] != _lightning.validation_epoch(self.trainer) or ahead[2]() not in loaders):
            self._ahead = None  # set ahead for another epoch, or another loader: Lightning's reset begins it again
            for loader in loaders:
                _lightning.reset_fresh_iterator(loader)
        start, self._draws = self.state.start, []
        if start is not None and all(isinstance(loader, DataLoader) for loader in loaders):
            self._user_resets = not (self._user_new or start.num_workers == 0 or not start.persistent_workers)
            limits = getattr(self.loop, "max_batches", [1] * len(loaders))
            reused = [dl for dl, n in zip(loaders, limits, strict=False) if n and _lightning.will_reuse_iterator(dl)]
            self._draws = [] if self._user_resets else reused
            resets = _weak_flag(self, "_user_resets")  # the loaders may outlive the tuner: they hold it weakly
            for loader in loaders:  # as Lightning processed them (a distributed sampler injected, say)
                _lightning.create_iterators_apart(loader, resets, self._loading)
                self._patched.add(loader)
        self._user_new = False
        if self.state.tuner_changed_workers():  # the count is the tuner's, and measured
            for loader in loaders:
                _lightning.quiet_worker_check(loader)
        self.probe.loader_requested()

    def _after_reset(self) -> None:
        """Guard the pass's iterator (:class:`PassGuard`), and draw the base seeds the user's loaders would have
        drawn (see the module's docstring)."""
        loaders = _lightning.loop_loaders(self.loop)
        self._pass_loader = loaders[0] if len(loaders) == 1 and isinstance(loaders[0], DataLoader) else None
        iterator = _lightning.loop_iterator(self.loop)
        if self._pass_loader is not None and iterator is not None:
            _lightning.replace_loop_iterator(self.loop, PassGuard(iterator, self._recover))
        draws, self._draws = self._draws, []
        for loader in draws:
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)

    # --- the loop's events ----------------------------------------------------------------------------------
    def pass_started(self, trainer: "pl.Trainer", budget: Budget, distributed: bool) -> None:
        """A pass begins, its decisions within ``budget``; on one process (not ``distributed``: every rank would
        have to switch at the same batch) it may switch inside where its loader allows (:meth:`_can_switch_inside`)."""
        self._done, self._pending, self._stale, self.pass_budget = 0, None, False, self._per_loader(budget)
        self._in_pass = not distributed and self._can_switch_inside()
        if self._counting:
            self.probe.epoch_started(self._pass_batches())

    def _pass_batches(self) -> float:
        return float(sum(b for b in getattr(self.loop, "max_batches", []) if not math.isinf(b)))

    def _can_switch_inside(self) -> bool:
        """Whether the running pass can go on from its batch on another loader: a map-style dataset served in order,
        a sampler that draws nothing (the rest of the pass is the same batches), a loader the tuner may rebuild."""
        loader, guard = self._pass_loader, _lightning.loop_iterator(self.loop)
        if loader is None or not isinstance(guard, PassGuard) or not self.state.tuning:
            return False
        return self._resumable(loader, guard.inner)

    @staticmethod
    def _resumable(loader: DataLoader, iterator: Any) -> bool:
        """Whether a pass over ``loader`` can go on from its batch on another loader (:meth:`_can_switch_inside`)."""
        plain = not isinstance(loader.dataset, IterableDataset) and _draws_nothing(loader)
        return plain and _lightning.in_order(iterator)

    def _fetch_ended(self) -> None:
        self.probe.fetch_ended()
        if self._reset_at is not None:  # the pass's first fetch
            self._first_wait_s = self.probe.clock() - self._fetch_at

    def batch_started(self) -> None:
        if self._reset_at is not None:  # the pass's first batch arrived
            self._filled(self.probe.clock() - self._reset_at)
        if self._counting:
            self.probe.step_started()

    def batch_ended(self, batch: Any, trainer: "pl.Trainer", left: Callable[[], int | None]) -> None:
        """A step ended; inside a pass that may switch, judge the window once it has its steps or can be judged
        early, over the rest of the pass and the ``left()`` passes after it."""
        if not self._counting:
            return
        self.probe.step_ended(batch, details=not self.state.done)
        self._done += 1
        if (times := self._stop_timing()) is not None:  # the start-up batch, loaded in this process
            self.probe.startup_samples(times)
        if not (self._in_pass and self.state.tuning and self.pass_budget is not None) or self._stale:
            return
        now = self.probe.peek()
        if now.steps < self.window_steps and not self.state.judge_early(now, self.pass_budget):
            return
        rest = self._pass_batches() - self._done
        passes = left()
        remaining = None if passes is None else int(rest + passes * self._pass_batches())
        stats = self.probe.close()
        decision = self.state.decide(stats, self.pass_budget, remaining)
        change = self.state.apply(decision, stats, self.pass_budget, self._step(trainer))
        self._decided(decision, trainer)
        self._aim(trainer)
        if change is not None and change.settings != self.state.current:
            if rest > 1:  # one more is fetched already
                self._log(trainer)  # the steps so far ran on the running config: logged under it
                self._pending = change.settings
            else:  # the pass ends on the running config: its last steps are no window of the target's
                self._stale = True

    def _filled(self, wait_s: float) -> None:
        """The pass's first batch arrived ``wait_s`` after its iterator was requested: what its loading takes from
        the start (:attr:`fill_s`) where the pass began in the open or began early and its first fetch still waited;
        at most the time since the early start where that fetch did not wait."""
        ahead, self._ahead, self._reset_at = self._ahead, None, None
        if ahead is None:
            self.fill_s = wait_s
            return
        since = self.probe.clock() - ahead[0]  # the workers began then
        if self._first_wait_s > 1e-3:  # and the first fetch still waited: the batch took that long
            self.fill_s = since
        elif self.fill_s is not None:  # it was ready: it took that long at most
            self.fill_s = min(self.fill_s, since)

    def start_ahead(self, trainer: "pl.Trainer", steps: int | None, step_s: float) -> None:
        """The next pass begins after ``steps`` more training steps of about ``step_s`` each (``None``: unknown): where
        its first batches (:attr:`fill_s` to load, with a margin of :data:`AHEAD`) would arrive after that, begin
        the pass now on its loader's persistent workers, where its sampler draws nothing (see the module's
        docstring)."""
        if self._ahead is not None or steps is None or steps < 1 or self.fill_s is None or step_s <= 0:
            return
        if steps > math.ceil(AHEAD * self.fill_s / step_s):
            return
        loaders = _lightning.loop_loaders(self.loop)
        if len(loaders) != 1 or not isinstance(loaders[0], DataLoader) or not _draws_nothing(loaders[0]):
            return
        if _lightning.loop_reloads_next(self.loop):  # the pass asks for a new loader
            return
        epoch = _lightning.validation_epoch(trainer)
        if _lightning.reset_ahead(loaders[0], epoch):
            self._ahead = (self.probe.clock(), epoch, weakref.ref(loaders[0]))
            self.started_ahead += 1

    def _before_fetch(self) -> None:
        if self._pending is not None:
            self._switch_inside(self._pending)
        self._fetch_at = self.probe.clock()
        self.probe.fetch_started()
        guard = _lightning.loop_iterator(self.loop)
        second = self._stop_timing() is not None  # a second fetch before the step ended: the times are no one batch's
        if not second and self._in_pass and self.probe.startup_next and isinstance(guard, PassGuard):
            # at 0 workers, sample by sample: the pass's first window can then be judged on its start-up step alone
            # (`windows.steady_from_the_start`), as the train loader's is
            self._sample_times = _lightning.time_samples(guard.inner, self.probe.clock)

    def _stop_timing(self) -> list[float] | None:
        """Stop timing samples (see ``_lightning.time_samples``); the times taken, or ``None`` when none was timing."""
        timing, self._sample_times = self._sample_times, None
        return None if timing is None else timing.finish()

    def _switch_inside(self, settings: LoaderSettings) -> None:
        """Go on from the batch the pass reached on a loader built with ``settings``."""
        self._pending = None
        guard = _lightning.loop_iterator(self.loop)
        if isinstance(guard, PassGuard):
            self._go_on(guard, settings)

    def _go_on(self, guard: PassGuard, settings: LoaderSettings) -> bool:
        """The pass goes on from its batch on a loader built with ``settings``: its batch sampler leaves out the
        batches the running iterator yielded (those the loop took, and the one its fetcher holds), the first time it
        is iterated only; in ``fit`` it serves the next passes too (its persistent workers carry over). False where
        it could not be built (the loader is measured only from then on)."""
        old, iterator = self._pass_loader, guard.inner
        if old is None:
            return False
        taken = _lightning.batches_yielded(iterator)
        batches = SkipOnce(old.batch_sampler, taken)
        overrides = {"batch_sampler": batches, "batch_size": 1, "shuffle": False, "sampler": None, "drop_last": False}
        keeps = self.trainer is not None and self.trainer.state.fn == "fit" and self.name == "val"
        if not keeps:  # a run of its own: this pass is its last, and nothing would stop persistent workers after it
            overrides["persistent_workers"] = False
        # from the user's loader: Lightning's own rebuild of it (the prediction loop's) may not be rebuilt again
        user = self._user_loader if isinstance(self._user_loader, DataLoader) else old
        try:
            new = self._build(user, settings, **overrides)
        except _lightning.NotRebuildableError as ex:
            self._measure_only(f"it cannot be rebuilt inside a pass ({ex})")
            return False
        # the user's running iterator drew its base seed already
        started = self.probe.build_loader(lambda: apart_from_global(new, lambda: iter(new)))
        _lightning.shutdown_iterator(iterator)
        if keeps:  # the old loader's persistent workers are not needed again
            _lightning.shutdown_workers(old)
        guard.inner = started
        if keeps:
            _lightning.replace_loop_iterator(self.loop, guard, new)
        self._pass_loader = new
        self.state.current = settings
        self.probe.rebuilt_in_fetch()
        self.probe.loader_built(self.state.current.num_workers)
        return True

    def _recover(self, error: BaseException, guard: PassGuard) -> bool:
        """A worker of the pass's loader died: record its config as failed, and go on from the batch the pass reached
        on the fallback config (no batch lost or repeated). False (the error propagates) for any other error, where
        the pass cannot go on from its batch, or past the recoveries allowed."""
        from lightning_dltune.switching.switch import error_summary, is_worker_death

        iterator, loader, budget = guard.inner, self._pass_loader, self.pass_budget or self.budget
        failed, trainer = self.state.current, self.trainer
        if not is_worker_death(error, _lightning.worker_died(iterator)) or loader is None or budget is None:
            return False
        if failed is None or trainer is None or not self._resumable(loader, iterator):
            return False
        if stopped_by_watch(error) and self._fork_restarts < MAX_FORK_RESTARTS:
            self.probe.leave_out_fetch()  # the wait for the hung worker, not the restart's start-up
            if not self._go_on(guard, failed):
                return False
            self._fork_restarts += 1  # a worker hung in its fork says nothing of the settings: the same again
            warn_once(
                f"eval-{self.name}-fork-restart-{self._fork_restarts}",
                f"DataLoaderTuner: a {self.name} loader worker hung in its fork and was stopped; started the loader "
                f"again on {failed.describe()} from the batch the pass had reached: no sample lost or repeated.",
                every_rank=True,
            )
            return True
        why = f"a DataLoader worker died: {error_summary(error)}"
        distributed = trainer.world_size > 1  # the other ranks learn it at the pass's end
        fallback = self.state.fail(WindowStats(), why, budget, self._step(trainer), agree_later=distributed)
        if fallback is None or not self._go_on(guard, fallback):
            return False
        warn_once(
            f"eval-{self.name}-fallback-{self.state.recoveries}",
            f"DataLoaderTuner: {why}. Rebuilt the {self.name} loader with {fallback.describe()} (was "
            f"{failed.describe()}) and went on from the batch the pass had reached: no sample lost or repeated.",
            every_rank=True,
        )
        return True

    def pass_ended(self, trainer: "pl.Trainer", budget: Budget, left: int | None, agreement: Any) -> bool:
        """The pass ended, with ``left`` passes to come (``None``: unbounded): log it, and judge the window once it
        has its steps (or no pass is left). ``agreement`` (:class:`~lightning_dltune.agreement.Agreement`) takes the
        decision on every rank alike, a config that failed on one rank included. True when tuning ended here."""
        if not self._counting or self.state.current is None:
            return False
        self._counting = False
        self.passes += 0 if trainer.sanity_checking else 1
        self._log(trainer)
        ended, before = False, self.state.target
        if self.state.done or self._stale:
            self.probe.skip()
        elif self._window_steps(agreement.distributed) >= self.policy.min_steps or left == 0:
            stats = self.probe.close()
            remaining = None if left is None else int(left * self._pass_batches())
            choose = lambda s, b, failed: self.state.decide(s, b, remaining, failed)  # noqa: E731
            stats, shared, decision = agreement.decide(stats, self._per_loader(budget), choose, self.state.unagreed)
            self.state.apply(decision, stats, shared, self._step(trainer), agreement.failures)
            ended = self._decided(decision, trainer)
            self._aim(trainer)
        if not agreement.distributed:
            self._keep_persistent_within(budget)
        if trainer.state.fn == "fit" and left != 0 and self._reload_for_target(before, agreement.distributed):
            self._reload_epoch, self._switch = _lightning.loop_reload_epoch(self.loop), True
            _lightning.request_loop_reload(self.loop)  # the next pass runs on the target
        return ended

    def _reload_for_target(self, before: LoaderSettings | None, distributed: bool) -> bool:
        """Whether the next pass needs a new loader for the target: on one process, where the loader serving is not
        on it; under DDP, where the agreed target changed (Lightning's request waits for every rank, and a rank that
        recovered from a dead worker serves another config than the others)."""
        target, loaders = self.state.target, _lightning.loop_loaders(self.loop)
        if target is None or not loaders or not all(isinstance(loader, DataLoader) for loader in loaders):
            return False
        return target != before if distributed else any(LoaderSettings.from_loader(dl) != target for dl in loaders)

    def _per_loader(self, budget: Budget) -> Budget:
        """``budget`` as one of the loop's loaders sees it: where there are several and their workers are persistent
        (alive together), each gets an equal share of its memory."""
        loaders, settings = len(dataloaders_in(self._user_loader)), self.state.target or self.state.current
        if loaders <= 1 or budget.memory_bytes is None or settings is None or not settings.persistent_workers:
            return budget
        return replace(budget, memory_bytes=budget.memory_bytes / loaders)

    def _keep_persistent_within(self, budget: Budget) -> None:
        """Persistent workers stay alive while the other loops run: where what they hold does not fit the memory the
        other loaders' workers leave (``budget``), the loop's next passes start their workers afresh instead."""
        target, held = self.state.target, self.held_bytes()
        if (
            target is None
            or not target.persistent_workers
            or budget.memory_bytes is None
            or held <= budget.memory_bytes
        ):
            return
        self.state.target = replace(target, persistent_workers=False)
        info_once(
            f"eval-{self.name}-not-persistent",
            f"DataLoaderTuner: the {self.name} loader's persistent workers hold {held / 2**20:.0f} MiB, more than the "
            f"{budget.memory_bytes / 2**20:.0f} MiB the memory budget leaves beside the other loaders' workers: its "
            "workers start afresh at every pass instead.",
        )

    def _window_steps(self, distributed: bool) -> int:
        """Under DDP every rank must close a window at the same pass: count what all ranks count alike (a rank that
        recovered from a dead worker has a start-up step more)."""
        return self.probe.window_batches if distributed else self.probe.window_steps

    def _aim(self, trainer: "pl.Trainer") -> None:
        """Mirror the loop's target onto a mixin DataModule (``loader_kwargs_for``), and so into its checkpoints."""
        datamodule, target = getattr(trainer, "datamodule", None), self.state.target
        if target is not None and isinstance(datamodule, TunableDataModuleMixin):
            datamodule.set_loop_settings(self.name, target)

    def _decided(self, decision: Decision | None, trainer: "pl.Trainer") -> bool:
        """Whether ``decision`` ended the loop's tuning: then the cache learns the result (on rank zero)."""
        ended = decision is not None and self.state.done
        if ended and trainer.is_global_zero:
            self.cache.teach(self.state)
        return ended

    def _step(self, trainer: "pl.Trainer") -> int:
        """The step axis of the loop's metrics: in ``fit`` the ``global_step`` validation ran at; in a run of its
        own, where ``global_step`` stands still, the pass's number (1, 2, ...)."""
        return trainer.global_step if trainer.state.fn == "fit" else self.passes + int(self._counting)

    def _log(self, trainer: "pl.Trainer") -> None:
        """The steps since the last log (a pass, or its part before a switch inside it): into the series (as the
        train loader's), and to every logger under the loop's name."""
        stats = self.probe.take_log()[0]
        if not stats.steps or self.state.current is None:
            return
        step, metrics = self._step(trainer), window_metrics(stats, None, self.state.current)
        self.series.record(step, metrics)
        named = {f"{PREFIX}{self.name}/{k[len(PREFIX) :]}": v for k, v in metrics.items()}
        for logger in trainer.loggers if trainer.is_global_zero else []:
            logger.log_metrics(named, step=step)

    def global_base_seed_draws(self, trainer: "pl.Trainer", epoch: int) -> int:
        """How many base seeds the validation pass after train epoch ``epoch - 1`` draws from the global random state
        in a run without the tuner, where that is all it draws from it: one for each of the user's loaders that
        creates an iterator for it (none has persistent workers, or Lightning asks the hook for new loaders then)
        and has no generator, where no sampler draws. 0 also where that is not known (no validation seen yet, no
        ``check_val_every_n_epoch``)."""
        start, users, every = self.state.start, dataloaders_in(self._user_loader), trainer.check_val_every_n_epoch
        if start is None or not users or every is None or epoch % every or not all(map(_draws_nothing, users)):
            return 0
        reloads = bool(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))  # a new loader: a new iterator
        if start.num_workers and start.persistent_workers and not reloads:
            return 0
        return sum(user.generator is None for user in users)

    # --- results --------------------------------------------------------------------------------------------
    def held_bytes(self) -> float:
        """What this loop's persistent workers hold while other loops run, those of each of its loaders (0 without
        them)."""
        current = self.state.current
        if current is None or not current.persistent_workers or not _lightning.loop_worker_pids(self.loop):
            return 0.0
        alive = sum(map(_lightning.will_reuse_iterator, _lightning.loop_loaders(self.loop)))
        return max(1, alive) * self.probe.held_bytes(current)

    def summary(self) -> str:
        return f"[{self.name}] {self.state.headline()}\n{summary_table(self.state.trials, self.state.result)}"

    def report(self, budget: Budget | None) -> dict[str, Any]:
        """The loop's section of the report: the train loader's fields, with its passes."""
        extra = {"passes": self.passes, "settled_step": self.state.settled_step, "started_ahead": self.started_ahead}
        report = build_report(**self.state.report_content(), budget=budget, series=self.series, extra=extra)
        report.pop("version")
        return report


def _weak_flag(owner: Any, name: str) -> Callable[[], bool]:
    """``owner.name``, read through a weak reference (``False`` once ``owner`` is gone)."""
    ref = weakref.ref(owner)
    return lambda: bool(getattr(ref(), name, False))


def dataloaders_in(loaders: Any) -> list[DataLoader]:
    """The ``DataLoader``s a loader hook returned: one, or a list, tuple or dict of them (``[]`` for anything else)."""
    found = list(loaders.values()) if isinstance(loaders, dict) else loaders
    found = list(found) if isinstance(found, (list, tuple)) else [found]
    return found if found and all(isinstance(loader, DataLoader) for loader in found) else []


def with_each_dataloader(loaders: Any, build: Callable[[DataLoader], DataLoader]) -> Any:
    """``loaders`` (see :func:`dataloaders_in`) with each ``DataLoader`` replaced by ``build(it)``."""
    if isinstance(loaders, dict):
        return {key: build(loader) for key, loader in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        built = [build(loader) for loader in loaders]
        return type(loaders)(*built) if hasattr(loaders, "_fields") else type(loaders)(built)  # a namedtuple too
    return build(loaders)


class EvalLoaders:
    """One :class:`EvalTuner` per evaluation loop in ``loops``, and the hooks that reach the running one."""

    def __init__(
        self,
        loops: Sequence[str],
        policy: Policy,
        observe_only: bool = False,
        tune_iterable: bool | str = "auto",
        cache: Any = False,
        limits: dict[str, Any] | None = None,
    ) -> None:
        self.tuners = {name: EvalTuner(name, policy, observe_only, tune_iterable, cache, limits) for name in loops}
        self.running: EvalTuner | None = None
        self.budget: Budget | None = None
        self.agreement: Any = None
        self.train_held: Callable[[], float] = lambda: 0.0
        self.verbose = True
        self._train_ends: list[float] = []  # when the last training steps ended (their spacing: a step's time)

    def install(
        self,
        trainer: "pl.Trainer",
        stage: str,
        budget: Budget,
        agreement: Any,
        train_held: Callable[[], float] = lambda: 0.0,
        verbose: bool = True,
        around: tuple[Callable[[], None], Callable[[], None]] = (lambda: None, lambda: None),
    ) -> None:
        """``stage`` begins: ``fit`` runs the validation loop, ``validate`` too; ``test`` and ``predict`` theirs.
        ``agreement``: the run's :class:`~lightning_dltune.agreement.Agreement`; ``train_held()``: what the train
        loader's workers hold (alive during validation in ``fit``); ``verbose``: print a loop's summary when its
        tuning ends; ``around``: called as each of the loop's runs begins and ends (the train loader's measurement
        pauses for all of validation, its set-up before ``on_validation_start`` too)."""
        name = {"fit": "val", "validate": "val"}.get(stage, stage)
        self.restore()
        self.budget, self.agreement, self.train_held, self.verbose = budget, agreement, train_held, verbose
        self._train_ends = []
        self.running = self.tuners.get(name)
        if self.running is not None:
            self.running.around = around
            self.running.install(trainer, budget, agreement)

    def restore(self, stop_workers: bool = False) -> None:
        if self.running is not None:
            if stop_workers:
                self.running.shutdown()
            self.running.restore()
        self.running = None

    def _now(self, trainer: "pl.Trainer") -> EvalTuner | None:
        tuner = self.running
        return tuner if tuner is not None and loop_name(trainer) == tuner.name else None

    def pass_started(self, trainer: "pl.Trainer") -> None:
        if (tuner := self._now(trainer)) is not None and self.budget is not None:
            tuner.pass_started(trainer, beside(self.budget, self._held_beside(tuner, trainer)), self.distributed)

    def _held_beside(self, tuner: EvalTuner, trainer: "pl.Trainer") -> float:
        """What the other loaders' workers hold while ``tuner``'s pass runs (the train loader's, in ``fit``)."""
        train = self.train_held() if trainer.state.fn == "fit" else 0.0
        return sum(t.held_bytes() for t in self.tuners.values() if t is not tuner) + train

    @property
    def distributed(self) -> bool:
        return self.agreement is not None and self.agreement.distributed

    def _left(self, trainer: "pl.Trainer") -> int | None:
        """Passes of the running loop after this one: in ``fit``, as many as validation runs; else none."""
        return passes_left(trainer) if trainer.state.fn == "fit" else 0

    def batch_started(self, trainer: "pl.Trainer") -> None:
        if (tuner := self._now(trainer)) is not None:
            tuner.batch_started()

    def batch_ended(self, trainer: "pl.Trainer", batch: Any) -> None:
        if (tuner := self._now(trainer)) is not None:
            tuner.batch_ended(batch, trainer, lambda: self._left(trainer))

    def pass_ended(self, trainer: "pl.Trainer") -> None:
        """Judge the running pass, within the memory the other loaders' workers leave; in ``fit`` with the passes
        left, else as the loop's only one."""
        tuner = self._now(trainer)
        if tuner is None or self.budget is None:
            return
        budget = beside(self.budget, self._held_beside(tuner, trainer))
        if tuner.pass_ended(trainer, budget, self._left(trainer), self.agreement) and self.verbose:
            rank_zero_info(f"DataLoaderTuner {tuner.summary()}\nDiagnosis: {tuner.state.diagnosis}")

    def train_batch_ended(self, trainer: "pl.Trainer") -> None:
        """A training step ended in ``fit``: the validation loader may begin its next pass now
        (:meth:`EvalTuner.start_ahead`), given how many steps are left before it and the median of the last steps'
        spacing (a validation pass between two of them is an outlier the median leaves out)."""
        tuner = self.running
        if tuner is None or tuner.name != "val" or trainer.state.fn != "fit":
            return
        self._train_ends = [*self._train_ends[-8:], tuner.probe.clock()]
        spacing = sorted(b - a for a, b in itertools.pairwise(self._train_ends))
        if spacing:
            tuner.start_ahead(trainer, steps_to_validation(trainer), spacing[len(spacing) // 2])

    def draws_before(self, generator: torch.Generator, epoch: int) -> None:
        """Make on ``generator`` (a copy of the global random state) what ``fit``'s validation pass between train
        epochs ``epoch - 1`` and ``epoch`` draws from the global state in a run without the tuner (see
        :meth:`EvalTuner.global_base_seed_draws`): seamless epochs draw the next epoch's order ahead from that copy, and
        the epoch's start checks it against the real state, whatever ran."""
        tuner = self.running
        trainer = None if tuner is None else tuner.trainer
        if tuner is None or tuner.name != "val" or trainer is None or trainer.state.fn != "fit":
            return
        for _ in range(tuner.global_base_seed_draws(trainer, epoch)):
            torch.empty((), dtype=torch.int64).random_(generator=generator)

    def held_bytes(self) -> float:
        """What the evaluation loops' persistent workers hold (idle while training runs)."""
        return sum(t.held_bytes() for t in self.tuners.values())

    def report(self, budget: Budget | None) -> dict[str, Any]:
        """Each measured loop's section of the report."""
        return {name: t.report(budget) for name, t in self.tuners.items() if t.passes or t.state.trials}

    def state_dict(self) -> dict[str, Any]:
        return {name: t.state.state_dict() for name, t in self.tuners.items() if t.state.trials}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            if name in self.tuners and isinstance(saved, dict):
                self.tuners[name].state.load_state_dict(saved)


def beside(budget: Budget, held_bytes: float) -> Budget:
    """``budget`` with ``held_bytes`` (workers of another loader, alive meanwhile) taken from its memory."""
    if budget.memory_bytes is None or held_bytes <= 0:
        return budget
    return replace(budget, memory_bytes=max(1.0, budget.memory_bytes - held_bytes))


class EvalLoopHooks(Callback):
    """The evaluation loops' hooks of :class:`~lightning_dltune.DataLoaderTuner`, forwarded to its ``evals``
    (:class:`EvalLoaders`)."""

    evals: EvalLoaders

    def _pass_started(self, trainer: "pl.Trainer", *args: Any) -> None:
        self.evals.pass_started(trainer)

    def _batch_started(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        self.evals.batch_started(trainer)

    def _batch_ended(self, trainer: "pl.Trainer", pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self.evals.batch_ended(trainer, batch)

    def _pass_ended(self, trainer: "pl.Trainer", *args: Any) -> None:
        self.evals.pass_ended(trainer)

    on_validation_start = on_test_start = on_predict_start = _pass_started  # type: ignore[assignment]
    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _batch_started
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _batch_ended  # type: ignore[assignment]
    on_validation_end = on_test_end = on_predict_end = _pass_ended  # type: ignore[assignment]
