"""The tuner with the loader libraries Lightning users already use: torchdata's ``StatefulDataLoader``, litdata's
``StreamingDataset``/``StreamingDataLoader`` and webdataset, each with real worker processes.

Every epoch must train every sample exactly once, across retunes and across a resume from a checkpoint.
``scripts/install-test-deps.sh`` installs the three libraries (litdata without its torchvision dependency), so
these tests run in CI rather than skip: a missing library fails the import below.
"""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import lightning.pytorch as pl
import litdata
import pytest
import torch
import webdataset as wds
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.measurement.memory import MiB
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset

from helpers import make_trainer

LENGTH = 320  # samples per epoch
BATCH = 8  # 40 batches per epoch
LATENCY_MS = 3.0  # per sample, storage-like: about 24 ms per batch against a 2 ms step, so workers pay


class EpochSamples(pl.Callback):
    """The dataset indices each epoch trained on, and the worker counts of the loaders that delivered them."""

    def __init__(self):
        self.indices: dict[int, list[int]] = {}
        self.workers: dict[int, set[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        epoch = trainer.current_epoch
        self.indices.setdefault(epoch, []).extend(int(i) for i in batch[2])
        self.workers.setdefault(epoch, set()).add(trainer.train_dataloader.num_workers)


class LoaderModel(SimulatedModel):
    """A ``step_ms`` step on (features, label, index) batches from a new ``make_loader()`` at every
    ``train_dataloader()``."""

    def __init__(self, make_loader, step_ms=2.0):
        super().__init__(step_ms=step_ms)
        self.make_loader = make_loader

    def train_dataloader(self):
        return self.make_loader()


def fit(root, make_loader, tuner, epochs, ckpt_path=None, stop_at=None, step_ms=2.0):
    """One fit with a checkpoint at every epoch's end; with ``stop_at``, it stops after that many steps and
    checkpoints there (mid-epoch)."""
    seen = EpochSamples()
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1, every_n_train_steps=stop_at)
    trainer = make_trainer(
        root, [tuner, ckpt, seen], max_epochs=epochs, max_steps=stop_at or -1, logger=False, enable_checkpointing=True
    )
    trainer.fit(LoaderModel(make_loader, step_ms), ckpt_path=ckpt_path)
    return seen


def assert_exact(*runs, epochs, length=LENGTH):
    """Every epoch, a resumed one pieced together from its runs, trained each sample exactly once."""
    trained: dict[int, list[int]] = {}
    for run in runs:
        for epoch, indices in run.indices.items():
            trained.setdefault(epoch, []).extend(indices)
    assert sorted(trained) == list(range(epochs))
    for epoch, indices in trained.items():
        lost, repeated = set(range(length)) - set(indices), len(indices) - len(set(indices))
        assert sorted(indices) == list(range(length)), f"epoch {epoch}: {len(lost)} lost, {repeated} repeated"


def no_resume_warning(recwarn):
    """Lightning did not warn that the loader cannot resume mid-epoch: it saw a loader state to restore."""
    return not [w for w in recwarn if "ended before the epoch ended" in str(w.message)]


# ---------------------------------------------------------------------------------------------------------
# torchdata: StatefulDataLoader, whose state Lightning saves under the fit loop and restores on resume
# ---------------------------------------------------------------------------------------------------------


def stateful_loader():
    return StatefulDataLoader(SyntheticDataset(LENGTH, latency_ms=LATENCY_MS), batch_size=BATCH, shuffle=True)


def test_stateful_dataloader_tuned_then_resumed_mid_epoch_trains_exactly_the_rest_of_the_epoch(tmp_path, recwarn):
    tuner = DataLoaderTuner()
    head = fit(tmp_path / "a", stateful_loader, tuner, epochs=3, stop_at=100)  # stops at batch 20 of epoch 2
    assert head.workers[0] == {0} and tuner.trials[0].decision.startswith("try ")
    assert min(head.workers[2]) > 0  # the checkpoint's loader is one the tuner built, with workers
    ckpt = tmp_path / "a" / "ckpt" / "epoch=2-step=100.ckpt"
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(saved) == 1  # Lightning saved the StatefulDataLoader's own state with the fit loop

    tail = fit(tmp_path / "b", stateful_loader, DataLoaderTuner(), epochs=3, ckpt_path=ckpt)
    assert list(tail.indices) == [2] and len(head.indices[2]) == 20 * BATCH
    assert sorted(head.indices[2] + tail.indices[2]) == list(range(LENGTH))  # the rest of epoch 2, nothing else
    assert_exact(head, tail, epochs=3)
    assert no_resume_warning(recwarn)


def test_a_stateful_loader_resumed_mid_epoch_finishes_it_on_the_settings_its_state_was_saved_with(tmp_path):
    """The tuner's checkpoint may plan another config than the running one: here a run held on 0 workers at the
    end of epoch 0, since a switch could not pay in the 2 steps left. The loader state Lightning restores fits
    only the settings it was saved with (torchdata asserts the same ``num_workers``), so the rest of the epoch
    runs on them."""
    tuner = DataLoaderTuner()
    head = fit(tmp_path / "a", stateful_loader, tuner, epochs=3, stop_at=42)  # epoch 0, then 2 batches of epoch 1
    assert tuner.phase == "held" and tuner.state_dict()["target"]["num_workers"] > 0
    assert head.workers == {0: {0}, 1: {0}}

    resumed = DataLoaderTuner()
    tail = fit(tmp_path / "b", stateful_loader, resumed, epochs=3, ckpt_path=tmp_path / "a/ckpt/epoch=1-step=42.ckpt")
    assert tail.workers[1] == {0} and resumed.trials[len(tuner.trials)].settings.num_workers == 0
    assert_exact(head, tail, epochs=3)


def test_a_stateful_loader_resumed_at_an_epochs_end_goes_on_to_the_planned_settings_at_once(tmp_path):
    """Under ``max_steps`` Lightning restores the loader state at an epoch's end too, and relies on it: the restored
    loader ends the finished epoch at once. The tuner builds the loader that state fits, and goes on to its
    planned config when that epoch ends, so the next epoch runs on the plan."""
    tuner = DataLoaderTuner()
    head = fit(tmp_path / "a", stateful_loader, tuner, epochs=1)  # held at its only epoch's end: too late to switch
    planned = tuner.state_dict()["target"]["num_workers"]
    assert tuner.phase == "held" and planned > 0

    tail = fit(
        tmp_path / "b",
        stateful_loader,
        DataLoaderTuner(),
        epochs=3,
        stop_at=80,
        ckpt_path=tmp_path / "a/ckpt/last.ckpt",
    )
    assert tail.workers == {1: {planned}}
    assert_exact(head, tail, epochs=2)


class Hoarding(SyntheticDataset):
    """Each worker keeps 512 KiB (written, so it counts) of every sample it loads: over the budget mid-epoch."""

    kept: ClassVar[list[bytes]] = []

    def __getitem__(self, index):
        # each worker its own list; not the training process (a sample timed or loaded there), which would keep it
        # for the rest of the suite: 455 MiB once, and every later fork of the suite's process took twice as long
        if torch.utils.data.get_worker_info() is not None:
            Hoarding.kept.append(b"\1" * (512 * 1024))
        return super().__getitem__(index)


def test_a_stateful_loader_over_the_memory_budget_finishes_its_epoch_exactly_then_runs_on_fewer_workers(tmp_path):
    """A loader without in-epoch switching (its own batch sampler) cannot be left mid-epoch without losing its
    place: the switch down waits for the epoch's end, and the epoch goes on exactly instead of being torn down."""

    def hoarding_loader():
        dataset = Hoarding(480, latency_ms=2.0)
        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=4, persistent_workers=True)

    tuner = DataLoaderTuner(max_memory=160 * MiB)  # 4 workers hold 240 MiB by the end of an epoch
    # 20 ms steps: the workers' memory, read every 0.25 s, is seen going over within the epoch
    seen = fit(tmp_path, hoarding_loader, tuner, epochs=3, step_ms=20.0)
    assert all(len(workers) == 1 for workers in seen.workers.values()), seen.workers  # never left mid-epoch
    assert seen.workers[0] == {4} and max(seen.workers[2]) < 4
    # the 4 workers' config found over the budget: by the check at each step (a failure), or, where the window closed
    # before a reading crossed, by the window's decision, the memory budget capping it (about 1 run in 10): once, or
    # twice (when first seen, and the rest of the epoch), never once per step
    over = [
        t
        for t in tuner.trials
        if t.settings.num_workers == 4 and ("memory budget" in (t.failed or "") or "predicted to fit" in t.decision)
    ]
    assert 1 <= len(over) <= 2, [(t.settings.num_workers, t.failed, t.rule, t.decision) for t in tuner.trials]
    assert_exact(seen, epochs=3, length=480)


# ---------------------------------------------------------------------------------------------------------
# litdata: a dataset written by litdata.optimize, streamed by StreamingDataLoader (stateful too)
# ---------------------------------------------------------------------------------------------------------


def write_litdata(output_dir: Path) -> str:
    """``litdata.optimize`` in a process of its own (see ``tests/litdata_samples.py``), its caches in tmp."""
    root = output_dir.parent
    env = {
        **os.environ,
        "TMPDIR": str(root),
        "DATA_OPTIMIZER_CACHE_FOLDER": str(root / "optimize_chunks"),
        "DATA_OPTIMIZER_DATA_CACHE_FOLDER": str(root / "optimize_data"),
    }
    run = subprocess.run(
        [sys.executable, "-c", "import sys, litdata_samples; litdata_samples.write(sys.argv[1])", str(output_dir)],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return str(output_dir)


class SlowStreamingDataset(litdata.StreamingDataset):
    """litdata's samples as (features, label, index), each after a storage-like wait."""

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        time.sleep(LATENCY_MS / 1e3)
        i = int(sample["index"])
        return torch.tensor(sample["x"]), torch.tensor(i % 4), i


def test_litdata_streaming_loader_tuned_then_resumed_mid_epoch_exactly(tmp_path, recwarn):
    data = write_litdata(tmp_path / "optimized")

    def streaming_loader():
        return litdata.StreamingDataLoader(SlowStreamingDataset(data, shuffle=True), batch_size=BATCH)

    tuner = DataLoaderTuner(tune_iterable=True)  # litdata splits its chunks among the workers itself
    head = fit(tmp_path / "a", streaming_loader, tuner, epochs=3, stop_at=100)
    assert head.workers[0] == {0} and min(head.workers[2]) > 0  # retuned before the checkpoint
    assert 0 < len(head.indices[2]) < LENGTH

    resumed = DataLoaderTuner(tune_iterable=True)
    tail = fit(tmp_path / "b", streaming_loader, resumed, epochs=3, ckpt_path=tmp_path / "a/ckpt/epoch=2-step=100.ckpt")
    assert list(tail.indices) == [2]
    assert sorted(head.indices[2] + tail.indices[2]) == list(range(LENGTH))  # the rest of epoch 2, nothing else
    assert_exact(head, tail, epochs=3)
    assert no_resume_warning(recwarn)


# ---------------------------------------------------------------------------------------------------------
# webdataset: tar shards split among the workers by split_by_worker
# ---------------------------------------------------------------------------------------------------------

# At least the most workers the tuner's default budget allows (8 per CPU, at most 64): webdataset raises in a
# worker left without a shard ("No samples found in dataset; perhaps you have fewer shards than workers"); the test of
# that failure writes fewer.
SHARDS = 64


def write_shards(directory: Path, shards: int = SHARDS) -> list[str]:
    directory.mkdir()
    per_shard = LENGTH // shards
    urls = []
    for shard in range(shards):
        urls.append(str(directory / f"shard-{shard:03d}.tar"))
        with wds.TarWriter(urls[-1]) as sink:
            for i in range(shard * per_shard, (shard + 1) * per_shard):
                sink.write({"__key__": f"{i:06d}", "cls": i})
    return urls


def slow_sample(sample):
    time.sleep(LATENCY_MS / 1e3)
    i = int(sample["cls"])
    return torch.full((32,), float(i)), torch.tensor(i % 4), i


def test_webdataset_split_by_worker_is_retuned_and_every_epoch_is_exact(tmp_path):
    urls = write_shards(tmp_path / "shards")

    def web_loader():
        dataset = wds.WebDataset(
            urls, shardshuffle=SHARDS, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker
        )
        return DataLoader(dataset.decode().map(slow_sample), batch_size=BATCH)

    tuner = DataLoaderTuner(tune_iterable=True)  # split_by_worker gives each worker its own shards
    seen = fit(tmp_path / "run", web_loader, tuner, epochs=3)
    assert_exact(seen, epochs=3)
    assert seen.workers[0] == {0} and tuner.trials[0].settings.num_workers == 0
    retuned = {w for workers in seen.workers.values() for w in workers} - {0}
    assert retuned, f"the tuner never switched: {[t.decision for t in tuner.trials]}"
    assert {t.settings.num_workers for t in tuner.trials} >= {0, *retuned}


def slower_sample(sample):
    """80 ms a batch against a 2 ms step: the model asks for far more workers than the 4 shards feed."""
    time.sleep(10 / 1e3)
    return slow_sample(sample)


def test_webdataset_with_fewer_shards_than_the_workers_tried_trains_on_without_a_lost_or_repeated_sample(tmp_path):
    urls = write_shards(tmp_path / "shards", shards=4)  # a worker past the 4th has no shard and raises

    def web_loader():
        dataset = wds.WebDataset(
            urls, shardshuffle=4, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker
        )
        return DataLoader(dataset.decode().map(slower_sample), batch_size=BATCH)

    tuner = DataLoaderTuner(tune_iterable=True)  # split_by_worker gives each worker its own shards
    with pytest.warns(
        DLTuneWarning, match=r"failed its first batch \(ValueError: No samples found in dataset; perhaps you have"
    ):
        seen = fit(tmp_path / "run", web_loader, tuner, epochs=4)
    assert_exact(seen, epochs=4)
    failed = [t for t in tuner.trials if t.failed]
    assert failed and all(t.settings.num_workers > 4 for t in failed), [(t.settings, t.failed) for t in tuner.trials]
    assert "No samples found in dataset" in failed[0].failed
    assert max(w for workers in seen.workers.values() for w in workers) <= 4  # no epoch trained on a failing count
    assert 1 < tuner.best_settings["num_workers"] <= 4  # tuned on within what the shards feed
    assert "Failed, and not used again" in tuner.diagnosis and "fewer shards than workers" in tuner.diagnosis


class SyntheticStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_the_loaders_that_need_every_rank_alike_say_why():
    """Each rank of a distributed run may run its own workers (a DistributedSampler splits by rank), except where
    the loader's layout or state spans the ranks: litdata's chunks, a StatefulDataLoader's state, an iterable stream."""
    from lightning_dltune.switching.loader import ranks_alike

    assert ranks_alike(DataLoader(SyntheticDataset(length=8), batch_size=4)) is None
    assert "saved from rank zero only" in ranks_alike(StatefulDataLoader(SyntheticDataset(length=8), batch_size=4))
    stream = SyntheticStream()
    assert "stream" in ranks_alike(DataLoader(stream, batch_size=None))
    # litdata's loader is told by its class (built without data: writing chunks takes a process of its own)
    streaming = litdata.StreamingDataLoader.__new__(litdata.StreamingDataLoader)
    assert "world_size x num_workers" in ranks_alike(streaming)
