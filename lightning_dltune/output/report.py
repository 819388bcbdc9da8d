"""The summary table people read at the end of tuning, the JSON report they can reuse, and the per-window series
the report keeps for the picture of the run (:mod:`lightning_dltune.output.plot`)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_dltune.measurement.gpu import GpuStats
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Budget, Trial

REPORT_NAME = "dltune_report.json"
REPORT_VERSION = 3  # 2: "series" (one point per logging window) and "stall_threshold"; 3: each trial's "rule"

PREFIX = "dltune/"
STALL_FRAC = PREFIX + "stall_frac"
DATA_WAIT_MS = PREFIX + "data_wait_ms"
STEP_MS = PREFIX + "step_ms"
OTHER_MS = PREFIX + "other_ms"
SAMPLES_PER_S = PREFIX + "samples_per_s"
NUM_WORKERS = PREFIX + "num_workers"
PREFETCH_FACTOR = PREFIX + "prefetch_factor"
PIN_MEMORY = PREFIX + "pin_memory"
GPU_UTIL_PCT = PREFIX + "gpu_util_pct"
GPU_MEM_PCT = PREFIX + "gpu_mem_pct"
GPU_STALL_FRAC = PREFIX + "gpu_stall_frac"
GPU_IDLE_MS = PREFIX + "gpu_idle_ms"
H2D_MS = PREFIX + "h2d_ms"
STALL_SPREAD = PREFIX + "stall_frac_spread"
STALL_MAX, STALL_MIN = PREFIX + "stall_frac_max", PREFIX + "stall_frac_min"
STALL_MAX_RANK = PREFIX + "stall_frac_max_rank"


def window_metrics(
    stats: WindowStats,
    gpu: GpuStats | None,
    settings: LoaderSettings,
    rank_stalls: Sequence[float] = (),
    nvml: dict[str, float] | None = None,
) -> dict[str, float]:
    """The ``dltune/*`` metrics of one logging window (see :class:`~lightning_dltune.DataLoaderTuner`);
    ``rank_stalls``: every rank's stall fraction, in a distributed run."""
    metrics = {
        STALL_FRAC: stats.stall_frac,
        DATA_WAIT_MS: stats.mean_wait_s * 1e3,
        STEP_MS: stats.mean_step_s * 1e3,
        OTHER_MS: stats.mean_other_s * 1e3,
        SAMPLES_PER_S: stats.samples_per_s,
        NUM_WORKERS: float(settings.num_workers),
        PREFETCH_FACTOR: float(settings.prefetch_factor or 0),
        PIN_MEMORY: float(settings.pin_memory),
    }
    if len(rank_stalls) > 1:  # which rank waits most, and the range
        metrics[STALL_MAX], metrics[STALL_MIN] = max(rank_stalls), min(rank_stalls)
        metrics[STALL_SPREAD] = metrics[STALL_MAX] - metrics[STALL_MIN]
        metrics[STALL_MAX_RANK] = float(max(range(len(rank_stalls)), key=rank_stalls.__getitem__))
    if gpu is not None and gpu.stall_frac is not None:
        metrics[GPU_STALL_FRAC] = gpu.stall_frac
        metrics[GPU_IDLE_MS] = gpu.mean_idle_s * 1e3
        metrics[H2D_MS] = gpu.mean_copy_s * 1e3
    if nvml:
        metrics[GPU_UTIL_PCT] = nvml["gpu_util_pct"]
        metrics[GPU_MEM_PCT] = nvml["gpu_mem_pct"]
    return metrics


SERIES_KEYS = ("step", "stall_frac", "samples_per_s", "num_workers", "prefetch_factor")
GPU_SERIES_KEY = "gpu_stall_frac"  # only in a report whose run measured it (CUDA)
PIN_SERIES_KEY = "pin_memory"  # only where some window ran pinned (1) (reports before it have none)


class WindowSeries:
    """The run's curves, one point per logging window: the step, the stall, the throughput and the loader's config.

    Fed with each window's :func:`window_metrics` (whether or not the run has a logger), kept in the report as
    ``"series"`` and drawn by :func:`lightning_dltune.output.plot.draw_report`. At most ``max_points`` points: beyond
    that every other point is dropped and windows are taken half as often, so a long run's report stays small.
    """

    def __init__(self, max_points: int = 2000) -> None:
        self.max_points = max_points
        self.reset()

    def reset(self) -> None:
        self.points: list[tuple[int, float, float, int, int, float | None, int]] = []
        self._every, self._seen = 1, 0

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """One logging window's ``dltune/*`` metrics, logged at ``step``."""
        self._seen += 1
        if (self._seen - 1) % self._every:
            return
        gpu = metrics.get(GPU_STALL_FRAC)
        self.points.append(
            (
                int(step),
                round(metrics[STALL_FRAC], 5),
                round(metrics[SAMPLES_PER_S], 2),
                int(metrics[NUM_WORKERS]),
                int(metrics[PREFETCH_FACTOR]),
                None if gpu is None else round(gpu, 5),
                int(metrics.get(PIN_MEMORY, 0.0)),
            )
        )
        if len(self.points) > self.max_points:
            self.points, self._every = self.points[::2], 2 * self._every

    def to_dict(self) -> dict[str, list[Any]]:
        """Column lists under :data:`SERIES_KEYS` (``prefetch_factor`` 0: loading in the main process), and
        ``gpu_stall_frac`` (``None`` where a window had no reading) when the GPU's stall was measured."""
        columns = [list(c) for c in zip(*self.points, strict=True)] or [[] for _ in range(7)]
        series = dict(zip(SERIES_KEYS, columns[:5], strict=True))
        if any(v is not None for v in columns[5]):
            series[GPU_SERIES_KEY] = columns[5]
        if any(columns[6]):
            series[PIN_SERIES_KEY] = columns[6]
        return series


def summary_table(trials: Sequence[Trial], settled: LoaderSettings | None) -> str:
    """A fixed-width table: one row per trial with its throughput, stall and the decision taken after it.

    With a GPU timeline (CUDA) it adds the GPU's stall (idle gap waiting for the loader) and the host-to-device
    copy per step, next to the host's measure; in a distributed run, each rank's stall (``rank:stall``: the row's
    other figures are the most stalled rank's).
    """
    on_gpu = any(t.stats.gpu_steps for t in trials)
    header: tuple[str, ...] = ("config", "steps", "samples/s", "stall", "wait ms", "step ms", "startup s")
    if on_gpu:
        header += ("gpu stall", "h2d ms")
    by_rank = any(t.ranks for t in trials)
    if by_rank:
        header += ("stall by rank",)
    header += ("decision",)
    rows = []
    for t in trials:
        s = t.stats
        mark = "*" if settled is not None and t.settings == settled else " "
        row: tuple[str, ...] = (
            f"{mark}{t.settings.describe()}",
            str(s.steps),
            f"{s.samples_per_s:.1f}",
            f"{s.stall_frac:.1%}",
            f"{s.mean_wait_s * 1e3:.2f}",
            f"{s.mean_step_s * 1e3:.2f}",
            f"{s.startup_s:.2f}",
        )
        if on_gpu:
            gpu_stall = s.gpu_stall_frac
            row += (
                "-" if gpu_stall is None else f"{gpu_stall:.1%}",
                f"{s.gpu.mean_copy_s * 1e3:.2f}" if s.gpu_steps else "-",
            )
        if by_rank:
            row += (" ".join(f"{i}:{x:.0%}" for i, x in enumerate(t.ranks)) or "-",)
        said = (t.failed and f"FAILED: {t.failed}") or t.decision
        rows.append((*row, f"[{t.rule}] {said}" if t.rule and said else said))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1])
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    return "\n".join(lines)


def build_report(
    *,
    trials: Sequence[Trial],
    start: LoaderSettings | None,
    settled: LoaderSettings | None,
    phase: str,
    diagnosis: str,
    budget: Budget | None,
    diagnosed_by: str = "",
    series: WindowSeries | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "phase": phase,
        "start_settings": start.to_loader_kwargs() if start else None,
        "settled_settings": settled.to_loader_kwargs() if settled else None,
        "diagnosis": diagnosis,
        "diagnosed_by": diagnosed_by,  # the diagnosis's name (`diagnose.DIAGNOSES`)
        "budget": None
        if budget is None
        else {
            "cpus": budget.cpus,
            "max_workers": budget.max_workers,
            "max_prefetch": budget.max_prefetch,
            "bound_by": budget.bound_by,
        },
        "trials": [t.to_dict() for t in trials],
        "series": (series or WindowSeries()).to_dict(),
    }
    if extra:
        report.update(extra)
    return report


class ReportError(ValueError):
    """A file that cannot be read as a report; the message is one line naming the problem and the fix."""


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The report in ``path``, in the current form whatever version wrote it (a version 1 report gets an empty
    ``"series"``). Raises :class:`ReportError` for a missing file or one that is not a dltune report."""
    path = Path(path)
    fix = f"Pass the {REPORT_NAME} that `fit` wrote (in the logger's directory, or the tuner's `report_path`)."
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"no such file: {path}. {fix}") from None
    except OSError as ex:
        raise ReportError(f"cannot read {path}: {ex.strerror or ex}. {fix}") from None
    except ValueError:  # not JSON, or not text
        raise ReportError(f"{path} is not a dltune report (not JSON). {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("version"), int) or "trials" not in data:
        raise ReportError(f"{path} is not a dltune report (no version and trials). {fix}")
    series = data.get("series")
    data["series"] = series if isinstance(series, dict) else {key: [] for key in SERIES_KEYS}
    return data


def report_path(option: str | os.PathLike[str] | bool | None, log_dir: str | None) -> Path | None:
    """Where the report goes: ``option`` itself, ``None`` for the logger's directory ``log_dir`` (nowhere without
    one), or nowhere for ``False``."""
    if option is False:
        return None
    if option is None or option is True:
        return None if log_dir is None else Path(log_dir) / REPORT_NAME
    return Path(option)


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
