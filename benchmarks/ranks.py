"""Ranks that differ (issue 35): two DDP processes on this node, rank 1's storage six times as slow as rank 0's.

Each sample waits 1 ms on rank 0 and 6 ms on rank 1 (batch 16, a 5 ms step): at 0 workers rank 1 takes about 100 ms
a batch and rank 0 waits for it in every all-reduce. Whole runs, side by side, each its own DDP launch (the launch is
not timed; ``trainer.fit`` on rank 0 is):

- the default: the user's loader, 0 workers;
- the rule of thumb: half the cores, never above 8 (on each rank);
- every static config of a grid, the same on both ranks; the fastest is the best static config;
- the tuner from 0 workers (``DataLoaderTuner()``, its defaults), twice;
- the uniform config: the tuner's agreed settings on both ranks, static (what each rank would run without its own).

    python benchmarks/ranks.py               # writes benchmarks/results/ranks.json
    python benchmarks/ranks.py --write-md    # ... and its section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LENGTH, BATCH, EPOCHS, STEP_MS = 1536, 16, 4, 5.0
LATENCY_MS = (1.0, 6.0)  # rank 0's, rank 1's
GRID = [(w, p) for w in (2, 4, 8, 16, 24) for p in (2, 4)]


def child(out: Path, config: str) -> None:
    """One whole run, as a DDP process (Lightning launches the second rank by running this script again)."""
    import lightning.pytorch as pl

    from lightning_dltune import DataLoaderTuner
    from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

    from sections import QUIET

    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    workers, prefetch = (0, None) if config in ("default", "tuner") else tuple(json.loads(config))
    tuner = DataLoaderTuner(cache=False, report_path=False, verbose=False, plot=False) if config == "tuner" else None
    dataset = SyntheticDataset(length=LENGTH, latency_ms=LATENCY_MS[rank])
    dm = SyntheticDataModule(dataset, batch_size=BATCH, num_workers=workers, prefetch_factor=prefetch)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_epochs=EPOCHS,
        callbacks=[tuner] if tuner else [],
        **QUIET,
    )
    model = SimulatedModel(step_ms=STEP_MS)
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    result: dict[str, Any] = {"seconds": time.perf_counter() - t0, "samples": len(model.seen_indices)}
    if tuner is not None:
        result.update(
            agreed=tuner.best_settings,
            rank_workers=tuner.agreement.rank_workers,
            trials=[
                (t.settings.num_workers, t.settings.prefetch_factor, t.stats.steps, t.decision) for t in tuner.trials
            ],
            settled_step=tuner.settled_step,
            diagnosis=tuner.diagnosis,
        )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(config: str) -> dict[str, Any]:
    """Run ``config`` as its own DDP job; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", tmp, config]
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{config}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return json.loads((Path(tmp) / "rank0.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-md", action="store_true", help="write its section of BENCHMARKS.md")
    parser.add_argument("--child", nargs=2, metavar=("OUT", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return 0
    from sections import publish, write_results

    cpus = len(os.sched_getaffinity(0))
    thumb = (max(1, min(8, cpus // 2)), 2)
    runs: dict[str, Any] = {"default": launch("default"), "rule_of_thumb": launch(json.dumps(thumb))}
    thumb_s = runs["rule_of_thumb"]["seconds"]
    print(f"default {runs['default']['seconds']:.1f} s, rule of thumb {thumb}: {thumb_s:.1f} s")
    grid = {}
    for w, p in GRID:
        grid[f"{w}w p{p}"] = launch(json.dumps([w, p]))["seconds"]
        print(f"static {w} workers, prefetch {p}: {grid[f'{w}w p{p}']:.1f} s")
    tuned = [launch("tuner") for _ in range(2)]
    for t in tuned:
        print(f"tuner: {t['seconds']:.1f} s, agreed {t['agreed']}, each rank's workers {t['rank_workers']}")
    agreed = tuned[0]["agreed"]
    uniform = launch(json.dumps([agreed["num_workers"], agreed.get("prefetch_factor") or 2]))
    best = min(grid, key=grid.__getitem__)
    result = {
        "cpus": cpus,
        "workload": {"length": LENGTH, "batch": BATCH, "epochs": EPOCHS, "step_ms": STEP_MS, "latency_ms": LATENCY_MS},
        "default": runs["default"],
        "rule_of_thumb": {"config": thumb, **runs["rule_of_thumb"]},
        "grid": grid,
        "best_static": {"config": best, "seconds": grid[best]},
        "tuner": tuned,
        "uniform": {"config": agreed, **uniform},
    }
    write_results(args.out, "ranks.json", result)
    mean = sum(t["seconds"] for t in tuned) / len(tuned)
    counts = " and ".join(str(t["rank_workers"]) for t in tuned)

    def ratio(seconds: float) -> str:
        return f"{mean / seconds:.2f}x"

    section = (
        f"Ranks that differ (`benchmarks/ranks.py`, issue 35): two DDP processes on {cpus} CPUs, each sample waiting "
        f"{LATENCY_MS[0]:.0f} ms on rank 0 and {LATENCY_MS[1]:.0f} ms on rank 1 (batch {BATCH}, a {STEP_MS:.0f} ms "
        f"step, {LENGTH // BATCH // 2} steps an epoch, {EPOCHS} epochs), whole runs (`trainer.fit` on rank 0), one "
        f"launch each. The tuner (two runs, {mean:.1f} s on average) settled on {agreed['num_workers']} workers "
        f"agreed and each rank's own counts {counts} (rank 0, rank 1): {ratio(grid[best])} the best static config "
        f"({best}, the same on both ranks, {grid[best]:.1f} s), {ratio(uniform['seconds'])} the uniform config (the "
        f"tuner's agreed settings on both ranks, {uniform['seconds']:.1f} s), {ratio(runs['default']['seconds'])} "
        f"the default (0 workers, {runs['default']['seconds']:.1f} s) and {ratio(runs['rule_of_thumb']['seconds'])} "
        f"the rule of thumb ({thumb[0]} workers, {runs['rule_of_thumb']['seconds']:.1f} s). Every static config: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in grid.items())
        + "."
    )
    publish("ranks", section, args.write_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
