import json
import statistics
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset, in_memory_dataset

from helpers import CORES, EpochClock, make_trainer


def latency_dataset(length=320):
    return SyntheticDataset(length=length, latency_ms=10.0)  # ~160 ms to load a batch of 16 in one process


def test_latency_bound_mixin_settles_far_above_the_cores_and_gets_faster(tmp_path):
    dm = SyntheticDataModule(latency_dataset(), batch_size=16, num_workers=0)
    tuner = DataLoaderTuner()
    clock = EpochClock(tuner)
    make_trainer(tmp_path, [tuner, clock], max_epochs=4).fit(SimulatedModel(step_ms=5), datamodule=dm)

    best = tuner.best_settings
    assert best is not None and best["num_workers"] >= 3 * CORES, tuner.trials
    # the tuner leaves 0 workers inside the first epoch: compare with what an epoch at 0 workers costs
    untuned_epoch = tuner.trials[0].stats.mean_wall_s * len(dm.train_dataloader())
    assert clock.durations[-1] * 3 <= untuned_epoch, (clock.durations, untuned_epoch)
    # the mixin carries the settings its loader runs on: the settled ones, or where tuning was held (a next trial
    # could not pay in the steps left: a full-suite run) the running ones, which best_settings may not be
    assert dm.loader_settings == tuner.state.target and dm.num_workers == tuner.state.current.num_workers
    if tuner.phase == "settled":
        assert dm.num_workers == best["num_workers"]
    assert tuner.diagnosis.startswith("input-bound")
    # no worker outlives its loader: mid-epoch, live children == workers of the current loader
    assert clock.children and all(alive == workers for alive, workers in clock.children), clock.children

    report = json.loads((tmp_path / "lightning_logs" / "version_0" / "dltune_report.json").read_text())
    assert report["settled_settings"] == best
    assert report["start_settings"]["num_workers"] == 0
    assert len(report["trials"]) == len(tuner.trials) >= 2
    assert report["trials"][0]["stats"]["stall_frac"] > 0.5
    assert report["budget"]["cpus"] <= CORES
    assert report["diagnosis"] == tuner.diagnosis


class PlainModel(SimulatedModel):
    """No mixin: train_dataloader returns a plain DataLoader built with positional arguments."""

    def __init__(self, dataset, **kwargs):
        super().__init__(**kwargs)
        self.dataset = dataset

    def train_dataloader(self):
        return DataLoader(self.dataset, 16, True)


class LoaderSpy(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_epoch_start(self, trainer, pl_module):
        dl = trainer.train_dataloader
        self.seen.append((dl.num_workers, dl.batch_sampler.batch_size))


def test_plain_dataloader_is_rebuilt_and_tensorboard_gets_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tuner = DataLoaderTuner()
    used = LoaderSpy()
    # windows of 2 steps: the tuner leaves 0 workers after 2 steps of a plain stall, and this test compares the
    # windows logged at 0 workers with those on the settled config
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, [tuner, used], max_epochs=3, logger=logger, log_every_n_steps=2)
    trainer.fit(PlainModel(latency_dataset(256), step_ms=5))

    assert tuner.best_settings["num_workers"] >= 3 * CORES
    # the first epoch starts on the user's 0 workers, every later one on a config the tuner measured (trials also
    # switch inside an epoch, and a prefetch change is made on the running workers), the last on the settled one,
    # always at the user's batch size
    assert used.seen[0][0] == 0
    assert {w for w, _ in used.seen[1:]} <= {t.settings.num_workers for t in tuner.trials}
    assert used.seen[-1][0] == tuner.best_settings["num_workers"]
    assert {b for _, b in used.seen} == {16}

    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("stall_frac", "data_wait_ms", "step_ms", "samples_per_s", "num_workers", "prefetch_factor"):
        assert f"dltune/{key}" in tags, tags
    workers = [e.value for e in events.Scalars("dltune/num_workers")]
    assert workers[0] == 0 and max(workers) >= 3 * CORES
    assert set(workers) <= {float(t.settings.num_workers) for t in tuner.trials}  # logged = what ran

    # Judge phases, not single points: a window holding an epoch start (where the pipeline refills) stalls on any
    # config. The median window on the settled config against the median window at the starting 0 workers.
    def by_phase(tag):
        values = {e.step: e.value for e in events.Scalars(tag)}
        start = [v for step, v in values.items() if workers_at[step] == 0]
        settled = [v for step, v in values.items() if workers_at[step] == tuner.best_settings["num_workers"]]
        assert start and settled, (tag, values, workers_at)
        return statistics.median(start), statistics.median(settled)

    workers_at = {e.step: e.value for e in events.Scalars("dltune/num_workers")}
    stall_start, stall_settled = by_phase("dltune/stall_frac")
    rate_start, rate_settled = by_phase("dltune/samples_per_s")
    assert stall_start > 0.5 and stall_settled < stall_start, (stall_start, stall_settled)
    assert rate_settled > 4 * rate_start, (rate_start, rate_settled)  # about 14x measured on 2 idle cores
    assert (tmp_path / "tb" / "version_0" / "dltune_report.json").exists()


def test_in_memory_tensors_keep_zero_workers(tmp_path):
    dm = SyntheticDataModule(in_memory_dataset(1024), batch_size=32, num_workers=0)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=2).fit(SimulatedModel(step_ms=10), datamodule=dm)
    assert tuner.best_settings["num_workers"] == 0, tuner.trials
    # a noisy machine can push the in-process fetch just over the threshold; the model then tries one worker,
    # never a big jump, and comes back to 0
    assert max(t.settings.num_workers for t in tuner.trials) <= 1, tuner.trials


def test_a_long_step_does_not_get_workers_it_does_not_need(tmp_path):
    dm = SyntheticDataModule(SyntheticDataset(length=160, latency_ms=0.5), batch_size=16)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=3).fit(SimulatedModel(step_ms=80), datamodule=dm)
    assert tuner.best_settings["num_workers"] <= 1, tuner.trials


def test_observe_only_measures_but_never_rebuilds(tmp_path):
    dm = SyntheticDataModule(SyntheticDataset(length=160, latency_ms=2.0), batch_size=16)
    tuner = DataLoaderTuner(observe_only=True, report_path=tmp_path / "r.json")
    trainer = make_trainer(tmp_path, [tuner], max_epochs=2, logger=False)
    trainer.fit(SimulatedModel(step_ms=2), datamodule=dm)
    assert trainer.train_dataloader.num_workers == 0 and dm.num_workers == 0
    assert [t.settings.num_workers for t in tuner.trials] == [0, 0]
    assert tuner.trials[0].stats.stall_frac > 0.5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["phase"] == "observing" and len(report["trials"]) == 2


class Stream(IterableDataset):
    """Draws its samples at random and does not shard: every worker would yield 64 more."""

    def __init__(self, latency_ms=0.0):
        self.latency_ms = latency_ms

    def __iter__(self):
        for i in range(64):
            time.sleep(self.latency_ms / 1e3)
            yield torch.randn(32), torch.tensor(i % 4)


def test_by_default_a_random_stream_that_does_not_shard_is_caught_before_its_epoch_grows(tmp_path):
    """The first round's workers start from one seed: a stream drawn at random yields the same first batch in two of
    them, so the tuner goes back to 0 workers before a batch of more is served, and every epoch stays 8 batches."""

    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(Stream(latency_ms=2.0), batch_size=8)

        def on_train_epoch_start(self):
            self.batches = 0

        def training_step(self, batch, batch_idx):
            self.batches += 1
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self):
            self.epochs = [*getattr(self, "epochs", []), self.batches]

    model, tuner = M(step_ms=1), DataLoaderTuner(min_steps=2)  # min_steps=2: a trial per 8-batch epoch
    with pytest.warns(DLTuneWarning, match=r"does not shard itself: with workers=\d+ .*Went back to workers=0"):
        make_trainer(tmp_path, [tuner], max_epochs=3, logger=False).fit(model)
    assert model.epochs == [8, 8, 8]
    assert (
        any(t.failed and "does not shard" in t.failed for t in tuner.trials) and tuner.best_settings["num_workers"] == 0
    )


def test_iterable_dataset_is_measured_not_retuned(tmp_path):
    class M(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=8)

    # min_steps=2: a trial per 8-batch epoch (the default 8 steady steps would pool both epochs into one window);
    # the default's pooling is tested in tests/test_state.py. tune_iterable=False: measured only (the default checks
    # the sharding and tunes: the test above, and tests/test_safety.py)
    tuner = DataLoaderTuner(min_steps=2, tune_iterable=False)
    trainer = make_trainer(tmp_path, [tuner], max_epochs=2, logger=False)
    with pytest.warns(DLTuneWarning, match="IterableDataset.*tune_iterable=False"):
        trainer.fit(M(step_ms=1))
    assert trainer.train_dataloader.num_workers == 0
    assert tuner.phase == "disabled" and len(tuner.trials) == 2
    again = make_trainer(
        tmp_path / "again", [DataLoaderTuner(min_steps=2, tune_iterable=False)], max_epochs=1, logger=False
    )
    with pytest.warns(DLTuneWarning, match="IterableDataset"):  # a second fit in the same process is told again
        again.fit(M(step_ms=1))


def test_validate_stage_is_left_alone(tmp_path):
    class M(SimulatedModel):
        def validation_step(self, batch, batch_idx):
            pass

        def val_dataloader(self):
            return DataLoader(in_memory_dataset(64), batch_size=8)

    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], logger=False).validate(M())
    assert tuner.trials == [] and tuner.best_settings is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stall_threshold": 0}, ValueError, r"`stall_threshold` must be in \(0, 1\), got 0"),
        ({"stall_threshold": "5%"}, TypeError, r"`stall_threshold` must be a float"),
        ({"max_trials": 0}, ValueError, r"`max_trials` must be an int >= 1, got 0. Use 1"),
        ({"max_workers": -2}, ValueError, r"`max_workers` must be a non-negative int, got -2"),
        ({"max_prefetch": 0}, ValueError, r"`max_prefetch` must be an int >= 1"),
        ({"min_steps": 0}, ValueError, r"`min_steps` must be an int >= 1"),
        ({"plot": "yes"}, TypeError, r"`plot` must be True or False, got 'yes'. Use False to skip the PNG"),
        ({"observe_only": "no"}, TypeError, r"`observe_only` must be True or False, got 'no'"),
        ({"tune_iterable": "no"}, TypeError, r"`tune_iterable` must be True, False or 'auto', got 'no'"),
        ({"log_gpu": 1}, TypeError, r"`log_gpu` must be True or False, got 1"),
        ({"verbose": None}, TypeError, r"`verbose` must be True or False, got None"),
        ({"max_memory": float("inf")}, ValueError, r"`max_memory` must be a fraction in \(0, 1\], or a finite number"),
        ({"max_memory": float("nan")}, ValueError, r"`max_memory` must be a fraction in \(0, 1\]"),
        ({"max_memory": 1.5}, ValueError, r"or a finite number of bytes >= 1 MiB \(1048576\), got 1.5. Use 0.5"),
        ({"max_memory": 0}, ValueError, r"`max_memory` must be a fraction in \(0, 1\]"),
        ({"report_path": 7}, TypeError, r"`report_path` must be None, a bool or a path, got 7"),
        ({"cache": 3.0}, TypeError, r"`cache` must be None, a bool or a path, got 3.0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataLoaderTuner(**kwargs)


@pytest.mark.parametrize("max_memory", [1.0, 0.25, 2**20, 8 * 2**30])
def test_a_memory_budget_as_a_fraction_or_in_bytes_is_taken(max_memory):
    assert DataLoaderTuner(max_memory=max_memory).max_memory == max_memory


def test_pytorchs_worker_count_warning_is_replaced_by_one_line_of_the_tuners(tmp_path, lightning_log):
    import warnings

    tuner = DataLoaderTuner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [tuner], max_epochs=2, logger=False).fit(PlainModel(latency_dataset(256), step_ms=5))
    assert max(t.settings.num_workers for t in tuner.trials) > CORES  # more workers than cores, on purpose
    pytorch = [w for w in caught if "worker processes in total" in str(w.message)]
    assert pytorch == [], [str(w.message) for w in pytorch]
    ours = [r.getMessage() for r in lightning_log.records if "starts more worker processes than the" in r.getMessage()]
    assert len(ours) == 1 and "on purpose" in ours[0], ours
    # the tuner forked workers, none hung: nothing is said of CPython's fork bug, even on a Python that has it
    said = [r.getMessage() for r in lightning_log.records] + [str(w.message) for w in caught]
    assert not [m for m in said if "gh-112275" in m or "after it is forked" in m]


def test_a_users_own_many_workers_still_get_pytorchs_warning(tmp_path, lightning_log):
    class Many(SimulatedModel):
        def train_dataloader(self):
            return DataLoader(latency_dataset(64), batch_size=16, num_workers=CORES + 2)

    tuner = DataLoaderTuner(max_trials=1)  # rebuilt for in-epoch switching, but the worker count stays the user's
    with pytest.warns(UserWarning, match="worker processes in total"):
        make_trainer(tmp_path, [tuner], max_epochs=1, logger=False).fit(Many(step_ms=1))
    assert tuner.trials[0].settings.num_workers == CORES + 2
    said = [r.getMessage() for r in lightning_log.records]
    assert said, "the capture sees Lightning's info lines (else the next assertion could not fail)"
    assert not [m for m in said if "starts more worker processes" in m]


@pytest.mark.parametrize("verbose", [True, False])
def test_the_summary_is_printed_unless_verbose_is_false(tmp_path, lightning_log, verbose):
    dm = SyntheticDataModule(SyntheticDataset(160, latency_ms=2.0), batch_size=16)
    tuner = DataLoaderTuner() if verbose else DataLoaderTuner(verbose=False)  # the default is True: tested as it is
    make_trainer(tmp_path, [tuner], max_epochs=2, logger=False).fit(SimulatedModel(step_ms=1), datamodule=dm)
    said = [r.getMessage() for r in lightning_log.records if r.getMessage().startswith("DataLoaderTuner ")]
    summaries = [m for m in said if "Diagnosis: " in m]
    assert bool(summaries) == verbose, said
    assert tuner.diagnosis  # quiet or not, the result is there to read


@pytest.mark.picture  # what is written next to the report, the picture included
@pytest.mark.parametrize("report_path", [None, False])
def test_report_path_false_writes_neither_report_nor_picture(tmp_path, report_path):
    dm = SyntheticDataModule(SyntheticDataset(96, latency_ms=1.0), batch_size=16)
    tuner = DataLoaderTuner() if report_path is None else DataLoaderTuner(report_path=False)  # None: the default
    logger = pl.loggers.CSVLogger(tmp_path)  # the logger's directory: where the default writes
    make_trainer(tmp_path, [tuner], max_epochs=1, logger=logger).fit(SimulatedModel(step_ms=1), datamodule=dm)
    written = sorted(p.name for p in tmp_path.rglob("dltune_report.*"))
    assert written == ([] if report_path is False else ["dltune_report.json", "dltune_report.png"])
    assert tuner.report is not None and (tuner.report_file is None) == (report_path is False)


def test_no_config_goes_past_max_prefetch(tmp_path):
    # bursty waits: the tuner reaches for deeper prefetch where more workers alone do not hide them
    dm = SyntheticDataModule(SyntheticDataset(320, latency_ms=2.0, tail_prob=0.1, tail_factor=20.0), batch_size=16)
    tuner = DataLoaderTuner(max_prefetch=1)
    make_trainer(tmp_path, [tuner], max_epochs=3, logger=False).fit(SimulatedModel(step_ms=1), datamodule=dm)
    assert any(t.settings.num_workers > 0 for t in tuner.trials)
    assert {t.settings.prefetch_factor for t in tuner.trials} <= {None, 1}, [t.settings for t in tuner.trials]
    assert tuner.best_settings["prefetch_factor"] in (None, 1)


@pytest.mark.parametrize(
    ("version", "hangs"),
    [
        ((3, 11, 7), True),  # this machine's: the worker stuck in PyOS_AfterFork_Child, read with gdb
        ((3, 11, 9), True),
        ((3, 11, 10), False),  # the fix (CPython gh-112275)
        ((3, 10, 14), True),
        ((3, 10, 15), False),
        ((3, 12, 0), False),  # 3.12 had it from the start
        ((3, 13, 1), False),
    ],
)
def test_the_pythons_whose_forked_workers_can_hang_are_named(version, hangs):
    from lightning_dltune.switching.forkwatch import forks_may_hang

    assert forks_may_hang(version) is hangs
