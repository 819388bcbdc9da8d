"""The evaluation loaders (validation in ``fit`` and ``trainer.validate``, test, predict) are measured and tuned."""

import json
import time
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner, TunableDataModuleMixin
from lightning_dltune.switching.evaluation import beside
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset
from lightning_dltune.tuning.model import Budget

from helpers import make_trainer, scalars


class EvalModel(SimulatedModel):
    """Records every evaluation batch's dataset indices, per loop, and every train batch's."""

    def __init__(self):
        super().__init__(step_ms=1.0)
        self.seen = {"train": [], "val": [], "test": [], "predict": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch[2].tolist())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen["val"].append((dataloader_idx, batch[2].tolist()) if dataloader_idx else batch[2].tolist())

    def test_step(self, batch, batch_idx):
        self.seen["test"].append(batch[2].tolist())

    def predict_step(self, batch, batch_idx):
        self.seen["predict"].append(batch[2].tolist())
        return batch[2]


class EvalData(pl.LightningDataModule):
    """A plain DataModule (no mixin) whose loaders all take the user's ``**loader_kwargs``, as in issue 36."""

    def __init__(self, train=96, val=160, latency_ms=4.0, **loader_kwargs):
        super().__init__()
        self.train_set = SyntheticDataset(train, latency_ms=1.0)
        self.eval_set = SyntheticDataset(val, latency_ms=latency_ms)
        self.predict_set = SyntheticDataset(3 * val, latency_ms=latency_ms)  # long enough to switch inside its pass
        self.loader_kwargs = loader_kwargs

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=16, shuffle=True, **self.loader_kwargs)

    def val_dataloader(self):
        return DataLoader(self.eval_set, batch_size=16, **self.loader_kwargs)

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return DataLoader(self.predict_set, batch_size=16, **self.loader_kwargs)


class Indices(BasePredictionWriter):
    """The batch indices Lightning hands a prediction writer, batch by batch."""

    def __init__(self):
        super().__init__(write_interval="batch")
        self.batch_indices = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batch_indices.append(list(batch_indices))


def fit(tmp_path, callbacks, epochs=3, **kwargs):
    pl.seed_everything(7)
    model = EvalModel()
    trainer = make_trainer(tmp_path, callbacks, max_epochs=epochs, **kwargs)
    trainer.fit(model, datamodule=EvalData())
    return model, trainer


class RandomState(pl.Callback):
    """The global random state after each validation pass."""

    def __init__(self):
        self.states = []

    def on_validation_end(self, trainer, pl_module):
        self.states.append(torch.get_rng_state())


def test_validation_loader_is_tuned_exact_logged_and_reported(tmp_path):
    tuner, after_tuned, after_untuned = DataLoaderTuner(), RandomState(), RandomState()
    logger = TensorBoardLogger(tmp_path / "tuned", name="")
    tuned, _ = fit(tmp_path / "tuned", [tuner, after_tuned], logger=logger)
    untuned, _ = fit(tmp_path / "untuned", [after_untuned], logger=False)
    # every validation pass and every training epoch saw the samples of a run without the tuner, in its order, and
    # each pass left the global random state as it did there: the tuner's persistent validation workers are reset,
    # not created, where the user's loader draws a base seed at every pass (the train loader shuffles from that state)
    assert tuned.seen == untuned.seen
    assert len(after_tuned.states) == 4  # the sanity check and three passes
    assert all(torch.equal(a, b) for a, b in zip(after_tuned.states, after_untuned.states, strict=True))
    val = tuner.evals.tuners["val"]
    assert val.passes == 3  # the sanity check is measured, not counted as a pass
    assert val.state.trials[0].settings.num_workers == 0  # the user's own loader, measured first
    assert val.state.trials[0].decision.startswith("try")
    assert val.state.current.num_workers > 0  # validation ran on the tuner's workers after the first pass
    report = json.loads(tuner.report_file.read_text())
    assert report["loops"]["val"]["passes"] == 3
    assert report["loops"]["val"]["series"]["num_workers"][0] == 0
    assert report["loops"]["val"]["series"]["num_workers"][-1] == val.state.current.num_workers
    assert report["loops"]["val"]["trials"][0]["settings"]["num_workers"] == 0
    # the passes' metrics, under the loop's name, read back from TensorBoard; the train ones kept their names
    # the sanity check's batches, on the user's 0 workers, were the first window (logged at step 0): every pass of
    # the run then ran on the tuner's workers
    steps = report["loops"]["val"]["series"]["step"]
    assert len(steps) == 4 and steps[0] == 0 < steps[1] < steps[2] < steps[3]
    workers = scalars(logger.log_dir, "dltune/val/num_workers")
    assert workers == report["loops"]["val"]["series"]["num_workers"]
    assert workers[0] == 0 and workers[1:] == [val.state.current.num_workers] * 3
    assert len(scalars(logger.log_dir, "dltune/val/stall_frac")) == 4
    assert scalars(logger.log_dir, "dltune/stall_frac")


def test_restored_after_fit(tmp_path):
    """After ``fit`` the evaluation loop's loader requests, reset and fetch hooks are Lightning's again."""
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner = DataLoaderTuner(report_path=False)
    _, trainer = fit(tmp_path, [tuner], epochs=1, logger=False)
    loop = trainer.fit_loop.epoch_loop.val_loop
    assert "dataloader" not in vars(loop._data_source)
    assert "reset" not in vars(loop) and "_on_before_fetch" not in vars(loop)


def test_eval_loops_off_leaves_validation_alone(tmp_path):
    # eval_loops=(): the off switch under test; report_path=False: no report is read here
    tuner = DataLoaderTuner(eval_loops=(), report_path=False)
    model, trainer = fit(tmp_path, [tuner], epochs=2, logger=False)
    assert trainer.val_dataloaders.num_workers == 0
    assert not tuner.evals.tuners
    assert len(model.seen["val"]) == 2 + 2 * 10  # the sanity check's 2 batches, then 10 per epoch


def test_validate_test_and_predict_on_their_own(tmp_path):
    """A standalone run is one pass: measured, logged and reported; its plan is what the next run of that loop tries,
    and the batches come back in the same order whatever the config."""
    tuner, writer = DataLoaderTuner(), Indices()
    logger = TensorBoardLogger(tmp_path, name="")
    trainer = make_trainer(tmp_path, [tuner, writer], logger=logger)
    model, data = EvalModel(), EvalData()
    trainer.validate(model, datamodule=data)
    trainer.test(model, datamodule=data)
    first = trainer.predict(model, datamodule=data)
    second = trainer.predict(model, datamodule=data)
    expected = [list(range(i, i + 16)) for i in range(0, 160, 16)]
    assert model.seen["val"] == model.seen["test"] == expected
    expected = [list(range(i, i + 16)) for i in range(0, 480, 16)]
    assert model.seen["predict"] == expected + expected
    assert [p.tolist() for p in first] == [p.tolist() for p in second] == expected
    # each batch's indices as Lightning's prediction writers see them, across the switch inside the first pass
    assert writer.batch_indices == expected + expected
    predict = tuner.evals.tuners["predict"]
    assert predict.passes == 2
    assert predict.state.trials[0].settings.num_workers == 0
    workers = predict.state.trials[1].settings.num_workers
    assert workers > 0  # switched inside the first pass, after its first window
    assert len(predict.series.points) == 3  # the first pass logged on each config, the second once
    report = json.loads((tmp_path / "version_0" / "dltune_report.json").read_text())
    assert set(report["loops"]) == {"val", "test", "predict"}
    assert report["loops"]["predict"]["passes"] == 2
    assert scalars(logger.log_dir, "dltune/test/stall_frac")
    assert scalars(logger.log_dir, "dltune/predict/num_workers") == [0, workers, workers]  # as the series


def test_checkpoint_carries_each_loops_state(tmp_path):
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner = DataLoaderTuner(report_path=False)
    fit(tmp_path, [tuner], epochs=2, logger=False)
    state = tuner.state_dict()
    assert state["loops"]["val"]["trials"]
    resumed = DataLoaderTuner()
    resumed.load_state_dict(state)
    val = tuner.evals.tuners["val"].state
    planned = val.held.settings if val.held is not None else val.target  # a held loop's plan: a resumed run tries it
    assert planned is not None and planned.num_workers > 0
    assert resumed.evals.tuners["val"].state.target == planned
    assert resumed.evals.tuners["val"].state.trials == tuner.evals.tuners["val"].state.trials
    older = {k: v for k, v in state.items() if k != "loops"}  # a checkpoint written before evaluation loops were
    DataLoaderTuner().load_state_dict(older)


def test_persistent_workers_of_another_loader_are_taken_from_the_memory_budget():
    budget = Budget(cpus=2, max_workers=16, memory_bytes=1e9)
    assert beside(budget, 3e8).memory_bytes == pytest.approx(7e8)
    assert beside(budget, 0.0) is budget
    assert beside(Budget(cpus=2, max_workers=16), 3e8).memory_bytes is None


@pytest.mark.parametrize("value", ["val", ("train",), 3])
def test_eval_loops_argument_is_checked(value):
    with pytest.raises(ValueError, match="`eval_loops` must be a sequence of loop names"):
        DataLoaderTuner(eval_loops=value)


class CountingData(EvalData):
    """Counts the calls of its validation hook."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_requests = 0

    def val_dataloader(self):
        self.val_requests += 1
        return super().val_dataloader()


@pytest.mark.parametrize(
    "schedule",
    [
        {"limit_val_batches": 3},  # short passes: pooled into windows
        {"check_val_every_n_epoch": 2, "max_epochs": 4},
        {"val_check_interval": 0.5},  # validation inside the training epoch, the train loader's workers alive
        {"reload_dataloaders_every_n_epochs": 1},  # the user's schedule: the hook is asked as often as untuned
    ],
    ids=["limit_val_batches", "every_2_epochs", "twice_an_epoch", "reload_every_epoch"],
)
def test_validation_schedules_stay_exact(tmp_path, schedule):
    runs = []
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    for callbacks in ([DataLoaderTuner(report_path=False)], []):  # no report: see the comment above
        pl.seed_everything(7)
        model, data = EvalModel(), CountingData()
        opts = {"max_epochs": 2, **schedule}
        make_trainer(tmp_path, callbacks, logger=False, **opts).fit(model, datamodule=data)
        runs.append((model.seen, data.val_requests, callbacks))
    (tuned, asked, (tuner,)), (untuned, untuned_asked, _) = runs
    assert tuned == untuned
    assert asked == untuned_asked  # the tuner's own switches do not call the hook
    val = tuner.evals.tuners["val"]
    assert val.state.trials and val.state.trials[0].settings.num_workers == 0
    assert val.state.current.num_workers > 0


def test_a_model_without_validation_step_is_left_alone(tmp_path):
    class NoValidation(EvalModel):
        validation_step = None

    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner = DataLoaderTuner(report_path=False)
    make_trainer(tmp_path, [tuner], max_epochs=1, logger=False).fit(NoValidation(), datamodule=EvalData())
    assert tuner.evals.tuners["val"].passes == 0 and not tuner.evals.tuners["val"].state.trials


def test_an_iterable_validation_dataset_is_measured_only(tmp_path, lightning_log):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(SyntheticDataset(96, latency_ms=2.0)[i] for i in range(96))

    class StreamData(EvalData):
        def val_dataloader(self):
            return DataLoader(Stream(), batch_size=16)

    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner = DataLoaderTuner(report_path=False)
    model = EvalModel()
    make_trainer(tmp_path, [tuner], max_epochs=2, logger=False).fit(model, datamodule=StreamData())
    val = tuner.evals.tuners["val"]
    assert val.state.phase == "disabled" and val.state.current.num_workers == 0 and val.passes == 2
    assert len(model.seen["val"]) == 2 + 2 * 6
    assert "the val loader is measured only: its dataset is an IterableDataset" in lightning_log.text


def test_a_standalone_loops_result_is_cached_for_the_next_run(tmp_path, lightning_log):
    for _ in range(2):
        # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
        tuner = DataLoaderTuner(report_path=False)
        make_trainer(tmp_path, [tuner], logger=False).predict(EvalModel(), datamodule=EvalData())
    predict = tuner.evals.tuners["predict"]
    assert predict.state.cache_hit and predict.state.trials[0].settings.num_workers > 0
    assert "the predict loader starts from cached settings" in lightning_log.text


class MixinData(TunableDataModuleMixin, pl.LightningDataModule):
    """The mixin's way in: the train loader takes ``loader_kwargs``, the validation loader ``loader_kwargs_for``."""

    def __init__(self):
        super().__init__()
        self.train_set, self.eval_set = SyntheticDataset(96, latency_ms=1.0), SyntheticDataset(160, latency_ms=4.0)
        self.num_workers, self.prefetch_factor, self.pin_memory, self.persistent_workers = 0, None, False, False
        self.built_val_with = []

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=16, shuffle=True, **self.loader_kwargs)

    def val_dataloader(self):
        self.built_val_with.append(self.loader_kwargs_for("val")["num_workers"])
        return DataLoader(self.eval_set, batch_size=16, **self.loader_kwargs_for("val"))


def test_mixin_validation_settings_live_on_the_datamodule(tmp_path):
    data = MixinData()
    assert data.loader_kwargs_for("val") == data.loader_kwargs_for("train") == data.loader_kwargs
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner = DataLoaderTuner(report_path=False)
    pl.seed_everything(7)
    model = EvalModel()
    # Lightning asks for the validation loader again every epoch: the hook then builds it with the tuner's settings
    make_trainer(tmp_path, [tuner], max_epochs=3, logger=False, reload_dataloaders_every_n_epochs=1).fit(
        model, datamodule=data
    )
    target = tuner.evals.tuners["val"].state.target
    assert target.num_workers > 0 and data.loader_kwargs_for("val") == target.to_loader_kwargs()
    assert data.built_val_with[0] == 0 and data.built_val_with[-1] == target.num_workers
    assert data.state_dict()["dltune_loop_settings"]["val"] == target.to_loader_kwargs()
    restored = MixinData()
    restored.load_state_dict(data.state_dict())
    assert restored.loader_kwargs_for("val") == target.to_loader_kwargs()
    assert (
        model.seen["val"]
        == [list(range(i, i + 16)) for i in range(0, 160, 16)][:2]
        + [list(range(i, i + 16)) for i in range(0, 160, 16)] * 3
    )


def test_validation_is_left_out_of_the_train_window_its_set_up_and_its_workers_cpu_too():
    """The validation loop's run (its loader request, its iterator's creation and first batch, then the pass) pauses
    the train loader's measurement; pauses nest (the run around ``on_validation_start``/``_end``); the CPU the
    children spend meanwhile is not the window's."""
    from lightning_dltune.measurement.probe import Probe

    now, cpu = [0.0], [(0.0, 0.0)]
    probe = Probe(clock=lambda: now[0], cpu_clock=lambda: 0.0, cpu_seconds=lambda: cpu[0])
    probe.timer.epoch_started()
    for _ in range(2):  # steady steps of 10 ms
        probe.step_started()
        now[0] += 0.01
        probe.step_ended(torch.zeros(4, 2))
    probe.pause()  # the validation loop's run begins: its set-up (0.5 s, validation workers using 3 s of CPU)
    now[0] += 0.5
    probe.pause()  # on_validation_start
    now[0] += 1.0
    cpu[0] = (0.0, 3.0)
    probe.resume()  # on_validation_end: still inside the run
    now[0] += 0.25
    probe.resume()  # the run returns
    probe.step_started()
    now[0] += 0.01
    probe.step_ended(torch.zeros(4, 2))
    stats = probe.close()
    assert stats.other_s == pytest.approx(0.0)  # none of the 1.75 s of validation
    assert stats.excluded_s == pytest.approx(1.75)
    assert stats.worker_cpu_s == pytest.approx(0.0)


class KillValidationWorker(pl.Callback):
    """Kill a worker of the validation loader at the 4th batch of the last pass."""

    def __init__(self, epoch):
        self.epoch, self.killed = epoch, None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        import os
        import signal

        from lightning_dltune.switching import _lightning

        if trainer.sanity_checking or trainer.current_epoch != self.epoch or batch_idx != 3 or self.killed:
            return
        pids = _lightning.loop_worker_pids(trainer.fit_loop.epoch_loop.val_loop)
        if pids:
            self.killed = pids[0]
            os.kill(pids[0], signal.SIGKILL)


def test_a_validation_worker_killed_mid_pass_loses_and_repeats_nothing(tmp_path, recwarn):
    # few workers, so that the killed one still has batches of the pass to load (with 16, it had loaded them all)
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    tuner, kill = DataLoaderTuner(report_path=False, max_workers=4), KillValidationWorker(epoch=2)
    tuned, _ = fit(tmp_path / "tuned", [tuner, kill], logger=False)
    untuned, _ = fit(tmp_path / "untuned", [], logger=False)
    assert kill.killed is not None  # the tuner's workers served that pass
    assert tuned.seen == untuned.seen
    val = tuner.evals.tuners["val"].state
    (failed,) = [t for t in val.trials if t.failed]
    assert "a DataLoader worker died" in failed.failed and failed.settings.num_workers > 0
    assert val.phase == "settled" and val.current != failed.settings
    assert any("no sample lost or repeated" in str(w.message) for w in recwarn)


def test_persistent_evaluation_workers_that_the_memory_left_cannot_hold_start_afresh_each_pass(monkeypatch):
    """What the workers hold is a stand-in here (a real reading is in the memory tests): 100 MiB against the 50 MiB
    the budget leaves beside the other loaders' workers."""
    from lightning_dltune.settings import LoaderSettings
    from lightning_dltune.switching.evaluation import EvalTuner
    from lightning_dltune.tuning.model import Policy

    tuner = EvalTuner("val", Policy())
    tuner.state.target = LoaderSettings.normalized(8)
    assert tuner.state.target.persistent_workers
    monkeypatch.setattr(tuner, "held_bytes", lambda: 100 * 2**20)
    tuner._keep_persistent_within(Budget(cpus=2, max_workers=16, memory_bytes=200 * 2**20))
    assert tuner.state.target.persistent_workers  # fits
    tuner._keep_persistent_within(Budget(cpus=2, max_workers=16, memory_bytes=50 * 2**20))
    assert tuner.state.target == LoaderSettings.normalized(8, persistent_workers=False)


def test_seamless_epochs_go_on_across_validation(tmp_path):
    """The train loader shuffles from the global random state, which validation draws from between epochs (its
    iterator's base seed, in a run without the tuner): seamless epochs draw the next epoch's order ahead with that
    draw made, so the epochs after validation begin on the carried iterator, in an untuned run's order."""
    runs = []
    # report_path=False: this test reads the tuner, not the report (the default's report: the first test)
    for callbacks in ([DataLoaderTuner(report_path=False)], []):  # no report: see the comment above
        pl.seed_everything(7)
        model, data = EvalModel(), EvalData(train=320)
        data.train_set = SyntheticDataset(320, latency_ms=4.0)  # the train loader's workers: seamless epochs
        make_trainer(tmp_path, callbacks, max_epochs=3, logger=False).fit(model, datamodule=data)
        runs.append((model.seen, callbacks))
    (tuned, (tuner,)), (untuned, _) = runs
    assert tuned == untuned
    assert tuner.state.current.num_workers > 0 and tuner.switcher.seamless.carried >= 1


class LoadedHere(SyntheticDataset):
    """Records the indices it loads in the main process (a worker's record stays in the worker)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.here = []

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is None:
            self.here.append(index)
        return super().__getitem__(index)


def test_a_predict_pass_at_0_workers_switches_after_its_first_batch_where_its_samples_show_a_plain_stall(tmp_path):
    # 16 samples of 20 ms a batch and a 2 ms step: every sample of the first batch waits alike, a stall whose model asks
    # for more workers than max_workers: the pass switches after that batch (not the second), as the train loader does
    class Data(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.dataset = LoadedHere(320, latency_ms=20.0)

        def predict_dataloader(self):
            return DataLoader(self.dataset, batch_size=16)

    tuner, data = DataLoaderTuner(cache=False), Data()  # cache=False: its fingerprint loads samples here too
    predictions = make_trainer(tmp_path, [tuner], logger=False).predict(EvalModel(), datamodule=data)
    assert [p.tolist() for p in predictions] == [list(range(i, i + 16)) for i in range(0, 320, 16)]
    assert data.dataset.here == list(range(16))
    assert tuner.evals.tuners["predict"].state.trials[1].settings.num_workers > 0


class StampsFirstSample(SyntheticDataset):
    """Appends to ``path`` the time each load of sample 0 begins, in whatever process loads it."""

    def __init__(self, n, path, **kwargs):
        super().__init__(n, **kwargs)
        self.path = str(path)

    def __getitem__(self, index):
        if index == 0:
            with open(self.path, "a") as fh:
                fh.write(f"{time.time()}\n")
        return super().__getitem__(index)


class Ends(pl.Callback):
    """When each training epoch's last step ended, and when each validation pass ended (its sanity check's too)."""

    def __init__(self):
        self.train, self.val = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1:
            self.train.append(time.time())

    def on_validation_end(self, trainer, pl_module):
        self.val.append(time.time())


def test_the_validation_workers_load_a_passs_first_batches_while_training_runs(tmp_path):
    # a validation batch takes 320 ms to load (16 samples of 20 ms), a training epoch 6 steps of about 10 ms: once
    # the validation loader's persistent workers are the tuner's, each pass begins while the epoch before it trains
    class Data(EvalData):
        def __init__(self, path):
            super().__init__()
            self.eval_set = StampsFirstSample(64, path, latency_ms=20.0)

    runs, tuner = [], DataLoaderTuner(report_path=False)  # no report is read here
    for name, callbacks in (("tuned", [tuner]), ("untuned", [])):
        pl.seed_everything(7)
        model, ends = EvalModel(), Ends()
        model.step_ms = 10.0
        callbacks = [*callbacks, ends]
        make_trainer(tmp_path, callbacks, max_epochs=4, logger=False).fit(model, datamodule=Data(tmp_path / name))
        runs.append((model.seen, ends))
    (tuned, ends), (untuned, _) = runs
    assert tuned == untuned
    val = tuner.evals.tuners["val"]
    assert val.state.current.num_workers > 0 and val.state.current.persistent_workers
    # pass e loaded its sample 0 ahead where it did so after pass e - 1 ended and before epoch e's last step did
    loads = [float(t) for t in (tmp_path / "tuned").read_text().split()]
    ahead = [any(a < t < b for t in loads) for a, b in zip(ends.val, ends.train, strict=False)]
    assert len(ahead) == 4 and ahead[-2:] == [True, True] and val.started_ahead >= 2, (ahead, val.started_ahead)


class TwoValidationSets(EvalData):
    """Two validation loaders, as a list (Lightning runs them one after the other)."""

    def __init__(self):
        super().__init__(val=64)
        self.other_set = SyntheticDataset(48, latency_ms=4.0)

    def val_dataloader(self):
        return [super().val_dataloader(), DataLoader(self.other_set, batch_size=16, **self.loader_kwargs)]


class Shares(pl.Callback):
    """At each validation pass's end (after the tuner's): what the loop's workers hold, what one loader's hold,
    the memory one loader's decisions were taken within, and the tuner's whole memory budget."""

    def __init__(self, tuner):
        self.tuner, self.seen = tuner, []

    def on_validation_end(self, trainer, pl_module):
        val = self.tuner.evals.tuners["val"]
        if not trainer.sanity_checking and val.state.current.num_workers:
            one = val.probe.held_bytes(val.state.current)
            self.seen.append((val.held_bytes(), one, val.pass_budget.memory_bytes, self.tuner.budget.memory_bytes))


def described(tuner):
    return [(t.settings.describe(), t.stats.steps, t.decision) for t in tuner.state.trials]


def test_several_validation_loaders_get_one_config_and_share_one_memory_cap(tmp_path):
    runs, tuner = [], DataLoaderTuner(report_path=False)  # no report is read here
    shares = Shares(tuner)
    for callbacks in ([tuner, shares], []):
        pl.seed_everything(7)
        after, model = RandomState(), EvalModel()
        trainer = make_trainer(tmp_path, [*callbacks, after], max_epochs=3, logger=False)
        trainer.fit(model, datamodule=TwoValidationSets())
        runs.append((model.seen, after.states, trainer.val_dataloaders))
    (tuned, tuned_states, loaders), (untuned, untuned_states, _) = runs
    # the same batches in the same order, and the same global random state after every pass (the train loader
    # shuffles from it): the tuner's persistent workers are reset where the user's loaders draw a seed at each pass
    assert tuned == untuned
    assert all(torch.equal(a, b) for a, b in zip(tuned_states, untuned_states, strict=True))
    val = tuner.evals.tuners["val"]
    assert val.state.current.num_workers > 0 and val.state.current.persistent_workers
    assert [loader.num_workers for loader in loaders] == [val.state.current.num_workers] * 2
    # both loaders' workers are alive together: counted twice, and each loader decides within half the memory
    assert shares.seen, described(val)
    held, one, share, memory = shares.seen[-1]
    assert one > 0 and held == pytest.approx(2 * one)
    assert share <= memory / 2


def test_a_switch_from_the_users_persistent_workers_leaves_the_random_state_as_their_reset_does(tmp_path):
    # the user's validation workers are persistent: each pass resets them, drawing nothing from the global random
    # state; the tuner's new loader (built inside the sanity check, as the loader is served in order) creates an
    # iterator, which draws its base seed from a copy.
    # cache=False: a cached config would serve from the sanity check on, where the user's loader creates its first
    # iterator too; report_path=False: no report is read here
    runs = []
    for callbacks in ([DataLoaderTuner(cache=False, report_path=False)], []):  # defaults off: see above
        pl.seed_everything(7)
        after, model = RandomState(), EvalModel()
        trainer = make_trainer(tmp_path, [*callbacks, after], max_epochs=3, logger=False)
        trainer.fit(model, datamodule=EvalData(num_workers=1, persistent_workers=True))
        runs.append((model.seen, after.states, trainer.val_dataloaders.num_workers))
    (tuned, tuned_states, workers), (untuned, untuned_states, _) = runs
    assert workers > 1  # the tuner's count
    assert tuned == untuned
    assert all(torch.equal(a, b) for a, b in zip(tuned_states, untuned_states, strict=True))


def test_a_new_iterator_created_apart_draws_nothing_from_the_global_random_state():
    """Between passes the tuner's rebuilt loader creates its iterator apart from the global state where the user's
    loader would reset its own (``_lightning.create_iterators_apart``); otherwise as PyTorch does, drawing a seed."""
    from lightning_dltune.switching import _lightning

    apart = [True]
    loader = DataLoader(SyntheticDataset(8), batch_size=4, num_workers=1)
    _lightning.create_iterators_apart(loader, lambda: apart[0])
    before = torch.get_rng_state()
    assert [b[2].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(torch.get_rng_state(), before)
    apart[0] = False
    torch.empty((), dtype=torch.int64).random_()  # the one draw a new iterator makes
    expected = torch.get_rng_state()
    torch.set_rng_state(before)
    list(loader)
    assert torch.equal(torch.get_rng_state(), expected)


def test_loaders_lightning_reloads_never_get_persistent_workers_with_pinned_memory(tmp_path, recwarn):
    # the user's loaders pin their batches and Lightning reloads them every epoch: persistent workers would leak the
    # pin thread's memory (PyTorch issue 91252, which Lightning warns about), so the tuner's workers are not persistent
    pl.seed_everything(7)
    tuner = DataLoaderTuner(report_path=False)  # no report is read here
    trainer = make_trainer(tmp_path, [tuner], max_epochs=3, logger=False, reload_dataloaders_every_n_epochs=1)
    trainer.fit(EvalModel(), datamodule=EvalData(pin_memory=True))
    val = tuner.evals.tuners["val"].state
    assert val.current.num_workers > 0 and val.current.pin_memory, val.current
    assert not val.current.persistent_workers and not val.target.persistent_workers
    assert tuner.state.reloads and val.reloads  # the train loader's state builds its settings alike
    assert not [w for w in recwarn if "can lead to instability" in str(w.message)]


def test_a_state_whose_loader_lightning_reloads_builds_pinned_memory_without_persistent_workers():
    from lightning_dltune.settings import LoaderSettings
    from lightning_dltune.tuning.state import TuningState

    pinned = LoaderSettings.normalized(8, pin_memory=True)
    state = TuningState()
    state.target = pinned
    assert state.target.persistent_workers  # no reloads: as decided
    state.reloads = True
    state.target = pinned
    assert state.target == replace(pinned, persistent_workers=False)
    state.target = LoaderSettings.normalized(8)  # no pinned memory: persistent workers stay
    assert state.target.persistent_workers


def test_each_loader_of_a_namedtuple_of_loaders_is_rebuilt_into_the_same_namedtuple():
    from collections import namedtuple

    from lightning_dltune.switching.evaluation import dataloaders_in, with_each_dataloader

    Pair = namedtuple("Pair", "clean noisy")
    pair = Pair(DataLoader(range(4)), DataLoader(range(8)))
    rebuilt = with_each_dataloader(pair, lambda loader: DataLoader(loader.dataset, batch_size=2))
    assert isinstance(rebuilt, Pair) and [d.batch_size for d in dataloaders_in(rebuilt)] == [2, 2]
    assert with_each_dataloader({"a": pair.clean}, lambda loader: loader) == {"a": pair.clean}
