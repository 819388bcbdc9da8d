"""``DataLoaderTuner``: the Lightning callback. Only glue: its hooks forward to the parts that own the work.

* :class:`~lightning_dltune.measurement.probe.Probe` measures (the step timer, the GPU timeline, CPU and worker memory);
* :class:`~lightning_dltune.tuning.state.TuningState` decides and remembers (phase, trials, settings, result);
* :class:`~lightning_dltune.agreement.Agreement` makes every decision the same on every rank;
* :class:`~lightning_dltune.switching.loader.LoaderSwitcher` builds, switches and recovers the train loader;
* :class:`~lightning_dltune.output.view.RunView` shows the run: the loggers, TensorBoard's dashboard and text, the PNG.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dltune._copies import RebuiltWhenCopied
from lightning_dltune._warn import reset_warnings
from lightning_dltune.agreement import Agreement
from lightning_dltune.measurement.budget import tuner_budget, warn_shm_risk
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.measurement.probe import Probe
from lightning_dltune.output.cache import RunCache
from lightning_dltune.output.report import build_report, window_metrics
from lightning_dltune.output.view import RunView
from lightning_dltune.settings import LoaderSettings, Mode, check_one_tuner, check_tuner_arguments
from lightning_dltune.switching.evaluation import EVAL_LOOPS, EvalLoaders, EvalLoopHooks, beside
from lightning_dltune.switching.loader import LoaderSwitcher, is_last_epoch, remaining_steps
from lightning_dltune.tuning.model import Budget, Policy
from lightning_dltune.tuning.state import Phase, TuningState, WindowPlan


class DataLoaderTuner(RebuiltWhenCopied, EvalLoopHooks, Callback):
    r"""Measure how long training waits for data and retune the train ``DataLoader`` (inside an epoch or between
    epochs, see ``mode``), and the validation, test and predict loaders between and inside their passes.

    It times every step (data wait, step, other host time), and at the end of each measurement window a model of
    the loader decides whether to run the train loader with other ``num_workers`` / ``prefetch_factor``, within
    the CPUs and memory this process may use. Once the stall is gone (or more workers stop
    paying) it settles, prints a summary with a one-line diagnosis, and writes ``dltune_report.json``.

    On CUDA the stall is measured as the GPU sees it: CUDA events at step end, fetch start and end, and step
    start, read later without synchronizing (:class:`~lightning_dltune.measurement.gpu.GpuTimeline`), give the GPU's
    idle
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
            could still take (``0.5`` by default, honouring a cgroup ``memory.max``), or bytes (at least 1 MiB); divided
            among a node's ranks. Each
            worker's unique memory (USS) is measured, and a config predicted to exceed this is never tried.
        min_steps: steady-state steps a trial needs before it is judged (short epochs are pooled).
        observe_only: measure, log and report, but never rebuild the loader.
        tune_iterable: retune an ``IterableDataset``'s train loader too (at epoch boundaries). Only a dataset that
            shards itself by worker (``torch.utils.data.get_worker_info()``) may have more workers: otherwise every
            worker yields all of it. ``"auto"``: where that is checked before a config with more workers serves a
            batch (its first two workers must load different batches; the loader iterates as PyTorch's own does),
            measured only elsewhere (a loader that keeps its own state: a StatefulDataLoader, litdata's) and in the
            evaluation loops. ``True``: every such loader, checked on its first batches. ``False``: measured only.
        mode: when to switch configs. ``"epoch"``: at epoch boundaries. ``"in_epoch"``: every
            ``window_steps`` steps, inside the epoch, continuing from exactly the batch the loop reached.
            ``"auto"``: in-epoch for long epochs (at least ``8 * window_steps`` batches, or a first window
            predicting over a minute per epoch), epoch boundaries otherwise, except that a window whose stall
            is plainly the loader's (half the time or more, judged from a few steps on) switches at once when more
            than ``min_steps`` batches of the epoch are left. In-epoch switching needs a
            map-style dataset with a plain ``BatchSampler`` (what ``batch_size=``/``shuffle=`` create); other
            loaders fall back to epoch boundaries with one message.
        window_steps: steps per measurement window in in-epoch mode.
        log_gpu: sample GPU utilization and memory through NVML on CUDA.
        cache: where settled settings are remembered across runs: ``None`` uses ``$DLTUNE_CACHE`` or
            ``~/.cache/lightning-dltune/cache.json``, a path uses that file, ``False`` disables it. A run whose
            key (host CPUs and memory, accelerator, dataset class and length, batch size, the workers' start method,
            the tuner's limits, local world size, rank and world size under DDP, library version) is cached, and
            whose samples cost about what they cost then, starts from the cached settings and only verifies them.
        report_path: the file to write the JSON report to; ``None`` writes ``dltune_report.json`` in the logger's
            directory, where Lightning writes the run's files (without a logger, none: the report is on
            ``tuner.report``), ``False`` writes none. A path that cannot be written when ``fit``
            ends is one warning: ``fit`` returns as it would without the tuner.
        verbose: print the summary table and diagnosis when tuning settles.
        plot: after ``fit``, draw the run (stall, samples/s and ``num_workers`` over steps, config changes marked,
            the diagnosis as caption) as a PNG next to the report (``dltune_report.png``), when matplotlib is
            installed and a report is written. ``dltune plot REPORT.json`` draws the same picture later.
        seamless_epochs: load the next epoch's first batches while this epoch's last ones are consumed, so no
            epoch starts with an empty pipeline (PyTorch refills it at every epoch start, persistent workers or
            not). ``"auto"``: where the next epoch's order is known before it begins, drawn exactly as it would be
            then (no shuffling, a ``DistributedSampler``, a loader or sampler with its own ``generator``), on the
            loaders the tuner builds with workers and in-epoch switching. ``True``: on every sampler; a
            ``RandomSampler`` without a generator is then seeded from the run's seed and the epoch (reproducible,
            but not the order a run without the tuner draws). ``False``: off.
        eval_loops: the evaluation loops whose loader is measured and tuned too, from ``"val"`` (validation in
            ``fit`` and ``trainer.validate``), ``"test"`` and ``"predict"`` (see
            :mod:`lightning_dltune.switching.evaluation`);
            ``()`` for none. All by default: Lightning validates after every epoch, and a validation loader left at
            the default 0 workers can take longer than the tuned training it follows.

    Raises:
        ValueError: if an argument is outside its allowed values (``TypeError``: of the wrong type).
        MisconfigurationException: in ``setup``, if the ``Trainer`` holds another ``DataLoaderTuner``.

    Attributes:
        best_settings: the settled loader settings as ``DataLoader`` keyword arguments (``None`` until settled).
            Where tuning was held (``phase == "held"``) it is the best config measured, planned for a later run,
            while this run's loader goes on with the config it runs (the headline says which).
        trials: the measured :class:`~lightning_dltune.tuning.model.Trial` history.
        diagnosis: one sentence on what bounds training.
        settled_step: the global step at which tuning settled, or held for the rest of the run (``None`` until
            then).
        budget: this process's own budget; ``agreed_budget`` the tightest over all nodes (distributed runs).
        cache_hit: whether this run started from cached settings.
        report: the report written at the end of ``fit`` (a dict), with the per-window ``"series"``.
        plot_file: the PNG drawn at the end of ``fit`` (``None`` when none was).

    Logged Metrics (every ``log_every_n_steps``, to every logger, on rank zero):
        - ``dltune/stall_frac``: data wait / wall time of the window (fraction)
        - ``dltune/data_wait_ms``: mean time blocked on the next batch per step (ms)
        - ``dltune/step_ms``: mean time from batch start to batch end (ms)
        - ``dltune/other_ms``: mean other host time between steps, validation excluded (ms)
        - ``dltune/samples_per_s``: training throughput of the window (samples/s)
        - ``dltune/num_workers``: ``num_workers`` of the current train loader
        - ``dltune/prefetch_factor``: its ``prefetch_factor`` (0 when loading in the main process)
        - ``dltune/pin_memory``: 1 where it pins its batches, else 0
        - ``dltune/gpu_util_pct``, ``dltune/gpu_mem_pct``: NVML utilization and memory use (CUDA only, %)
        - ``dltune/gpu_stall_frac``: the GPU's idle gap waiting for the loader / the GPU's time (CUDA only,
          fraction; from CUDA events read without synchronizing, and what decisions use there)
        - ``dltune/gpu_idle_ms``, ``dltune/h2d_ms``: mean idle gap and host-to-device copy per step as the GPU
          saw them (CUDA only, ms)
        - ``dltune/stall_frac_spread``, ``dltune/stall_frac_max``, ``dltune/stall_frac_min``,
          ``dltune/stall_frac_max_rank``: each rank's stall, its range and the rank that waits most (distributed runs)
        - ``dltune/val/*``, ``dltune/test/*``, ``dltune/predict/*``: ``stall_frac``, ``data_wait_ms``, ``step_ms``,
          ``other_ms``, ``samples_per_s``, ``num_workers``, ``prefetch_factor`` of each evaluation pass, once per
          pass; at the ``global_step`` the pass ran at in ``fit``, at the pass's number (1, 2, ...) of its loop
          in ``validate``/``test``/``predict`` runs of their own, where ``global_step`` stands still

    With a ``TensorBoardLogger``, these are also gathered on one custom-scalars dashboard (category ``dltune``),
    and the summary (headline, diagnosis, table) goes to the Text tab (tag ``dltune/summary``) when tuning ends
    and when training ends.

    Distributed: every rank measures; each decision is taken on the statistics of the rank that waited most for
    data and the smallest budget of any node (gathered with the strategy's ``all_gather``), and every rank switches
    at the same step, so Lightning's reload barrier never waits on a rank that decided otherwise. Once tuning ends,
    where the ranks' stalls differed, each rank runs its own worker count (``rank_workers`` in the report).

    Run length: a switch restarts the loader's workers, so with ``max_epochs``/``max_steps`` known a config is
    tried only if it is predicted to save more over the steps left than its start-up costs; otherwise the tuner
    stays on its config for the rest of the run (``phase == "held"``) and plans the next config for a resumed
    or longer run.

    Checkpoints: the tuner's phase, trials and settled settings are saved with the callback state (and, with
    the mixin, the settings with the DataModule's). A run resumed after tuning settled starts on the settled
    settings and does not tune again; one resumed mid-tuning continues where it was; one resumed mid-epoch
    continues the epoch's sample order exactly at the saved batch.

    Copies: a tuner pickles and deep-copies (``ddp_spawn`` pickles the trainer's callbacks); a copy keeps the
    arguments, what was learnt and the results, and builds its running parts anew.

    Example::

        from lightning import Trainer
        from lightning_dltune import DataLoaderTuner

        trainer = Trainer(callbacks=[DataLoaderTuner()])
        trainer.fit(model, datamodule=dm)
    """

    budget: Budget | None
    report: dict[str, Any] | None
    report_file: Path | None

    def __init__(
        self,
        stall_threshold: float = 0.05,
        max_trials: int = 6,
        max_workers: int | None = None,
        max_prefetch: int = 8,
        max_memory: float | None = None,
        min_steps: int = 8,
        observe_only: bool = False,
        tune_iterable: bool | Literal["auto"] = "auto",
        mode: Mode = "auto",
        window_steps: int = 20,
        log_gpu: bool = True,
        cache: str | Path | bool | None = None,
        report_path: str | Path | bool | None = None,
        verbose: bool = True,
        plot: bool = True,
        seamless_epochs: bool | str = "auto",
        eval_loops: Sequence[str] = EVAL_LOOPS,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        check_tuner_arguments(**arguments)
        self.policy = Policy(stall_threshold=float(stall_threshold), max_trials=max_trials, min_steps=min_steps)
        self.max_workers, self.max_prefetch, self.max_memory = max_workers, max_prefetch, max_memory
        self._state_key = self._generate_state_key(stall_threshold=self.policy.stall_threshold, max_workers=max_workers)
        self.observe_only, self.tune_iterable, self.mode, self.log_gpu = observe_only, tune_iterable, mode, log_gpu
        self.cache, self.report_path = None if cache is True else cache, None if report_path is True else report_path
        self._cache, self.verbose, self.plot = RunCache(self.cache), verbose, plot
        self.view, self.state = RunView(plot), TuningState(self.policy, observe_only)
        self.plan = WindowPlan(mode, max(window_steps, min_steps + 1), min_steps, whole=lambda: self.state.whole_epoch)
        self.probe = Probe(worker_pids=lambda: self.switcher.worker_pids())
        hooks = (self._lookup_cache, self._fail)
        self.switcher = LoaderSwitcher(self.state, self.probe, mode, tune_iterable, *hooks, seamless_epochs)
        self.agreement = Agreement()
        self._limits = {"max_workers": max_workers, "max_prefetch": max_prefetch, "max_memory": max_memory}
        self.evals = EvalLoaders(eval_loops, self.policy, observe_only, tune_iterable, self.cache, self._limits)
        self.switcher.seamless.before_epoch = self.evals.draws_before  # validation's draws between epochs
        self.budget, self.report, self.report_file, self._steps_since_log = None, None, None, 0
        self._copied_from(arguments)  # a copy (ddp_spawn pickles the callbacks) is built anew from its arguments

    def _rebuild(self, **arguments: Any) -> None:
        DataLoaderTuner.__init__(self, **arguments)

    # --- results, read from the parts ---------------------------------------------------------------------------
    phase = property(lambda self: self.state.phase, doc="The tuning :class:`~lightning_dltune.tuning.state.Phase`.")
    trials = property(lambda self: self.state.trials, doc="Every measured trial.")
    best_settings = property(lambda self: self.state.best_settings, doc="The result as ``DataLoader`` kwargs.")
    settled_step = property(lambda self: self.state.settled_step, doc="The step tuning ended at.")
    diagnosis = property(lambda self: self.state.diagnosis, doc="What bounds training, in a sentence.")
    cache_hit = property(lambda self: self.state.cache_hit, doc="Whether this run started from the cache.")
    agreed_budget = property(lambda self: self.agreement.budget, doc="The tightest node's budget (DDP).")
    stall_spread = property(lambda self: self.agreement.stall_spread, doc="Max - min stall across ranks.")
    plot_file = property(lambda self: self.view.plot_file, doc="The PNG of the run drawn after ``fit``.")
    state_key = property(lambda self: self._state_key, doc="Built once: Lightning reads it at every hook call.")

    # --- set-up and tear-down -----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        check_one_tuner([c for c in getattr(trainer, "callbacks", []) if isinstance(c, DataLoaderTuner)])
        reset_warnings()  # a second run (a notebook, a sweep) is told again what the first was told
        self.budget = tuner_budget(max(1, trainer.num_devices), self.max_workers, self.max_prefetch, self.max_memory)
        self.agreement = Agreement(trainer.strategy, self.policy, lambda: self.switcher.alike)
        held, around = lambda: self.probe.held_bytes(self.state.current), (self.probe.pause, self.probe.resume)
        self.evals.install(trainer, stage, self.budget, self.agreement, held, self.verbose, around)
        if stage != "fit":
            return
        self.state.begin_fit()
        self.view.start()
        self.switcher.single_process = not self.agreement.distributed
        self.probe.start(trainer.strategy.root_device, self.log_gpu)
        self.switcher.install(trainer)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._release()
        if stage != "fit" and self.evals.report(self.budget):  # a validate, test or predict run: its loop reported
            self._write_report(trainer, self.report or self._build_report(trainer), draw=False)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._release(failed=True)  # Lightning calls no teardown hook after an exception

    def _release(self, failed: bool = False) -> None:
        """Undo :meth:`setup`; after a ``failed`` run, also stop every worker the tuner holds. Safe to call twice."""
        self.switcher.restore(stop_workers=failed)
        self.evals.restore(stop_workers=failed)
        self.probe.stop()

    # --- the cache ----------------------------------------------------------------------------------------------
    def _lookup_cache(self, loader: DataLoader) -> None:
        trainer, budget, cache = self.switcher.trainer, self.budget, self._cache
        if trainer is not None and budget is not None:  # every rank starts on the same config
            hit = cache.start(self.state, loader, budget.cpus, trainer, self._limits, self.agreement)
            if hit is not None:
                rank_zero_info(f"DataLoaderTuner: starting from cached settings {hit.describe()} ({cache.path}).")

    # --- the loop's hooks ---------------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.probe.epoch_started(trainer.num_training_batches)
        self.switcher.epoch_started()
        self.plan.epoch_started(self.switcher.in_epoch, self.state.tuning, trainer.num_training_batches)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self.probe.step_started()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.probe.step_ended(batch, details=self.state.phase is not Phase.SETTLED)
        self.switcher.batch_done()
        self.evals.train_batch_ended(trainer)  # the validation loader may begin its next pass
        self._steps_since_log += 1
        if self._steps_since_log >= max(1, int(getattr(trainer, "log_every_n_steps", 50))):
            self._steps_since_log = 0
            self._log(trainer)
        if self._over_memory_budget():  # held at once, tuning or not (a distributed run agrees at a window's end)
            return self._close_window(trainer, now=self.switcher.in_epoch, done=batch_idx + 1)
        if not (self.switcher.in_epoch and self.state.tuning):
            return
        batches = trainer.num_training_batches
        left = batches - (batch_idx + 1)
        now = self.probe.peek()
        if self.plan.close_in_epoch(
            self._window_steps(),
            self.state.judge_early(now, self.budget, on_gpu=self.probe.gpu is not None),
            left,
            self.agreement.any if self.agreement.distributed else None,
            lambda: self.agreement.largest(batches * now.mean_wall_s),
            lambda: self.state.undecided(now, self.agreement.distributed),
        ):
            self._close_window(trainer, now=True, done=batch_idx + 1)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.probe.pause()  # validation is not training's time
        super().on_validation_start(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        self.probe.resume()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        undecided = lambda: self.state.undecided(self.probe.peek(), self.agreement.distributed)  # noqa: E731
        if self.state.current is None or self.state.done:
            self.probe.skip()
            if self.agreement.distributed and self.state.done:  # a failure on one rank is agreed here
                self._close_window(trainer, now=False, done=trainer.num_training_batches)
        elif self.plan.close_at_epoch_end(self._window_steps(), is_last_epoch(trainer), undecided):
            self._close_window(trainer, now=False, done=trainer.num_training_batches)
        self.switcher.epoch_ended(is_last_epoch(trainer))  # after the decision: the reload it asked for, if any

    def _over_memory_budget(self) -> bool:
        budget = None if self.budget is None else self.budget.memory_bytes
        local = self.state.switching and not self.agreement.distributed and not self.switcher.waiting_for_epoch_end
        return local and self.probe.over_budget(self.state.current, budget)

    def _window_steps(self) -> int:
        """Under DDP every rank must close a window at the same step: count what all ranks count alike."""
        return self.probe.window_batches if self.agreement.distributed else self.probe.window_steps

    def _log(self, trainer: "pl.Trainer") -> None:
        stats, gpu_stats, nvml = self.probe.take_log()
        self.agreement.spread(stats.stall_frac)  # every rank's, in `rank_stalls`
        if stats.steps:  # the series is kept with or without a logger
            current = self.state.current or LoaderSettings()
            self.view.window(trainer, window_metrics(stats, gpu_stats, current, self.agreement.rank_stalls, nvml))

    # --- deciding -----------------------------------------------------------------------------------------------
    def _close_window(self, trainer: "pl.Trainer", now: bool, done: float) -> None:
        """Judge the window that just ended; ``done``: batches of this epoch already trained."""
        assert self.budget is not None
        running = self.probe.held_bytes(self.state.current)  # before the window's close takes the readings
        stats = self._measured() if not self.state.done else self.probe.memory_only()
        left, epoch = remaining_steps(trainer, done), trainer.num_training_batches
        in_epoch = not (ranks := self.agreement.distributed) and now  # where a switch up may start in the background
        in_place = self.switcher.changes_in_place  # a prefetch change restarts nothing, more workers start alone
        choose = lambda s, b, f: self.state.decide(s, b, left, f, in_epoch, in_place, epoch)  # noqa: E731
        budget = beside(self.budget, self.evals.held_bytes())  # the evaluation loops' persistent workers
        stats, budget, decision = self.agreement.decide(stats, budget, choose, self.state.unagreed, self.state.current)
        failures, stalls = self.agreement.failures, self.agreement.rank_stalls  # no stalls in a single process
        change = self.state.apply(decision, stats, budget, trainer.global_step, failures, stalls)
        self.probe.memory.measuring = self.state.probing_memory
        ended = decision is not None and self.state.done  # then each rank its own count
        settings, everywhere = self.agreement.own_change(change, ended, self.state.current, budget)
        self.state.rank_workers = self.agreement.rank_workers  # checkpointed: each rank's back on resume
        if settings is not None:  # under DDP, each rank's own count from the epoch end: every rank reloads together
            self._log(trainer)  # the steps not logged yet ran on the running config: logged under its settings
            behind = change is not None and self.state.starts_behind(
                change, running, self.probe.batch_bytes, budget, ranks
            )
            self.switcher.switch(settings, now and not self.agreement.later, is_last_epoch(trainer), everywhere, behind)
        if decision is not None and self.state.done:
            self._tuning_ended(trainer)

    def _measured(self) -> WindowStats:
        stats = self.probe.close(decision_waits=self.state.switching and self.state.tuning)
        warn_shm_risk(self.state.current, stats.batch_bytes, self.budget, self.policy.shm_fraction)
        return stats

    def _fail(self, kind: str, why: str) -> LoaderSettings | None:
        """The running config failed: record it and return the fallback (see ``LoaderSwitcher``)."""
        assert self.budget is not None and self.switcher.trainer is not None
        before = self.state.best_settings, self.state.phase
        distributed = self.agreement.distributed  # then the window goes on: every rank closes it at the same step
        stats = WindowStats() if distributed else self._measured()
        fallback = self.state.fail(stats, f"{kind}: {why}", self.budget, self.switcher.trainer.global_step, distributed)
        if fallback is not None and (self.state.best_settings, self.state.phase) != before:
            self._tuning_ended(self.switcher.trainer)  # a new result, summarized; the cache forgets the failed one
        return fallback

    def _tuning_ended(self, trainer: "pl.Trainer") -> None:
        self.plan.in_epoch = False
        self._cache.teach(self.state, self.agreement.cache_extra())  # under DDP each rank its own entry
        self.view.summarize(trainer, self.state, say=self.verbose)

    # --- checkpoints and the report -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self._tuning_state(), **self.switcher.position_state()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_tuning_state(state_dict)
        self.state.target = self.agreement.resumed(self.state.target, self.state.rank_workers)  # this rank's own
        self.switcher.aim(self.state.target)  # now: FSDP/DeepSpeed restore after on_fit_start
        self.switcher.load_position(state_dict)

    def _tuning_state(self) -> dict[str, Any]:
        """What was learnt (phase, trials, settings, each evaluation loop's), without the epoch's position."""
        return {**self.state.state_dict(), "loops": self.evals.state_dict()}

    def _load_tuning_state(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)
        self.evals.load_state_dict(state.get("loops", {}))

    def _plain_state(self) -> dict[str, Any]:  # a copy's: what was learnt and the results
        return {"tuning": self._tuning_state(), "budget": self.budget, "report": self.report, "file": self.report_file}

    def _load_plain_state(self, state: dict[str, Any]) -> None:
        self._load_tuning_state(state["tuning"])
        self.budget, self.report, self.report_file = state["budget"], state["report"], state["file"]

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self.budget is not None  # the final summary, while the loggers are still open (fit's end is later)
        self.state.finish(self.budget)
        self.view.summarize(trainer, self.state, say=False)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self.budget is not None
        self.state.finish(self.budget)
        self.report = self._build_report(trainer)
        self._write_report(trainer, self.report)

    def _build_report(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stall_threshold": self.policy.stall_threshold,
            **{"settled_step": self.settled_step, "cache_hit": self.cache_hit, "world_size": trainer.world_size},
            **self.agreement.report(),
        }
        return build_report(**self.state.report_content(), budget=self.budget, series=self.view.series, extra=extra)

    def _write_report(self, trainer: "pl.Trainer", report: dict[str, Any], draw: bool = True) -> None:
        """Write ``report`` with every evaluation loop's section, and (``draw``, after ``fit``) draw it."""
        self.report = {**report, "loops": self.evals.report(self.budget)}
        self.report_file = self.view.publish(trainer, self.report, self.report_path, draw) or self.report_file
