"""Regenerate BENCHMARKS.md at one commit, with one command: every benchmark of this folder, one after the other on
this machine (their raw numbers in ``benchmarks/results/``), then the file written anew: the commit and the machine,
a headline table and a chart (``docs/images/benchmarks.png``) of the tuner against the default, the rule of thumb
and the best static config, and each benchmark's own section below. How each one measures: docs/benchmarks.md;
earlier results: docs/benchmark-history.md and git.

    python benchmarks/all.py            # about an hour on 2 CPUs; needs a clean work tree (the commit is stated)
    python benchmarks/all.py --render   # the headline, the chart and the header again from the results, nothing run
    python benchmarks/all.py --quick    # a smoke run of every step, written under a temporary folder

The GPU sections (``scripts/gpu_check.sh`` on a CUDA machine) are kept from the file as they were, with the machine
and the date they were measured on. The ``imagefolder`` workload runs where torchvision is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from run import WORKLOADS, ratio_interval
from sections import write_section

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHART = ROOT / "docs" / "images" / "benchmarks.png"
# what this command writes: a work tree changed only there is still the commit it states
OUTPUTS = ("BENCHMARKS.md", "benchmarks/results/", "docs/images/benchmarks.png")  # and BENCHMARKS.md.draft

SKELETON = """# Benchmarks

<!-- header -->
<!-- /header -->

<!-- headline -->
<!-- /headline -->

## The stall, against the truth

<!-- truth -->
<!-- /truth -->

{truth_gpu}

## Memory

<!-- memory -->
<!-- /memory -->

## Evaluation loaders

<!-- evaluation -->
<!-- /evaluation -->

## Ranks that differ

<!-- ranks -->
<!-- /ranks -->

## Whole runs

<!-- results -->
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def changed_files() -> list[str]:
    """Files of the work tree that differ from the commit, apart from what this command writes."""
    lines = git("status", "--porcelain").splitlines()
    paths = [line[3:] for line in lines if line[3:]]
    return [p for p in paths if not p.startswith(OUTPUTS)]


def block(text: str, name: str) -> str | None:
    """The section ``name`` of a BENCHMARKS.md, markers included (``None``: not there)."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        return None
    return start + text.split(start, 1)[1].split(end, 1)[0] + end


def steps(quick: bool, out: Path) -> list[tuple[str, list[str]]]:
    """Each benchmark's command line, in the order they run (the whole runs last: they write the file's end)."""
    o = ["--out", str(out), "--write-md"]
    q = ["--quick"] if quick else []
    runs = [
        ("truth", ["truth.py", *q, *o]),
        ("memory", ["memory.py", *o]),
        ("evaluation", ["evaluation.py", *(["--rounds", "1", "--epochs", "2"] if quick else []), *o]),
        ("ranks", ["ranks.py", *o]),
    ]
    if importlib.util.find_spec("torchvision") is not None:
        runs.append(("imagefolder", ["run.py", "--workloads", "imagefolder", "--workloads-only", *q, *o]))
    whole = ",".join(w for w in WORKLOADS if w != "imagefolder")  # imagefolder (where torchvision is) runs alone
    runs.append(("workloads", ["run.py", "--workloads", whole, *q, *o]))
    return runs


def run_all(quick: bool, out: Path, md: Path) -> dict[str, float]:
    """Run every step; the minutes each took."""
    env = {**os.environ, "DLTUNE_BENCHMARKS_MD": str(md)}
    minutes: dict[str, float] = {}
    for name, command in steps(quick, out):
        print(f"== {name}: python {' '.join(command)}", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *command], cwd=HERE, env=env)
        minutes[name] = (time.perf_counter() - t0) / 60
        if done.returncode != 0:
            failed = f"benchmarks/all.py: {name} failed (exit {done.returncode})"
            raise SystemExit(f"{failed}; {md} holds the sections before it, BENCHMARKS.md is as it was")
    return minutes


# --- the headline ----------------------------------------------------------------------------------------------


def _load(out: Path, name: str) -> Any:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


def headline_rows(out: Path, quick: bool, ran: list[str]) -> list[dict[str, Any]]:
    """One row per workload of the steps that ``ran``: the default's, the rule of thumb's and the tuner's whole run
    over the best static config's (the tuner's with its 95% interval over paired rounds where there are rounds)."""
    rows: list[dict[str, Any]] = []
    runs = _load(out, "quick.json" if quick else "latest.json") if "workloads" in ran else None
    extra = None
    if "imagefolder" in ran:
        extra = _load(out, "workloads-imagefolder-quick.json" if quick else "workloads-imagefolder.json")
    for w in (runs or {"workloads": []})["workloads"] + (extra or {"workloads": []})["workloads"]:
        s, p = w["seconds"], w.get("paired") or {}
        rows.append(
            {
                "workload": w["workload"],
                "what": w["what"],
                "default": s["default"] / s["oracle"],
                "thumb": s["rule_of_thumb"] / s["oracle"],
                "tuner": p.get("ratio", s["tuner"] / s["oracle"]),
                "low": p.get("ratio_low"),
                "high": p.get("ratio_high"),
                "best": f"{w['workers']['oracle']}, {s['oracle']:.1f} s",
            }
        )
    evaluation = (_load(out, "evaluation.json") if "evaluation" in ran else None) or {}
    what = {"val": "validation every epoch", "val_quarter": "validation 4 times an epoch", "predict": "a predict run"}
    for name, saved in evaluation.items():
        walls = saved["walls"]
        static = [a for a in walls if a.startswith("workers=")]
        oracle = min(static, key=lambda a: statistics.median(walls[a]))
        base = statistics.median(walls[oracle])
        thumb = saved.get("thumb") or min(static, key=_count)  # results before it was saved: workers=1 on 2 CPUs
        tuned = ratio_interval(walls["tuned"], walls[oracle])
        rows.append(
            {
                "workload": f"eval: {name}",
                "what": f"10 ms a sample, {what.get(name, name)}",
                "default": statistics.median(walls["default"]) / base,
                "thumb": statistics.median(walls[thumb]) / base,
                "tuner": tuned["ratio"],
                "low": tuned["ratio_low"] if len(walls["tuned"]) > 1 else None,
                "high": tuned["ratio_high"] if len(walls["tuned"]) > 1 else None,
                "best": f"{oracle.split('=')[1]}w, {base:.1f} s",
            }
        )
    ranks = _load(out, "ranks.json") if "ranks" in ran else None
    if ranks:
        best = ranks["best_static"]["seconds"]
        tuner = [t["seconds"] / best for t in ranks["tuner"]]
        rows.append(
            {
                "workload": "ranks",
                "what": "2 DDP ranks, samples 1 ms and 6 ms",
                "default": ranks["default"]["seconds"] / best,
                "thumb": ranks["rule_of_thumb"]["seconds"] / best,
                "tuner": statistics.mean(tuner),
                "low": min(tuner),
                "high": max(tuner),
                "best": f"{ranks['best_static']['config']}, {best:.1f} s",
                "spread": "runs",
            }
        )
    return rows


def _count(arm: str) -> int:
    return int(arm.split("=")[1])


def headline(rows: list[dict[str, Any]]) -> str:
    lines = [
        "Whole-run time over the best static config's (lower is better; the best static config is the fastest of "
        "a grid searched after the fact, which no real run knows in advance). The tuner starts from the Lightning "
        "default of 0 workers and its trials are counted; its spread is the 95% interval over paired rounds "
        "(ranks: the least and most of its launches). The default and the rule of thumb (half the CPUs, never "
        "above 8: 1 worker on 2 CPUs) are one run each.",
        "",
        "| workload | default (0 workers) | rule of thumb | DataLoaderTuner (spread) | best static config |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f" ({r['low']:.2f}-{r['high']:.2f}x)" if r["low"] is not None else ""
        lines.append(
            f"| {r['workload']}: {r['what']} | {r['default']:.2f}x | {r['thumb']:.2f}x | {r['tuner']:.2f}x{spread} "
            f"| 1.00x ({r['best']}) |"
        )
    lines += ["", "![The tuner against the default and the rule of thumb](docs/images/benchmarks.png)"]
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    """The headline's ratios drawn: one line per workload, on a log scale, 1.0 the best static config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["workload"] for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4), dpi=100)
    y = list(range(len(rows)))
    ax.axvline(1.0, color="black", lw=1)
    ax.scatter([r["default"] for r in rows][::-1], y, marker="o", color="#999999", label="default (0 workers)")
    ax.scatter([r["thumb"] for r in rows][::-1], y, marker="^", color="#e69f00", label="rule of thumb")
    tuner = [r["tuner"] for r in rows][::-1]
    low = [r["tuner"] - (r["low"] if r["low"] is not None else r["tuner"]) for r in rows][::-1]
    high = [(r["high"] if r["high"] is not None else r["tuner"]) - r["tuner"] for r in rows][::-1]
    ax.errorbar(tuner, y, xerr=[low, high], fmt="D", color="#0072b2", capsize=3, label="DataLoaderTuner")
    ax.set_xscale("log")
    ticks = [t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50) if t <= 1.5 * max(max(r["default"], r["thumb"]) for r in rows)]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_yticks(y, names)
    ax.set_xlabel("whole-run time over the best static config's (log scale; 1x: the best static config)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 1.12), ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def header(run: dict[str, Any]) -> str:
    return (
        f"Measured at commit `{run['commit']}` on {run['date']} by `python benchmarks/all.py`, "
        f"{sum(run['minutes'].values()):.0f} minutes: {run['machine']}. How each benchmark measures: "
        "[docs/benchmarks.md](docs/benchmarks.md); earlier results: "
        "[docs/benchmark-history.md](docs/benchmark-history.md)."
    )


def machine() -> str:
    import lightning
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpus} CPUs, no GPU (the accelerator is simulated by a sleep in `training_step`), {platform.platform()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}"
    )


def write(md: Path, out: Path, quick: bool, run: dict[str, Any]) -> None:
    """The header, the headline and the chart of the run described by ``run`` (its manifest, ``all.json``)."""
    rows = headline_rows(out, quick, list(run["minutes"]))
    chart(rows, out / "benchmarks.png" if quick else CHART)
    write_section("header", header(run), md)
    write_section("headline", headline(rows), md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--render", action="store_true", help="rewrite the headline, chart and header; run nothing")
    how.add_argument("--quick", action="store_true", help="a smoke run, written under a temporary folder")
    args = parser.parse_args(argv)
    changed = changed_files()
    if changed and not (args.quick or args.render):
        raise SystemExit(
            "benchmarks/all.py: the work tree differs from its commit (" + ", ".join(changed[:5]) + "); "
            "BENCHMARKS.md states the commit it was measured at: commit first, or use --quick for a smoke run"
        )
    commit = git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")
    md, out = ROOT / "BENCHMARKS.md", HERE / "results"
    if args.quick:
        scratch = Path(tempfile.mkdtemp(prefix="dltune-benchmarks-"))
        md, out = scratch / "BENCHMARKS.md", scratch / "results"
    if args.render:
        if not (out / "all.json").exists():
            raise SystemExit(f"benchmarks/all.py --render: no {out / 'all.json'}; run `python benchmarks/all.py` first")
        run = json.loads((out / "all.json").read_text())
        write(md, out, args.quick, run)
    else:
        old = (ROOT / "BENCHMARKS.md").read_text() if (ROOT / "BENCHMARKS.md").exists() else ""
        out.mkdir(parents=True, exist_ok=True)
        (out / "all.json").unlink(missing_ok=True)  # a later --render reads this run's manifest or none
        # the steps write a new file beside the old one, which it replaces once every step succeeded
        draft = md.with_name(md.name + ".draft")
        draft.write_text(SKELETON.format(truth_gpu=gpu_sections(old)))
        date = datetime.date.today().isoformat()
        minutes = run_all(args.quick, out, draft)
        if changed_files() != changed:  # a file changed while the benchmarks ran
            commit = commit.split()[0] + " with uncommitted changes"
        run = {"commit": commit, "date": date, "machine": machine(), "minutes": minutes}
        (out / "all.json").write_text(json.dumps(run, indent=2) + "\n")
        write(draft, out, args.quick, run)
        draft.replace(md)
    print(f"wrote {md} ({sum(run['minutes'].values()):.0f} minutes of benchmarks)")
    return 0


def gpu_sections(old: str) -> str:
    """The GPU results of the file before, kept as they were (only a CUDA machine measures them again)."""
    kept = block(old, "truth_gpu")
    if kept is None:
        return "No GPU result yet: `scripts/gpu_check.sh` on a CUDA machine measures one."
    return "On a GPU (`benchmarks/truth_gpu.py --quick`, from `scripts/gpu_check.sh`, not rerun here):\n\n" + kept


if __name__ == "__main__":
    sys.exit(main())
