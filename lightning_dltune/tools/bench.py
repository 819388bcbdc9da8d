"""``dltune bench TARGET``: loader-only throughput over a sweep of ``num_workers``/``prefetch_factor``.

Done properly where the usual snippet is not:

* warm-up lasts until the pipeline is full (at least the batches in flight, ``num_workers x prefetch_factor``),
  and the steady window is several times longer than that, so the rate is production, not a prefetched
  buffer draining; the window's ends are taken where the consumer had to wait (the queue was empty at both
  ends), and the table says how many batches each rate was measured over;
* a rate above what the workers could physically produce (``num_workers`` over the production time of a batch
  measured at 1 worker, and at most the CPUs' share for a CPU-bound loader) is flagged, not printed;
* the loader is iterated epoch after epoch, its workers persistent (as a training loop iterates it), for as
  many epochs as the warm-up and the window need: every config gets a rate, however short an epoch. A window
  that spans epoch starts includes their refill (PyTorch empties the pipeline at every epoch's end), as
  training over such epochs does; the wait for an epoch's first batch is reported apart;
* worker start-up is excluded from the steady state but reported, every config's window is repeated and given as
  median and spread, workers' memory is measured, the sweep stays within the CPUs this process may use, and a
  config whose batches in flight would not fit the free ``/dev/shm`` is not run (the table says so).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

from lightning_dltune.measurement.budget import cpu_budget, default_max_workers, shm_free_bytes
from lightning_dltune.measurement.measure import process_cpu_seconds
from lightning_dltune.measurement.probe import batch_size as batch_size_of
from lightning_dltune.measurement.probe import tensor_bytes, worker_uss
from lightning_dltune.output.report import write_json_atomic
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.switching.loader import NotRebuildableError, rebuild_dataloader, shutdown_workers
from lightning_dltune.tuning.model import Policy

WINDOW_PER_FLIGHT = 4  # the steady window holds at least this many times the batches in flight
LIMIT_TOLERANCE = 0.20  # a rate this far above the physical limit is flagged (the 1-worker rate is noisy too)


class BenchError(Exception):
    """A problem with the user's target, reported as one clear line."""


@dataclass
class BenchRow:
    num_workers: int
    prefetch_factor: int | None
    startup_s: float
    batches_per_s: float | None  # None: no trustworthy rate (see ``note``)
    spread: float  # (max - min) / median over repeats
    samples_per_s: float | None
    worker_uss_mb: float
    warmup_batches: int = 0  # batches consumed after the first one before the steady window
    window_batches: int = 0  # batches the rate was measured over (median over repeats)
    worker_cpu_per_batch_s: float = 0.0  # the workers' CPU seconds per batch in the steady window
    epoch_start_s: float | None = None  # median wait for an epoch's first batch, after the first epoch
    limit_batches_per_s: float | None = None  # the most the workers could physically produce
    predicted_stall: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Measurement:
    """One config's repeats: start-up, steady rates, the counts they used, worker memory and CPU."""

    startup_s: float
    rates: list[float]
    warmup: int
    window: int
    uss_mb: float
    batch_samples: int
    cpu_per_batch_s: float
    batch_bytes: int = 0  # the tensors of one batch: what each batch in flight holds in /dev/shm
    epoch_starts: tuple[float, ...] = ()  # the waits for the first batch of every epoch after the first


def in_flight(settings: LoaderSettings) -> int:
    """Batches the workers hold ahead of the consumer once the pipeline is full."""
    return settings.num_workers * (settings.prefetch_factor or 2) if settings.num_workers else 0


def window_sizes(settings: LoaderSettings, batches: int, warmup: int) -> tuple[int, int]:
    """Warm-up and steady-window batch counts: ``warmup`` and ``batches`` are minimums."""
    flight = in_flight(settings)
    return max(warmup, flight), max(batches, WINDOW_PER_FLIGHT * flight)


def steady_rate(times: Sequence[float], waits: Sequence[float]) -> tuple[float, int]:
    """Batches per second over a steady window, and the number of batches it was measured over.

    ``times[0]`` is when the window began (the last warm-up batch arrived), ``times[i]`` when its ``i``-th batch
    arrived, and ``waits[i - 1]`` how long ``next()`` blocked for it. The rate is taken between the first and
    the last read that blocked (for at least half the mean interval): the queue was empty at both, so whatever
    the workers had buffered before is not counted as production. Without such reads (the workers outpace the
    consumer: the queue stays full), or with too few to span a quarter of the window, the whole window counts.
    """
    n = len(times) - 1
    if n < 1 or len(waits) != n:
        raise ValueError(f"need one wait per batch of a non-empty window, got {n} batches and {len(waits)} waits.")
    mean = (times[-1] - times[0]) / n
    blocked = [i for i in range(1, n + 1) if waits[i - 1] >= 0.5 * mean]
    a, b = (blocked[0], blocked[-1]) if len(blocked) >= 2 and blocked[-1] - blocked[0] >= n // 4 else (0, n)
    span = times[b] - times[a]
    return ((b - a) / span if span > 0 else math.inf), b - a


def physical_limit(workers: int, one_worker_rate: float, cpus: float, cpu_per_batch_s: float) -> float:
    """The most batches/s ``workers`` can produce: each no faster than one worker alone, and together no more
    than the CPUs can compute when a batch costs CPU time."""
    limit = workers * one_worker_rate
    if cpu_per_batch_s > 0:
        limit = min(limit, max(cpus, 1.0) / cpu_per_batch_s)
    return limit


def load_target(spec: str) -> Any:
    """``path/to/file.py:name`` or ``package.module:name`` -> the object.

    A file is imported under its own name with its folder on ``sys.path``, so worker processes started with
    ``spawn`` or ``forkserver`` (macOS, and Linux from Python 3.14) can import it again to unpickle the dataset.
    """
    if ":" not in spec:
        raise BenchError(f"TARGET must be `path/to/file.py:name` or `module:name`, got {spec!r}.")
    where, _, name = spec.rpartition(":")
    try:
        module = _import_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except BenchError:
        raise
    except Exception as ex:
        raise BenchError(f"importing {where} failed: {type(ex).__name__}: {ex}") from ex
    try:
        return getattr(module, name)
    except AttributeError:
        raise BenchError(f"{where} has no attribute {name!r}") from None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise BenchError(f"no such file: {path}")
    path = path.resolve()
    name = path.stem
    if not name.isidentifier():
        raise BenchError(f"{path.name} is not an importable module name; rename it (letters, digits, _).")
    known = sys.modules.get(name)
    if known is not None:
        if Path(getattr(known, "__file__", "") or "").resolve() == path:
            return known
        raise BenchError(
            f"`{name}` already names another module ({getattr(known, '__file__', 'built in')}), so worker processes "
            f"could not import {path.name}; rename the file, or give TARGET as an importable `module:name`."
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # spawned workers get this process's sys.path
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def base_loader(target: Any, batch_size: int) -> DataLoader:
    """A DataLoader from a Dataset, a LightningDataModule, a DataLoader, a class of one of these, or any callable
    returning one of them (a factory), a Dataset wrapped with ``batch_size`` and ``shuffle=True``."""
    obj = target
    for _ in range(2):  # a class or factory, then what it returned
        if isinstance(obj, (DataLoader, Dataset)) or _is_datamodule(obj) or not callable(obj):
            break
        label = f"{getattr(obj, '__name__', type(obj).__name__)}()"
        try:
            obj = obj()
        except Exception as ex:
            raise BenchError(f"calling {label} failed: {type(ex).__name__}: {ex}") from ex
    try:
        if _is_datamodule(obj):
            obj.prepare_data()
            obj.setup("fit")
            obj = obj.train_dataloader()
        elif isinstance(obj, Dataset) and not isinstance(obj, DataLoader):
            obj = DataLoader(obj, batch_size=batch_size, shuffle=True)
    except Exception as ex:
        raise BenchError(f"building the loader failed: {type(ex).__name__}: {ex}") from ex
    if not isinstance(obj, DataLoader):
        raise BenchError(
            "TARGET must be or give a Dataset, a DataLoader or a LightningDataModule (a class, an instance, or a "
            f"function returning one); got {type(obj).__name__}."
        )
    return obj


def _is_datamodule(obj: Any) -> bool:
    import lightning.pytorch as pl

    return isinstance(obj, pl.LightningDataModule)


def _worker_uss_mb() -> float:
    """The mean unique memory of this process's children (the loader's workers), in MiB."""
    import psutil

    sizes = worker_uss([child.pid for child in psutil.Process().children(recursive=True)])
    return statistics.mean(sizes) / 2**20 if sizes else 0.0


def _workers_cpu_s(settings: LoaderSettings) -> float:
    main, children = process_cpu_seconds()
    return children if settings.num_workers else main


def epochs(loader: DataLoader) -> Generator[tuple[Any, bool], None, None]:
    """``loader``'s batches, epoch after epoch as a training loop asks for them, each with whether it began an
    epoch; ends only for a loader without batches."""
    while True:
        began = True
        for batch in loader:
            yield batch, began
            began = False
        if began:
            return


def measure(loader: DataLoader, settings: LoaderSettings, batches: int, warmup: int, repeats: int) -> Measurement:
    """Measure ``loader``: its first batch (start-up), a warm-up that fills the pipeline, then ``repeats`` steady
    windows (:func:`window_sizes`), each after a warm-up of its own, over as many epochs as they need; the rate of
    each from :func:`steady_rate`."""
    want_warmup, want_window = window_sizes(settings, batches, warmup)
    rates: list[float] = []
    windows: list[int] = []
    starts: list[float] = []
    uss = cpu_per_batch = 0.0
    stream = epochs(loader)

    def take() -> float:
        t = time.perf_counter()
        _, began = next(stream)
        waited = time.perf_counter() - t
        if began:
            starts.append(waited)
        return waited

    try:
        t0 = time.perf_counter()
        first, _ = next(stream)
        startup = time.perf_counter() - t0
        for r in range(repeats):
            for _ in range(want_warmup):
                take()
            cpu0 = _workers_cpu_s(settings)
            times, waits = [time.perf_counter()], []
            for _ in range(want_window):
                waits.append(take())
                times.append(time.perf_counter())
            if r == 0:
                cpu_per_batch = (_workers_cpu_s(settings) - cpu0) / want_window
                uss = _worker_uss_mb()
            rate, used = steady_rate(times, waits)
            rates.append(rate)
            windows.append(used)
    except StopIteration:
        raise BenchError("the loader gives no batch: pass a non-empty dataset.") from None
    except Exception as ex:
        raise BenchError(f"the dataset raised while loading: {type(ex).__name__}: {ex}") from ex
    finally:
        stream.close()
    return Measurement(
        startup,
        rates,
        want_warmup,
        int(statistics.median(windows)),
        uss,
        batch_size_of(first),
        cpu_per_batch,
        tensor_bytes(first),
        tuple(starts),
    )


def sweep_configs(max_workers: int, prefetch: list[int]) -> list[LoaderSettings]:
    counts = [0] + [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= max_workers]
    if max_workers not in counts:
        counts.append(max_workers)
    out = [LoaderSettings()]
    for w in counts[1:]:
        out += [LoaderSettings.normalized(w, p) for p in prefetch]
    return out


def _row(settings: LoaderSettings, m: Measurement) -> BenchRow:
    med = statistics.median(m.rates) if m.rates else None
    return BenchRow(
        num_workers=settings.num_workers,
        prefetch_factor=settings.prefetch_factor,
        startup_s=m.startup_s,
        batches_per_s=med,
        spread=(max(m.rates) - min(m.rates)) / med if med else 0.0,
        samples_per_s=None if med is None else med * m.batch_samples,
        worker_uss_mb=m.uss_mb,
        warmup_batches=m.warmup,
        window_batches=m.window,
        worker_cpu_per_batch_s=m.cpu_per_batch_s,
        epoch_start_s=statistics.median(m.epoch_starts) if m.epoch_starts else None,
    )


def check_limits(rows: list[BenchRow], cpus: float) -> None:
    """Flag (and withdraw) every rate above what its workers could physically produce, from the 1-worker rows."""
    ones = [r for r in rows if r.num_workers == 1 and r.batches_per_s]
    if not ones:
        return
    one_rate = max(r.batches_per_s or 0.0 for r in ones)
    cpu = statistics.median(r.worker_cpu_per_batch_s for r in ones)
    for r in rows:
        if r.num_workers < 1 or r.batches_per_s is None:
            continue
        r.limit_batches_per_s = physical_limit(r.num_workers, one_rate, cpus, cpu)
        if r.batches_per_s > r.limit_batches_per_s * (1 + LIMIT_TOLERANCE):
            r.note = (
                f"measured {r.batches_per_s:.1f} batches/s is above the physical limit "
                f"{r.limit_batches_per_s:.1f}: not a steady rate, withdrawn"
            )
            r.batches_per_s = r.samples_per_s = None


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
    print(
        f"Sweeping num_workers 0..{cap} ({budget.cpus:g} CPUs, {budget.bound_by}); {repeats} repeats each; warm-up "
        f"at least the batches in flight, a steady window of at least {WINDOW_PER_FLIGHT}x that."
        + (
            " More workers than CPUs on purpose: a loader waiting on storage wants them (PyTorch's warning about "
            "it is left out here)."
            if cap > budget.cpus
            else ""
        )
    )
    batch_bytes, shm = 0, shm_free_bytes()
    for settings in sweep_configs(cap, prefetch or [2, 4]):
        no_room = shm_short(settings, batch_bytes, shm)
        if no_room:
            rows.append(
                BenchRow(settings.num_workers, settings.prefetch_factor, 0.0, None, 0.0, None, 0.0, note=no_room)
            )
            print(f"  {settings.describe():24s} {'-':>8} ({no_room})", flush=True)
            continue
        try:
            loader = rebuild_dataloader(base, settings.to_loader_kwargs(), quiet=True)
        except NotRebuildableError as ex:
            raise BenchError(f"cannot set num_workers on this DataLoader: {ex}") from ex
        try:
            m = measure(loader, settings, batches, warmup, repeats)
        finally:
            shutdown_workers(loader)
        batch_bytes = max(batch_bytes, m.batch_bytes)
        row = _row(settings, m)
        rows.append(row)
        rate = f"{row.batches_per_s:8.1f} batches/s" if row.batches_per_s else f"{'-':>8} ({row.note})"
        print(f"  {settings.describe():24s} {rate}  (start-up {row.startup_s:.2f} s)", flush=True)
    check_limits(rows, budget.cpus)
    for row in rows:
        if step_ms is not None and row.batches_per_s:
            load_s = 1.0 / row.batches_per_s
            row.predicted_stall = max(0.0, load_s - step_ms / 1e3) / max(load_s, step_ms / 1e3)
    rec, why = recommend(rows, step_ms)
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
    plot, no_plot = _plot(rows, out / "bench.png", step_ms)
    print(f"Wrote {out / 'bench.json'}" + (f" and {plot}" if plot else f"; no plot: {no_plot}"))
    return result


def shm_short(settings: LoaderSettings, batch_bytes: int, shm_bytes: float | None) -> str:
    """Why ``settings`` is not run where its batches in flight would take more than the tuner's share of the free
    ``/dev/shm`` (a worker would die with a bus error), else ``""``."""
    need = batch_bytes * settings.batches_in_flight
    if shm_bytes is None or need <= Policy().shm_fraction * shm_bytes:
        return ""
    return (
        f"not run: its {settings.batches_in_flight} batches in flight need about {need / 2**20:.0f} MiB of "
        f"/dev/shm, {shm_bytes / 2**20:.0f} MiB free (docker run --shm-size=8g, or --ipc=host)"
    )


def recommend(rows: list[BenchRow], step_ms: float | None) -> tuple[BenchRow, str]:
    """The cheapest config that does the job among those measured, and why, naming the configs without a rate."""
    measured = [r for r in rows if r.batches_per_s]
    if not measured:
        raise BenchError("no config gave a steady rate; see each config's note above.")
    best = max(r.batches_per_s or 0.0 for r in measured)
    if step_ms is not None:
        ok = [r for r in measured if (r.predicted_stall or 0) <= 0.05]
        pool = ok or [max(measured, key=lambda r: r.batches_per_s or 0.0)]
        why = f"the cheapest that keeps a {step_ms:g} ms step fed (predicted stall <= 5%)"
    else:
        pool = [r for r in measured if (r.batches_per_s or 0.0) >= 0.95 * best]
        why = "the cheapest within 5% of the best throughput"
    unmeasured = [_describe(r) for r in rows if r not in measured]
    if unmeasured:
        why += f"; among the configs measured: {', '.join(unmeasured)} had no rate (see their notes)"
    return min(pool, key=lambda r: (r.num_workers, r.prefetch_factor or 0)), why


def _describe(row: BenchRow) -> str:
    return LoaderSettings.normalized(row.num_workers, row.prefetch_factor).describe()


def format_table(rows: list[BenchRow], step_ms: float | None) -> str:
    head = (
        f"{'workers':>7} {'prefetch':>8} {'batches/s':>10} {'spread':>7} {'samples/s':>10} {'warm-up':>7} "
        f"{'window':>6} {'start-up s':>10} {'epoch start s':>13} {'MiB/worker':>10}"
    )
    head += f" {'stall @ ' + format(step_ms, 'g') + ' ms':>14}" if step_ms is not None else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = (
            f"{r.batches_per_s:>10.1f} {r.spread:>7.0%} {r.samples_per_s:>10.1f}"
            if r.batches_per_s
            else (f"{'-':>10} {'-':>7} {'-':>10}")
        )
        epoch_start = "-" if r.epoch_start_s is None else f"{r.epoch_start_s:.3f}"
        line = (
            f"{r.num_workers:>7} {r.prefetch_factor or '-':>8} {rate} {r.warmup_batches:>7} {r.window_batches:>6} "
            f"{r.startup_s:>10.2f} {epoch_start:>13} {r.worker_uss_mb:>10.1f}"
        )
        if step_ms is not None:
            line += f" {r.predicted_stall:>14.0%}" if r.predicted_stall is not None else f" {'-':>14}"
        lines.append(line + (f"  {r.note}" if r.note else ""))
    lines.append(
        "warm-up: batches consumed after the first before timing; window: batches the rate was measured over; "
        "epoch start: the wait for an epoch's first batch after the first epoch (the pipeline refilling)."
    )
    return "\n".join(lines)


def _plot(rows: list[BenchRow], path: Path, step_ms: float | None) -> tuple[Path | None, str]:
    """The plot, or ``None`` and why there is none. Drawn on a bare ``Figure``: a notebook's backend is left alone."""
    from lightning_dltune import _imports

    if not _imports._MATPLOTLIB_AVAILABLE:
        return None, _imports.MATPLOTLIB_MISSING
    from matplotlib.figure import Figure

    measured = [r for r in rows if r.samples_per_s]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for pf in sorted({r.prefetch_factor or 0 for r in measured}):
        pts = [r for r in measured if (r.prefetch_factor or 0) == pf or r.num_workers == 0]
        ax.plot(
            [r.num_workers for r in pts],
            [r.samples_per_s or 0.0 for r in pts],
            marker="o",
            label=f"prefetch_factor={pf}" if pf else "0 workers",
        )
    if step_ms is not None and measured:
        per_batch = (measured[0].samples_per_s or 0.0) / (measured[0].batches_per_s or 1.0)
        ax.axhline(per_batch * 1e3 / step_ms, color="k", ls="--", lw=1, label=f"needed by a {step_ms:g} ms step")
    ax.set_xticks(sorted({r.num_workers for r in rows}))
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s (median of repeats)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path, ""
