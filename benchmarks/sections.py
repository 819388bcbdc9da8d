"""Write one benchmark's section of BENCHMARKS.md between its markers, before the side-by-side results (which
``benchmarks/run.py --write-md`` regenerates and keeps everything above)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# `benchmarks/all.py --quick` writes a smoke run's file elsewhere
BENCHMARKS_MD = Path(os.environ.get("DLTUNE_BENCHMARKS_MD") or Path(__file__).resolve().parent.parent / "BENCHMARKS.md")
# a benchmark's Trainer writes and prints nothing of its own
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def write_results(out: Path, name: str, results: Any) -> Path:
    """Write a benchmark's raw numbers to ``out/name`` (JSON, the folder made if needed); returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def write_section(name: str, section: str, path: Path = BENCHMARKS_MD) -> None:
    text = path.read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{section}\n{end}"
    if start in text:
        text = text.split(start)[0] + block + text.split(end, 1)[1]
    else:
        text = text.replace("<!-- results -->", block + "\n\n<!-- results -->", 1)
    path.write_text(text)


def publish(name: str, section: str, write_md: bool) -> None:
    """Print a benchmark's ``section`` and, with ``write_md``, write it into BENCHMARKS.md under ``name``."""
    print("\n" + section)
    if write_md:
        write_section(name, section)
