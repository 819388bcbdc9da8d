"""Compares two reports of scripts/lightning_suite_plugin.py: Lightning's tests without and with the tuner.

    python3 scripts/lightning_suite_compare.py BASELINE.json INJECTED.json [--times BASE_S INJ_S]

Prints the counts of each run, then every test that passed without the tuner and failed or errored with it
(a regression), one per line with the last line of its exception, then the reverse (tests fixed or made flaky
the other way, for information). Exit status: 0 without regressions, 1 with, 2 if a report is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


def load(path: Path) -> dict[str, dict[str, str]]:
    return json.loads(path.read_text())["tests"]


def counts(tests: dict[str, dict[str, str]]) -> str:
    c = Counter(t["outcome"] for t in tests.values())
    return ", ".join(f"{c.get(o, 0)} {o}" for o in OUTCOMES) + f" ({len(tests)} in all)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("injected", type=Path)
    parser.add_argument("--times", nargs=2, type=float, metavar=("BASELINE_S", "INJECTED_S"))
    args = parser.parse_args(argv)
    for path in (args.baseline, args.injected):
        if not path.is_file():
            print(f"lightning-suite: no report at {path} (did pytest start?)", file=sys.stderr)
            return 2
    base, inj = load(args.baseline), load(args.injected)
    times = args.times or (None, None)

    print("== counts")
    for name, tests, secs in (("without tuner", base, times[0]), ("with tuner   ", inj, times[1])):
        wall = f"  [{secs / 60:.1f} min]" if secs is not None else ""
        print(f"{name}: {counts(tests)}{wall}")

    ran = [t for t in inj.values() if "tuners" in t]
    with_tuner = sum(1 for t in ran if t["tuners"] > 0)
    print(f"with tuner: {with_tuner} of the {len(ran)} tests that ran built a Trainer that got a tuner")

    bad = ("failed", "error")
    regressions = sorted(
        n for n, t in inj.items() if t["outcome"] in bad and base.get(n, {}).get("outcome") == "passed"
    )
    fixed = sorted(n for n, t in base.items() if t["outcome"] in bad and inj.get(n, {}).get("outcome") == "passed")
    only_base = sorted(set(base) - set(inj))
    only_inj = sorted(set(inj) - set(base))

    print(f"== regressions: {len(regressions)} (pass without the tuner, {'/'.join(bad)} with it)")
    for n in regressions:
        print(f"{n}  [{inj[n]['outcome']}] {inj[n]['reason']}")
    if fixed:
        print(f"== the other way: {len(fixed)} (fail without the tuner, pass with it; likely flaky)")
        for n in fixed:
            print(f"{n}  [{base[n]['outcome']} without] {base[n]['reason']}")
    if only_base or only_inj:
        print(f"== ran in one run only: {len(only_base)} without the tuner only, {len(only_inj)} with it only")
        for n in only_base:
            print(f"{n}  [without only: {base[n]['outcome']}]")
        for n in only_inj:
            print(f"{n}  [with only: {inj[n]['outcome']}] {inj[n]['reason']}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
