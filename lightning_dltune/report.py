"""The summary table people read at the end of tuning and the JSON report they can reuse."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dltune.decide import Budget, Trial
from lightning_dltune.gpu import GpuStats
from lightning_dltune.measure import WindowStats
from lightning_dltune.settings import LoaderSettings

REPORT_NAME = "dltune_report.json"
REPORT_VERSION = 1

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


def window_metrics(
    stats: WindowStats,
    gpu: GpuStats | None,
    settings: LoaderSettings,
    spread: float | None = None,
    nvml: dict[str, float] | None = None,
) -> dict[str, float]:
    """The ``dltune/*`` metrics of one logging window (see :class:`~lightning_dltune.DataLoaderTuner`)."""
    metrics = {
        STALL_FRAC: stats.stall_frac,
        DATA_WAIT_MS: stats.mean_wait_s * 1e3,
        STEP_MS: stats.mean_step_s * 1e3,
        OTHER_MS: stats.mean_other_s * 1e3,
        SAMPLES_PER_S: stats.samples_per_s,
        NUM_WORKERS: float(settings.num_workers),
        PREFETCH_FACTOR: float(settings.prefetch_factor or 0),
    }
    if spread is not None:
        metrics[STALL_SPREAD] = spread
    if gpu is not None and gpu.stall_frac is not None:
        metrics[GPU_STALL_FRAC] = gpu.stall_frac
        metrics[GPU_IDLE_MS] = gpu.mean_idle_s * 1e3
        metrics[H2D_MS] = gpu.mean_copy_s * 1e3
    if nvml:
        metrics[GPU_UTIL_PCT] = nvml["gpu_util_pct"]
        metrics[GPU_MEM_PCT] = nvml["gpu_mem_pct"]
    return metrics


def summary_table(trials: Sequence[Trial], settled: LoaderSettings | None) -> str:
    """A fixed-width table: one row per trial with its throughput, stall and the decision taken after it.

    With a GPU timeline (CUDA) it adds the GPU's stall (idle gap waiting for the loader) and the host-to-device
    copy per step, next to the host's measure.
    """
    on_gpu = any(t.stats.gpu_steps for t in trials)
    header: tuple[str, ...] = ("config", "steps", "samples/s", "stall", "wait ms", "step ms", "startup s")
    if on_gpu:
        header += ("gpu stall", "h2d ms")
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
        rows.append((*row, (t.failed and f"FAILED: {t.failed}") or t.decision))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1])
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    return "\n".join(lines)


def trial_to_dict(trial: Trial) -> dict[str, Any]:
    return {
        "settings": trial.settings.to_loader_kwargs(),
        "stats": trial.stats.to_dict(),
        "failed": trial.failed,
        "decision": trial.decision,
    }


def trial_from_dict(data: dict[str, Any]) -> Trial:
    from lightning_dltune.measure import WindowStats

    return Trial(
        settings=LoaderSettings.from_dict(data.get("settings", {})),
        stats=WindowStats.from_dict(data.get("stats", {})),
        failed=data.get("failed"),
        decision=data.get("decision", ""),
    )


def build_report(
    *,
    trials: Sequence[Trial],
    start: LoaderSettings | None,
    settled: LoaderSettings | None,
    phase: str,
    diagnosis: str,
    budget: Budget | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "phase": phase,
        "start_settings": start.to_loader_kwargs() if start else None,
        "settled_settings": settled.to_loader_kwargs() if settled else None,
        "diagnosis": diagnosis,
        "budget": None
        if budget is None
        else {
            "cpus": budget.cpus,
            "max_workers": budget.max_workers,
            "max_prefetch": budget.max_prefetch,
            "bound_by": budget.bound_by,
        },
        "trials": [trial_to_dict(t) for t in trials],
    }
    if extra:
        report.update(extra)
    return report


def report_path(option: str | os.PathLike[str] | bool | None, log_dir: str | None, root_dir: str) -> Path | None:
    """Where the report goes: ``option`` itself, ``None`` for the logger's directory (else ``root_dir``), or
    nowhere for ``False``."""
    if option is False:
        return None
    if option is None or option is True:
        return Path(log_dir or root_dir) / REPORT_NAME
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
