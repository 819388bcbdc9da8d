import os
import signal
import time
from itertools import islice, pairwise

import lightning.pytorch as pl
import psutil
import pytest
import torch
from lightning.fabric.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.switching._lightning import recording
from lightning_dltune.switching.switch import RecordedBatches, ResumableBatchSampler, is_worker_death
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import live_children, make_trainer

# ---------------------------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------------------------


def test_same_batches_as_a_plain_batch_sampler_and_resume_continues_the_epoch():
    data = range(23)
    torch.manual_seed(3)
    plain = [list(b) for b in BatchSampler(RandomSampler(data), 5, False)]
    torch.manual_seed(3)
    rbs = ResumableBatchSampler(RandomSampler(data), 5, False)
    assert list(rbs) == plain and len(rbs) == 5
    rbs.resume_at(3)
    assert list(rbs) == plain[3:]
    assert sorted(rbs.epoch_order) == list(range(23))
    assert list(rbs) != plain  # a plain __iter__ starts the next epoch with a new order


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_at_every_position(drop_last):
    rbs = ResumableBatchSampler(range(10), 3, drop_last)
    full = list(rbs)
    for k in range(len(rbs) + 1):
        rbs.resume_at(k)
        assert list(rbs) == full[k:]
    with pytest.raises(ValueError, match=r"`batch` must be in \[0, "):
        rbs.resume_at(len(rbs) + 1)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_draws_from_the_generator_what_the_users_loader_draws(workers):
    # a loader with workers asks its sampler past the epoch's last batch (their prefetch), and a RandomSampler with
    # a generator then draws one more permutation: the next epoch's order depends on it
    def orders(loader):  # as Lightning's loop takes them: it stops at the loader's length
        return [[i for b in islice(loader, len(loader)) for i in b.tolist()] for _ in range(3)]

    kw = dict(num_workers=workers, persistent_workers=workers > 0)
    plain = orders(DataLoader(range(24), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5), **kw))
    g = torch.Generator().manual_seed(5)
    rbs = ResumableBatchSampler(RandomSampler(range(24), generator=g), 4, False, exhaust=workers > 0)
    assert orders(DataLoader(range(24), batch_sampler=rbs, generator=g, **kw)) == plain
    g = torch.Generator().manual_seed(5)
    rbs = ResumableBatchSampler(RandomSampler(range(24), generator=g), 4, False, exhaust=workers == 0)
    assert orders(DataLoader(range(24), batch_sampler=rbs, generator=g, **kw))[1:] != plain[1:]


def test_lightning_can_still_inject_its_distributed_sampler():
    with recording():
        rbs = ResumableBatchSampler(RandomSampler(range(20)), 4, False, exhaust=True)
        dl = DataLoader(list(range(20)), batch_sampler=rbs)
    ddp = _update_dataloader(dl, DistributedSampler(list(range(20)), num_replicas=2, rank=1, shuffle=False))
    assert isinstance(ddp.batch_sampler, ResumableBatchSampler) and ddp.batch_sampler.exhaust
    assert [i for b in ddp.batch_sampler for i in b] == list(range(1, 20, 2))


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_resumable_loader_stays_shuffled_for_lightnings_sampler_injection(tmp_path, shuffle):
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled

    class M(SimulatedModel):
        def train_dataloader(self):
            # a worker: the tuner runs its own batch sampler on such a loader (one without workers serves as the user
            # built it until a setting changes: tests/test_citizen.py)
            return DataLoader(SyntheticDataset(64), 8, shuffle, num_workers=1)

    tuner = DataLoaderTuner(max_trials=1)
    trainer = make_trainer(tmp_path, [tuner], max_epochs=1, logger=False)
    trainer.fit(M(step_ms=0))
    dl = trainer.train_dataloader
    assert isinstance(dl.batch_sampler, ResumableBatchSampler)
    assert _is_dataloader_shuffled(dl) is shuffle


@pytest.mark.parametrize(
    ("message", "death"),
    [
        ("DataLoader worker (pid(s) 123) exited unexpectedly", True),
        ("DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that ...", True),
        ("Caught KeyError in DataLoader worker process 0.", False),
    ],
)
def test_worker_death_is_told_apart_from_a_dataset_error(message, death):
    assert is_worker_death(RuntimeError(message)) is death
    assert not is_worker_death(ValueError(message))


def test_a_broken_pipe_counts_as_a_death_only_when_a_worker_is_dead():
    error = ConnectionResetError(104, "Connection reset by peer")
    assert is_worker_death(error, worker_dead=True)
    assert not is_worker_death(error, worker_dead=False)


# ---------------------------------------------------------------------------------------------------------
# exact sample accounting in a real Trainer
# ---------------------------------------------------------------------------------------------------------


class EpochIndices(pl.Callback):
    def __init__(self):
        self.epochs: list[list[int]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = len(pl_module.seen_indices)

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append(pl_module.seen_indices[self._start :])


class PlainModel(SimulatedModel):
    def __init__(self, dataset, **kwargs):
        super().__init__(**kwargs)
        self.dataset = dataset

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=8, shuffle=True)


def run(tmp_path, tuner, path, epochs=3, workers=0, extra=(), latency_ms=2.0, step_ms=1):
    pl.seed_everything(7, workers=True)
    dataset = SyntheticDataset(length=480, latency_ms=latency_ms)
    record = EpochIndices()
    if path == "mixin":
        model, dm = SimulatedModel(step_ms=step_ms), SyntheticDataModule(dataset, batch_size=8, num_workers=workers)
    else:
        model, dm = PlainModel(dataset, step_ms=step_ms), None
    trainer = make_trainer(tmp_path, [tuner, record, *extra], max_epochs=epochs, logger=False)
    trainer.fit(model, datamodule=dm)
    return record.epochs


def observed(tmp_path, path, **kwargs):
    """The epochs of a run that never switches (an observe-only tuner): the reference a tuned run's orders are
    compared with. Its samples load and its steps run at once: the orders come from the seed and the loader, not
    from how long a sample takes (a ``SyntheticDataset`` sample is the same whenever it is loaded); only the tuned
    run needs the stall, and it keeps the one its test sets."""
    return run(tmp_path, DataLoaderTuner(observe_only=True), path, latency_ms=0.0, step_ms=0, **kwargs)


@pytest.mark.parametrize("path", ["mixin", "plain"])
def test_mid_epoch_switches_train_on_exactly_the_untuned_order(tmp_path, path):
    reference = observed(tmp_path / "a", path)
    # mode="in_epoch", windows of 10: several switches inside each 60-batch epoch, each one a chance to lose or repeat
    # a sample; the default "auto" switches inside such an epoch only once its stall is plain (the test below)
    tuner = DataLoaderTuner(mode="in_epoch", window_steps=10, min_steps=5)
    tuned = run(tmp_path / "b", tuner, path)

    assert len(tuned) == len(reference) == 3
    for epoch, (got, want) in enumerate(zip(tuned, reference, strict=True)):
        assert sorted(got) == list(range(480)), f"epoch {epoch} is not an exact permutation"
        assert got == want, f"epoch {epoch}: order differs from the untuned run"
    # it really switched inside the first epoch (60 batches, windows of 10 steps)
    configs = [t.settings for t in tuner.trials]
    assert len(set(configs)) >= 2 and configs[0].num_workers == 0
    assert sum(t.stats.steps for t in tuner.trials[: len(set(configs))]) < 60


class KillAWorker(pl.Callback):
    def __init__(self, at_batch):
        self.at_batch = at_batch
        self.killed = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.at_batch:
            workers = trainer.train_dataloader._iterator._workers  # this loader's worker processes
            assert self.killed is None and all(psutil.pid_exists(w.pid) for w in workers)
            self.killed = workers[1].pid
            os.kill(self.killed, signal.SIGKILL)


def test_a_killed_worker_is_replaced_and_the_epoch_continues_exactly(tmp_path):
    reference = observed(tmp_path / "a", "mixin", epochs=2, workers=4)
    # mode="in_epoch": the loader gets the resumable batch sampler that lets the epoch go on after the death ("auto"
    # gives it to long or plainly stalled epochs only); max_trials=1: the run stays on the user's 4 workers, which
    # the kill hits
    tuner = DataLoaderTuner(mode="in_epoch", max_trials=1)
    killer = KillAWorker(at_batch=12)
    with pytest.warns(
        DLTuneWarning, match=r"a DataLoader worker died .*continued epoch 0 at batch \d+: no sample lost"
    ):
        tuned = run(tmp_path / "b", tuner, "mixin", epochs=2, workers=4, extra=[killer])
    assert killer.killed is not None
    assert tuned == reference
    failed = [t for t in tuner.trials if t.failed]
    assert failed and failed[0].settings.num_workers == 4 and "worker died" in failed[0].failed
    assert tuner.best_settings["num_workers"] != 4  # a config whose worker died is not chosen again


class WorkersPerBatch(pl.Callback):
    def __init__(self):
        self.seen: list[tuple[int, int]] = []  # (epoch, num_workers of the loader that delivered the batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.current_epoch, trainer.train_dataloader.num_workers))


@pytest.mark.parametrize("mode", ["auto", "epoch"])
def test_a_short_epoch_switches_once_the_stall_is_obvious_unless_told_to_wait(tmp_path, mode):
    reference = observed(tmp_path / "a", "plain", epochs=2)
    tuner, workers = DataLoaderTuner(mode=mode), WorkersPerBatch()
    tuned = run(tmp_path / "b", tuner, "plain", epochs=2, extra=[workers])

    assert tuned == reference  # exact permutations, in the untuned order, even across the switch
    first_epoch = {w for e, w in workers.seen if e == 0}
    assert tuner.trials[0].settings.num_workers == 0
    if mode == "auto":  # 60 batches is a short epoch: still switched after min_steps, at a 94% stall
        assert tuner.trials[0].stats.steps < 20
        assert 0 in first_epoch and max(first_epoch) > 0
    else:
        assert tuner.trials[0].stats.steps == 59  # the whole first epoch but its start-up step
        assert first_epoch == {0}


class OpensLazily(SyntheticDataset):
    """Opens its store on the first sample a process loads (0.5 s); every sample after that is fast."""

    def __getitem__(self, index):
        if not getattr(self, "opened", False):
            time.sleep(0.5)
            self.opened = True
        return super().__getitem__(index)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_first_step_at_0_workers_decides_alone_where_its_samples_show_a_plain_stall(tmp_path, lazy):
    # 16 samples of 20 ms a batch and a 2 ms step: every sample of the first step waits alike, a stall whose model
    # asks for more workers than max_workers: the switch follows that step (not the second), the epoch trained in
    # the untuned order. A store opened on the first sample waits longer still, but the other samples are fast: not
    # judged on that step. The cache's fingerprint loads a few samples in the training process before the first
    # step, which opens the store there: the lazy case turns the cache off to show the first step opening it
    def fit(path, tuner, record, latency_ms=20.0, step_ms=2):
        pl.seed_everything(3)
        data = OpensLazily(480) if lazy else SyntheticDataset(480, latency_ms=latency_ms)
        callbacks = record if isinstance(record, list) else [record]
        trainer = make_trainer(path, [tuner, *callbacks], max_epochs=1, logger=False)
        trainer.fit(SimulatedModel(step_ms=step_ms), datamodule=SyntheticDataModule(data, batch_size=16))

    reference = EpochIndices()
    # the order of a run that never switches, its samples loaded and its steps run at once (see `observed`)
    fit(tmp_path / "a", DataLoaderTuner(observe_only=True), reference, latency_ms=0.0, step_ms=0)
    tuner, workers, record = DataLoaderTuner(cache=not lazy), WorkersPerBatch(), EpochIndices()
    fit(tmp_path / "b", tuner, [record, workers])
    assert record.epochs == reference.epochs
    assert tuner.trials[0].settings.num_workers == 0, described(tuner)
    if lazy:
        assert tuner.trials[0].stats.steps > 1 and workers.seen[2] == (0, 0), described(tuner)
    else:
        assert workers.seen[:2] == [(0, 0), (0, 16)], described(tuner)


def described(tuner):
    return [(t.settings.describe(), t.stats.steps, t.decision) for t in tuner.trials]


def test_a_worker_dying_after_settling_moves_the_result_the_cache_and_the_checkpoint_off_it(tmp_path):
    import json

    cache = tmp_path / "cache.json"
    reference = observed(tmp_path / "a", "mixin", epochs=1, workers=4)
    # one trial: the first window (20 steps) settles on the starting 4 workers; the kill comes after it
    tuner = DataLoaderTuner(mode="in_epoch", max_trials=1, cache=cache)  # as in the test above
    killer = KillAWorker(at_batch=40)
    with pytest.warns(DLTuneWarning, match=r"a DataLoader worker died .*continued epoch 0 at batch \d+"):
        tuned = run(tmp_path / "b", tuner, "mixin", epochs=1, workers=4, extra=[killer])
    assert tuned == reference
    assert tuner.trials[0].decision.startswith("settle on workers=4") and tuner.trials[-1].failed
    assert tuner.best_settings["num_workers"] != 4 and tuner.phase == "settled"
    assert tuner.state_dict()["best_settings"] == tuner.best_settings
    entries = json.loads(cache.read_text())["entries"].values() if cache.exists() else []
    assert all(e["settings"]["num_workers"] != 4 for e in entries)  # the cache does not keep the dead config


class CountWorkersAtStart:
    """A ``worker_init_fn`` that records how many worker processes the trainer has when a worker starts."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, worker_id):
        alive = live_children(psutil.Process(os.getppid()), recursive=False)
        with open(self.path, "a") as fh:
            fh.write(f"{len(alive)}\n")


class ChildrenPerBatch(pl.Callback):
    """At every batch: live worker processes against the tuner's loaders' (the serving one's, and a background
    start's until it takes over)."""

    def __init__(self, tuner):
        self.tuner, self.seen = tuner, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        starting = self.tuner.switcher.starting
        expected = self.tuner.state.current.num_workers + (starting.num_workers if starting else 0)
        self.seen.append((len(live_children()), expected))


def test_an_in_epoch_switch_stops_the_old_workers_when_the_new_ones_take_over(tmp_path):
    """A switch up starts the new workers beside the old ones (a background start), a switch down stops the old
    ones first; either way no worker outlives its loader, also for a non-persistent iterator, which its loader
    does not hold."""
    counts = tmp_path / "counts.txt"

    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(
                SyntheticDataset(length=640, latency_ms=20.0),  # 2 workers stall even on a busy host; a switch pays
                batch_size=8,
                shuffle=True,
                num_workers=2,  # non-persistent: the loader does not hold its iterator
                worker_init_fn=CountWorkersAtStart(counts),
            )

    # mode="in_epoch", windows of 10: the switches happen inside the one epoch, where both worker sets could be alive
    tuner = DataLoaderTuner(mode="in_epoch", window_steps=10, min_steps=5)
    children = ChildrenPerBatch(tuner)
    make_trainer(tmp_path, [tuner, children], max_epochs=1, logger=False).fit(M(step_ms=1))
    configs = [t.settings.num_workers for t in tuner.trials]
    assert len(set(configs)) >= 2, tuner.trials  # it switched inside the epoch
    seen = [int(n) for n in counts.read_text().split()]
    # as each worker starts: the old set beside it only when the switch adds workers (a start the epoch's end cut
    # short is no trial, but was seen beside the serving loader at a batch)
    beside = [b + (a if b > a else 0) for a, b in pairwise(configs)]
    assert max(seen) <= max([configs[0], *beside, *(expected for _, expected in children.seen)]), (seen, configs)
    assert all(alive == expected for alive, expected in children.seen), children.seen


def test_the_users_batches_are_recorded_as_handed_out_and_give_the_whole_epochs_order():
    """What a switch from the user's own loader goes on from: the batches handed out, the rest of the epoch drawn from
    the same iteration (and still handed out from there), up to its end and not past it (as a loader without workers
    draws), and an iteration cut at a batch."""

    def batches():
        return BatchSampler(RandomSampler(range(20), generator=torch.Generator().manual_seed(0)), 4, False)

    expected, users = list(batches()), batches()
    recorded = RecordedBatches(iter(users), len(users))
    assert [next(recorded), next(recorded)] == expected[:2] and recorded.next == 2
    before = users.sampler.generator.get_state()
    assert recorded.order() == [i for batch in expected for i in batch]
    assert torch.equal(users.sampler.generator.get_state(), before)  # not drawn past the epoch's end
    assert recorded.order() == [i for batch in expected for i in batch]  # drawn once
    assert next(recorded) == expected[2]
    assert not recorded.cut(2) and recorded.cut(4)
    assert list(recorded) == [expected[3]]  # nothing from the cut on
