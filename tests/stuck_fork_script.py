"""Run by tests/test_forkwatch.py as its own process: a fit in which one forked loader worker hangs before Python's
after-fork code ends, as CPython's gh-112275 leaves one.

python tests/stuck_fork_script.py OUT train   # the train loader's first forked worker hangs
python tests/stuck_fork_script.py OUT val 2   # the validation loader's first forked worker (in the sanity check),
                                              # stopped after 2 s instead of the default 10 s

The hang is made real: this script's own ``os.register_at_fork`` hook, registered before the tuner's, makes the
chosen child wait for ever on a lock it holds (a futex wait, as CPython's hang is) before the tuner's hook runs in it,
so the child never reports, stays alive, and never reads its queue. Writes OUT/result.json: each epoch's train indices
and the order its batch sampler drew, each validation pass's indices, the processes the watch stopped, the windows'
start-up times, and the tuner's warnings.
"""

import json
import os
import sys
import threading
import warnings
from pathlib import Path

_forks = 0


def _count() -> None:
    global _forks
    _forks += 1


def _hang_the_first() -> None:
    if _forks == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # for ever


os.register_at_fork(before=_count, after_in_child=_hang_the_first)  # first: the tuner's hook never runs in it

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_dltune import DataLoaderTuner  # noqa: E402
from lightning_dltune.switching import forkwatch  # noqa: E402
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset  # noqa: E402


class Recorded(SimulatedModel):
    def __init__(self) -> None:
        super().__init__(step_ms=2.0)
        self.by_epoch: dict[int, list[int]] = {}
        self.drawn: list[list[int]] = []  # each epoch's order, as the train loader's batch sampler drew it
        self.val_passes: list[list[int]] = []

    def on_train_epoch_end(self) -> None:
        self.drawn.append(self.trainer.train_dataloader.batch_sampler.epoch_order)

    def training_step(self, batch, batch_idx):
        self.by_epoch.setdefault(self.current_epoch, []).extend(int(i) for i in batch[2])
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self.val_passes.append([])

    def validation_step(self, batch, batch_idx):
        self.val_passes[-1].extend(int(i) for i in batch[2])


class WithValidation(SyntheticDataModule):
    def __init__(self, val_workers: int) -> None:
        super().__init__(SyntheticDataset(length=192, latency_ms=4.0), batch_size=8, seed=3)
        self.val_workers = val_workers

    def val_dataloader(self):
        data = SyntheticDataset(length=96, latency_ms=4.0)
        return torch.utils.data.DataLoader(data, batch_size=8, num_workers=self.val_workers)


def main() -> None:
    out, where = Path(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        forkwatch._WATCH.after_s = float(sys.argv[3])
    warnings.simplefilter("always")
    pl.seed_everything(5, workers=True)
    model, tuner = Recorded(), DataLoaderTuner()
    stopped, say = [], forkwatch._WATCH.on_kill
    forkwatch._WATCH.on_kill = lambda pid: (stopped.append(pid), say(pid))
    # the sanity check's loader forks first only where the validation loader has workers
    data = WithValidation(val_workers=2 if where == "val" else 0)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        callbacks=[tuner],
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    result = {
        "epochs": [model.by_epoch[e] for e in sorted(model.by_epoch)],
        "drawn": model.drawn,
        "startup_s": [t.stats.startup_s for t in [*tuner.trials, *tuner.evals.tuners["val"].state.trials]],
        "val_passes": model.val_passes,
        "stopped": stopped,
        "forks": _forks,
        "warnings": [str(w.message) for w in caught if "DataLoaderTuner" in str(w.message)],
        "failed": [s.describe() for s in tuner.state.failed_configs],
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
