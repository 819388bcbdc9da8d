import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dltune import DataLoaderTuner
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import make_trainer


class LoaderSpy(pl.Callback):
    def __init__(self):
        self.workers = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.workers.append(trainer.train_dataloader.num_workers)


def data():
    return SyntheticDataModule(SyntheticDataset(length=192, latency_ms=10.0), batch_size=16, num_workers=0)


def fit(tmp_path, epochs, ckpt_path=None, tuner=None, dm=None, spy=None, every_n_steps=None, **kwargs):
    # cache off in these resume tests: a resumed fit must go on from its checkpoint, and a fit before it in the same
    # test would leave a cache hit for it (a resume with the default cache: test_loader_libraries.py)
    tuner = tuner or DataLoaderTuner(cache=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1, every_n_train_steps=every_n_steps)
    callbacks = [tuner, ckpt] + ([spy] if spy else [])
    trainer = make_trainer(tmp_path, callbacks, max_epochs=epochs, logger=False, enable_checkpointing=True, **kwargs)
    trainer.fit(SimulatedModel(step_ms=20), datamodule=dm or data(), ckpt_path=ckpt_path)
    return tuner, trainer


def test_resumed_after_settling_it_starts_on_the_settled_settings_and_does_not_tune(tmp_path):
    # a 50% threshold settles after the first jump: no near-threshold stall left for the run length to judge (at
    # 20%, the 9-10 workers of the jump stalled 10-14% alone, and past 20% once in a full suite on a busy host: the
    # next config would not have paid in the steps left, and the run held instead of settling). The default threshold
    # (5%) is what the other resumes here run with; cache off as in `fit` (see there)
    first, _ = fit(tmp_path, epochs=3, tuner=DataLoaderTuner(cache=False, stall_threshold=0.5))
    assert first.phase == "settled", [(t.settings.describe(), t.stats.steps, t.decision) for t in first.trials]
    spy = LoaderSpy()
    second, _ = fit(
        tmp_path,
        epochs=5,
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
        spy=spy,
        tuner=DataLoaderTuner(cache=False, stall_threshold=0.5),  # as the first fit: the same run, resumed
    )
    assert len(second.trials) == len(first.trials)  # zero tuning trials after resume
    assert second.best_settings == first.best_settings
    assert spy.workers == [first.best_settings["num_workers"]] * 2  # from the first resumed epoch on


def short_data():
    """4 batches an epoch: the stall is plain after 2 steps, with 1 step left, too few to pay for a start."""
    return SyntheticDataModule(SyntheticDataset(length=64, latency_ms=10.0), batch_size=16, num_workers=0)


def test_resumed_mid_tuning_it_continues_where_it_was(tmp_path):
    first, _ = fit(tmp_path, epochs=1, dm=short_data())
    # the run ended after its first window: too late to pay for a switch, so it stays and plans the next config
    assert first.phase == "held" and len(first.trials) == 1
    planned = first.state_dict()["target"]["num_workers"]
    assert planned > 0
    spy = LoaderSpy()
    second, _ = fit(tmp_path, epochs=3, ckpt_path=tmp_path / "ckpt" / "last.ckpt", spy=spy, dm=short_data())
    assert spy.workers[0] == planned  # the config decided before the checkpoint is the next one measured
    assert second.trials[0] == first.trials[0] and len(second.trials) >= 2


def test_the_mixin_restores_settings_from_the_datamodule_state_alone():
    dm = data()
    dm.num_workers, dm.prefetch_factor, dm.persistent_workers = 6, 4, True
    fresh = data()
    fresh.load_state_dict(dm.state_dict())
    assert fresh.loader_kwargs == {
        "num_workers": 6,
        "prefetch_factor": 4,
        "pin_memory": False,
        "persistent_workers": True,
    }


@pytest.mark.parametrize(
    ("state", "phase"),
    [
        ({}, "tuning"),
        ({"phase": "settled"}, "tuning"),  # settled on nothing: there is no config to stay on, so it tunes
        ({"phase": "settled", "best_settings": {"num_workers": 3}}, "settled"),
        ({"version": 0, "trials": []}, "tuning"),
    ],
    ids=["empty", "settled_without_settings", "settled", "version_0"],
)
def test_older_or_partial_checkpoints_load(state, phase):
    tuner = DataLoaderTuner()
    tuner.load_state_dict(state)
    assert tuner.trials == [] and tuner.phase == phase
    assert tuner.state.target == (LoaderSettings(3, 2, False, True) if phase == "settled" else None)


class Indices(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.extend(int(i) for i in batch[2])


def indices_of(path, tuner, latency_ms=1.0, **kwargs):
    """The dataset indices one epoch trains on, in order (a 60-batch epoch, seeded)."""
    pl.seed_everything(11, workers=True)
    seen = Indices()
    dm = SyntheticDataModule(SyntheticDataset(length=480, latency_ms=latency_ms), batch_size=8, num_workers=0)
    fit(path, epochs=1, tuner=tuner, dm=dm, spy=seen, **kwargs)
    return seen.seen


def test_resumed_mid_epoch_the_epoch_continues_in_the_same_order(tmp_path):
    # mode="in_epoch", windows of 10: the checkpoint at step 25 falls in an epoch that switched inside, twice (with
    # the defaults: the test below)
    # the reference trains untuned (observe_only) and no earlier run's cache starts any run here (cache=False)
    reference = indices_of(tmp_path / "ref", DataLoaderTuner(observe_only=True, cache=False))  # as `fit` does
    head = indices_of(
        tmp_path / "b",
        DataLoaderTuner(mode="in_epoch", window_steps=10, min_steps=5, cache=False),
        every_n_steps=25,
        max_steps=25,
    )
    ckpt = tmp_path / "b" / "ckpt" / "epoch=0-step=25.ckpt"
    assert ckpt.exists() and len(head) == 25 * 8
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        tail = indices_of(
            tmp_path / "c", DataLoaderTuner(mode="in_epoch", window_steps=10, min_steps=5, cache=False), ckpt_path=ckpt
        )
    assert head + tail == reference  # no sample lost or repeated across the restart


def test_resumed_mid_epoch_with_the_defaults_the_epoch_continues_in_the_same_order(tmp_path):
    # the reference trains untuned (observe_only) and no earlier run's cache starts any run here (cache=False)
    reference = indices_of(tmp_path / "ref", DataLoaderTuner(observe_only=True, cache=False))
    head = indices_of(tmp_path / "b", DataLoaderTuner(cache=False), every_n_steps=25, max_steps=25)
    ckpt = tmp_path / "b" / "ckpt" / "epoch=0-step=25.ckpt"
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        tail = indices_of(tmp_path / "c", DataLoaderTuner(cache=False), ckpt_path=ckpt)
    assert head + tail == reference


def test_a_second_checkpoint_in_a_resumed_epoch_keeps_the_order(tmp_path):
    """Lightning skips `on_train_epoch_start` when it resumes mid-epoch: the guard, the position and the
    start-up accounting must come back without it, so a second checkpoint in the same epoch is exact too."""

    def tuner():  # switches inside the epoch, as in the test above
        return DataLoaderTuner(mode="in_epoch", window_steps=10, min_steps=5)

    reference = indices_of(tmp_path / "ref", DataLoaderTuner(observe_only=True))
    head = indices_of(tmp_path / "a", tuner(), every_n_steps=25, max_steps=25)
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        middle = indices_of(
            tmp_path / "b", tuner(), every_n_steps=40, max_steps=40, ckpt_path=tmp_path / "a/ckpt/epoch=0-step=25.ckpt"
        )
    second = tmp_path / "b" / "ckpt" / "epoch=0-step=40.ckpt"
    assert second.exists() and len(middle) == 15 * 8
    state = next(v for k, v in torch.load(second, weights_only=False)["callbacks"].items() if "DataLoaderTuner" in k)
    assert state["epoch_batch"] == 40  # the position in the epoch, not in the resumed iterator
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        tail = indices_of(tmp_path / "c", tuner(), ckpt_path=second)
    assert head + middle + tail == reference  # no sample lost or repeated across two restarts


CHECKPOINTS = sorted((Path(__file__).parent / "data").glob("tuner-*-mid-epoch.ckpt"))


@pytest.mark.parametrize("path", CHECKPOINTS, ids=[p.name for p in CHECKPOINTS])
def test_a_checkpoint_an_earlier_release_wrote_mid_epoch_resumes_in_the_same_order(tmp_path, path):
    """A checkpoint committed at a release (``tests/data/make_checkpoint.py``: a stalled fit stopped at step 25 of 60,
    one trial taken, 3 workers running) still loads: the epoch goes on from its batch in its order on the settings it
    ran, and what was learnt is kept."""
    saved = torch.load(path, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("DataLoaderTuner")]
    # the epoch's order as the saved fit drew it (its first 25 batches trained before the checkpoint)
    order = state["epoch_order"]
    assert sorted(order) == list(range(480)) and state["epoch_batch"] == 25
    ckpt = tmp_path / path.name
    shutil.copy(path, ckpt)
    # cache=False, as in every resume test here (see `fit`): the resumed fit goes on from the file, not from a cache
    # entry an earlier test left (a resume with the default cache: tests/test_loader_libraries.py)
    tuner = DataLoaderTuner(cache=False)
    with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
        tail = indices_of(tmp_path / "c", tuner, latency_ms=5.0, ckpt_path=ckpt)
    assert tail == order[25 * 8 :]
    learnt = len(state["trials"])
    assert [t.to_dict() for t in tuner.trials[:learnt]] == state["trials"]
    assert tuner.trials[learnt].settings == LoaderSettings.from_dict(state["loader_settings"])  # the next window's
