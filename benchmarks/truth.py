"""Truth benchmark: the tuner's stall and production-time estimate against what a simulated accelerator saw.

The accelerator is SIMULATED (no GPU here): ``training_step`` sleeps ``step_ms`` and records its own busy
interval, timed inside the step. Between steps the host does a known amount of other work (a sleep of
``host_ms`` in the module's ``on_train_batch_end``, after the tuner's hook), which belongs to ``other``, not to
the stall. Each loader has a known cost (latency-bound, CPU-bound, in-memory, bursty) and runs at several fixed
worker counts with an observe-only tuner attached.

Per steady-state logging window (no epoch start inside it), the truth is taken from the accelerator alone:

    idle      = window wall time - the accelerator's busy time
    stall     = (idle - steps x idle per step with the data already in memory) / wall

where "idle per step with the data already in memory" comes from a calibration run on pre-built batches (the
framework's own time between steps and the known host work, which no loader can remove). The production time
of a batch is known independently: one batch built in the main process, timed here apart from any training.
The tuner's figures are its logged ``stall_frac`` and ``model.estimate(...).batch_s`` (the model's per-batch
production time), read where the model uses it: at 0 workers, or with workers that stall.

    python benchmarks/truth.py                # writes benchmarks/results/truth.json
    python benchmarks/truth.py --write-md     # ... and its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import default_collate as collate

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measurement.budget import cpu_budget
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset, in_memory_dataset
from lightning_dltune.tuning.model import Budget, Policy, Trial, estimate

from sections import write_results, write_section

HERE = Path(__file__).resolve().parent
BATCH = 16
STEP_MS = 20.0
HOST_MS = 4.0
LOG_EVERY = 20

WORKLOADS: dict[str, dict[str, Any]] = {
    "latency": {"make": lambda n: SyntheticDataset(n, latency_ms=2.0), "workers": [0, 1, 2, 4], "what": "2 ms wait"},
    "cpu": {"make": lambda n: SyntheticDataset(n, cpu_ms=2.0), "workers": [0, 1, 2], "what": "2 ms CPU"},
    "in_memory": {"make": lambda n: in_memory_dataset(n), "workers": [0, 1], "what": "TensorDataset"},
    "bursty": {
        "make": lambda n: SyntheticDataset(n, latency_ms=1.0, tail_prob=0.05, tail_factor=25.0),
        "workers": [0, 2, 4],
        "what": "1 ms wait, 5% 25x",
    },
}


class Accelerator(SimulatedModel):
    """Records its own busy interval per step (the simulated kernel), and does known host work between steps."""

    def __init__(self, step_ms: float, host_ms: float) -> None:
        super().__init__(step_ms=0.0)
        self.busy_ms, self.host_ms = step_ms, host_ms
        self.busy: list[tuple[float, float]] = []
        self.first_of_epoch: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        t0 = time.perf_counter()
        time.sleep(self.busy_ms / 1e3)  # the simulated accelerator's work
        self.busy.append((t0, time.perf_counter()))
        self.first_of_epoch.append(batch_idx < 2)  # the epoch's first batches refill the pipeline
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(self.host_ms / 1e3)  # known host work between steps (logging, metrics, ...): not a stall


class Prebuilt(Dataset):
    """Batches already collated in memory: a loader that costs (almost) nothing, for the calibration run."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def production_s(dataset: Dataset, batches: int = 12) -> float:
    """Seconds to build one batch in the main process, timed apart from training (the known cost)."""
    n = len(dataset)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for b in range(batches):
        collate([dataset[(b * BATCH + i) % n] for i in range(BATCH)])
    return (time.perf_counter() - t0) / batches


def observe(
    model: pl.LightningModule, loader: DataLoader, epochs: int, steps: Any, log_every: int = LOG_EVERY, **trainer: Any
) -> list[Any]:
    """Train ``model`` on ``loader`` with an observe-only tuner (the config is fixed here: measured, never
    switched) and return the tuner's logging windows as it logged them: ``(steps(), host stats, GPU stats)``,
    ``steps()`` read at each log (the model's own count of steps so far)."""
    tuner = DataLoaderTuner(observe_only=True, verbose=False, report_path=False, cache=False)
    windows: list[Any] = []
    take_log = tuner.probe.take_log

    def recorded() -> Any:  # read the window the tuner logs, as it logs it
        out = take_log()
        windows.append((steps(), out[0], out[1]))
        return out

    tuner.probe.take_log = recorded  # type: ignore[method-assign]
    pl.Trainer(
        max_epochs=epochs,
        callbacks=[tuner],
        logger=False,
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer,
    ).fit(model, train_dataloaders=loader)
    return windows


def fit(loader: DataLoader, epochs: int, settings: LoaderSettings) -> tuple[Accelerator, list[tuple[int, WindowStats]]]:
    """Train with an observe-only tuner and return the accelerator's record and the tuner's logging windows as
    ``(global step at the log, stats)``."""
    model = Accelerator(STEP_MS, HOST_MS)
    windows = observe(model, loader, epochs, lambda: len(model.busy))
    return model, [(end, stats) for end, stats, _ in windows]


def idle_per_step(model: Accelerator, steps: range) -> tuple[float, float, float]:
    """Wall time, accelerator idle time and busy time over ``steps`` (each from the previous step's end)."""
    start = model.busy[steps[0] - 1][1]
    wall = model.busy[steps[-1]][1] - start
    busy = sum(model.busy[i][1] - model.busy[i][0] for i in steps)
    return wall, wall - busy, busy


def steady(model: Accelerator, windows: list[tuple[int, WindowStats]]) -> list[tuple[range, WindowStats]]:
    """The logging windows with no epoch start inside and every step measured by the tuner."""
    out = []
    prev = 0
    for end, stats in windows:
        steps = range(prev, end)
        prev = end
        if steps.start == 0 or any(model.first_of_epoch[i] for i in steps) or stats.steps != len(steps):
            continue
        out.append((steps, stats))
    return out


def calibrate(epochs: int, samples: int) -> float:
    """Accelerator idle per step when the batches are already in memory: framework time and host work."""
    ds = in_memory_dataset(samples)
    batches = [collate([ds[i] for i in range(b, b + BATCH)]) for b in range(0, samples, BATCH)]
    model, windows = fit(DataLoader(Prebuilt(batches), batch_size=None), epochs, LoaderSettings())
    idles = [idle_per_step(model, steps)[1] / len(steps) for steps, _ in steady(model, windows)]
    return statistics.median(idles)


def run_config(name: str, workers: int, epochs: int, samples: int, cal_idle: float) -> dict[str, Any]:
    w = WORKLOADS[name]
    dataset = w["make"](samples)
    known = production_s(dataset)
    settings = LoaderSettings.normalized(workers, 2 if workers else None)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, **settings.to_loader_kwargs())
    model, windows = fit(loader, epochs, settings)
    budget = Budget(cpus=cpu_budget().cpus, max_workers=64)
    policy = Policy()
    rows = []
    # with workers, the model reads the production time off the window only when the loader is what the step
    # waits for (then workers x wall time per step is a batch's production time); otherwise it is hidden
    bound = workers == 0 or known / workers > (STEP_MS + HOST_MS) / 1e3 * 1.1
    for steps, stats in steady(model, windows):
        wall, idle, busy = idle_per_step(model, steps)
        truth = max(0.0, idle - len(steps) * cal_idle) / wall
        modelled = bound and (workers == 0 or stats.stall_frac > policy.stall_threshold / 2)
        est = estimate([Trial(settings, stats)], budget, policy).batch_s if modelled else None
        rows.append(
            {
                "steps": len(steps),
                "truth_stall": truth,
                "tuner_stall": stats.stall_frac,
                "error_pp": (stats.stall_frac - truth) * 100,
                "tuner_step_ms": stats.mean_step_s * 1e3,
                "busy_ms": busy / len(steps) * 1e3,
                "tuner_other_ms": stats.mean_other_s * 1e3,
                "estimate_batch_ms": None if est is None else est * 1e3,
            }
        )
    ests = [r["estimate_batch_ms"] for r in rows if r["estimate_batch_ms"] is not None]
    est_ms = statistics.median(ests) if ests else None
    summary = {
        "workload": name,
        "what": w["what"],
        "workers": workers,
        "windows": len(rows),
        "truth_stall": statistics.mean(r["truth_stall"] for r in rows),
        "tuner_stall": statistics.mean(r["tuner_stall"] for r in rows),
        "max_abs_error_pp": max(abs(r["error_pp"]) for r in rows),
        "mean_error_pp": statistics.mean(r["error_pp"] for r in rows),
        "known_batch_ms": known * 1e3,
        "estimate_batch_ms": est_ms,
        "estimate_error": None if est_ms is None else est_ms / (known * 1e3) - 1,
        "production_bound": bound,
        "tuner_step_ms": statistics.mean(r["tuner_step_ms"] for r in rows),
        "tuner_other_ms": statistics.mean(r["tuner_other_ms"] for r in rows),
        "window_rows": rows,
    }
    print(
        f"  {name:10s} {workers}w  stall truth {summary['truth_stall']:6.1%} tuner {summary['tuner_stall']:6.1%} "
        f"(max |err| {summary['max_abs_error_pp']:.1f} pp over {len(rows)} windows); batch {known * 1e3:.1f} ms, "
        f"estimate {'-' if est_ms is None else format(est_ms, '.1f')} ms",
        flush=True,
    )
    return summary


def markdown(results: dict[str, Any]) -> str:
    one, dflt = results["one_thread"], results["default_threads"]
    lines = [
        f"Simulated accelerator: a {STEP_MS:g} ms step timed inside `training_step`, {HOST_MS:g} ms of known host "
        f"work between steps, batch {BATCH}, logging windows of {LOG_EVERY} steps ({results['epochs']} epochs, "
        f"{results['samples']} samples). The truth is the accelerator's idle time beyond what it idles with the "
        f"data already in memory (calibration: {one['calibration_idle_ms']:.2f} ms per step with one intra-op "
        f"thread, {dflt['calibration_idle_ms']:.2f} ms with torch's default {dflt['threads']}). Stall columns are "
        "means over the steady windows; the error is the largest of any window.",
        "",
        f"| loader | workers | true stall | tuner's stall | max error | batch cost (known) | tuner's estimate | "
        f"default threads ({dflt['threads']}): true / tuner's stall | tuner's step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, d in zip(one["configs"], dflt["configs"], strict=True):
        est = "hidden" if not r["production_bound"] else "-"
        if r["estimate_batch_ms"] is not None:
            diff = r["estimate_batch_ms"] - r["known_batch_ms"]
            rel = f"{diff:+.1f} ms" if r["known_batch_ms"] < 1 else f"{r['estimate_error']:+.0%}"
            est = f"{r['estimate_batch_ms']:.1f} ms ({rel})"
        lines.append(
            f"| {r['workload']} ({r['what']}) | {r['workers']} | {r['truth_stall']:.1%} | {r['tuner_stall']:.1%} | "
            f"{r['max_abs_error_pp']:.1f} pp | {r['known_batch_ms']:.1f} ms | {est} | {d['truth_stall']:.1%} / "
            f"{d['tuner_stall']:.1%} | {r['tuner_step_ms']:.1f} / {d['tuner_step_ms']:.1f} |"
        )
    s1, sd = one["summary"], dflt["summary"]
    lines += [
        "",
        f"With one intra-op thread: the largest stall error of any window is {s1['max_stall_error_pp']:.1f} pp "
        f"(target 2 pp), and the production-time estimate, where the model uses it, is within "
        f"{s1['max_estimate_error']:.0%} of the known cost (target 15%). Host work between steps is counted as "
        f"`other` ({HOST_MS:g} ms known; the tuner's `other_ms` is logged), not as stall.",
        "",
        f"With torch's default {dflt['threads']} intra-op threads the training process's own step slows down "
        f"whenever it shares the CPUs: after loading in the main process (0 workers) and next to CPU-bound workers. "
        "The accelerator then idles while the host finishes its slower step: the tuner counts that as step time "
        f"(last column: its step with one thread / default threads), not as data wait, so the true idle exceeds its "
        f"stall there (largest window {sd['max_stall_error_pp']:.1f} pp). The same bias makes the step measured at "
        "0 workers longer than the step with workers; the tuner corrects the first jump with the step it measures "
        "after switching (`windows.sized_on_a_longer_step`), and `torch.set_num_threads(1)` in a process that "
        "loads on few CPUs removes it.",
    ]
    return "\n".join(lines)


def run_all(epochs: int, samples: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    cal = calibrate(epochs, samples)
    print(f"{threads} intra-op threads; calibration: idle per step with the data in memory {cal * 1e3:.2f} ms")
    configs = [run_config(n, k, epochs, samples, cal) for n, w in WORKLOADS.items() for k in w["workers"]]
    ests = [abs(c["estimate_error"]) for c in configs if c["estimate_error"] is not None and c["known_batch_ms"] >= 1]
    return {
        "threads": threads,
        "calibration_idle_ms": cal * 1e3,
        "configs": configs,
        "summary": {
            "max_stall_error_pp": max(c["max_abs_error_pp"] for c in configs),
            "max_estimate_error": max(ests) if ests else 0.0,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke size: 2 epochs of 40 steps")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-md", action="store_true", help="write its section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    epochs, samples = (2, 40 * BATCH) if args.quick else (3, 60 * BATCH)
    t0 = time.perf_counter()
    default_threads = torch.get_num_threads()
    results = {
        "epochs": epochs,
        "samples": samples,
        "one_thread": run_all(epochs, samples, 1),
        "default_threads": run_all(epochs, samples, default_threads),
        "torch": torch.__version__,
        "lightning": pl.__version__,
    }
    torch.set_num_threads(default_threads)
    results["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "truth_quick.json" if args.quick else "truth.json", results)
    section = markdown(results)
    print("\n" + section)
    if args.write_md:
        write_section("truth", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
