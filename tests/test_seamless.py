"""Seamless epochs: the next epoch's first batches load while this one's last are consumed, every epoch's order
exactly what a run without them (and without the tuner) trains on."""

import time
from itertools import islice

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from lightning_dltune import DataLoaderTuner
from lightning_dltune.switching.switch import GuardedIterator, GuardHooks, ResumableBatchSampler
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset

from helpers import make_trainer


class Dropout(SimulatedModel):
    """Draws from the global random state in every step, as dropout does."""

    def __init__(self, step_ms=5.0):
        super().__init__(step_ms=step_ms)
        self.drop = nn.Dropout(0.5)

    def training_step(self, batch, batch_idx):
        x = self.drop(batch[0])
        return super().training_step((x, *batch[1:]), batch_idx)


class Epochs(pl.Callback):
    """Each epoch's indices, and how long its first batch took to arrive after the epoch began."""

    def __init__(self):
        self.epochs, self.first_wait = [], []
        self.carried = []  # by epoch: whether it began on an iterator carried over from the epoch before

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([])
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.first_wait.append(time.perf_counter() - self._t0)
            tuners = [c for c in trainer.callbacks if isinstance(c, DataLoaderTuner)]
            carried = tuners[0].switcher.seamless.carried if tuners else 0
            self.carried.append(carried > sum(self.carried))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs[-1].extend(int(i) for i in batch[2])


def described(tuner):
    return tuner.switcher.seamless.carried, [(t.settings.describe(), t.stats.steps, t.decision) for t in tuner.trials]


def fit(
    tmp_path,
    callbacks,
    epochs=4,
    workers=0,
    latency_ms=5.0,
    step_ms=5.0,
    length=320,
    seed=7,
    trainer_kw=None,
    model=Dropout,
    **loader,
):
    pl.seed_everything(0)
    ds = SyntheticDataset(length, latency_ms=latency_ms)
    kwargs = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    kwargs.update(loader)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    dl = DataLoader(ds, batch_size=16, shuffle=True, **kwargs)
    record = Epochs()
    trainer = make_trainer(tmp_path, [*callbacks, record], max_epochs=epochs, logger=False, **(trainer_kw or {}))
    trainer.fit(model(step_ms), train_dataloaders=dl)
    record.rng_after = torch.get_rng_state()  # what training goes on with
    return record


def untuned(tmp_path, **kwargs):
    """A run without the tuner: the reference a tuned run's orders are compared with. Its samples load and its
    steps run at once: the orders a run trains (and its draws from the global state) come from its seeds, its
    generator and its steps' draws, not from how long a sample takes (a ``SyntheticDataset`` sample is the same
    whenever it is loaded); only a tuned run needs the stall, and it keeps the one its test sets."""
    return fit(tmp_path, [], latency_ms=0.0, step_ms=0.0, **kwargs)


@pytest.fixture(scope="module")
def untuned_5(tmp_path_factory):
    return untuned(tmp_path_factory.mktemp("untuned"), epochs=5)


def test_tuned_with_seamless_epochs_every_epoch_trains_what_an_untuned_run_trains(tmp_path, untuned_5):
    untuned = untuned_5
    tuner = DataLoaderTuner()
    tuned = fit(tmp_path / "tuned", [tuner], epochs=5)
    trials = [(t.settings.describe(), t.stats.steps, t.decision) for t in tuner.trials]
    assert tuner.switcher.seamless.carried >= 1, trials
    assert tuned.epochs == untuned.epochs, ([e[:4] for e in tuned.epochs], [e[:4] for e in untuned.epochs], trials)


@pytest.mark.parametrize("workers", [0, 2])  # the user's loader creates an iterator every epoch, or once
def test_a_loader_built_anew_for_every_epoch_trains_what_an_untuned_run_trains(tmp_path, workers):
    # Lightning builds the train loader again every epoch (the user's reload flag): each epoch's loader creates its
    # iterator, and its workers are handed that epoch's first batches (the order drawn) before on_train_epoch_start.
    # A persistent user loader draws its workers' base seed from the generator once, a new loader every epoch. The
    # run without the tuner reloads too: Lightning iterates the user's loader twice in such an epoch (`setup_data`
    # and the epoch loop), so its orders are not those of a run that never reloads
    reload = {"reload_dataloaders_every_n_epochs": 1}
    reference = untuned(tmp_path / "untuned", epochs=5, workers=workers, trainer_kw=reload)
    tuner = DataLoaderTuner()
    tuned = fit(tmp_path / "tuned", [tuner], epochs=5, workers=workers, trainer_kw=reload)
    assert tuned.epochs == reference.epochs, described(tuner)
    assert tuner.best_settings["num_workers"] > workers, described(tuner)


def test_the_next_epoch_is_loaded_while_this_one_ends_and_without_it_every_epoch_waits(tmp_path):
    # 160 ms to load a batch, a 60 ms step: the tuner goes to enough workers to hide it; each epoch's first batch
    # then waits for a whole production time unless the workers were already loading it. Only the epochs that began
    # on a carried iterator are judged: an epoch after a switch between epochs starts new workers (a busy host can
    # keep the tuner trying configs until the fifth epoch)
    on, off = DataLoaderTuner(), DataLoaderTuner(seamless_epochs=False)  # the argument under test
    runs = {}
    for name, tuner in (("on", on), ("off", off)):
        runs[name] = fit(tmp_path / name, [tuner], epochs=6, latency_ms=10.0, step_ms=60.0, length=192)
    seen = {
        name: [(c, round(w, 3)) for c, w in zip(run.carried, run.first_wait, strict=True)] for name, run in runs.items()
    }
    carried = [wait for began_carried, wait in seen["on"] if began_carried]
    assert len(carried) >= 2 and on.switcher.seamless.carried == len(carried), (seen, described(on))
    assert off.switcher.seamless.carried == 0 and not any(runs["off"].carried)
    assert on.best_settings["num_workers"] > 0 and off.best_settings["num_workers"] > 0
    refills = sorted(runs["off"].first_wait[-2:])  # the last epochs, long after the tuner settled
    assert refills[0] > 0.1, seen  # a refill: at least most of a batch's 160 ms
    assert max(carried) < refills[0] / 2, (seen, described(on))


def test_seamless_epochs_alone_keep_the_users_config_and_its_order(tmp_path):
    # the documented way to have seamless epochs on a config chosen by hand: one trial (the user's config, measured
    # and kept) and no cache (whose settings would replace it)
    reference = untuned(tmp_path / "untuned", epochs=5, workers=4)
    tuner = DataLoaderTuner(max_trials=1, cache=False)  # the documented way in, as the comment above says
    tuned = fit(tmp_path / "tuned", [tuner], epochs=5, workers=4)
    assert tuned.epochs == reference.epochs, described(tuner)
    assert [t.settings.num_workers for t in tuner.trials] == [4] and tuner.phase == "settled", described(tuner)
    assert tuner.best_settings == {
        "num_workers": 4,
        "prefetch_factor": 2,
        "pin_memory": False,
        "persistent_workers": True,
    }
    assert tuner.switcher.seamless.carried >= 3, described(tuner)  # every epoch start after the first window's


class Steady(SimulatedModel):
    """Draws nothing from the global random state (a model whose dropout runs on a GPU's generator)."""

    def __init__(self, step_ms=5.0):
        super().__init__(step_ms=step_ms)


@pytest.mark.parametrize("new_each", [True, False])
def test_a_loader_lightning_reloads_on_the_users_own_settings_trains_what_a_run_without_the_tuner_trains(
    tmp_path, without_tuner, new_each
):
    # settled at once on the user's 2 persistent workers (a stall under the threshold): the loader is still the
    # tuner's (its batch sampler), which keeps the iterator setup_data made, where the user's loader is reset by the
    # epoch loop and draws its order again
    tuner = DataLoaderTuner(stall_threshold=0.99)  # the argument under test: settle on the user's settings
    tuned = reloaded_every_epoch(tmp_path, [tuner], 2, new_each)
    assert tuner.best_settings["num_workers"] == 2 and tuner.phase == "settled", described(tuner)
    assert tuned == without_tuner(2, new_each), described(tuner)


@pytest.mark.parametrize("workers", [0, 2])  # the user's loader creates an iterator every epoch, or once
def test_a_sampler_drawing_from_the_global_state_is_drawn_ahead_when_training_leaves_that_state_alone(
    tmp_path, workers
):
    # no generator: each epoch's seed comes from the global random state at its start. Training that draws nothing
    # from it between epochs leaves the state as it was when the order was drawn ahead: the epoch checks that
    reference = untuned(tmp_path / "untuned", seed=None, model=Steady, workers=workers, epochs=5)
    tuner = DataLoaderTuner()
    tuned = fit(tmp_path / "tuned", [tuner], seed=None, model=Steady, workers=workers, epochs=5)
    assert tuner.switcher.seamless.carried >= 1, described(tuner)
    assert tuned.epochs == reference.epochs, described(tuner)
    assert torch.equal(tuned.rng_after, reference.rng_after)  # the global state goes on as without the tuner


def test_a_sampler_that_draws_from_the_global_state_is_left_alone_unless_asked(tmp_path, lightning_log):
    # dropout on the CPU draws from the global state in every step: the order drawn ahead is found wrong at the
    # next epoch's start, which then draws its own as without the tuner, and no order is drawn ahead again
    reference = untuned(tmp_path / "untuned", seed=None)
    auto = DataLoaderTuner()
    tuned = fit(tmp_path / "auto", [auto], seed=None)
    assert auto.switcher.seamless.carried == 0 and tuned.epochs == reference.epochs
    assert "seamless epochs stopped for this loader: its RandomSampler draws each epoch's seed" in lightning_log.text

    # opted in: each epoch's order comes from the run's seed and the epoch, the same in two runs, every sample once
    runs = []
    for i in range(2):
        tuner = DataLoaderTuner(seamless_epochs=True)  # the argument under test
        runs.append(fit(tmp_path / f"on{i}", [tuner], seed=None).epochs)
        assert tuner.switcher.seamless.carried >= 1, described(tuner)
    assert runs[0] == runs[1]
    assert all(sorted(epoch) == list(range(320)) for epoch in runs[0])
    assert len({tuple(epoch) for epoch in runs[0]}) == len(runs[0])  # a new order every epoch


def test_epochs_cut_short_and_validation_between_epochs_keep_the_untuned_order(tmp_path):
    class Validated(Dropout):
        validated = 0

        def validation_step(self, batch, batch_idx):
            Validated.validated += 1

    def run(path, callbacks, latency_ms=5.0, step_ms=5.0):
        pl.seed_everything(0)
        g = torch.Generator().manual_seed(3)
        dl = DataLoader(SyntheticDataset(320, latency_ms=latency_ms), batch_size=16, shuffle=True, generator=g)
        val = DataLoader(SyntheticDataset(64), batch_size=16)
        record = Epochs()
        trainer = make_trainer(path, [*callbacks, record], max_epochs=4, logger=False, limit_val_batches=None)
        trainer.fit(Validated(step_ms), train_dataloaders=dl, val_dataloaders=val)
        return record

    reference = run(tmp_path / "untuned", [], latency_ms=0.0, step_ms=0.0)  # a reference: see `untuned`
    tuner = DataLoaderTuner()
    Validated.validated = 0
    tuned = run(tmp_path / "tuned", [tuner])
    assert tuned.epochs == reference.epochs and tuner.switcher.seamless.carried >= 1, described(tuner)
    assert Validated.validated == 4 * 4 + 2  # every epoch validated (and the sanity check ran its 2 batches)

    # 15 of 20 batches an epoch: each epoch stops before its end, and the next draws its own order as without
    short = {"limit_train_batches": 15}
    reference = untuned(tmp_path / "untuned_short", trainer_kw=short)
    tuner = DataLoaderTuner()
    tuned = fit(tmp_path / "tuned_short", [tuner], trainer_kw=short)
    assert tuned.epochs == reference.epochs and tuner.switcher.seamless.carried == 0, described(tuner)


class Counted(torch.utils.data.Dataset):
    """Counts the samples loaded, in whatever process loads them."""

    def __init__(self, n):
        self.n = n
        self.loaded = torch.multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.loaded.get_lock():
            self.loaded.value += 1
        return torch.zeros(32), torch.tensor(0), torch.tensor(i)


@pytest.mark.parametrize("end", [{"max_epochs": 2}, {"max_epochs": -1, "max_steps": 10}])
def test_nothing_past_the_fits_last_batch_is_loaded(tmp_path, end):
    # 5 batches an epoch on 2 workers, a 100 ms step the loader keeps up with: the tuner settles on the user's
    # config. Epoch 1's first batches load while epoch 0 ends; in the last epoch (by max_epochs or max_steps) the
    # workers are handed no batch of an epoch that will not run: they would be stopped in the middle of it (up to a
    # batch's time at fit's end) and take CPU from the last steps
    data = Counted(80)
    g = torch.Generator().manual_seed(1)
    dl = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, persistent_workers=True, generator=g)
    tuner = DataLoaderTuner()
    trainer = make_trainer(tmp_path, [tuner], logger=False, **end)
    trainer.fit(SimulatedModel(step_ms=100.0), train_dataloaders=dl)
    assert tuner.switcher.seamless.carried == 1 and len(tuner.trials) == 1, described(tuner)
    # 4 batches more loaded the next epoch; none for the cache's fingerprint, which loads nothing in the training
    # process where the user's loader has workers
    assert data.loaded.value == 2 * 80, described(tuner)


def test_seamless_epochs_argument_is_checked():
    with pytest.raises(ValueError, match=r"`seamless_epochs` must be one of \('auto', True, False\), got 'yes'"):
        DataLoaderTuner(seamless_epochs="yes")
    with pytest.raises(ValueError, match="seamless_epochs"):
        DataLoaderTuner(seamless_epochs=1)


# early, and late enough that the new loader's first requests (4 workers x 2) reach into the next epoch's order
@pytest.mark.parametrize("at", [0, 5])
def test_a_switch_inside_an_epoch_leaves_the_generator_as_a_run_without_it(at):
    g = torch.Generator().manual_seed(1)
    data = list(range(64))
    sampler = ResumableBatchSampler(RandomSampler(data, generator=g), 8, False)
    sampler.carry_on(lambda ahead: None)
    first = DataLoader(data, batch_sampler=sampler, num_workers=1, prefetch_factor=1, generator=g)
    second = DataLoader(data, batch_sampler=sampler, num_workers=4, generator=g)
    switch = lambda loader: second if loader is first and guard.position == at else None  # noqa: E731
    guard = GuardedIterator(first, iter(first), GuardHooks(replace=switch))
    epoch0 = [int(i) for batch in guard for i in batch]
    assert guard.loader is second and sampler.advance()
    epoch1 = [int(i) for batch in islice(guard.inner, 8) for i in batch]

    expected = torch.Generator().manual_seed(1)
    torch.empty((), dtype=torch.int64).random_(generator=expected)  # the first iterator's base seed
    assert epoch0 == torch.randperm(64, generator=expected).tolist()
    assert epoch1 == torch.randperm(64, generator=expected).tolist()
    for loader in (first, second):
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()
    guard.inner._shutdown_workers()


class HookModel(Dropout):
    """Returns its train loader from its own hook: a new ``DataLoader`` at every call, or the same one."""

    def __init__(self, new_each, latency_ms=2.0, step_ms=5.0, **loader):
        super().__init__(step_ms=step_ms)
        self.dataset, self.loader = SyntheticDataset(320, latency_ms=latency_ms), loader
        self.new_each, self.dl = new_each, None

    def train_dataloader(self):
        if self.new_each:  # nothing else holds it: Lightning keeps the loader the tuner returns for it
            return DataLoader(self.dataset, batch_size=16, shuffle=True, **self.loader)
        if self.dl is None:
            self.dl = DataLoader(self.dataset, batch_size=16, shuffle=True, **self.loader)
        return self.dl


class CallsModel(HookModel):
    """Records the epoch at each call of its ``train_dataloader`` hook."""

    def __init__(self, **timing):
        super().__init__(new_each=True, **timing)
        self.calls = []

    def train_dataloader(self):
        self.calls.append(self.trainer.current_epoch)
        return super().train_dataloader()


def test_a_reload_the_tuner_asks_for_leaves_lightnings_own_reload_schedule_as_it_was(tmp_path, monkeypatch):
    from lightning_dltune.switching import _lightning

    asked = []  # the epochs the tuner reloads at (it asks at the end of the one before)
    request = _lightning.request_train_reload
    monkeypatch.setattr(
        _lightning, "request_train_reload", lambda t, **kw: (asked.append(t.current_epoch + 1), request(t, **kw))
    )
    calls = []
    for callbacks in ([], [DataLoaderTuner(mode="epoch")]):  # epoch mode: its switches are reloads
        # without the tuner, only the hook's calls are read: its samples load and its steps run at once
        model = CallsModel() if callbacks else CallsModel(latency_ms=0.0, step_ms=0.0)
        reload = {"reload_dataloaders_every_n_epochs": 2}
        trainer = make_trainer(tmp_path / str(len(calls)), callbacks, max_epochs=6, logger=False, **reload)
        trainer.fit(model)
        calls.append(model.calls)
    assert calls[0] == [0, 2, 4]
    # a reload the tuner asked for outside Lightning's schedule, not followed by another at once: Lightning used to
    # count its next reload from there (at 3, not 2), and the hook was called when a run without the tuner does not
    assert any(e % 2 and e + 1 not in asked for e in asked), asked
    assert calls[1] == sorted({*calls[0], *asked}), (calls, asked)


def reloaded_every_epoch(tmp_path, callbacks, workers, new_each, **timing):
    """Each epoch's indices of a fit whose LightningModule hook Lightning asks for the loader at every epoch."""
    loader = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    pl.seed_everything(0)
    record = Epochs()
    reload = {"reload_dataloaders_every_n_epochs": 1}
    trainer = make_trainer(tmp_path, [*callbacks, record], max_epochs=4, logger=False, **reload)
    trainer.fit(HookModel(new_each, **timing, **loader))
    return record.epochs


@pytest.fixture(scope="module")
def without_tuner(tmp_path_factory):
    runs = {}

    def run(workers, new_each):  # a reference: its samples load and its steps run at once (see `untuned`)
        if (workers, new_each) not in runs:
            path = tmp_path_factory.mktemp("untuned")
            runs[workers, new_each] = reloaded_every_epoch(path, [], workers, new_each, latency_ms=0.0, step_ms=0.0)
        return runs[workers, new_each]

    return run


@pytest.mark.parametrize("workers", [0, 2])  # persistent with 2
@pytest.mark.parametrize("new_each", [True, False])
@pytest.mark.parametrize("observe_only", [True, False])
def test_a_loader_lightning_reloads_every_epoch_trains_what_a_run_without_the_tuner_trains(
    tmp_path, without_tuner, workers, new_each, observe_only
):
    # Lightning asks the hook again at every epoch and iterates the loader twice (`setup_data` and the epoch loop).
    # Observing, the tuner's loader is the user's, and what it draws then stands. Tuning, it runs on other settings:
    # what it drew in `setup_data` is undone, what the user's loader draws there (a base seed, an order its workers
    # are handed) is drawn instead, and its iterator is reset so that the epoch loop draws the epoch's order as
    # the user's loader does. No generator: every draw is from the global state, which dropout draws from too
    tuner = DataLoaderTuner(observe_only=observe_only)  # the argument under test (observing, or the default)
    tuned = reloaded_every_epoch(tmp_path, [tuner], workers, new_each)
    assert tuned == without_tuner(workers, new_each), described(tuner)
    if not observe_only:  # it ran on other settings than the user's (where it ends is the run-length rule's: with
        # few steps left it may hold on the user's config, which a busy host made it do in one full-suite run)
        assert any(t.settings.num_workers not in (workers, 0) for t in tuner.trials), described(tuner)
