"""Background starts (#13, part 2): the next loader starts while the running one serves, and takes over at a
hand-over batch, with every batch of the epoch delivered once, in order."""

import gc
import multiprocessing.context
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_in_epoch import EpochIndices, PlainModel, WorkersPerBatch, observed, run
from torch.utils.data import DataLoader, Dataset, RandomSampler, get_worker_info

from lightning_dltune import DataLoaderTuner
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.switching import _lightning
from lightning_dltune.switching.switch import GuardedIterator, GuardHooks, ResumableBatchSampler
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import live_children, make_trainer


class WhoLoads(Dataset):
    """Each sample is its index and the worker count of the loader that loaded it (0: the main process)."""

    def __init__(self, n=96, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        workers = 0 if info is None else info.num_workers
        if i == self.fail_at and workers == 1:
            raise RuntimeError(f"cannot read sample {i}")
        time.sleep(0.002)
        return torch.tensor([i, workers])


def slow_start(worker_id):
    time.sleep(0.6)  # a worker that takes long to start (imports, a remote file system)


def loaders(sampler, dataset, generator=None, new_init=None):
    old = DataLoader(dataset, batch_sampler=sampler, num_workers=1, prefetch_factor=2, generator=generator)
    new = DataLoader(dataset, batch_sampler=sampler, num_workers=2, worker_init_fn=new_init, generator=generator)
    return old, new


def served(batches):
    """(indices in the order delivered, the worker count of the loader that served each batch)."""
    indices = [int(i) for b in batches for i in b[:, 0]]
    by = [int(b[0, 1]) for b in batches]
    return indices, by


def shut(*its):
    for it in its:
        stop = getattr(it, "_shutdown_workers", None)
        if stop is not None:
            stop()


def switching(old, new, at, lead, **kwargs):
    """A guard over ``old`` that switches to ``new`` at batch ``at``, in the background with ``lead``."""
    hooks = GuardHooks(
        replace=lambda loader: new if loader is old and guard.position == at else None,
        close=shut,
        ahead=lambda loader: (lead, len(old.batch_sampler)),
        **kwargs,
    )
    guard = GuardedIterator(old, iter(old), hooks)
    return guard


def test_an_iteration_cut_at_a_batch_yields_nothing_from_there_and_another_resumes_there():
    sampler = ResumableBatchSampler(range(40), 4, False)
    old = iter(sampler)
    first = [next(old) for _ in range(3)]
    live = sampler.live
    assert live.next == 3 and not sampler.cut(live, 2)  # batch 2 was handed out already
    assert sampler.cut(live, 6) and not sampler.cut(live, 11)  # past the epoch's end
    sampler.resume_at(6)
    new = list(iter(sampler))
    assert first + list(old) + new == [list(range(i, i + 4)) for i in range(0, 40, 4)]


@pytest.mark.parametrize("new_init", [None, slow_start], ids=["ready-in-time", "slow-to-start"])
def test_a_background_start_hands_over_at_its_batch_with_the_exact_order(new_init):
    g = torch.Generator().manual_seed(5)
    dataset = WhoLoads()
    sampler = ResumableBatchSampler(RandomSampler(dataset, generator=g), 8, False)
    old, new = loaders(sampler, dataset, g, new_init)
    starts = []
    guard = switching(old, new, 2, 3, overlap=lambda loader: starts.append((guard.position, guard.next[2])))
    indices, by = served(list(guard))
    expected = torch.Generator().manual_seed(5)
    torch.empty((), dtype=torch.int64).random_(generator=expected)  # the first iterator's base seed
    assert indices == torch.randperm(len(dataset), generator=expected).tolist()  # each once, in the epoch's order

    # the old loader serves 3 batches from the loop's position (it had been handed batches 2 and 3 already)
    assert starts == [(2, 5)] and guard.handed_over == 1 and guard.loader is new
    assert by == [1] * 5 + [2] * (len(sampler) - 5)
    shut(guard.inner)


def test_the_hand_over_never_comes_before_the_batches_the_old_workers_were_handed():
    dataset = WhoLoads()
    sampler = ResumableBatchSampler(range(len(dataset)), 8, False)
    old, new = loaders(sampler, dataset)
    guard = switching(old, new, 2, 0)  # no lead: the batches already in flight are served first
    indices, by = served(list(guard))
    assert indices == list(range(len(dataset)))
    assert by == [1] * 4 + [2] * (len(sampler) - 4) and guard.handed_over == 1
    shut(guard.inner)


class ForkFailsAt(multiprocessing.context.ForkContext):
    """A fork context whose ``n``-th process start fails as fork does when the system is out of processes."""

    def __init__(self, n):
        starts = [0]

        class Process(multiprocessing.context.ForkProcess):
            def start(self):
                starts[0] += 1
                if starts[0] == n:
                    raise OSError(11, "Resource temporarily unavailable")
                super().start()

        self.Process = Process


def test_a_switch_whose_workers_cannot_all_start_serves_every_batch_on_those_that_did_and_says_so():
    sampler = ResumableBatchSampler(range(40), 2, False)
    old = DataLoader(list(range(40)), batch_sampler=sampler, num_workers=2)
    new = DataLoader(list(range(40)), batch_sampler=sampler, num_workers=4, multiprocessing_context=ForkFailsAt(3))
    adopted = []
    hooks = GuardHooks(
        replace=lambda loader: new if loader is old and guard.position == 3 else None,
        close=shut,
        adopt=lambda old, new: adopted.append(LoaderSettings.from_loader(new).num_workers),
        iterate=_lightning.iterate_growing,
    )
    guard = GuardedIterator(old, iter(old), hooks)
    batches = [b.tolist() for b in guard]
    assert [i for b in batches for i in b] == list(range(40))  # nothing lost or repeated
    # the new loader runs the 2 workers that started (the 3rd fork failed), and is adopted as such
    assert guard.loader is new and new.num_workers == 2 and len(guard.inner._workers) == 2 and adopted == [2]
    shut(guard.inner)


def test_a_failure_during_the_overlap_stops_the_new_workers_and_recovers_at_the_loop_position():
    dataset = WhoLoads(fail_at=8 * 4)  # batch 4's first sample, when the 1-worker loader loads it
    sampler = ResumableBatchSampler(range(len(dataset)), 8, False)
    old, new = loaders(sampler, dataset)
    fallback = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    recovered = []

    def on_error(error, loader, position):
        recovered.append((position, len(live_children()), "cannot read sample 32" in str(error)))
        return fallback

    guard = switching(old, new, 1, 4, on_error=on_error)
    indices, by = served(list(guard))
    assert indices == list(range(len(dataset)))  # nothing lost or repeated
    # from batch 1 the old loader was to serve 4 batches, to batch 5, and failed at 4;
    # the new loader's 2 workers were stopped first (the old one's worker is left for the recovery to stop)
    assert recovered == [(4, 1, True)]
    assert guard.next is None and guard.loader is fallback and guard.handed_over == 0
    assert by[:4] == [1] * 4 and set(by[4:]) == {0}
    shut(guard.inner)


class UsersLoader(PlainModel):
    """The user's own loader: ``workers`` persistent workers, or loading in the training process (0)."""

    def __init__(self, *args, generator=None, workers=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator, self.workers = generator, workers

    def train_dataloader(self):
        return DataLoader(
            self.dataset,
            batch_size=8,
            shuffle=True,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
            generator=self.generator,
        )


def fit(tmp_path, tuner, extra=(), generator=None, workers=1, wrap=lambda dataset: dataset, latency_ms=10.0, step_ms=1):
    pl.seed_everything(7, workers=True)
    record = EpochIndices()
    # 80 ms to load a batch against a 1 ms step: one worker is far too few, the tuner goes up at once
    dataset = wrap(SyntheticDataset(length=480, latency_ms=latency_ms))
    model = UsersLoader(dataset, step_ms=step_ms, generator=generator, workers=workers)
    make_trainer(tmp_path, [tuner, record, *extra], max_epochs=2, logger=False).fit(model)
    return record.epochs


def test_a_tuned_fit_jumps_from_0_workers_at_once_on_the_exact_order(tmp_path):
    """Default arguments: the jump from the user's 0 workers takes over at once (its workers start one by one, each
    loading as it has started: see test_lightning_private), and the epochs are exactly those of an observe-only run."""
    # the reference never switches: its samples load and its steps run at once (see test_in_epoch's `observed`)
    reference = fit(tmp_path / "a", DataLoaderTuner(observe_only=True), workers=0, latency_ms=0.0, step_ms=0)
    tuner, workers = DataLoaderTuner(), WorkersPerBatch()
    tuned = fit(tmp_path / "b", tuner, [workers], workers=0)
    assert tuned == reference
    assert tuner.trials[0].settings.num_workers == 0 and tuner.switcher.background_starts == 0, tuner.trials
    first = [w for e, w in workers.seen if e == 0]
    assert first[0] == 0 and max(first) > 1


def test_a_tuned_fit_adds_workers_beside_the_users_one_on_the_exact_order(tmp_path):
    """Default arguments: the user's loader with one worker is rebuilt around the tuner's batch sampler (a new object:
    the user's own is left as it was), so a switch to more workers starts only the added ones beside it."""
    # the reference never switches: its samples load and its steps run at once (see test_in_epoch's `observed`)
    reference = fit(tmp_path / "a", DataLoaderTuner(observe_only=True), latency_ms=0.0, step_ms=0)
    tuner, workers = DataLoaderTuner(), WorkersPerBatch()
    tuned = fit(tmp_path / "b", tuner, [workers])
    assert tuned == reference
    assert tuner.switcher.grown >= 1 and tuner.switcher.background_starts == 0, tuner.trials
    first = [w for e, w in workers.seen if e == 0]
    assert first[0] == 1 and max(first) > 1


class StopWhileStarting(pl.Callback):
    """Ends the fit (as a time limit or early stopping would) while a background start has not taken over."""

    def __init__(self, tuner):
        self.tuner, self.stopped_at = tuner, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.stopped_at is None and self.tuner.switcher.starting is not None:
            self.stopped_at = batch_idx
            trainer.should_stop = True


def test_a_fit_that_ends_before_the_hand_over_leaves_no_worker_behind(tmp_path):
    """The stopped start's loader is persistent and, with seamless epochs, held in a reference cycle: only
    stopping it (not freeing it) ends its workers, so the garbage collector is kept out of the check. A MapDataPipe
    gets no workers added in place (`_lightning.can_add_workers`): its switch from 1 worker starts behind it."""
    from torch.utils.data.datapipes.map import SequenceWrapper

    tuner = DataLoaderTuner()
    stop = StopWhileStarting(tuner)
    gc.disable()
    try:
        fit(tmp_path, tuner, [stop], generator=torch.Generator().manual_seed(3), wrap=SequenceWrapper)
        assert stop.stopped_at is not None, tuner.trials  # it did stop during a background start
        assert tuner.switcher.starting is None and tuner.state.current.num_workers == 1  # never took over
        assert live_children() == []
    finally:
        gc.enable()


class ChangeAt(pl.Callback):
    """Asks the tuner's switcher for ``change(current settings)`` at batch ``at`` of the first epoch (as a decision
    would), and records the workers serving then and at the next epoch's first batch, and the loader's depth."""

    def __init__(self, tuner, at, change=lambda current: current.with_prefetch(4), now=True):
        self.tuner, self.at, self.change, self.now = tuner, at, change, now
        self.pids: list[list[int]] = []
        self.depth: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = self.tuner.switcher._guarded
        if (trainer.current_epoch, batch_idx) in ((0, self.at), (1, 0)):
            self.pids.append([w.pid for w in getattr(guard.inner, "_workers", [])])
            self.depth.append(trainer.train_dataloader.prefetch_factor)
        if (trainer.current_epoch, batch_idx) == (0, self.at):
            target = self.change(self.tuner.state.current)
            self.tuner.state.target = target
            self.tuner.switcher.switch(target, now=self.now, last_epoch=False)


def test_a_prefetch_change_is_made_on_the_running_workers_and_keeps_the_exact_order(tmp_path):
    reference = observed(tmp_path / "a", "mixin", epochs=2, workers=2)
    # max_trials=1: tuning settles on the user's config after the first window, so only this change is made
    tuner = DataLoaderTuner(max_trials=1)
    deepen = ChangeAt(tuner, at=20)  # a deeper prefetch
    tuned = run(tmp_path / "b", tuner, "mixin", epochs=2, workers=2, extra=[deepen])
    assert tuned == reference
    assert tuner.switcher.in_place == 1 and tuner.state.current.prefetch_factor == 4
    assert deepen.depth == [2, 4]  # the loader says so at the next epoch
    assert deepen.pids[0] == deepen.pids[1]  # the same worker processes: nothing restarted


def test_workers_are_added_beside_the_running_ones_and_keep_the_exact_order(tmp_path):
    reference = observed(tmp_path / "a", "mixin", epochs=2, workers=2)
    # max_trials=1: tuning settles on the user's config after the first window, so only this change is made
    tuner = DataLoaderTuner(max_trials=1)
    add = ChangeAt(tuner, at=20, change=lambda current: current.with_workers(4))  # two more workers
    tuned = run(tmp_path / "b", tuner, "mixin", epochs=2, workers=2, extra=[add])
    assert tuned == reference
    assert tuner.switcher.grown == 1 and tuner.state.current.num_workers == 4
    running, next_epoch = add.pids
    assert len(running) == 2 and next_epoch[:2] == running and len(set(next_epoch)) == 4  # two started, none stopped


class FailsOnAddedWorkers(SyntheticDataset):
    """Samples that only the first two workers can load (as a worker_init_fn or a per-worker resource might)."""

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None and info.id >= 2:
            raise RuntimeError(f"worker {info.id} cannot open the storage")
        return super().__getitem__(i)


def test_added_workers_that_fail_in_their_first_batches_fall_back_on_the_exact_order(tmp_path):
    reference = observed(tmp_path / "a", "mixin", epochs=2, workers=2)
    pl.seed_everything(7, workers=True)
    tuner, record = DataLoaderTuner(max_trials=1), EpochIndices()  # max_trials=1: only this change is made
    add = ChangeAt(tuner, at=20, change=lambda current: current.with_workers(4))  # two more workers
    dm = SyntheticDataModule(FailsOnAddedWorkers(length=480, latency_ms=2.0), batch_size=8, num_workers=2)
    trainer = make_trainer(tmp_path / "b", [tuner, record, add], max_epochs=2, logger=False)
    with pytest.warns(UserWarning, match="workers failed to start.*no sample lost or repeated"):
        trainer.fit(SimulatedModel(step_ms=1), datamodule=dm)
    assert record.epochs == reference
    assert tuner.switcher.grown == 1 and tuner.state.current.num_workers == 2  # grown, failed, fell back
    assert any(t.failed and t.settings.num_workers == 4 for t in tuner.trials)


@pytest.fixture(scope="module")
def switch_to_0(tmp_path_factory):
    """One fit switched from the user's 2 workers to 0 in its first epoch, and its reference: the two tests below
    read the same run. It runs inside the first test that asks for it (not at the module's set-up), so that test's
    own cache file and its check for leftover workers and threads (conftest.py) cover it."""
    runs = []

    def switched():
        if not runs:
            tmp_path = tmp_path_factory.mktemp("switch_to_0")
            reference = observed(tmp_path / "a", "mixin", epochs=2, workers=2)
            tuner = DataLoaderTuner(max_trials=1)  # max_trials=1: only this change is made
            zero = ChangeAt(tuner, at=20, change=lambda current: LoaderSettings())  # as settling on a start at 0 would
            tuned = run(tmp_path / "b", tuner, "mixin", epochs=2, workers=2, extra=[zero])
            runs.append((tuner, tuned, reference))
        return runs[0]

    return switched


def test_a_switch_to_0_workers_from_a_loader_changed_in_place_builds_a_new_loader(switch_to_0):
    tuner, tuned, reference = switch_to_0()  # from a loader changed in place (it failed an assertion)
    assert tuned[0] == reference[0]  # the epoch of the switch: the exact order
    assert all(sorted(epoch) == list(range(480)) for epoch in tuned)  # every epoch: each sample once
    assert tuner.state.current.num_workers == 0 and tuner.switcher.in_place == tuner.switcher.grown == 0


def test_after_a_switch_from_the_users_workers_to_0_the_next_epoch_keeps_the_untuned_order(switch_to_0):
    # the user's persistent workers draw no base seed after the first epoch, where a new 0-worker iterator would
    _, tuned, reference = switch_to_0()
    assert tuned[1] == reference[1]


def fit_to(root, tuner, epochs, extra=(), ckpt_path=None, latency_ms=2.0, step_ms=1):
    """Each epoch's indices of a fit of the users' 2 persistent workers that checkpoints at each epoch's end."""
    pl.seed_everything(7, workers=True)
    record, ckpt = EpochIndices(), ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1)
    dm = SyntheticDataModule(SyntheticDataset(length=480, latency_ms=latency_ms), batch_size=8, num_workers=2)
    callbacks = [tuner, record, ckpt, *extra]
    trainer = make_trainer(root, callbacks, max_epochs=epochs, logger=False, enable_checkpointing=True)
    trainer.fit(SimulatedModel(step_ms=step_ms), datamodule=dm, ckpt_path=ckpt_path)
    return record.epochs, trainer


def test_a_fit_resumed_on_0_workers_from_the_users_persistent_ones_trains_the_untuned_order(tmp_path):
    # the resumed fit's first epoch creates its loader's iterator, as the untuned resumed fit does: it draws a base
    # seed. Every tuner here has its cache off: a resumed fit must go on from its checkpoint, not from the cache the
    # fit before it filled (a resume with the default cache: tests/test_loader_libraries.py)
    observing = lambda: DataLoaderTuner(observe_only=True, cache=False)  # noqa: E731
    # the references never switch: their samples load and their steps run at once (see test_in_epoch's `observed`)
    at_once = {"latency_ms": 0.0, "step_ms": 0}
    fit_to(tmp_path / "a", observing(), epochs=2, **at_once)
    reference, _ = fit_to(tmp_path / "r", observing(), epochs=3, ckpt_path=tmp_path / "a/ckpt/last.ckpt", **at_once)
    # and without the tuner at all (its loader is served: seamless)
    fit_to(tmp_path / "p", pl.Callback(), epochs=2, **at_once)
    without, _ = fit_to(tmp_path / "q", pl.Callback(), epochs=3, ckpt_path=tmp_path / "p/ckpt/last.ckpt", **at_once)
    assert without == reference
    tuner = DataLoaderTuner(max_trials=1, cache=False)  # max_trials=1: only this change is made

    def settle_on_0(current):
        tuner.state.best_settings = LoaderSettings().to_loader_kwargs()  # as a settle decision records it
        return LoaderSettings()

    fit_to(tmp_path / "b", tuner, 2, [ChangeAt(tuner, at=59, change=settle_on_0, now=False)])
    assert tuner.state.current.num_workers == 0
    resumed = DataLoaderTuner(cache=False)  # cache off: see above (the checkpoint, not the cache, says 0 workers)
    tuned, trainer = fit_to(tmp_path / "c", resumed, 3, ckpt_path=tmp_path / "b/ckpt/last.ckpt")
    assert trainer.train_dataloader.num_workers == 0  # resumed on the tuner's settings
    assert len(tuned) == len(reference) == 1 and tuned == reference


def test_a_switch_from_the_users_workers_to_0_between_epochs_keeps_every_later_epochs_untuned_order(tmp_path):
    reference = observed(tmp_path / "a", "mixin", epochs=3, workers=2)
    tuner = DataLoaderTuner(max_trials=1)  # max_trials=1: only this change is made
    # at the first epoch's last batch, for the next epoch (the loader is reloaded between them)
    zero = ChangeAt(tuner, at=59, change=lambda current: LoaderSettings(), now=False)
    tuned = run(tmp_path / "b", tuner, "mixin", epochs=3, workers=2, extra=[zero])
    assert tuner.state.current.num_workers == 0
    assert tuned == reference


class Counting(SyntheticDataModule):
    """Counts the requests for its train loader."""

    requests = 0

    def train_dataloader(self):
        self.requests += 1
        return super().train_dataloader()


class ReloadForTheOthers(pl.Callback):
    """At the end of epoch 1, asks the switcher for the reload every rank makes under DDP when another rank's count
    changes (``switch(..., everywhere=True)`` on this rank's own settings, as ``Agreement.own_change`` returns them);
    the tuner's worker processes at each epoch's start."""

    def __init__(self, tuner):
        self.tuner, self.pids = tuner, []

    def on_train_epoch_start(self, trainer, pl_module):
        self.pids.append(sorted(self.tuner.switcher.worker_pids()))

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            switcher = self.tuner.switcher
            switcher.switch(self.tuner.state.current, now=False, last_epoch=False, everywhere=True)


def test_a_rank_whose_settings_stay_goes_on_with_its_workers_through_the_reload_the_other_ranks_make(tmp_path):
    # one process: the callback asks for the reload a DDP rank makes for the others (test_ddp checks it across ranks,
    # where a rank stays only some runs); observe_only: no decision of the tuner's moves the loader meanwhile
    tuner, orders = DataLoaderTuner(observe_only=True), {}
    reload = ReloadForTheOthers(tuner)
    for name, callbacks in (("tuned", [reload, tuner]), ("untuned", [])):
        dm = Counting(SyntheticDataset(length=64), batch_size=16, num_workers=2, seed=3)
        epochs = EpochIndices()
        make_trainer(tmp_path / name, [*callbacks, epochs], max_epochs=3, logger=False).fit(
            SimulatedModel(step_ms=1), datamodule=dm
        )
        orders[name] = (epochs.epochs, dm.requests)
    assert orders["tuned"][1] == 2  # the reload was made: the user's hook was asked again
    assert len(reload.pids[1]) == 2 and reload.pids[2] == reload.pids[1]  # the same worker processes went on
    assert orders["tuned"][0] == orders["untuned"][0]  # every epoch trained what the untuned run trained
