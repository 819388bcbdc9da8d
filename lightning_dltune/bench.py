"""``dltune bench TARGET``: loader-only throughput over a sweep of ``num_workers``/``prefetch_factor``.

Done properly where the usual snippet is not: worker start-up and warm-up are excluded from the steady state
but reported, every config is repeated and given as median and spread, workers' memory is measured, and the
sweep stays within the CPUs this process may use (or ``--max-workers``).
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

from lightning_dltune.budget import cpu_budget, default_max_workers
from lightning_dltune.loader import NotRebuildableError, rebuild_dataloader, shutdown_workers
from lightning_dltune.probe import batch_size as batch_size_of
from lightning_dltune.report import write_json_atomic
from lightning_dltune.settings import LoaderSettings


class BenchError(Exception):
    """A problem with the user's target, reported as one clear line."""


@dataclass
class BenchRow:
    num_workers: int
    prefetch_factor: int | None
    startup_s: float
    batches_per_s: float
    spread: float  # (max - min) / median over repeats
    samples_per_s: float
    worker_uss_mb: float
    predicted_stall: float | None = None


def load_target(spec: str) -> Any:
    """``path/to/file.py:name`` or ``package.module:name`` -> the object."""
    if ":" not in spec:
        raise BenchError(f"TARGET must be `path/to/file.py:name` or `module:name`, got {spec!r}.")
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise BenchError(f"no such file: {where}")
            mod_name = f"_dltune_target_{path.stem}"
            spec_ = importlib.util.spec_from_file_location(mod_name, path)
            assert spec_ is not None and spec_.loader is not None
            module = importlib.util.module_from_spec(spec_)
            sys.modules[mod_name] = module  # worker processes unpickle objects from it
            sys.path.insert(0, str(path.parent.resolve()))
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except BenchError:
        raise
    except Exception as ex:
        raise BenchError(f"importing {where} failed: {type(ex).__name__}: {ex}") from ex
    try:
        return getattr(module, name)
    except AttributeError:
        raise BenchError(f"{where} has no attribute {name!r}") from None


def base_loader(target: Any, batch_size: int) -> DataLoader:
    """A DataLoader from a Dataset (class or instance), a DataLoader factory, or a LightningDataModule."""
    import lightning.pytorch as pl

    obj = target
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as ex:
            raise BenchError(f"instantiating {target.__name__}() failed: {type(ex).__name__}: {ex}") from ex
    try:
        if isinstance(obj, pl.LightningDataModule):
            obj.prepare_data()
            obj.setup("fit")
            loader = obj.train_dataloader()
        elif isinstance(obj, Dataset):
            loader = DataLoader(obj, batch_size=batch_size, shuffle=True)
        elif callable(obj):
            loader = obj()
        else:
            loader = obj
    except Exception as ex:
        raise BenchError(f"building the loader failed: {type(ex).__name__}: {ex}") from ex
    if not isinstance(loader, DataLoader):
        raise BenchError(
            f"TARGET must give a Dataset, a DataLoader factory or a LightningDataModule; got {type(loader).__name__}."
        )
    return loader


def _worker_uss_mb() -> float:
    import psutil

    sizes = []
    for child in psutil.Process().children(recursive=True):
        try:
            sizes.append(child.memory_full_info().uss)
        except psutil.Error:
            continue
    return statistics.mean(sizes) / 2**20 if sizes else 0.0


def measure(loader: DataLoader, batches: int, warmup: int, repeats: int) -> tuple[float, list[float], float, int]:
    """Start-up seconds, steady batches/s per repeat, worker USS (MB), and samples per batch."""
    rates: list[float] = []
    startup = 0.0
    uss = 0.0
    batch_samples = 1
    for r in range(repeats):
        t0 = time.perf_counter()
        t1 = t0
        n = 0
        try:
            it = iter(loader)
            first = next(it)
            if r == 0:
                startup = time.perf_counter() - t0
                batch_samples = batch_size_of(first)
            for _ in range(warmup):
                next(it)
            t1 = time.perf_counter()
            for _ in range(batches):
                next(it)
                n += 1
        except StopIteration:
            pass
        except Exception as ex:
            raise BenchError(f"the dataset raised while loading: {type(ex).__name__}: {ex}") from ex
        if n:
            rates.append(n / (time.perf_counter() - t1))
        if r == 0:
            uss = _worker_uss_mb()
    if not rates:
        raise BenchError(f"the loader has too few batches: need more than {warmup + 1} for a measurement.")
    return startup, rates, uss, batch_samples


def sweep_configs(max_workers: int, prefetch: list[int]) -> list[LoaderSettings]:
    counts = [0] + [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= max_workers]
    if max_workers not in counts:
        counts.append(max_workers)
    out = [LoaderSettings()]
    for w in counts[1:]:
        out += [LoaderSettings.normalized(w, p) for p in prefetch]
    return out


def run_bench(
    target: str,
    *,
    batch_size: int = 32,
    batches: int = 30,
    warmup: int = 3,
    repeats: int = 3,
    max_workers: int | None = None,
    prefetch: list[int] | None = None,
    step_ms: float | None = None,
    out: Path = Path("dltune_bench"),
) -> dict[str, Any]:
    base = base_loader(load_target(target), batch_size)
    budget = cpu_budget()
    cap = default_max_workers(budget.cpus) if max_workers is None else max_workers
    rows: list[BenchRow] = []
    print(f"Sweeping num_workers 0..{cap} ({budget.cpus:g} CPUs, {budget.bound_by}); {repeats} repeats each.")
    for settings in sweep_configs(cap, prefetch or [2, 4]):
        try:
            loader = rebuild_dataloader(base, settings.to_loader_kwargs())
        except NotRebuildableError as ex:
            raise BenchError(f"cannot set num_workers on this DataLoader: {ex}") from ex
        try:
            startup, rates, uss, per_batch = measure(loader, batches, warmup, repeats)
        finally:
            shutdown_workers(loader)
        med = statistics.median(rates)
        row = BenchRow(
            settings.num_workers,
            settings.prefetch_factor,
            startup,
            med,
            (max(rates) - min(rates)) / med if med else 0.0,
            med * per_batch,
            uss,
        )
        if step_ms is not None:
            load_s = 1.0 / med
            row.predicted_stall = max(0.0, load_s - step_ms / 1e3) / max(load_s, step_ms / 1e3)
        rows.append(row)
        print(f"  {settings.describe():24s} {med:8.1f} batches/s  (start-up {startup:.2f} s)", flush=True)
    best = max(r.batches_per_s for r in rows)
    if step_ms is not None:
        ok = [r for r in rows if (r.predicted_stall or 0) <= 0.05]
        pool = ok or [max(rows, key=lambda r: r.batches_per_s)]
        why = f"the cheapest that keeps a {step_ms:g} ms step fed (predicted stall <= 5%)"
    else:
        pool = [r for r in rows if r.batches_per_s >= 0.95 * best]
        why = "the cheapest within 5% of the best throughput"
    rec = min(pool, key=lambda r: (r.num_workers, r.prefetch_factor or 0))
    result = {
        "target": target,
        "batch_size": batch_size,
        "cpus": budget.cpus,
        "cpu_bound_by": budget.bound_by,
        "step_ms": step_ms,
        "rows": [asdict(r) for r in rows],
        "recommended": LoaderSettings.normalized(rec.num_workers, rec.prefetch_factor).to_loader_kwargs(),
        "why": why,
    }
    out = Path(out)
    write_json_atomic(out / "bench.json", result)
    print()
    print(format_table(rows, step_ms))
    print(f"\nRecommended: num_workers={rec.num_workers}, prefetch_factor={rec.prefetch_factor} ({why}).")
    plot = _plot(rows, out / "bench.png")
    print(f"Wrote {out / 'bench.json'}" + (f" and {plot}" if plot else ""))
    return result


def format_table(rows: list[BenchRow], step_ms: float | None) -> str:
    head = f"{'workers':>7} {'prefetch':>8} {'batches/s':>10} {'spread':>7} {'samples/s':>10} {'start-up s':>10}"
    head += f" {'MB/worker':>9}" + (f" {'stall @ ' + format(step_ms, 'g') + ' ms':>14}" if step_ms is not None else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (
            f"{r.num_workers:>7} {r.prefetch_factor or '-':>8} {r.batches_per_s:>10.1f} {r.spread:>7.0%} "
            f"{r.samples_per_s:>10.1f} {r.startup_s:>10.2f} {r.worker_uss_mb:>9.1f}"
        )
        if r.predicted_stall is not None:
            line += f" {r.predicted_stall:>14.0%}"
        lines.append(line)
    return "\n".join(lines)


def _plot(rows: list[BenchRow], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for pf in sorted({r.prefetch_factor or 0 for r in rows}):
        pts = [r for r in rows if (r.prefetch_factor or 0) == pf or r.num_workers == 0]
        ax.plot(
            [r.num_workers for r in pts],
            [r.samples_per_s for r in pts],
            marker="o",
            label=f"prefetch_factor={pf}" if pf else "0 workers",
        )
    ax.set_xscale("symlog", base=2)
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s (median of repeats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
