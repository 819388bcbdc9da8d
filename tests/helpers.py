import os
import time

import lightning.pytorch as pl
import psutil

from lightning_dltune import DataLoaderTuner

CORES = len(os.sched_getaffinity(0))


def live_children(process: psutil.Process | None = None, recursive: bool = True) -> list[psutil.Process]:
    """Live child processes (of this process by default), less the helpers started once for the rest of the
    process's life, which are no loader workers: multiprocessing's resource tracker (the first ``spawn``) and Open
    MPI's ``orted`` (where mpi4py is installed, Lightning's ``MPIEnvironment.detect()`` initializes MPI at the first
    ``Trainer``; seen on the GPU machine, 2026-12-04)."""
    out = []
    for p in (process or psutil.Process()).children(recursive=recursive):
        try:
            command = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in command and p.name() != "orted":
                out.append(p)
        except psutil.Error:
            continue
    return out


def describe(p: psutil.Process) -> str:
    """A process as a leftover report names it: its pid, parent, status and command line."""
    try:
        return f"{p.pid} (parent {p.ppid()}, {p.status()}): {' '.join(p.cmdline())[:200]!r}"
    except psutil.Error as e:
        return f"{p.pid} ({type(e).__name__})"


class EpochClock(pl.Callback):
    """Wall time of each training epoch, and how many worker processes ran mid-epoch against how many the
    tuner's loaders should have (the running one's, and a background start's until it takes over)."""

    def __init__(self, tuner: DataLoaderTuner | None = None) -> None:
        self.tuner = tuner
        self.durations: list[float] = []
        self.children: list[tuple[int, int]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 4 and self.tuner is not None and self.tuner.state.current is not None:
            starting = self.tuner.switcher.starting  # a loader starting in the background: both sets are alive
            workers = self.tuner.state.current.num_workers + (starting.num_workers if starting else 0)
            self.children.append((len(live_children()), workers))

    def on_train_epoch_end(self, trainer, pl_module):
        self.durations.append(time.perf_counter() - self._t0)


class Indices(pl.Callback):
    """The dataset indices each epoch trained, in order (batches carry them third, as ``SyntheticDataset``'s do)."""

    def __init__(self):
        self.epochs = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.epochs[-1].extend(int(i) for i in batch[2])


def make_trainer(tmp_path, callbacks, max_epochs=4, **kwargs):
    opts = dict(
        max_epochs=max_epochs,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
    )
    opts.update(kwargs)
    return pl.Trainer(**opts)


def scalars(log_dir, tag):
    """The values of one scalar tag, read back from the TensorBoard event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def count_rules_fired():
    """Count each rule that fires from now on, in this process: the rule of each decision ``decide``,
    ``enforce_memory`` and ``verify_cached`` return and of each trial ``TuningState.fail`` records (a decision
    replaced by a settle override counts under the override), and each entry of ``windows.JUDGED_EARLY``,
    ``windows.RUNS_ON`` and ``diagnose.DIAGNOSES`` that holds. Returns the live ``Counter`` (rule name -> times)."""
    import collections
    import functools

    from lightning_dltune.tuning import diagnose, rules, state, windows

    fired = collections.Counter()

    def counted(rule, name=None):
        @functools.wraps(rule)
        def wrapper(*args, **kwargs):
            result = rule(*args, **kwargs)
            if result:
                fired[name or getattr(result, "rule", None) or rule.__name__] += 1
            return result

        return wrapper

    for name in ("decide", "enforce_memory", "verify_cached"):
        wrapped = counted(getattr(rules, name))
        setattr(rules, name, wrapped)
        setattr(state, name, wrapped)
    fail = state.TuningState.fail

    def counted_fail(self, *args, **kwargs):
        result = fail(self, *args, **kwargs)
        fired["config_failed"] += 1
        return result

    state.TuningState.fail = counted_fail
    windows.JUDGED_EARLY = tuple(map(counted, windows.JUDGED_EARLY))
    windows.RUNS_ON = state.RUNS_ON = tuple(map(counted, windows.RUNS_ON))
    diagnose.DIAGNOSES = tuple(map(counted, diagnose.DIAGNOSES))
    diagnose.stall_left = counted(diagnose.stall_left)
    return fired
