"""The picture of a run, drawn from its report: stall, throughput and the loader's config over steps, every config
change marked, the diagnosis as caption.

One drawing function, :func:`draw_report`, serves the tuner (a PNG next to ``dltune_report.json`` after ``fit``)
and ``dltune plot REPORT.json`` (the same picture later). It draws on a bare ``matplotlib.figure.Figure``: no
pyplot, so the caller's backend (a notebook's) and pyplot's figures are left alone.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_dltune import _imports
from lightning_dltune.output.report import GPU_SERIES_KEY, PIN_SERIES_KEY, SERIES_KEYS
from lightning_dltune.settings import LoaderSettings

_CAPTION_WIDTH = 115


class PlotError(RuntimeError):
    """The run cannot be drawn (no matplotlib, a report without a series); one line with the fix."""


def plot_path(report_file: str | os.PathLike[str]) -> Path:
    """Where the picture of ``report_file`` goes: next to it, with the suffix ``.png``."""
    return Path(report_file).with_suffix(".png")


def config_changes(
    steps: Sequence[int], workers: Sequence[int], prefetch: Sequence[int], pinned: Sequence[int] = ()
) -> list[int]:
    """The steps where the loader's config (workers, prefetch, pinned memory) changed: the start of the first window
    logged with a new config (the previous window's step: each point covers the steps since the one before)."""
    pins = list(pinned) or [0] * len(steps)
    configs = list(zip(workers, prefetch, pins, strict=False))
    return [steps[i - 1] for i in range(1, len(steps)) if configs[i] != configs[i - 1]]


def _series(report: Mapping[str, Any]) -> dict[str, list[Any]]:
    series = report.get("series")
    if not isinstance(series, Mapping) or not series.get("step"):
        version = report.get("version")
        why = "it was written before reports kept one (version 1)" if version == 1 else "no window was logged"
        raise PlotError(
            f"the report has no per-window series to draw: {why}. Train with this version of lightning-dltune "
            "for at least `log_every_n_steps` steps."
        )
    columns = {key: list(series.get(key) or []) for key in (*SERIES_KEYS, GPU_SERIES_KEY, PIN_SERIES_KEY)}
    n = len(columns["step"])
    if any(len(columns[key]) != n for key in SERIES_KEYS):
        raise PlotError("the report's series has columns of different lengths: it was edited or truncated.")
    return columns


def _title(report: Mapping[str, Any]) -> str:
    settled = report.get("settled_settings")
    config = LoaderSettings.from_dict(settled).describe() if isinstance(settled, dict) else "no result"
    return f"DataLoaderTuner ({report.get('phase', '?')}): {config}"


def draw_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw the run of ``report`` (a dict from the tuner or :func:`~lightning_dltune.output.report.read_report`) as a
    PNG at ``path``: stall fraction, samples/s and ``num_workers``/``prefetch_factor`` over steps, in three
    panels sharing the step axis, dashed lines where the config changed, the diagnosis below.

    Raises:
        PlotError: matplotlib is missing, or the report holds no series.
    """
    if not _imports._MATPLOTLIB_AVAILABLE:
        raise PlotError(_imports.MATPLOTLIB_MISSING)
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    s = _series(report)
    caption = textwrap.wrap(f"Diagnosis: {report.get('diagnosis') or '-'}", _CAPTION_WIDTH) or [""]
    height = 7.0 + 0.18 * len(caption)
    fig = Figure(figsize=(8.5, height), dpi=100)
    fig.subplots_adjust(left=0.1, right=0.97, top=1 - 0.45 / height, bottom=(0.6 + 0.18 * len(caption)) / height)
    stall, rate, config = fig.subplots(3, 1, sharex=True)
    steps = s["step"]
    line = {"drawstyle": "steps-pre", "marker": ".", "markersize": 4}  # a point covers the steps since the last
    stall.plot(steps, s["stall_frac"], label="host: data wait / wall time", **line)
    if any(v is not None for v in s[GPU_SERIES_KEY]):
        gpu = [float("nan") if v is None else v for v in s[GPU_SERIES_KEY]]
        stall.plot(steps, gpu, label="GPU: idle waiting for data", **line)
    threshold = report.get("stall_threshold")
    if isinstance(threshold, (int, float)):
        stall.axhline(threshold, color="grey", linestyle=":", label=f"stall_threshold {threshold:.0%}")
    stall.yaxis.set_major_formatter(PercentFormatter(1.0))
    stall.set_ylim(bottom=0)
    stall.set_ylabel("stall")
    rate.plot(steps, s["samples_per_s"], color="tab:green", **line)
    rate.set_ylim(bottom=0)
    rate.set_ylabel("samples/s")
    config.plot(steps, s["num_workers"], color="tab:purple", label="num_workers", **line)
    config.plot(steps, s["prefetch_factor"], color="tab:orange", label="prefetch_factor", **line)
    if any(s[PIN_SERIES_KEY]):
        config.plot(steps, s[PIN_SERIES_KEY], color="tab:cyan", label="pin_memory (1: on)", **line)
    config.set_ylim(bottom=0)
    config.set_ylabel("loader config")
    config.set_xlabel("global step")
    _draw_validation(report, stall, config)
    for i, step in enumerate(config_changes(steps, s["num_workers"], s["prefetch_factor"], s[PIN_SERIES_KEY])):
        for ax in (stall, rate, config):
            ax.axvline(step, color="tab:red", linestyle="--", alpha=0.6, label="config changed" if i == 0 else None)
    for ax in (stall, rate, config):
        ax.grid(alpha=0.3)
    stall.legend(fontsize=8, loc="upper right")
    config.legend(fontsize=8, loc="upper left")
    stall.set_title(_title(report))
    fig.text(0.02, 0.15 / height, "\n".join(caption), fontsize=9, va="bottom", ha="left")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _draw_validation(report: Mapping[str, Any], stall: Any, config: Any) -> None:
    """The validation loader's passes, at the steps they ran at: its stall and its ``num_workers`` (crosses)."""
    loops = report.get("loops")
    series = loops.get("val", {}).get("series") if isinstance(loops, Mapping) else None
    if not isinstance(series, Mapping) or not series.get("step"):
        return
    marks = {"linestyle": "none", "marker": "x", "markersize": 5, "color": "tab:brown"}
    stall.plot(series["step"], series["stall_frac"], label="validation pass: data wait / wall time", **marks)
    config.plot(series["step"], series["num_workers"], label="validation num_workers", **marks)
