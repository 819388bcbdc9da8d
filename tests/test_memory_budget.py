"""The memory budget held with real workers: copy-on-read growth measured before the jump, and enforced inside
the epoch when it is overrun. The workers' memory is sampled by the test itself, apart from the tuner's own."""

import collections
import gc
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
from test_in_epoch import EpochIndices, WorkersPerBatch

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.memory import MiB
from lightning_dltune.tools.synthetic import (
    PythonObjectsDataset,
    SimulatedModel,
    SyntheticDataModule,
    SyntheticDataset,
    WorkerMemoryWatch,
)

from helpers import make_trainer


def exact_epochs(epochs, length):
    return all(collections.Counter(e) == collections.Counter(range(length)) for e in epochs)


class MeasuringSpy(pl.Callback):
    """At each batch: the running worker count and whether the tuner's memory readings run at the larger share."""

    def __init__(self, tuner):
        self.tuner, self.seen = tuner, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        current = self.tuner.state.current
        self.seen.append((current.num_workers if current else None, self.tuner.probe.memory.measuring))


@pytest.mark.timeout(240)
def test_many_python_objects_stay_within_the_memory_budget_and_train_exactly(tmp_path):
    dataset = PythonObjectsDataset()
    budget = 90 * MiB
    tuner = DataLoaderTuner(max_memory=budget)
    record, spy = EpochIndices(), MeasuringSpy(tuner)
    # Only reading the dataset's objects may grow a worker (the copy-on-read this test bounds). Unfrozen, a garbage
    # collection in a worker touches every object header of this test process, which after a few hundred tests
    # holds far more than the dataset: that one-off copy depends on what ran before (the full suite measured
    # 120 MiB against the 116.6 MiB bound, twice; alone it passes), as in test_safety.
    gc.collect()
    gc.freeze()
    try:
        with WorkerMemoryWatch() as watch:
            # 6 epochs: the settled workers are persistent and go on copying in later epochs, toward the budget
            # (settled on 3 of them, they reach it, and the check at each step must leave them between readings)
            trainer = make_trainer(tmp_path, [tuner, record, spy], max_epochs=6, logger=False)
            trainer.fit(SimulatedModel(step_ms=10), datamodule=SyntheticDataModule(dataset, batch_size=16))
    finally:
        gc.unfreeze()
    assert exact_epochs(record.epochs, len(dataset))
    worked = [t for t in tuner.trials if t.settings.num_workers > 0]
    assert worked, [t.decision for t in tuner.trials]
    # the first jump measured a small config before going far: the process holds more than the budget
    assert worked[0].settings.num_workers <= 2, tuner.trials[0].decision
    assert "to measure a worker's memory" in tuner.trials[0].decision
    # that window read its workers at the larger CPU share (set at the decision, a batch before its loader
    # serves), and the configs after it did not
    probe = worked[0].settings.num_workers
    assert any(measuring for w, measuring in spy.seen if w == probe), spy.seen
    assert not any(measuring for w, measuring in spy.seen if w > probe), spy.seen
    growth = max(t.stats.worker_mem_growth_bytes for t in worked)
    assert growth > 0, "the workers' copy-on-read growth was measured"
    # The bound: the 1.05x of the budget. Workers predicted to outgrow the budget are not settled on, old
    # workers stop before new ones start (tested in test_in_epoch), and the check at each step leaves the running
    # ones before a reading crosses the budget (their latest reading, grown since, plus what they grow before they
    # stop). Before the readings were summed worker by worker and paced by the growth per batch, settled workers
    # went 1.12x past it between two readings.
    assert watch.peak <= 1.05 * budget, (watch.peak / MiB, len(watch.others), [t.decision for t in tuner.trials])
    assert max(t.settings.num_workers for t in tuner.trials) >= 2, [
        (t.settings.describe(), t.stats.steps, t.stats.worker_memory, t.decision) for t in tuner.trials
    ]  # and the budget was used, not avoided


class Leaky(SyntheticDataset):
    """Each worker keeps ``leak_kib`` of every sample it loads: fine at first, over the budget mid-epoch."""

    kept: ClassVar[list[bytes]] = []

    def __init__(self, length=480, leak_kib=512):
        super().__init__(length=length)
        self.leak = leak_kib * 1024

    def __getitem__(self, index):
        # written, so it counts: `bytes(n)` is calloc'd zero pages that USS does not see until touched
        # each worker its own list; not the training process (a sample timed or loaded there), which would keep it
        # for the rest of the suite: 455 MiB once, and every later fork of the suite's process took twice as long
        if torch.utils.data.get_worker_info() is not None:
            Leaky.kept.append(b"\1" * self.leak)
        return super().__getitem__(index)


@pytest.mark.timeout(240)
def test_memory_growing_past_the_budget_mid_epoch_switches_down_inside_the_epoch_exactly(tmp_path):
    dataset = Leaky()
    # max_workers=4: the user's own 4 workers are the ones that grow past the budget (a stalling window with
    # workers is judged after min_steps, and the tuner would otherwise add workers first); the default ceiling's
    # path through the budget is the test above
    tuner = DataLoaderTuner(max_memory=160 * MiB, max_workers=4)
    record, workers = EpochIndices(), WorkersPerBatch()
    dm = SyntheticDataModule(dataset, batch_size=8, num_workers=4)  # the user's own 4 (persistent) workers
    trainer = make_trainer(tmp_path, [tuner, record, workers], max_epochs=2, logger=False)
    with WorkerMemoryWatch() as watch:
        trainer.fit(SimulatedModel(step_ms=20), datamodule=dm)
    assert exact_epochs(record.epochs, len(dataset))
    # Held within 20 batches' leak (8 samples of 512 KiB a batch, 80 MiB) of the budget: the check at each step
    # counts what the workers grew since their latest reading (read once, at most all they hold per batch taken; a
    # new loader's from nothing, growing as the workers before them). Alone this test peaks at most 7 MiB over it;
    # in the full suite it went 40-100 MiB over before the last two were counted. Before the check counted growth,
    # the workers were read every 2 s far from the budget, and reached 380-395 MiB between two readings.
    assert watch.peak <= 160 * MiB + 20 * 8 * dataset.leak, (watch.peak / MiB, [t.decision for t in tuner.trials])
    # the user's 4 workers are left for going over the budget (the check at each step) or, where their first
    # window's readings already showed the leak, for being predicted to outgrow it (the full suite saw both)
    left = [t for t in tuner.trials if (t.failed and "memory budget" in t.failed) or "outgrow" in (t.decision or "")]
    assert left, [t.decision for t in tuner.trials]
    assert left[0].settings.num_workers == 4
    in_epoch = [e for e in range(2) if len({w for ep, w in workers.seen if ep == e}) > 1]
    assert in_epoch, workers.seen  # 4 workers, then fewer, inside one epoch: left mid-epoch, not at its end
    assert tuner.best_settings["num_workers"] < 4
    assert "memory budget" in tuner.diagnosis and "numpy arrays" in tuner.diagnosis
