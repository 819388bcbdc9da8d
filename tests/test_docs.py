"""The README and the pages under ``docs/`` say what the code does, and their examples run (issue #33).

* Every fenced ``python`` block of ``README.md`` and of every ``docs/*.md`` runs as written, as a file of its own, in a
  fresh interpreter (``sys.executable``) whose working directory is a temporary one, with its own tuning cache: what
  it writes (``dltune_report.json``, ``lightning_logs/``) stays there, and the workers it starts end with its process.
  A block that is not Python to run (a shell command, a config file) is fenced with its own language (``bash``,
  ``yaml``); a fence without a language fails, so that no example escapes the run.
* The README stays under 250 lines.
* The tables name what the code has: the rules in ``docs/how-it-decides.md`` (``rules.RULES``,
  ``rules.SETTLE_OVERRIDES``, ``rules.FINAL`` and the rules outside ``rules.decide``), and in the README
  ``DataLoaderTuner``'s arguments with their defaults and the diagnoses (``diagnose.DIAGNOSES``).
* Every relative link of these pages reaches a file of the repository.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dltune import DataLoaderTuner
from lightning_dltune.tuning import diagnose, rules

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py", "python3"}
EXAMPLE_TIMEOUT_S = 180  # each takes a few seconds on 2 cores; the limit only stops one that hangs


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """Each fenced block of a Markdown text: its language (the info string's first word, "" for none), the line its
    opening fence is on (1-based) and its code, less the fence's indent (a block inside a list item is indented)."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        opening = re.match(r"^(?P<indent> *)(?P<ticks>`{3,}|~{3,})(?P<info>.*)$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, ticks = len(opening["indent"]), opening["ticks"]
        language = (opening["info"].split() or [""])[0].lower()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^ *{re.escape(ticks[0])}{{{len(ticks)},}}\s*$", lines[i]):
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            i += 1
        assert i < len(lines), f"a fence opened on line {start} is never closed"
        blocks.append((language, start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def examples() -> list:
    found = []
    for page in PAGES:
        for language, line, code in fenced_blocks(page.read_text()):
            if language in PYTHON:
                name = page.relative_to(ROOT).as_posix()
                found.append(pytest.param(name, line, code, id=f"{name}:{line}"))
    return found


@pytest.mark.parametrize(("page", "line", "code"), examples())
def test_the_example_runs(page, line, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),  # this checkout's package
        DLTUNE_CACHE=str(tmp_path / "dltune_cache.json"),  # never the user's cache
        MPLCONFIGDIR=str(tmp_path / "matplotlib"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"the example at {page}, line {line}, exited with {done.returncode}:\n{done.stderr[-4000:]}"
    )


def test_the_readme_and_the_docs_have_examples_to_run():
    """An extraction that finds nothing would pass the test above by running nothing."""
    pages = {param.values[0] for param in examples()}
    assert "README.md" in pages and any(page.startswith("docs/") for page in pages), pages


def test_every_fence_names_its_language():
    unnamed = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in PAGES
        for language, line, _ in fenced_blocks(page.read_text())
        if not language
    ]
    assert not unnamed, f"fences without a language (```python, ```bash, ...): {unnamed}"


def test_the_readme_is_under_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move detail to docs/"


def table(text: str, first_header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose first header cell is ``first_header``, as lists of cells."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and cells(line)[0] == first_header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return rows
    raise AssertionError(f"no table headed {first_header!r}")


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def code(cell: str) -> str:
    """The first code span of a cell."""
    found = re.search(r"`([^`]+)`", cell)
    assert found is not None, f"no code span in {cell!r}"
    return found.group(1)


def test_how_it_decides_names_every_rule_in_order():
    rows = table((ROOT / "docs" / "how-it-decides.md").read_text(), "rule")
    named = [code(row[0]) for row in rows]
    outside = ["over_memory_budget", "cached_settings_hold", "failed_on_a_rank"]
    expected = [
        *(rule.__name__ for rule in rules.RULES),
        "start_costs_more",
        *(override.__name__ for override in rules.SETTLE_OVERRIDES),
        *outside,
    ]
    assert named == expected
    assert {code(row[0]) for row in rows if "final" in row[1]} == set(rules.FINAL)


def test_the_readme_names_every_argument_of_the_tuner_with_its_default():
    rows = table(README.read_text(), "argument")
    documented = {code(row[0]): ast.literal_eval(code(row[1])) for row in rows}
    parameters = inspect.signature(DataLoaderTuner.__init__).parameters.values()
    actual = {p.name: p.default for p in parameters if p.name != "self"}
    assert documented == actual


def test_the_readme_names_every_diagnosis_in_order():
    named = [code(row[0]) for row in table(README.read_text(), "diagnosis (`diagnosed_by`)")]
    assert named == [*(d.__name__ for d in diagnose.DIAGNOSES), "stall_left"]


def test_every_relative_link_reaches_a_file():
    broken = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", page.read_text())  # a code span's brackets are no link
        for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text):
            path = target.split("#", 1)[0]
            if re.match(r"^[a-z]+:", target) or not path:
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
