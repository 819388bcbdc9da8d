"""What a run shows people: the ``dltune/*`` scalars in every logger, in TensorBoard a dashboard of them and the
summary as text, and after ``fit`` a picture of the run next to the report.

:class:`RunView` is the callback's only way to its loggers. It keeps the run's
:class:`~lightning_dltune.output.report.WindowSeries` (every logging window, with or without a logger), writes the
custom-scalars layout to each TensorBoard logger with the first window, the diagnosis and the summary table to
TensorBoard's Text tab when tuning ends and when training ends, and draws the PNG with
:func:`~lightning_dltune.output.plot.draw_report` (the function ``dltune plot`` uses). Writing happens on rank zero.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from lightning_dltune import _imports
from lightning_dltune._warn import info_once, warn_once
from lightning_dltune.output.plot import PlotError, draw_report, plot_path
from lightning_dltune.output.report import (
    DATA_WAIT_MS,
    GPU_IDLE_MS,
    GPU_MEM_PCT,
    GPU_STALL_FRAC,
    GPU_UTIL_PCT,
    NUM_WORKERS,
    OTHER_MS,
    PIN_MEMORY,
    PREFETCH_FACTOR,
    SAMPLES_PER_S,
    STALL_FRAC,
    STALL_MAX,
    STALL_MAX_RANK,
    STALL_MIN,
    STALL_SPREAD,
    STEP_MS,
    WindowSeries,
    report_path,
    summary_table,
    write_json_atomic,
)
from lightning_dltune.tuning.state import TuningState

SUMMARY_TAG = "dltune/summary"
DASHBOARD = "dltune"
DASHBOARD_CHARTS: dict[str, tuple[str, ...]] = {
    "stall (fraction of the step's time)": (STALL_FRAC, GPU_STALL_FRAC, STALL_SPREAD, STALL_MAX, STALL_MIN),
    "rank that waits most": (STALL_MAX_RANK,),
    "data wait (ms per step)": (DATA_WAIT_MS, GPU_IDLE_MS),
    "step time (ms)": (STEP_MS, OTHER_MS),
    "throughput (samples/s)": (SAMPLES_PER_S,),
    "workers": (NUM_WORKERS, PREFETCH_FACTOR, PIN_MEMORY),
    "GPU utilization (%)": (GPU_UTIL_PCT, GPU_MEM_PCT),
    "evaluation loaders: stall (per pass)": tuple(f"dltune/{loop}/stall_frac" for loop in ("val", "test", "predict")),
    "evaluation loaders: workers": tuple(f"dltune/{loop}/num_workers" for loop in ("val", "test", "predict")),
}


def dashboard_layout() -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout (``SummaryWriter.add_custom_scalars``): one category, one multi-line chart per
    group of ``dltune/*`` tags, each tag matched exactly."""
    return {
        DASHBOARD: {
            title: ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]] for title, tags in DASHBOARD_CHARTS.items()
        }
    }


def summary_markdown(state: TuningState) -> str:
    """The tuner's result for TensorBoard's Text tab: the headline, the diagnosis and the table (in a code
    block, so its columns stay aligned)."""
    table = summary_table(state.trials, state.result)
    return f"**DataLoaderTuner** {state.headline()}\n\n**Diagnosis:** {state.diagnosis or '-'}\n\n```\n{table}\n```"


class RunView:
    """The run's series, its loggers and its picture.

    Args:
        plot: draw the PNG after ``fit`` (when matplotlib is installed and a report is written).

    Attributes:
        series: the :class:`~lightning_dltune.output.report.WindowSeries` of this ``fit``.
        plot_file: the PNG written after ``fit`` (``None`` before, or when none was drawn).
    """

    def __init__(self, plot: bool = True) -> None:
        self.plot = plot
        self.series = WindowSeries()
        self.plot_file: Path | None = None
        self._layout_written = False
        self._summary = ""

    def start(self) -> None:
        """A new ``fit``: a fresh series; the dashboard and the summary are written again."""
        self.series.reset()
        self.plot_file, self._layout_written, self._summary = None, False, ""

    def window(self, trainer: "pl.Trainer", metrics: Mapping[str, float]) -> None:
        """A logging window's metrics: into the series, and to every logger (with TensorBoard's dashboard first)."""
        self.series.record(trainer.global_step, metrics)
        if not trainer.loggers:
            return
        if not self._layout_written:
            self._layout_written = True
            _write_layout(trainer)
        _log_to_loggers(trainer, dict(metrics))

    def summarize(self, trainer: "pl.Trainer", state: TuningState, say: bool) -> None:
        """Tuning or training ended: the summary to TensorBoard's Text tab (when it changed) and, ``say``, printed."""
        if say:
            rank_zero_info(
                f"DataLoaderTuner {state.headline()}\n{summary_table(state.trials, state.result)}\n"
                f"Diagnosis: {state.diagnosis}"
            )
        text = summary_markdown(state)
        if text != self._summary:
            self._summary = text
            _write_text(trainer, text)

    def publish(self, trainer: "pl.Trainer", report: dict[str, Any], option: Any, draw: bool = True) -> Path | None:
        """Write ``report`` where the tuner's ``report_path`` ``option`` says (:func:`report_path`) and, ``draw``,
        draw it, on rank zero; the file written (``None``: none)."""
        log_dir = run_files_dir(trainer) if option is None else None
        path = report_path(option, log_dir)
        if option is None and log_dir is None:
            info_once(
                "no-report-file",
                "DataLoaderTuner: no logger directory, so no report file: the report is on `tuner.report`; "
                "pass `DataLoaderTuner(report_path=...)` to write it.",
            )
        if path is None or not trainer.is_global_zero:
            return None
        written = write_report(path, report)
        if draw:
            self.draw(report, written)
        return written

    def draw(self, report: Mapping[str, Any], report_file: Path | None) -> Path | None:
        """The picture of ``report`` next to ``report_file`` (``None``: not asked for, no report was written, or not
        possible: said once)."""
        if not self.plot or report_file is None:
            return None
        if not _imports._MATPLOTLIB_AVAILABLE:
            info_once("no-matplotlib", f"DataLoaderTuner: no picture of the run: {_imports.MATPLOTLIB_MISSING}.")
            return None
        path = plot_path(report_file)
        try:
            self.plot_file = draw_report(report, path)
        except PlotError as ex:
            info_once("no-plot", f"DataLoaderTuner: no picture of the run: {ex}")
        except OSError as ex:  # the report was written: training's result is not lost for a picture
            info_once("no-plot", f"DataLoaderTuner: no picture of the run: cannot write {path}: {ex.strerror or ex}.")
        return self.plot_file


def run_files_dir(trainer: "pl.Trainer") -> str | None:
    """Where Lightning writes this run's files: the first logger's directory (``None`` without a logger, or where it
    is a checkpoint folder, which holds checkpoints only). Every rank must call it: ``log_dir`` broadcasts."""
    if not trainer.loggers:
        return None
    log_dir = trainer.log_dir
    dirpaths = (getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks)
    checkpoint_dirs = {os.path.realpath(d) for d in dirpaths if d}
    if log_dir is None or os.path.realpath(log_dir) in checkpoint_dirs:
        return None
    return str(log_dir)


def write_report(path: Path, report: dict[str, Any]) -> Path | None:
    """Write the report; a path that cannot be written is one warning (``None``), not a failed ``fit`` after
    training."""
    try:
        return write_json_atomic(path, report)
    except OSError as ex:
        warn_once(
            f"report-write-{path}",
            f"DataLoaderTuner: cannot write the report {path} ({ex.strerror or ex}); training's result is kept. "
            "Pass `DataLoaderTuner(report_path=...)` a file in a writable directory, or `report_path=False`.",
        )
        return None


def tensorboard_writers(trainer: "pl.Trainer") -> list[Any]:
    """The ``SummaryWriter`` of each TensorBoard logger of ``trainer``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    return [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


@rank_zero_only
def _log_to_loggers(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


@rank_zero_only
def _write_layout(trainer: "pl.Trainer") -> None:
    for writer in tensorboard_writers(trainer):
        writer.add_custom_scalars(dashboard_layout())


@rank_zero_only
def _write_text(trainer: "pl.Trainer", text: str) -> None:
    for writer in tensorboard_writers(trainer):
        writer.add_text(SUMMARY_TAG, text, global_step=trainer.global_step)
