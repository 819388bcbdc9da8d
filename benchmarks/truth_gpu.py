"""Truth benchmark on CUDA: the GPU idle gap the tuner reads from events, against a synchronized reference.

On CUDA the tuner does not trust host timestamps: kernels run asynchronously, so the host can wait for the next
batch while the GPU still works through the previous step. It reads the GPU's idle gap from CUDA events instead
(``lightning_dltune.measurement.gpu.GpuTimeline``, logged as ``dltune/gpu_stall_frac``). This benchmark checks that
figure
against references that do not come from the tuner's accounting:

- **synchronized reference**: the same training with ``torch.cuda.synchronize()`` at the end of every step, timed
  apart on the host. With the GPU drained at every step end, the host's clock is the GPU's: the window's wall
  time is exact, and the true stall is the time beyond what the same synchronized loop takes with the batches
  already in memory (a calibration run on prebuilt batches), over the wall time. In that run the tuner's
  event-based stall must agree with it window by window.
- **asynchronous run** (how people train): the step ends are CUDA events read after the run, so the window's wall
  time is the GPU's own; the true stall is again the time beyond the calibration run's (asynchronous, prebuilt
  batches) per step, over the wall time. Here the host timer's stall overstates (it counts waits the GPU spent
  working off queued steps); the event-based stall must not.

The step's GPU work is a kernel of known duration (``torch.cuda._sleep``, calibrated in cycles per ms) after a
tiny linear layer; the host does a known amount of work between steps (a sleep in ``on_train_batch_end``).

What the truth counts that the events do not: every second the loader costs the GPU, including a host loop that
runs slower because it loads in its own process (0 workers: intra-op threads and the loading share the CPUs). The
events put that time under ``other`` (the GPU idle while the host is busy between steps), not under the stall, so
at 0 workers they may read lower than the truth by that much; the host timer counts it as step time.

    python benchmarks/truth_gpu.py                      # on a CUDA machine; writes benchmarks/results/truth_gpu.json
    python benchmarks/truth_gpu.py --device cpu --quick # smoke run of this script anywhere (no GPU figures)
    python benchmarks/truth_gpu.py --write-md           # ... and its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from truth import BATCH, Prebuilt, collate, observe, production_s

from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataset, in_memory_dataset

from sections import write_results, write_section

HERE = Path(__file__).resolve().parent
STEP_MS = 20.0
HOST_MS = 2.0
LOG_EVERY = 10

WORKLOADS: dict[str, dict[str, Any]] = {
    "latency": {"make": lambda n: SyntheticDataset(n, latency_ms=2.0), "workers": [0, 8], "what": "2 ms wait"},
    "cpu": {"make": lambda n: SyntheticDataset(n, cpu_ms=1.0), "workers": [0, 4], "what": "1 ms CPU"},
    "in_memory": {"make": lambda n: in_memory_dataset(n), "workers": [0], "what": "TensorDataset"},
}


class Kernel:
    """GPU work of a known duration on the current stream (``torch.cuda._sleep``); a sleep on the CPU."""

    def __init__(self, device: str, ms: float) -> None:
        self.device, self.ms, self.cycles = device, ms, 0
        if device == "cuda":
            torch.cuda._sleep(1000)  # load the kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            probe = 10_000_000
            start.record()
            torch.cuda._sleep(probe)
            end.record()
            end.synchronize()
            self.cycles = int(probe * ms / start.elapsed_time(end))

    def __call__(self) -> None:
        if self.device == "cuda":
            torch.cuda._sleep(self.cycles)
        else:
            time.sleep(self.ms / 1e3)

    def measured_ms(self, repeats: int = 10) -> float:
        """What one launch takes as the device runs it (events on CUDA)."""
        if self.device != "cuda":
            return self.ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            self()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats


class Accelerator(SimulatedModel):
    """Marks the end of every step (a CUDA event, or the host's clock after synchronizing) and does known host
    work between steps."""

    def __init__(self, kernel: Kernel, host_ms: float, sync: bool) -> None:
        super().__init__(step_ms=0.0)
        self.kernel, self.host_ms, self.sync = kernel, host_ms, sync
        self.ends: list[Any] = []
        self.first_of_epoch: list[bool] = []
        self.kernel_ms: list[Any] = []  # the kernel's own time in each step (events around it; read by end_times)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.kernel.device == "cuda":
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            self.kernel()  # the step's GPU work, of known duration
            after.record()
            self.kernel_ms.append((before, after))
        else:
            self.kernel()
        self.first_of_epoch.append(batch_idx < 2)  # the epoch's first batches refill the pipeline
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.kernel.device == "cuda" and not self.sync:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.ends.append(event)
        else:
            if self.kernel.device == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
        time.sleep(self.host_ms / 1e3)  # known host work between steps: `other`, not a stall

    def end_times(self) -> list[float]:
        """Each step's end in seconds, on one clock (the GPU's for events). The events are read once and
        replaced by their times, so none outlives the run (see :func:`fit`)."""
        if self.ends and not isinstance(self.ends[0], float):
            torch.cuda.synchronize()
            first = self.ends[0]
            self.ends = [first.elapsed_time(e) / 1e3 for e in self.ends]
        if self.kernel_ms and not isinstance(self.kernel_ms[0], float):
            torch.cuda.synchronize()
            self.kernel_ms = [before.elapsed_time(after) for before, after in self.kernel_ms]
        return list(self.ends)

    def kernel_median_ms(self) -> float | None:
        """The kernel's median time per step as the GPU ran it (``None`` off CUDA)."""
        self.end_times()
        return statistics.median(self.kernel_ms) if self.kernel_ms else None


def fit(loader: DataLoader, device: str, kernel: Kernel, sync: bool, epochs: int) -> tuple[Accelerator, list[Any]]:
    """Train with an observe-only tuner; return the model and the logging windows as ``(steps so far, host
    stats, GPU stats)``, as the tuner logged them."""
    # A finished run's Trainer and model are garbage in reference cycles until the collector runs. Collected in a
    # forked loader worker, a CUDA event among them is destroyed there, where CUDA cannot be used, and the worker
    # aborts ("CUDA error: initialization error", seen on an H200): collect them here, before the workers fork,
    # and read this run's events into plain times at once.
    gc.collect()
    model = Accelerator(kernel, HOST_MS, sync)
    windows = observe(model, loader, epochs, lambda: len(model.ends), LOG_EVERY, accelerator=device, devices=1)
    model.end_times()
    return model, windows


def steady_windows(model: Accelerator, windows: list[Any]) -> list[tuple[range, WindowStats, Any]]:
    """Logging windows with no epoch start inside and every step measured by the host timer."""
    out, prev = [], 0
    for end, stats, gpu in windows:
        steps = range(prev, end)
        prev = end
        if steps.start == 0 or not steps or any(model.first_of_epoch[i] for i in steps) or stats.steps != len(steps):
            continue
        out.append((steps, stats, gpu))
    return out


def calibrate(device: str, kernel: Kernel, sync: bool, epochs: int, samples: int) -> tuple[float, float | None]:
    """Seconds per step with the batches already in memory (the same loop, no loader cost), and the kernel's
    median milliseconds per step in that run."""
    ds = in_memory_dataset(samples)
    batches = [collate([ds[i] for i in range(b, b + BATCH)]) for b in range(0, samples, BATCH)]
    model, windows = fit(DataLoader(Prebuilt(batches), batch_size=None), device, kernel, sync, epochs)
    ends = model.end_times()
    per_step = statistics.median((ends[s[-1]] - ends[s[0] - 1]) / len(s) for s, _, _ in steady_windows(model, windows))
    return per_step, model.kernel_median_ms()


def phases(windows: list[Any]) -> dict[str, float] | None:
    """Milliseconds per step the GPU spent idle, copying, on other host work and in the step."""
    read = [g for _, _, g in windows if g is not None and g.steps]
    steps = sum(g.steps for g in read)
    if not steps:
        return None
    names = ("idle", "copy", "other", "step")
    return {k: round(sum(getattr(g, f"{k}_s") for g in read) / steps * 1e3, 3) for k in names}


def run_config(
    name: str, workers: int, device: str, kernel: Kernel, sync: bool, cal_s: float, epochs: int, samples: int
) -> dict[str, Any]:
    w = WORKLOADS[name]
    dataset = w["make"](samples)
    kwargs: dict[str, Any] = {"num_workers": workers, "pin_memory": device == "cuda"}
    if workers:
        kwargs.update(prefetch_factor=2, persistent_workers=True)
    model, windows = fit(DataLoader(dataset, batch_size=BATCH, shuffle=True, **kwargs), device, kernel, sync, epochs)
    ends = model.end_times()
    rows = []
    for steps, stats, gpu in steady_windows(model, windows):
        wall = ends[steps[-1]] - ends[steps[0] - 1]
        truth = max(0.0, wall - len(steps) * cal_s) / wall
        rows.append(
            {
                "steps": len(steps),
                "truth": truth,
                "host": stats.stall_frac,
                "events": None if gpu is None else gpu.stall_frac,
                "wall_s": wall,
            }
        )
    # the events' windows lag the host's on an asynchronous run (a step is read once the GPU reaches it), so the
    # run's figure is over every step the timeline read, against the truth over the same steps' span
    gpu_idle = sum(g.idle_s for _, _, g in windows if g is not None)
    gpu_wall = sum(g.wall_s for _, _, g in windows if g is not None)
    span = ends[-1] - ends[0]
    truth_run = max(0.0, span - (len(ends) - 1) * cal_s) / span
    events_run = gpu_idle / gpu_wall if gpu_wall > 0 else None
    host_wall = sum(s.wall_s for _, s, _ in windows)
    host_run = sum(s.wait_s for _, s, _ in windows) / host_wall if host_wall > 0 else 0.0
    window_errors = [abs(r["events"] - r["truth"]) * 100 for r in rows if r["events"] is not None]
    summary = {
        "workload": name,
        "what": w["what"],
        "workers": workers,
        "sync": sync,
        "known_batch_ms": production_s(dataset) * 1e3,
        "truth": truth_run,
        "events": events_run,
        "host": host_run,
        "events_error_pp": None if events_run is None else (events_run - truth_run) * 100,
        "host_error_pp": (host_run - truth_run) * 100,
        "max_window_error_pp": max(window_errors) if window_errors else None,
        # the kernel's own median time per step, against the calibration run's (`cal_<mode>_kernel_ms`): a truth
        # check of the truth (a kernel that runs longer here is slower GPU work, not an idle GPU)
        "kernel_ms": model.kernel_median_ms(),
        "steady_step_ms": statistics.median(r["wall_s"] / r["steps"] * 1e3 for r in rows) if rows else None,
        # the GPU's time per step in each phase, over every step the timeline read (gpu.py's five marks)
        "gpu_phase_ms": phases(windows),
        "windows": rows,
    }
    ev = "n/a" if events_run is None else f"{events_run:6.1%}"
    print(
        f"  {'sync ' if sync else 'async'} {name:9s} {workers}w  truth {truth_run:6.1%}  events {ev}  host "
        f"{host_run:6.1%}  steady step {summary['steady_step_ms'] or float('nan'):.2f} ms, kernel "
        f"{summary['kernel_ms'] or float('nan'):.2f} ms; GPU phases (ms) {summary['gpu_phase_ms']}",
        flush=True,
    )
    return summary


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"On {results['gpu']}: a {STEP_MS:g} ms kernel per step (`torch.cuda._sleep`, measured "
        f"{results['kernel_ms']:.2f} ms), {HOST_MS:g} ms of host work between steps, batch {BATCH}, "
        f"{results['epochs']} epochs of {results['samples'] // BATCH} steps. Truth: the time per step beyond the "
        f"same loop's with the batches in memory (synchronized: {results['cal_sync_ms']:.2f} ms, asynchronous: "
        f"{results['cal_async_ms']:.2f} ms per step), over the wall time; events: the tuner's `gpu_stall_frac`; "
        "host: its host-timer `stall_frac`. Whole-run figures; the largest window error is for the synchronized "
        "run, where the windows line up.",
        "",
        "| loader | workers | sync: truth | sync: events | sync: max window error | async: truth | async: events | "
        "async: host timer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, a in zip(results["sync"], results["async"], strict=True):

        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1%}"

        mw = "n/a" if s["max_window_error_pp"] is None else f"{s['max_window_error_pp']:.1f} pp"
        lines.append(
            f"| {s['workload']} ({s['what']}) | {s['workers']} | {pct(s['truth'])} | {pct(s['events'])} | "
            f"{mw} | {pct(a['truth'])} | {pct(a['events'])} | {pct(a['host'])} |"
        )
    errs = [abs(r["events_error_pp"]) for r in results["sync"] + results["async"] if r["events_error_pp"] is not None]
    host = [r["host_error_pp"] for r in results["async"]]
    if errs:
        lines += [
            "",
            f"The event-based stall is within {max(errs):.1f} pp of the truth on every run (target 2 pp); "
            f"the host timer on the asynchronous runs is off by {min(host):+.1f} to {max(host):+.1f} pp.",
        ]
    lines += step_phase_note(results)
    return "\n".join(lines)


def step_phase_note(results: dict[str, Any]) -> list[str]:
    """Where the events read low: the step phase beyond the kernel's own time, on asynchronous runs whose GPU
    idled while the host waited (it had drained its queue) against those whose GPU never did."""
    drained, fed = [], []
    for r in results["async"]:
        phase, kernel = r.get("gpu_phase_ms"), r.get("kernel_ms")
        if phase is None or kernel is None:
            return []
        (drained if phase["idle"] > 0.1 else fed).append((r, phase["step"] - kernel))
    if not drained:
        return []

    def span(rows: list[tuple[dict[str, Any], float]]) -> str:
        lo, hi = min(x for _, x in rows), max(x for _, x in rows)
        return f"{lo:.2f} ms" if hi - lo < 0.005 else f"{lo:.2f}-{hi:.2f} ms"

    gaps = [(r["truth"] - r["events"]) * 100 for r, _ in drained]
    return [
        "",
        f"Where the events read low ({min(gaps):.1f}-{max(gaps):.1f} pp on the asynchronous runs whose GPU idled "
        f"while the host waited for a batch), the step phase shows why: it lasted {span(drained)} per step longer "
        "than the kernel itself, timed by events around it"
        + (f", against {span(fed)} where the GPU never idled" if fed else "")
        + ". A GPU that drained its queue waiting for the batch then waits again while the host launches the step "
        "up to its first kernel (in the queue behind the previous step, that launch cost nothing); the events book "
        "that wait as step time, so on an asynchronous run their stall is a lower bound, by about that much per "
        "stalled step. The synchronized runs, whose GPU drains every step with or without a loader, agree.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default); cpu only checks that this script runs (no GPU figures)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: 2 epochs of 30 steps")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-md", action="store_true", help="write its section of BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA device here; run it on a GPU machine (scripts/gpu_check.sh), or pass "
            "--device cpu to check the script"
        )
    warnings.filterwarnings("ignore")
    epochs, samples = (2, 30 * BATCH) if args.quick else (3, 50 * BATCH)
    t0 = time.perf_counter()
    kernel = Kernel(args.device, STEP_MS)
    results: dict[str, Any] = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)",
        "kernel_ms": kernel.measured_ms(),
        "epochs": epochs,
        "samples": samples,
        "torch": torch.__version__,
        "lightning": pl.__version__,
    }
    for mode, sync in (("sync", True), ("async", False)):
        cal, cal_kernel = calibrate(args.device, kernel, sync, epochs, samples)
        results[f"cal_{mode}_ms"] = cal * 1e3
        results[f"cal_{mode}_kernel_ms"] = cal_kernel
        print(f"{mode}: {cal * 1e3:.2f} ms per step with the batches in memory (kernel {cal_kernel} ms)", flush=True)
        results[mode] = [
            run_config(n, k, args.device, kernel, sync, cal, epochs, samples)
            for n, w in WORKLOADS.items()
            for k in w["workers"]
        ]
    results["wall_s"] = time.perf_counter() - t0
    name = f"truth_gpu{'_' + args.device if args.device != 'cuda' else ''}{'_quick' if args.quick else ''}.json"
    path = write_results(args.out, name, results)
    section = markdown(results)
    print("\n" + section + f"\nwrote {path} ({results['wall_s']:.0f} s)")
    if args.write_md:
        write_section("truth_gpu", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
