"""Write one benchmark's section of BENCHMARKS.md between its markers, before the side-by-side results (which
``benchmarks/run.py --write-md`` regenerates and keeps everything above)."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(name: str, section: str, path: Path = BENCHMARKS_MD) -> None:
    text = path.read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{section}\n{end}"
    if start in text:
        text = text.split(start)[0] + block + text.split(end, 1)[1]
    else:
        text = text.replace("<!-- results -->", block + "\n\n<!-- results -->", 1)
    path.write_text(text)
