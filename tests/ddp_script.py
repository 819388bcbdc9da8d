"""Run by tests/test_ddp.py as its own process tree: Lightning's "ddp" launcher re-executes this script.

python tests/ddp_script.py OUT single       # 2 processes on one node (Lightning launches the second)
                                            # ... rank 1 loads at a sixth of rank 0's pace
python tests/ddp_script.py OUT kill in_epoch  # the same, a worker of rank 1 killed in epoch 0
python tests/ddp_script.py OUT head in_epoch  # stopped and checkpointed in the middle of epoch 2
python tests/ddp_script.py OUT tail in_epoch CKPT  # resumed from that checkpoint
NODE_RANK=i ... python tests/ddp_script.py OUT node   # two processes per "node", each node launched by the test
python tests/ddp_script.py OUT memory       # 4 workers per rank whose memory grows past the node's budget
"""

import contextlib
import faulthandler
import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DistributedSampler

from lightning_dltune import DataLoaderTuner
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset


class Record(pl.Callback):
    """The indices each epoch trained on (per batch: a resumed epoch has no epoch start), and its sampler's epoch."""

    def __init__(self):
        self.by_epoch: dict[int, list[int]] = {}
        self.sampler_epochs = []
        self.workers: list[int] = []  # the train loader's workers at each epoch's start
        self.pids: list[list[int]] = []  # ... and their processes

    def on_train_epoch_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.batch_sampler.sampler
        self.sampler_epochs.append(sampler.epoch if isinstance(sampler, DistributedSampler) else None)
        self.workers.append(trainer.train_dataloader.num_workers)
        tuner = next(c for c in trainer.callbacks if isinstance(c, DataLoaderTuner))
        self.pids.append(sorted(tuner.switcher.worker_pids()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_epoch.setdefault(trainer.current_epoch, []).extend(int(i) for i in batch[2])

    @property
    def epochs(self) -> list[list[int]]:
        return [self.by_epoch[e] for e in sorted(self.by_epoch)]


class Dropout(SimulatedModel):
    """Draws from the global random state in every step, as dropout does: seamless epochs must not move a draw."""

    def training_step(self, batch, batch_idx):
        x = torch.nn.functional.dropout(batch[0], 0.5)
        return super().training_step((x, *batch[1:]), batch_idx)


class WithValidation(SyntheticDataModule):
    """A validation loader beside the train one (the user's 0 workers), as a plain DataModule returns it."""

    def val_dataloader(self):
        return torch.utils.data.DataLoader(SyntheticDataset(length=160, latency_ms=5.0), batch_size=16)


class Validated(Dropout):
    """Records each validation batch's indices (sanity check included)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.val_seen: list[list[int]] = []

    def validation_step(self, batch, batch_idx):
        self.val_seen.append([int(i) for i in batch[2]])


class KillOnRank1(pl.Callback):
    """Kill one worker of rank 1's train loader at its 4th batch: a death only that rank sees."""

    def __init__(self):
        self.killed = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.current_epoch == 0 and batch_idx == 3 and self.killed is None:
            import signal

            self.killed = trainer.train_dataloader._iterator._workers[0].pid
            os.kill(self.killed, signal.SIGKILL)


def show_a_hang(after_s: float = 85.0) -> None:
    """A hang shows its stacks instead of a silent timeout: this process's, and its descendants' (its loader workers,
    forked, keep the SIGUSR1 handler; a rank it launched registers its own): each writes its stacks to the log, then
    the process exits. A descendant without the handler (a spawned worker) is ended by the signal instead."""
    import signal
    import threading
    import time

    import psutil

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def dump() -> None:
        time.sleep(after_s)
        me = f"rank {os.environ.get('LOCAL_RANK', '0')} (pid {os.getpid()})"
        print(f"ddp_script: {me} still running after {after_s:.0f} s; its loader iterators:", flush=True)
        print(loader_iterators(), flush=True)
        for child in psutil.Process().children(recursive=True):  # one at a time: their stacks do not interleave
            with contextlib.suppress(psutil.Error):
                print(f"ddp_script: {me}: stacks of {child.pid} ({child.ppid()}'s child)", flush=True)
                child.send_signal(signal.SIGUSR1)
                time.sleep(0.2)
        print(f"ddp_script: stacks of {me}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    threading.Thread(target=dump, name="show-a-hang", daemon=True).start()
    faulthandler.dump_traceback_later(after_s + 10, exit=True)  # where that thread cannot run


def loader_iterators() -> str:
    """Every multi-process loader iterator of this process, as PyTorch tracks its batches: where a hang waits."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    lines = []
    for it in [o for o in gc.get_objects() if isinstance(o, _MultiProcessingDataLoaderIter)]:
        try:
            queued = [q.qsize() for q in it._index_queues] if not it._shutdown else "shut down"
            results = it._worker_result_queue.qsize() if not it._shutdown else "shut down"
        except Exception as error:  # a closed queue
            queued = results = repr(error)
        tasks = {i: (info[0], len(info)) for i, info in it._task_info.items()}  # batch: (worker, 2 once it arrived)
        lines.append(
            f"  {id(it):x} over {len(it._dataset)} samples: {it._num_workers} workers, alive "
            f"{[w.is_alive() for w in it._workers]}, status {it._workers_status}, sent {it._send_idx}, received "
            f"{it._rcvd_idx}, yielded {it._num_yielded}, outstanding {it._tasks_outstanding}, tasks {tasks}, "
            f"queued per worker {queued}, results queued {results}, prefetch {it._prefetch_factor}, "
            f"own attributes {sorted(k for k in vars(it) if k in ('_reset', '_try_put_index'))}"
        )
    return "\n".join(lines) or "  none"


def main() -> None:
    show_a_hang(float(os.environ.get("DDP_SCRIPT_DUMP_AFTER_S", 85)))  # set lower to see the dump without a hang
    out, kind = Path(sys.argv[1]), sys.argv[2]
    warnings.filterwarnings("ignore")
    if kind == "node" and os.environ.get("NODE_RANK") == "1" and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this "node" has fewer CPUs
    pl.seed_everything(5, workers=True)
    mode = sys.argv[3] if len(sys.argv) > 3 else "auto"
    # report, cache and summary at their defaults (the cache file is the test's own, through $DLTUNE_CACHE);
    # short windows only so that 12-step epochs hold several of them
    # the memory run's budget is the node's, split between its 2 ranks as DataLoaderTuner does: 72 MiB each
    memory = {"max_memory": 144 * 2**20} if kind == "memory" else {}
    # the resumed run's own counts come back from a settled run: no deeper prefetch left to try, whose start would not
    # pay in the steps left (a hold, which a resumed run tries on every rank alike)
    memory.update({"max_prefetch": 2} if kind in ("head", "tail") else {})
    tuner = DataLoaderTuner(mode=mode, window_steps=5, min_steps=4, **memory)
    record = Record()
    extra = [KillOnRank1()] if kind == "kill" else []
    limits = {}
    if kind == "head":  # stop and checkpoint at step 30: batch 6 of epoch 2 (12 batches per rank and epoch), once
        # tuning settled (at step 18 a hold could end it: too few steps left to pay for a deeper prefetch)
        from lightning.pytorch.callbacks import ModelCheckpoint

        extra.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=30, save_top_k=-1))
        limits = {"max_steps": 30, "enable_checkpointing": True}
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        num_nodes=2 if kind == "node" else 1,
        max_epochs=4 if kind in ("memory", "head", "tail") else 3,
        default_root_dir=out,
        callbacks=[tuner, record, *extra],
        # a logger whose directory is `out`: the report's default place, read by every rank together (a broadcast)
        logger=pl.loggers.CSVLogger(out, name="", version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **limits},
    )
    workers = {"kill": 2, "memory": 4}.get(kind, 0)  # a worker to kill; the user's own 4 workers
    if kind == "memory":
        from test_memory_budget import Leaky  # each worker keeps 512 KiB of every sample it loads

        dataset: SyntheticDataset = Leaky(length=384)
    elif kind in ("single", "head", "tail"):  # rank 1's samples take 6x as long (3x in the resumed run's two halves:
        # fewer workers to start): the ranks differ, the tuner says which waits, and each rank runs its own workers once
        # tuning ended (a resumed run too)
        slow = 6.0 if kind == "single" else 3.0
        dataset = SyntheticDataset(length=384, latency_ms=1.0 if os.environ.get("LOCAL_RANK", "0") == "0" else slow)
    else:
        dataset = SyntheticDataset(length=384, latency_ms=5.0)
    validated = kind == "single"  # with a validation set, validated every epoch
    dm = (WithValidation if validated else SyntheticDataModule)(dataset, batch_size=16, num_workers=workers)
    ckpt_path = sys.argv[4] if kind == "tail" else None
    model = Validated(step_ms=5) if validated else Dropout(step_ms=5)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    val = tuner.evals.tuners["val"].state
    result = {
        "rank": trainer.global_rank,
        "pid": os.getpid(),
        "cpu_apart": tuner.probe.apart,  # the ranks this one launched, whose CPU is not its loader's
        "world_size": trainer.world_size,
        "best_settings": tuner.best_settings,
        "trials": [t.settings.to_loader_kwargs() for t in tuner.trials],
        "decisions": [t.decision for t in tuner.trials],
        "trial_ranks": [list(t.ranks) for t in tuner.trials],  # each rank's stall, per window
        "rank_workers": tuner.agreement.rank_workers,  # each rank's own count, once they run their own
        "alike": tuner.agreement.alike,
        "running": tuner.state.current.to_loader_kwargs(),  # this rank's settings at the end
        "workers_per_epoch": record.workers,
        "pids_per_epoch": record.pids,
        "own_cpus": len(os.sched_getaffinity(0)),
        "agreed_cpus": None if tuner.agreed_budget is None else tuner.agreed_budget.cpus,
        "stall_spread": tuner.stall_spread,
        "epochs": record.epochs,
        "by_epoch": record.by_epoch,
        "sampler_epochs": record.sampler_epochs,
        "sampler": type(trainer.train_dataloader.batch_sampler.sampler).__name__,
        "seed": int(os.environ.get("PL_GLOBAL_SEED", 0)),
        "steps_per_trial": [t.stats.steps for t in tuner.trials],
        "phase": str(tuner.phase),
        "settled_step": tuner.settled_step,
        "failed": [t.failed for t in tuner.trials],
        "carried": tuner.switcher.seamless.carried,  # epochs begun on the last epoch's iterator (seamless)
        "report_file": None if tuner.report_file is None else str(tuner.report_file),
        "memory_budget": None if tuner.budget is None else tuner.budget.memory_bytes,
        "own_max_workers": None if tuner.budget is None else tuner.budget.max_workers,  # this rank's share's
        "val_seen": getattr(model, "val_seen", []),
        "val_trials": [t.settings.to_loader_kwargs() for t in val.trials],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
