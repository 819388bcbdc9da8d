"""The ``dltune`` command: ``dltune demo``, ``dltune bench TARGET``, ``dltune plot REPORT`` and
``dltune cache list|clear``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn


def ranks(entry: dict[str, Any]) -> str:
    """A DDP rank's entry: which rank, and its own workers where the ranks ran their own."""
    fields = entry.get("fields", {})
    if "rank" not in fields:
        return ""
    own = entry.get("own_workers")
    return f", rank {fields['rank']} of {fields.get('world_size')}" + (f" ({own} workers of its own)" if own else "")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (``dltune bench: error: ...``), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: type[int] | type[float], low: float, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not value >= low:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, 1, "an int >= 1")


def _count(text: str) -> int:
    return _number(text, int, 0, "an int >= 0")


def _positive_ms(text: str) -> float:
    value = _number(text, float, 0, "a positive number of milliseconds")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints like 2,4; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive ints like 2,4; got {text!r}")
    return values


def _version() -> str:
    """This package's version, with the torch and Lightning it runs on (what a bug report needs)."""
    import lightning
    import torch

    from lightning_dltune import __version__

    return f"lightning-dltune {__version__} (torch {torch.__version__}, lightning {lightning.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dltune", description="Measure and tune PyTorch DataLoaders.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small model from num_workers=0 with DataLoaderTuner attached")
    demo.add_argument("--out", type=Path, default=Path("dltune_runs/demo"), help="where logs, report and plot go")
    demo.add_argument("--quick", action="store_true", help="a shorter run (CI smoke test)")
    demo.add_argument("--epochs", type=_positive_int, default=None, help="epochs to train (default 6, quick 4)")

    bench = sub.add_parser("bench", help="loader-only throughput over a num_workers/prefetch_factor sweep")
    bench.add_argument(
        "target",
        help="a Dataset, DataLoader or LightningDataModule, or a class or function giving one: file.py:name or "
        "module:name (a file is imported by its name, so spawned workers can import it too)",
    )
    bench.add_argument("--batch-size", type=_positive_int, default=32, help="batch size when TARGET is a Dataset")
    bench.add_argument(
        "--batches",
        type=_positive_int,
        default=30,
        help="least steady-state batches per repeat (at least 4x the batches in flight are used)",
    )
    bench.add_argument(
        "--warmup",
        type=_count,
        default=3,
        help="least batches after the first one excluded as warm-up (at least the batches in flight are used)",
    )
    bench.add_argument("--repeats", type=_positive_int, default=3, help="repeats per config (median and spread)")
    bench.add_argument("--max-workers", type=_count, default=None, help="largest num_workers (default: 8 per CPU)")
    bench.add_argument("--prefetch", type=_int_list, default=[2, 4], help="prefetch factors to try, e.g. 2,4")
    bench.add_argument(
        "--step-ms", type=_positive_ms, default=None, help="model step time: flag configs that would stall"
    )
    bench.add_argument("--out", type=Path, default=Path("dltune_runs/bench"), help="where the JSON and plot go")
    plot = sub.add_parser("plot", help="draw a run from its dltune_report.json (stall, samples/s, workers over steps)")
    plot.add_argument("report", type=Path, help="the dltune_report.json written after fit")
    plot.add_argument("--out", type=Path, default=None, help="the PNG to write (default: next to REPORT, .png)")
    cache = sub.add_parser("cache", help="show or reset the tuning cache of settled settings")
    cache.add_argument("action", choices=["list", "clear"], help="list the entries, or delete the cache file")
    cache.add_argument("--path", type=Path, default=None, help="the cache file (default: $DLTUNE_CACHE or ~/.cache)")
    return parser


def _cache(action: str, path: Path | None) -> int:
    from lightning_dltune.output.cache import TuningCache, default_cache_path

    cache = TuningCache(path or default_cache_path())
    if action == "clear":
        print(f"removed {cache.clear()} entries: {cache.path}")
        return 0
    entries = cache.entries()
    print(f"{len(entries)} entries in {cache.path}")
    for entry in entries:
        fields, settings = entry.get("fields", {}), entry.get("settings", {})
        rate = entry.get("samples_per_s")
        print(
            f"  {entry.get('saved', '?')}  {fields.get('dataset')} (len {fields.get('dataset_len')}, batch "
            f"{fields.get('batch_size')}, {fields.get('accelerator')}): workers={settings.get('num_workers')} "
            f"prefetch={settings.get('prefetch_factor')}" + (f", {rate:.0f} samples/s" if rate else "") + ranks(entry)
        )
    return 0


def _plot(report_file: Path, out: Path | None) -> int:
    from lightning_dltune.output.plot import PlotError, draw_report, plot_path
    from lightning_dltune.output.report import ReportError, read_report

    out = out or plot_path(report_file)
    try:
        path = draw_report(read_report(report_file), out)
    except (ReportError, PlotError) as ex:
        error = str(ex)
    except OSError as ex:  # the PNG cannot be written
        error = f"cannot write {ex.filename or out}: {ex.strerror or ex}. Pass another --out."
    else:
        print(f"Plot: {path}")
        return 0
    print(f"dltune plot: error: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from lightning_dltune.tools.demo import run_demo

        run_demo(args.out, quick=args.quick, epochs=args.epochs)
        return 0
    if args.command == "cache":
        return _cache(args.action, args.path)
    if args.command == "plot":
        return _plot(args.report, args.out)
    from lightning_dltune.tools.bench import BenchError, run_bench

    try:
        run_bench(
            args.target,
            batch_size=args.batch_size,
            batches=args.batches,
            warmup=args.warmup,
            repeats=args.repeats,
            max_workers=args.max_workers,
            prefetch=args.prefetch,
            step_ms=args.step_ms,
            out=args.out,
        )
    except BenchError as ex:
        print(f"dltune bench: error: {ex}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
