"""Draw the README's pictures from one real ``dltune demo`` run: the PNG the tuner writes after ``fit``, and the curves
TensorBoard shows, read back from the run's event file. Both go to ``docs/images/``, with the commit, the machine
and the demo's last lines in ``docs/images/demo-run.txt``.

    python scripts/readme_picture.py            # about 2 minutes on 2 cores

Run it on a clean tree: the picture says which commit drew it."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
CURVES = (  # what a user looks at first in TensorBoard's dltune dashboard, top to bottom
    ("dltune/stall_frac", "stall fraction"),
    ("dltune/samples_per_s", "samples/s"),
    ("dltune/num_workers", "num_workers"),
)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of ``CURVES`` in the TensorBoard event files under ``log_dir``, as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag, _ in CURVES}


def draw_curves(scalars: dict[str, list[tuple[int, float]]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(CURVES), 1, figsize=(8, 5.5), sharex=True)
    for ax, (tag, label) in zip(axes, CURVES, strict=True):
        steps, values = zip(*scalars[tag], strict=True)
        ax.plot(steps, values, drawstyle="steps-post" if tag.endswith("num_workers") else "default")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.set_title(tag, fontsize=9, loc="left")
    axes[-1].set_xlabel("global step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DLTUNE_CACHE", os.devnull)  # the demo turns the cache off; nothing else reads one
    from lightning_dltune.tools.demo import run_demo

    IMAGES.mkdir(parents=True, exist_ok=True)
    drawn_at = commit()
    with tempfile.TemporaryDirectory() as tmp:
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            result = run_demo(Path(tmp))
        print(said.getvalue())
        if result["plot"] is None:
            sys.exit("the demo drew no PNG: install the [view] extra (matplotlib, tensorboard)")
        shutil.copy(result["plot"], IMAGES / "demo-run.png")
        machine = f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}"
        title = f"dltune demo at {drawn_at} ({machine}): the curves TensorBoard shows, read from the event file"
        draw_curves(read_scalars(result["log_dir"]), title, IMAGES / "demo-tensorboard.png")
    last = said.getvalue().split("=== dltune demo result ===", 1)[-1].strip().splitlines()
    kept = [line for line in last if not line.startswith(("Report:", "Plot:", "TensorBoard logs:", "  view them"))]
    (IMAGES / "demo-run.txt").write_text(f"dltune demo at {drawn_at} ({machine})\n" + "\n".join(kept) + "\n")
    print(f"wrote {IMAGES / 'demo-run.png'}, {IMAGES / 'demo-tensorboard.png'} and {IMAGES / 'demo-run.txt'}")


if __name__ == "__main__":
    main()
