"""``DataLoaderTuner``: the Lightning callback that wires the hooks to the timer, the decision and the logs."""

from __future__ import annotations

import dataclasses
import math
import time
from array import array
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from typing_extensions import override

from lightning_dltune import _lightning, gpu
from lightning_dltune._warn import warn_once
from lightning_dltune.budget import cpu_budget, make_budget, memory_budget, shm_free_bytes
from lightning_dltune.cache import TuningCache, default_cache_path
from lightning_dltune.decide import Budget, Decision, Policy, Trial, decide, diagnose, pick_best
from lightning_dltune.measure import StepTimer, WindowStats, process_cpu_seconds
from lightning_dltune.mixin import TunableDataModuleMixin
from lightning_dltune.report import (
    REPORT_NAME,
    build_report,
    summary_table,
    trial_from_dict,
    trial_to_dict,
    write_json_atomic,
)
from lightning_dltune.settings import LoaderSettings, check_num_workers
from lightning_dltune.switch import GuardedIterator, ResumableBatchSampler

PREFIX = "dltune/"
STALL_FRAC = PREFIX + "stall_frac"
DATA_WAIT_MS = PREFIX + "data_wait_ms"
STEP_MS = PREFIX + "step_ms"
OTHER_MS = PREFIX + "other_ms"
SAMPLES_PER_S = PREFIX + "samples_per_s"
NUM_WORKERS = PREFIX + "num_workers"
PREFETCH_FACTOR = PREFIX + "prefetch_factor"
GPU_UTIL_PCT = PREFIX + "gpu_util_pct"
GPU_MEM_PCT = PREFIX + "gpu_mem_pct"
GPU_STALL_FRAC = PREFIX + "gpu_stall_frac"
GPU_IDLE_MS = PREFIX + "gpu_idle_ms"
H2D_MS = PREFIX + "h2d_ms"
STALL_SPREAD = PREFIX + "stall_frac_spread"
_STATE_VERSION = 1
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(WindowStats))

TUNING, SETTLED, OBSERVING, DISABLED = "tuning", "settled", "observing", "disabled"
HELD = "held"  # tuning stopped for the rest of this fit: switching would not pay in the steps left
MODES = ("auto", "epoch", "in_epoch")
_MAX_RECOVERIES = 3
_LONG_EPOCH_S = 60.0
_OBVIOUS_STALL = 0.5
_CACHE_TOLERANCE = 0.8  # cached settings hold while they deliver 80% of the cached throughput


class DataLoaderTuner(Callback):
    r"""Measure how long training waits for data and retune the train ``DataLoader`` between epochs.

    During the first epochs it times every step (data wait, step, other host time), and at each epoch end a
    model of the loader decides whether to rebuild the train loader with other ``num_workers`` /
    ``prefetch_factor``, within the CPUs this process may use. Once the stall is gone (or more workers stop
    paying) it settles, prints a summary with a one-line diagnosis, and writes ``dltune_report.json``.

    On CUDA the stall is measured as the GPU sees it: CUDA events at step end, fetch start and end, and step
    start, read later without synchronizing (:class:`~lightning_dltune.gpu.GpuTimeline`), give the GPU's idle
    gap and the host-to-device copy per step. Decisions then use the GPU's idle gap, and when copies take more
    than ``stall_threshold`` of the GPU's time the tuner tries ``pin_memory=True`` and keeps it if faster.

    Works with a DataModule that inherits :class:`~lightning_dltune.TunableDataModuleMixin` and with a plain
    ``DataLoader`` returned by any ``train_dataloader()`` (rebuilt as Lightning rebuilds loaders for its
    distributed sampler).

    Args:
        stall_threshold: stall fraction (data wait / wall time) below which the loader is good enough;
            0.05 is the level PyTorch's profiler flags.
        max_trials: most configs measured, the starting one included, before settling.
        max_workers: ceiling on ``num_workers``; ``None`` allows 8 per usable CPU (4 to 64), since a loader
            waiting on storage wants more workers than cores.
        max_prefetch: ceiling on ``prefetch_factor``.
        max_memory: memory the loader's workers (and pinned buffers) may add: a fraction of what this process
            could still take (``0.5`` by default, honouring a cgroup ``memory.max``), or bytes when > 1. Each
            worker's unique memory (USS) is measured, and a config predicted to exceed this is never tried.
        min_steps: steady-state steps a trial needs before it is judged (short epochs are pooled).
        observe_only: measure, log and report, but never rebuild the loader.
        tune_iterable: also retune an ``IterableDataset``'s loader (at epoch boundaries). Only for datasets
            that shard themselves with ``torch.utils.data.get_worker_info()``: otherwise every worker yields
            the whole dataset and more workers repeat samples. Off by default: such loaders are measured only.
        mode: when to switch configs. ``"epoch"``: at epoch boundaries. ``"in_epoch"``: every
            ``window_steps`` steps, inside the epoch, continuing from exactly the batch the loop reached.
            ``"auto"``: in-epoch for long epochs (at least ``8 * window_steps`` batches, or a first window
            predicting over a minute per epoch), epoch boundaries otherwise, except that a window whose stall
            is plainly the loader's (half the time or more, after ``min_steps``) switches at once when more than
            ``min_steps`` batches of the epoch are left (single process only). In-epoch switching needs a
            map-style dataset with a plain ``BatchSampler`` (what ``batch_size=``/``shuffle=`` create); other
            loaders fall back to epoch boundaries with one message.
        window_steps: steps per measurement window in in-epoch mode.
        log_gpu: sample GPU utilization and memory through NVML on CUDA.
        cache: where settled settings are remembered across runs: ``None`` uses ``$DLTUNE_CACHE`` or
            ``~/.cache/lightning-dltune/cache.json``, a path uses that file, ``False`` disables it. A run whose
            key (host CPUs and memory, accelerator, dataset class and length, batch size, local world size,
            library version) is cached starts from the cached settings and only verifies them.
        report_path: where to write the JSON report; ``None`` writes ``dltune_report.json`` in the logger's
            directory (or ``default_root_dir``), ``False`` writes none.
        verbose: print the summary table and diagnosis when tuning settles.

    Raises:
        ValueError: if an argument is outside its allowed values.

    Attributes:
        best_settings: the settled loader settings as ``DataLoader`` keyword arguments (``None`` until settled).
        trials: the measured :class:`~lightning_dltune.decide.Trial` history.
        diagnosis: one sentence on what bounds training.
        settled_step: the global step at which tuning settled, or held for the rest of the run (``None`` until
            then).
        budget: this process's own budget; ``agreed_budget`` the tightest over all nodes (distributed runs).
        cache_hit: whether this run started from cached settings.
        report: the report written at the end of ``fit`` (a dict).

    Logged Metrics (every ``log_every_n_steps``, to every logger, on rank zero):
        - ``dltune/stall_frac``: data wait / wall time of the window (fraction)
        - ``dltune/data_wait_ms``: mean time blocked on the next batch per step (ms)
        - ``dltune/step_ms``: mean time from batch start to batch end (ms)
        - ``dltune/other_ms``: mean other host time between steps, validation excluded (ms)
        - ``dltune/samples_per_s``: training throughput of the window (samples/s)
        - ``dltune/num_workers``: ``num_workers`` of the current train loader
        - ``dltune/prefetch_factor``: its ``prefetch_factor`` (0 when loading in the main process)
        - ``dltune/gpu_util_pct``, ``dltune/gpu_mem_pct``: NVML utilization and memory use (CUDA only, %)
        - ``dltune/gpu_stall_frac``: the GPU's idle gap waiting for the loader / the GPU's time (CUDA only,
          fraction; from CUDA events read without synchronizing, and what decisions use there)
        - ``dltune/gpu_idle_ms``, ``dltune/h2d_ms``: mean idle gap and host-to-device copy per step as the GPU
          saw them (CUDA only, ms)
        - ``dltune/stall_frac_spread``: max minus min stall fraction across ranks (distributed runs only)

    Distributed: every rank measures; each decision is taken on the slowest rank's statistics and the
    smallest budget of any node (gathered with the strategy's ``all_gather``), and every rank switches at the
    same step, so Lightning's reload barrier never waits on a rank that decided otherwise.

    Run length: a switch restarts the loader's workers, so with ``max_epochs``/``max_steps`` known a config is
    tried only if it is predicted to save more over the steps left than its start-up costs; otherwise the tuner
    stays on its config for the rest of the run (``phase == "held"``) and plans the next config for a resumed
    or longer run.

    Checkpoints: the tuner's phase, trials and settled settings are saved with the callback state (and, with
    the mixin, the settings with the DataModule's). A run resumed after tuning settled starts on the settled
    settings and does not tune again; one resumed mid-tuning continues where it was; one resumed mid-epoch
    continues the epoch's sample order exactly at the saved batch.

    Example::

        from lightning import Trainer
        from lightning_dltune import DataLoaderTuner

        trainer = Trainer(callbacks=[DataLoaderTuner()])
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        stall_threshold: float = 0.05,
        max_trials: int = 6,
        max_workers: int | None = None,
        max_prefetch: int = 8,
        max_memory: float | None = None,
        min_steps: int = 8,
        observe_only: bool = False,
        tune_iterable: bool = False,
        mode: str = "auto",
        window_steps: int = 20,
        log_gpu: bool = True,
        cache: str | Path | bool | None = None,
        report_path: str | Path | bool | None = None,
        verbose: bool = True,
    ) -> None:
        if isinstance(stall_threshold, bool) or not isinstance(stall_threshold, (int, float)):
            raise TypeError(f"`stall_threshold` must be a float in (0, 1), got {stall_threshold!r}.")
        if not 0.0 < stall_threshold < 1.0:
            raise ValueError(
                f"`stall_threshold` must be in (0, 1), got {stall_threshold}. Use 0.05 to accept a 5% stall."
            )
        if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
            raise ValueError(
                f"`max_trials` must be an int >= 1, got {max_trials!r}. Use 1 to measure without retuning."
            )
        if max_workers is not None:
            check_num_workers(max_workers, "max_workers")
        if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 1:
            raise ValueError(f"`max_prefetch` must be an int >= 1, got {max_prefetch!r}. PyTorch's default is 2.")
        if max_memory is not None and (
            isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)) or max_memory <= 0
        ):
            raise ValueError(
                f"`max_memory` must be a fraction in (0, 1] or a number of bytes > 1, got {max_memory!r}. "
                "Use 0.5 for half of the available memory."
            )
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
            raise ValueError(f"`min_steps` must be an int >= 1, got {min_steps!r}.")
        if mode not in MODES:
            raise ValueError(
                f"`mode` must be one of {MODES}, got {mode!r}. Use 'auto' to switch inside long epochs only."
            )
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 2:
            raise ValueError(f"`window_steps` must be an int >= 2, got {window_steps!r}. The default is 20.")
        if report_path is True:
            report_path = None
        self.policy = Policy(stall_threshold=float(stall_threshold), max_trials=max_trials, min_steps=min_steps)
        self.max_workers = max_workers
        self.max_prefetch = max_prefetch
        self.max_memory = max_memory
        self.observe_only = observe_only
        self.tune_iterable = tune_iterable
        self.mode = mode
        self.window_steps = max(window_steps, min_steps + 1)
        self.log_gpu = log_gpu
        if cache is True:
            cache = None
        self.cache = cache
        self.cache_hit = False
        self.stall_spread: float | None = None
        self.agreed_budget: Budget | None = None
        self.report_path = report_path
        self.verbose = verbose

        self.best_settings: dict[str, Any] | None = None
        self.settled_step: int | None = None
        self.trials: list[Trial] = []
        self.diagnosis: str = ""
        self.report: dict[str, Any] | None = None
        self.report_file: Path | None = None
        self.budget: Budget | None = None
        self.timer = StepTimer()
        self.phase = OBSERVING if observe_only else TUNING
        self._start: LoaderSettings | None = None
        self._current: LoaderSettings | None = None
        self._target: LoaderSettings | None = None
        self._window_cpu0: tuple[float, float] | None = None
        self._restores: list[Any] = []
        self._nvml: Any = None
        self._gpu: gpu.GpuTimeline | None = None
        self._nvml_metrics: dict[str, float] = {}
        self._steps_since_log = 0
        self._trainer: pl.Trainer | None = None
        self._resumable = False  # the train loader has a ResumableBatchSampler
        self._in_epoch = False  # windows inside the epoch are active
        self._guard_needed = False
        self._pending: LoaderSettings | None = None
        self._recoveries = 0
        self._rng_before_build: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._restored_epoch: tuple[list[int], int] | None = None  # (order, batch) of a mid-epoch checkpoint
        self._cache_fields: dict[str, Any] | None = None
        self._cached_entry: dict[str, Any] | None = None
        self._batch_bytes: float | None = None
        self._fresh_loader = False  # the running loader has not delivered a batch yet
        self._held: Decision | None = None  # what stopped tuning for this run (phase HELD), with the next config

    @property
    def state_key(self) -> str:
        return self._generate_state_key(stall_threshold=self.policy.stall_threshold, max_workers=self.max_workers)

    # ------------------------------------------------------------------------------------------------------
    # set-up and tear-down
    # ------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self.timer = StepTimer()
        if self.phase == HELD:  # a new fit has its own length: judge again
            self.phase, self._held = TUNING, None
        self.budget = self._make_budget(max(1, int(trainer.num_devices)))
        self._restores = [
            _lightning.install_loader_transform(trainer, self._on_loader),
            _lightning.install_fetch_hooks(trainer, self._before_fetch, self._after_fetch),
        ]
        self._gpu = gpu.timeline_for(trainer.strategy.root_device)
        if self.log_gpu and trainer.strategy.root_device.type == "cuda":
            from lightning_dltune.nvml import open_sampler

            index = trainer.strategy.root_device.index or 0
            self._nvml, why = open_sampler(index)
            if self._nvml is None:
                warn_once("nvml", f"GPU utilization is not logged: {why}.")

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        for restore in reversed(self._restores):
            restore()
        self._restores = []
        self._gpu = None
        if self._nvml is not None:
            if self._nvml.error:
                warn_once("nvml-error", f"GPU sampling stopped early: NVML said {self._nvml.error}.")
            self._nvml.stop()
            self._nvml = None

    # ------------------------------------------------------------------------------------------------------
    # the train loader
    # ------------------------------------------------------------------------------------------------------
    def _on_loader(self, loader: Any) -> Any:
        """Every train-loader request of ``fit`` passes here (see ``_lightning.install_loader_transform``)."""
        self.timer.loader_requested()
        if not isinstance(loader, DataLoader):
            self._disable(
                "unsupported-loader",
                f"the train loader is a {type(loader).__name__}, not one `torch.utils.data.DataLoader`; "
                "it is measured but not retuned",
            )
            return loader
        current = LoaderSettings.from_loader(loader)
        if self._start is None:
            self._start = current
            self._lookup_cache(loader)
        if isinstance(loader.dataset, IterableDataset) and self.phase == TUNING and not self.tune_iterable:
            self._disable(
                "iterable",
                "the train dataset is an IterableDataset: changing `num_workers` would repeat samples unless it "
                "shards itself with `get_worker_info()`, so the tuner only measures it. If yours does, opt in "
                "with `DataLoaderTuner(tune_iterable=True)`",
            )
        gen = loader.generator
        self._rng_before_build = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
        overrides: dict[str, Any] = {}
        target = self._target
        if target is not None and target != current and self.phase in (TUNING, SETTLED, HELD):
            overrides.update(target.to_loader_kwargs())
        resumable = self._resumable_overrides(loader)
        overrides.update(resumable)
        if overrides:
            try:
                loader = _lightning.rebuild_dataloader(loader, overrides)
                current = LoaderSettings.from_loader(loader)
            except _lightning.NotRebuildableError as ex:
                self._disable("not-rebuildable", f"the train loader cannot be rebuilt ({ex}); it is only measured")
        self._resumable = isinstance(loader.batch_sampler, ResumableBatchSampler)
        self._fresh_loader = True
        if self._resumable and self._restored_epoch is not None:
            self._resume_epoch(loader.batch_sampler)
        self._current = current
        return loader

    def _resume_epoch(self, sampler: ResumableBatchSampler) -> None:
        order, batch = self._restored_epoch or ([], 0)
        self._restored_epoch = None
        expected = len(sampler) * sampler.batch_size if sampler.drop_last else None
        if (expected is not None and len(order) != expected) or -(-len(order) // sampler.batch_size) != len(sampler):
            warn_once(
                "resume-order",
                "DataLoaderTuner: the checkpoint's epoch order does not fit this loader; "
                "the epoch restarts with a new order.",
            )
            return
        sampler._order = array("q", order)
        sampler.resume_at(batch)

    def _lookup_cache(self, loader: DataLoader) -> None:
        if self.cache is False or self.phase != TUNING or self._target is not None or self.trials:
            return
        self._cache_fields = self._cache_key_fields(loader)
        hit = TuningCache(self._cache_path()).get(self._cache_fields)
        if hit is not None:
            cached, self._cached_entry = hit
            self.cache_hit = True
            self._target = cached
            rank_zero_info(
                f"DataLoaderTuner: starting from cached settings {cached.describe()} ({self._cache_path()})."
            )

    def _cache_path(self) -> Path:
        return default_cache_path() if self.cache is None else Path(str(self.cache))

    def _cache_key_fields(self, loader: DataLoader) -> dict[str, Any]:
        import psutil

        from lightning_dltune import __version__

        trainer = self._trainer
        dataset = loader.dataset
        batch_sampler = loader.batch_sampler
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        accelerator = device.type
        if device.type == "cuda":
            accelerator += ":" + torch.cuda.get_device_name(device)
        budget = self._budget()
        return {
            "cpus": budget.cpus,
            "memory_gib": round(psutil.virtual_memory().total / 2**30),
            "accelerator": accelerator,
            "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
            "dataset_len": len(dataset) if hasattr(dataset, "__len__") else None,
            "batch_size": getattr(batch_sampler, "batch_size", None) or loader.batch_size,
            "local_world_size": int(trainer.num_devices) if trainer is not None else 1,
            "version": __version__,
        }

    def _resumable_overrides(self, loader: DataLoader) -> dict[str, Any]:
        """Constructor arguments that give ``loader`` a ResumableBatchSampler ({} when not wanted/possible)."""
        if self.mode == "epoch" or self.phase not in (TUNING, SETTLED, HELD):
            return {}
        bs = loader.batch_sampler
        if isinstance(bs, ResumableBatchSampler):
            return {}
        if isinstance(loader.dataset, IterableDataset) or type(bs) is not BatchSampler:
            if self.mode == "in_epoch":
                warn_once(
                    "no-in-epoch",
                    "DataLoaderTuner: in-epoch switching needs a map-style dataset with a plain BatchSampler "
                    f"(this loader has {type(bs).__name__}); switching at epoch boundaries instead, where "
                    "no sample can be lost or repeated.",
                )
            return {}
        return {
            "batch_sampler": ResumableBatchSampler(bs.sampler, bs.batch_size, bs.drop_last),
            "batch_size": 1,
            # no `shuffle`: Lightning then reads it from batch_sampler.sampler when it injects its
            # DistributedSampler (an explicit False would turn shuffling off under DDP)
            "shuffle": _lightning.REMOVE,
            "sampler": None,
            "drop_last": False,
        }

    def _disable(self, key: str, message: str) -> None:
        if self.phase == TUNING:
            self.phase = DISABLED
        warn_once(key, f"DataLoaderTuner: {message}.")

    def _set_target(self, settings: LoaderSettings) -> None:
        """The settings the next loader is built with, mirrored onto a mixin DataModule (and its state)."""
        self._target = settings
        datamodule = getattr(self._trainer, "datamodule", None)
        if isinstance(datamodule, TunableDataModuleMixin):
            datamodule.loader_settings = settings

    def _apply(self, trainer: "pl.Trainer", settings: LoaderSettings, now: bool = False) -> None:
        """Run on ``settings`` from the next fetch (``now``) or the next epoch (no-op if already on them)."""
        self._set_target(settings)
        if settings == self._current:
            self._pending = None
        elif now:
            self._pending = settings
        elif not _is_last_epoch(trainer):
            _lightning.request_train_reload(trainer)

    # ------------------------------------------------------------------------------------------------------
    # in-epoch switching and worker-death recovery
    # ------------------------------------------------------------------------------------------------------
    def _before_fetch(self) -> None:
        if self._guard_needed:
            self._install_guard()
        self.timer.fetch_started()
        if self._gpu is not None:
            self._gpu.fetch_started()

    def _after_fetch(self) -> None:
        self.timer.fetch_ended()
        if self._gpu is not None:
            self._gpu.fetch_ended()

    def _install_guard(self) -> None:
        self._guard_needed = False
        assert self._trainer is not None
        mode_iter = _lightning.train_mode_iterator(self._trainer)
        if mode_iter is None or len(mode_iter.iterators) != 1 or isinstance(mode_iter.iterators[0], GuardedIterator):
            return
        loader = mode_iter.iterables[0]
        if not isinstance(getattr(loader, "batch_sampler", None), ResumableBatchSampler):
            return
        mode_iter.iterators[0] = GuardedIterator(
            loader,
            mode_iter.iterators[0],
            self._switch_if_pending,
            self._recover,
            _lightning.detach_from_sigchld,
            _lightning.worker_died,
            self._startup_failed,
        )

    def _switch_if_pending(self, loader: DataLoader) -> DataLoader | None:
        if self._pending is None:
            return None
        settings, self._pending = self._pending, None
        self.timer.rebuilt_in_fetch()
        return self._replace_loader(loader, settings)

    def _replace_loader(self, loader: DataLoader, settings: LoaderSettings) -> DataLoader:
        assert self._trainer is not None
        with _lightning.recording():
            new = _lightning.rebuild_dataloader(loader, settings.to_loader_kwargs())
        _lightning.shutdown_workers(loader)
        _lightning.replace_train_loader(self._trainer, new)
        self._current = settings
        self._fresh_loader = True
        return new

    def _startup_failed(self, error: BaseException, loader: DataLoader, position: int) -> DataLoader | None:
        """A config the tuner chose failed before delivering its first batch (a raising ``worker_init_fn``,
        workers that cannot start): record it as failed and go back to the last good config. Errors of the
        user's own config, or after a config has delivered batches, are the user's and propagate."""
        current, start = self._current, self._start
        if not self._fresh_loader or current is None or start is None or current == start:
            return None
        if current.num_workers == start.num_workers and current.persistent_workers == start.persistent_workers:
            return None  # the workers are set up as the user had them: not something the tuner caused
        return self._fall_back(loader, position, "workers failed to start", error)

    def _recover(self, error: BaseException, loader: DataLoader, position: int) -> DataLoader | None:
        """A worker died: record the config as failed, fall back, and continue the epoch at ``position``."""
        return self._fall_back(loader, position, "a DataLoader worker died", error)

    def _fall_back(self, loader: DataLoader, position: int, kind: str, error: BaseException) -> DataLoader | None:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        summary = lines[-1] if lines else type(error).__name__  # a worker's traceback ends in its error
        if self._recoveries >= _MAX_RECOVERIES or self._current is None or self._trainer is None:
            return None
        self._recoveries += 1
        failed = self._current
        self.trials.append(Trial(failed, self._close_window(), failed=f"{kind}: {summary}"))
        never = {t.settings for t in self.trials if t.failed}
        usable = [t for t in self.trials if t.usable and t.settings not in never]
        if usable:
            fallback = pick_best(usable, self.policy).settings
        elif self._start is not None and self._start not in never:
            fallback = self._start
        else:
            fallback = failed.with_workers(failed.num_workers // 2)
        if self.phase == TUNING:
            self._settle(self._trainer, fallback, apply=False)
        self._set_target(fallback)
        warn_once(
            f"fallback-{self._recoveries}",
            f"DataLoaderTuner: {kind} ({summary}). Rebuilt the train loader with "
            f"{fallback.describe()} (was {failed.describe()}) and continued epoch {self._trainer.current_epoch} "
            f"at batch {position}: no sample lost or repeated. {failed.describe()} will not be used again.",
        )
        self.timer.rebuilt_in_fetch()
        return self._replace_loader(loader, fallback)

    # ------------------------------------------------------------------------------------------------------
    # measurement hooks
    # ------------------------------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.timer.epoch_started()
        if self._gpu is not None:
            self._gpu.epoch_started()
        self._keep_rng_as_untuned(trainer)
        self._guard_needed = self._resumable
        self._in_epoch = (
            self._resumable
            and self.phase == TUNING
            and (
                self.mode == "in_epoch"
                or (self.mode == "auto" and trainer.num_training_batches >= 8 * self.window_steps)
                or self._in_epoch
            )
        )

    def _keep_rng_as_untuned(self, trainer: "pl.Trainer") -> None:
        """Leave the global random state as a run that never changed the loader would have it, so each
        epoch's sample order depends on the seed and the epoch, not on what the tuner did.

        A loader built for this epoch already created its iterator (drawing a base seed, and for persistent
        workers the epoch's order too): undo that. A persistent iterator that is reset instead of recreated
        skips the base-seed draw a new iterator makes: make it, if the user's own loader would have.
        """
        saved, self._rng_before_build = self._rng_before_build, None
        loader = trainer.train_dataloader
        if trainer.current_epoch == 0 or self._start is None or not isinstance(loader, DataLoader):
            return
        if saved is not None:
            torch.set_rng_state(saved[0])
            if saved[1] is not None and loader.generator is not None:
                loader.generator.set_state(saved[1])
        if not self._start.persistent_workers and _lightning.will_reuse_iterator(loader):
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self._gpu is not None:
            self._gpu.step_started(steady=self.timer.steady)
        self.timer.step_started()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._gpu is not None:
            self._gpu.step_ended()
        self.timer.step_ended(_batch_size(batch))
        self._fresh_loader = False
        if self._batch_bytes is None and self.phase != SETTLED:
            self._batch_bytes = float(_tensor_bytes(batch))
        if self._window_cpu0 is None and self.phase != SETTLED:
            # CPU is counted from the end of a window's first step: worker start-up is not steady state
            self._window_cpu0 = process_cpu_seconds()
        self._steps_since_log += 1
        if self._steps_since_log >= max(1, int(getattr(trainer, "log_every_n_steps", 50))):
            self._steps_since_log = 0
            self._log(trainer)
        if self._resumable and self.phase == TUNING and self._window_done():
            left = trainer.num_training_batches - (batch_idx + 1)
            if not self._in_epoch and self.mode == "auto" and left > 2 * self.window_steps:
                predicted = trainer.num_training_batches * self.timer.peek_window().mean_wall_s
                if trainer.world_size > 1:  # every rank must make the same choice
                    predicted = float(trainer.strategy.reduce(torch.tensor(predicted), reduce_op="max"))
                self._in_epoch = predicted >= _LONG_EPOCH_S
            if left > self.policy.min_steps and (self._in_epoch or (self.mode == "auto" and self._obvious_stall())):
                # long epochs switch every window; a short one switches once the loader is plainly the
                # bottleneck, instead of spending the rest of the epoch on a config already judged
                self._close_trial(trainer, now=True, done=batch_idx + 1)

    def _window_done(self) -> bool:
        """A window is full after ``window_steps``, or after ``min_steps`` when the loader is plainly the
        bottleneck (half the time or more spent waiting): no need to wait longer to decide."""
        steps = self.timer.window_steps
        if steps >= self.window_steps:
            return True
        return steps >= self.policy.min_steps and self._obvious_stall()

    def _obvious_stall(self) -> bool:
        if self._trainer is not None and self._trainer.world_size > 1:
            return False  # a rank-local criterion would let ranks enter the decision's collectives apart
        return self.timer.peek_window().stall_frac >= _OBVIOUS_STALL

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.timer.pause()
        if self._gpu is not None:
            self._gpu.pause()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.timer.resume()

    def _log(self, trainer: "pl.Trainer") -> None:
        stats = self.timer.take_log_window()
        gpu_stats = self._gpu.take_log_window() if self._gpu is not None else None
        if self._nvml is not None:
            self._nvml_metrics = self._nvml.take() or self._nvml_metrics
        if trainer.world_size > 1:
            stalls = trainer.strategy.all_gather(torch.tensor([stats.stall_frac], dtype=torch.float64))
            self.stall_spread = float(stalls.max() - stalls.min())
        if not trainer.loggers or stats.steps == 0:
            return
        current = self._current or LoaderSettings()
        metrics = {
            STALL_FRAC: stats.stall_frac,
            DATA_WAIT_MS: stats.mean_wait_s * 1e3,
            STEP_MS: stats.mean_step_s * 1e3,
            OTHER_MS: stats.mean_other_s * 1e3,
            SAMPLES_PER_S: stats.samples_per_s,
            NUM_WORKERS: float(current.num_workers),
            PREFETCH_FACTOR: float(current.prefetch_factor or 0),
        }
        if self.stall_spread is not None:
            metrics[STALL_SPREAD] = self.stall_spread
        gpu_stall = gpu_stats.stall_frac if gpu_stats is not None else None
        if gpu_stats is not None and gpu_stall is not None:
            metrics[GPU_STALL_FRAC] = gpu_stall
            metrics[GPU_IDLE_MS] = gpu_stats.mean_idle_s * 1e3
            metrics[H2D_MS] = gpu_stats.mean_copy_s * 1e3
        if self._nvml_metrics:
            metrics[GPU_UTIL_PCT] = self._nvml_metrics["gpu_util_pct"]
            metrics[GPU_MEM_PCT] = self._nvml_metrics["gpu_mem_pct"]
        _log_to_loggers(trainer, metrics)

    # ------------------------------------------------------------------------------------------------------
    # deciding
    # ------------------------------------------------------------------------------------------------------
    def _close_window(self) -> WindowStats:
        stats = self.timer.take_window()
        if self._gpu is not None:
            stats = stats.with_gpu(self._gpu.take_window())
        if self._window_cpu0 is not None:
            main0, kids0 = self._window_cpu0
            main1, kids1 = process_cpu_seconds()
            stats = stats.with_cpu(worker_cpu_s=max(0.0, kids1 - kids0), main_cpu_s=max(0.0, main1 - main0))
        self._window_cpu0 = None
        stats = stats.with_memory(self._worker_mem_bytes(), self._batch_bytes or 0.0)
        self._batch_bytes = None
        self._check_shm(stats)
        return stats

    def _worker_mem_bytes(self) -> float:
        """Largest unique memory (USS) of one worker of the running loader, 0 without workers."""
        import psutil

        if self._trainer is None:
            return 0.0
        sizes = []
        for pid in _lightning.train_worker_pids(self._trainer):
            try:
                sizes.append(psutil.Process(pid).memory_full_info().uss)
            except psutil.Error:
                continue
        return float(max(sizes, default=0))

    def _check_shm(self, stats: WindowStats) -> None:
        """Say so, with the fix, when the running config's batches in flight may not fit /dev/shm."""
        shm = self.budget.shm_bytes if self.budget is not None else None
        current = self._current
        if shm is None or current is None or current.num_workers == 0 or stats.batch_bytes <= 0:
            return
        in_flight = stats.batch_bytes * current.num_workers * (current.prefetch_factor or 2)
        if in_flight > 0.8 * shm:
            warn_once(
                "shm-risk",
                f"DataLoaderTuner: {current.describe()} keeps about {in_flight / 2**20:.0f} MiB of batches in "
                f"flight but /dev/shm has {shm / 2**20:.0f} MiB free: workers may die with a bus error. Give the "
                "container more shared memory (docker run --shm-size=8g, or --ipc=host), or call "
                "torch.multiprocessing.set_sharing_strategy('file_system').",
            )

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._current is None or self.phase in (SETTLED, HELD):
            self.timer.take_window()
            if self._gpu is not None:
                self._gpu.take_window(wait=False)
            return
        if self.timer.window_steps < self.policy.min_steps and not _is_last_epoch(trainer):
            return  # pool short epochs into one trial
        if self._in_epoch:
            return  # windows run inside the epoch and carry over into the next one
        self._close_trial(trainer, now=False, done=trainer.num_training_batches)

    def _close_trial(self, trainer: "pl.Trainer", now: bool, done: float) -> None:
        """Judge the window that just ended; ``done``: batches of this epoch already trained."""
        assert self._current is not None
        stats, budget = self._close_window(), self._budget()
        if trainer.world_size > 1:
            stats, budget = self._reduce(trainer, stats, budget)
        trial = Trial(self._current, stats)
        if self.phase in (OBSERVING, DISABLED):
            self.trials.append(trial)
            return
        decision = self._verify_cached(trial) or decide(
            [*self.trials, trial], budget, self.policy, _remaining_steps(trainer, done)
        )
        decision = trainer.strategy.broadcast(decision, src=0)  # every rank must switch at the same step
        self.trials.append(Trial(trial.settings, trial.stats, trial.failed, _decision_text(decision)))
        if decision.action == "try":
            self._apply(trainer, decision.settings, now=now)
        elif decision.action == "settle":
            self._settle(trainer, decision.settings, now=now)
        elif decision.action == "hold":
            self._hold(trainer, decision)

    def _hold(self, trainer: "pl.Trainer", decision: Decision) -> None:
        """Stay on the running config for the rest of this ``fit``: the next config would not pay for its
        start-up in the steps left. Not a settled result: a resumed run continues tuning from
        ``decision.settings``, and the cache only learns the best config if it beat the starting one."""
        best = pick_best(self.trials, self.policy).settings
        self._stop_tuning(trainer, HELD, best, held=decision)
        if best != self._start:
            self._remember(best)
        current = self._current.describe() if self._current else "?"
        self._summarize(f"stays on {current} for the rest of this run: {decision.reason}", best)

    def _verify_cached(self, trial: Trial) -> Decision | None:
        """The first window of a cache hit: keep the cached settings if they still hold."""
        entry, self._cached_entry = self._cached_entry, None
        if entry is None or self.trials or self._target != trial.settings or not trial.usable:
            return None
        cached_rate = float(entry.get("samples_per_s") or 0.0)
        stall, rate = trial.stats.effective_stall_frac, trial.stats.samples_per_s
        if stall <= self.policy.stall_threshold or rate >= _CACHE_TOLERANCE * cached_rate:
            return Decision(
                "settle", trial.settings, f"cached settings verified ({rate:.0f} samples/s, stall {stall:.1%})"
            )
        return None

    def _reduce(self, trainer: "pl.Trainer", stats: WindowStats, budget: Budget) -> tuple[WindowStats, Budget]:
        """The slowest rank's statistics and the tightest node budget, the same on every rank."""
        inf = float("inf")
        limits = [budget.cpus, float(budget.max_workers), budget.memory_bytes or inf, budget.shm_bytes or inf]
        row = [float(getattr(stats, f)) for f in _STATS_FIELDS] + limits
        table = trainer.strategy.all_gather(torch.tensor(row, dtype=torch.float64)).reshape(-1, len(row))
        per_sample = table[:, _STATS_FIELDS.index("wall_s")] / table[:, _STATS_FIELDS.index("samples")].clamp(min=1)
        slowest = table[int(per_sample.argmax())].tolist()
        values = dict(zip(_STATS_FIELDS, slowest[: len(_STATS_FIELDS)], strict=True))
        for name in ("steps", "samples", "gpu_steps"):
            values[name] = int(values[name])
        stall = table[:, _STATS_FIELDS.index("wait_s")] / table[:, _STATS_FIELDS.index("wall_s")].clamp(min=1e-9)
        self.stall_spread = float(stall.max() - stall.min())
        tightest = table[:, len(_STATS_FIELDS) :].min(dim=0).values.tolist()
        reduced = Budget(
            cpus=tightest[0],
            max_workers=int(tightest[1]),
            max_prefetch=budget.max_prefetch,
            bound_by=budget.bound_by + " (tightest node)",
            memory_bytes=None if tightest[2] == inf else tightest[2],
            shm_bytes=None if tightest[3] == inf else tightest[3],
        )
        self.agreed_budget = reduced
        return WindowStats(**values), reduced

    def _budget(self) -> Budget:
        if self.budget is None:
            self.budget = self._make_budget(1)
        return self.budget

    def _make_budget(self, local_world_size: int) -> Budget:
        budget = make_budget(cpu_budget(local_world_size=local_world_size), self.max_workers, self.max_prefetch)
        if self.max_memory is not None and self.max_memory > 1:
            memory, mem_bound = float(self.max_memory) / local_world_size, f"max_memory={self.max_memory:.0f} bytes"
        else:
            mem = memory_budget(fraction=float(self.max_memory or 0.5), local_world_size=local_world_size)
            memory, mem_bound = mem.bytes, mem.bound_by
        return dataclasses.replace(
            budget,
            memory_bytes=memory,
            shm_bytes=shm_free_bytes(),
            bound_by=f"{budget.bound_by}; memory: {mem_bound}",
        )

    def _settle(self, trainer: "pl.Trainer", settings: LoaderSettings, now: bool = False, apply: bool = True) -> None:
        self._stop_tuning(trainer, SETTLED, settings)
        if apply:
            self._apply(trainer, settings, now=now)
        self._remember(settings)
        self._summarize(f"settled on {settings.describe()}", settings)

    def _stop_tuning(
        self, trainer: "pl.Trainer", phase: str, settings: LoaderSettings, held: Decision | None = None
    ) -> None:
        """End tuning in ``phase`` (settled or held) with ``settings`` as the result, and diagnose the run."""
        self.phase, self._held = phase, held
        self._in_epoch = False
        self.settled_step = trainer.global_step
        self.best_settings = settings.to_loader_kwargs()
        self.diagnosis = diagnose(self.trials, settings, self._budget(), self.policy, held=held)

    def _summarize(self, headline: str, settings: LoaderSettings) -> None:
        if self.verbose:
            rank_zero_info(
                f"DataLoaderTuner {headline}\n{summary_table(self.trials, settings)}\nDiagnosis: {self.diagnosis}"
            )

    @rank_zero_only
    def _remember(self, settings: LoaderSettings) -> None:
        if self.cache is False or self._cache_fields is None:
            return
        final = next((t for t in reversed(self.trials) if t.settings == settings and t.usable), None)
        extra = {}
        if final is not None:
            extra = {"samples_per_s": final.stats.samples_per_s, "stall_frac": final.stats.effective_stall_frac}
        TuningCache(self._cache_path()).put(self._cache_fields, settings, extra)

    # ------------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        target = self._held.settings if self._held else self._target  # a held run's plan: a resumed run tries it
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "phase": self.phase,
            "trials": [trial_to_dict(t) for t in self.trials],
            "best_settings": self.best_settings,
            "start": None if self._start is None else self._start.to_loader_kwargs(),
            "target": None if target is None else target.to_loader_kwargs(),
            "settled_step": self.settled_step,
            "diagnosis": self.diagnosis,
        }
        position = self._epoch_position()
        if position is not None:
            state["epoch_order"], state["epoch_batch"] = position
        return state

    def _epoch_position(self) -> tuple[list[int], int] | None:
        """The running epoch's order and the batch the loop reached, when a checkpoint is taken mid-epoch."""
        if self._trainer is None or not self._resumable:
            return None
        mode_iter = _lightning.train_mode_iterator(self._trainer)
        guard = mode_iter.iterators[0] if mode_iter is not None and mode_iter.iterators else None
        if not isinstance(guard, GuardedIterator):
            return None
        sampler = guard.loader.batch_sampler
        if not 0 < guard.position < len(sampler):
            return None
        return sampler.epoch_order, guard.position

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        phase = state_dict.get("phase", TUNING)
        self.trials = [trial_from_dict(t) for t in state_dict.get("trials", [])]
        self.best_settings = state_dict.get("best_settings")
        self.settled_step = state_dict.get("settled_step")
        self.diagnosis = state_dict.get("diagnosis", "")
        start, target = state_dict.get("start"), state_dict.get("target")
        self._start = None if start is None else LoaderSettings.from_dict(start)
        if not self.observe_only:
            self.phase = SETTLED if phase == SETTLED else TUNING
            if phase == SETTLED and self.best_settings is not None:
                target = self.best_settings
            if target is not None:  # applied now: FSDP/DeepSpeed restore after on_fit_start
                self._set_target(LoaderSettings.from_dict(target))
        if "epoch_order" in state_dict:
            self._restored_epoch = (list(state_dict["epoch_order"]), int(state_dict.get("epoch_batch", 0)))

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.phase in (TUNING, HELD, OBSERVING, DISABLED) and any(t.usable for t in self.trials):
            best = pick_best(self.trials, self.policy).settings
            if self.phase != TUNING or self.best_settings is None:
                self.best_settings = best.to_loader_kwargs()
            self.diagnosis = diagnose(self.trials, best, self._budget(), self.policy, held=self._held)
            if self.phase == TUNING:
                self.diagnosis += " (tuning had not settled when training ended.)"
        self.report = build_report(
            trials=self.trials,
            start=self._start,
            settled=LoaderSettings.from_dict(self.best_settings) if self.best_settings else None,
            phase=self.phase,
            diagnosis=self.diagnosis,
            budget=self.budget,
            extra={
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "settled_step": self.settled_step,
                "cache_hit": self.cache_hit,
                "world_size": trainer.world_size,
                "agreed_budget": None if self.agreed_budget is None else dataclasses.asdict(self.agreed_budget),
                "stall_frac_spread": self.stall_spread,
            },
        )
        self._write_report(trainer)

    @rank_zero_only
    def _write_report(self, trainer: "pl.Trainer") -> None:
        if self.report_path is False or self.report is None:
            return
        if self.report_path is None:
            path = Path(trainer.log_dir or trainer.default_root_dir) / REPORT_NAME
        else:
            path = Path(str(self.report_path))
        write_json_atomic(path, self.report)
        self.report_file = path


def _decision_text(decision: Decision) -> str:
    if decision.action == "try":
        return f"try {decision.settings.describe()}: {decision.reason}"
    if decision.action == "settle":
        return f"settle on {decision.settings.describe()}: {decision.reason}"
    if decision.action == "hold":
        return f"stay for the rest of this run: {decision.reason}"
    return f"keep measuring: {decision.reason}"


def _remaining_steps(trainer: "pl.Trainer", done: float) -> int | None:
    """Training batches left in ``fit`` after ``done`` batches of the current epoch (``None``: unbounded)."""
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        return None
    left: float | None = None
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        left = (trainer.max_epochs - trainer.current_epoch) * batches - done
    module = trainer.lightning_module
    if trainer.max_steps >= 0 and trainer.accumulate_grad_batches == 1 and module.automatic_optimization:
        by_steps = trainer.max_steps - trainer.global_step  # one optimizer step per batch
        left = by_steps if left is None else min(left, by_steps)
    return None if left is None else max(0, int(left))


def _is_last_epoch(trainer: "pl.Trainer") -> bool:
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs


def _tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, dict):
        return sum(_tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(v) for v in batch)
    return 0


def _batch_size(batch: Any) -> int:
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:
        return 1


@rank_zero_only
def _log_to_loggers(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
