"""A small JSON cache of settled loader settings, keyed by what makes them valid.

The key holds the host (usable CPUs, memory), the accelerator, the dataset's class and length, the batch
size, the local world size, the limits the user set (``max_workers``, ``max_prefetch``, ``max_memory``), the
workers' start method and the library version: change any of them and the cached result no longer applies.
Under DDP it also holds the rank and the world size: every rank keeps its own entry in its node's cache (the
agreed settings, its own worker count and how far the ranks' stalls differed), so ranks on other nodes find
theirs; ranks on one node write one file, each write under a lock on it.
Each entry also stores a fingerprint of the per-sample cost (a few samples loaded in the main process); a
later run whose samples cost more than twice as much, or less than half, does not use the entry (a heavier
transform is not the same workload). Writes go through a temporary file and a rename; a corrupt or foreign
file is ignored with one warning and replaced on the next write. ``dltune cache list`` / ``dltune cache clear``
show and reset it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_dltune._warn import warn_once
from lightning_dltune.output.report import write_json_atomic
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Trial

CACHE_FORMAT = "lightning-dltune-cache"
CACHE_VERSION = 1
CACHE_ENV = "DLTUNE_CACHE"
FINGERPRINT_SAMPLES = 3
FINGERPRINT_TOLERANCE = 2.0  # a per-sample cost within a factor of 2 of the cached one is the same workload


def default_cache_path() -> Path:
    """``$DLTUNE_CACHE``, else ``$XDG_CACHE_HOME/lightning-dltune/cache.json`` (``~/.cache`` by default)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning-dltune" / "cache.json"


def cache_key(fields: dict[str, Any]) -> str:
    """A short stable hash of the key fields."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


class TuningCache:
    """Read and write settled settings at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _entries(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as ex:
            warn_once(
                f"cache-read-{self.path}", f"DataLoaderTuner: cannot read the cache {self.path} ({ex}); ignoring it."
            )
            return {}
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if (
            not isinstance(data, dict)
            or data.get("format") != CACHE_FORMAT
            or not isinstance(data.get("entries"), dict)
        ):
            warn_once(
                f"cache-bad-{self.path}",
                f"DataLoaderTuner: {self.path} is not a lightning-dltune cache (corrupt or foreign); ignoring it. "
                "It is replaced on the next write; pass `cache=False` or another path to keep it.",
            )
            return {}
        if data.get("version") != CACHE_VERSION:
            return {}
        return data["entries"]

    def entries(self) -> list[dict[str, Any]]:
        """Every valid entry, oldest first."""
        return sorted((e for e in self._entries().values() if isinstance(e, dict)), key=lambda e: e.get("saved", ""))

    def clear(self) -> int:
        """Remove the cache file; the number of entries it held."""
        with self._locked():
            count = len(self._entries())
            self.path.unlink(missing_ok=True)
        return count

    def drop(self, fields: dict[str, Any]) -> None:
        with self._locked():
            entries = self._entries()
            if entries.pop(cache_key(fields), None) is not None:
                self._write(entries)

    def get(self, fields: dict[str, Any]) -> tuple[LoaderSettings, dict[str, Any]] | None:
        """The cached settings for ``fields`` and their whole entry, or ``None``."""
        entry = self._entries().get(cache_key(fields))
        if not isinstance(entry, dict) or entry.get("fields") != json.loads(json.dumps(fields, default=str)):
            return None
        try:
            return LoaderSettings.from_dict(entry["settings"]), entry
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, fields: dict[str, Any], settings: LoaderSettings, extra: dict[str, Any] | None = None) -> None:
        with self._locked():
            entries = self._entries()
            entries[cache_key(fields)] = {
                "fields": json.loads(json.dumps(fields, default=str)),
                "settings": settings.to_loader_kwargs(),
                "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **(extra or {}),
            }
            self._write(entries)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive lock on ``<path>.lock`` around a read and its write: the ranks of one node write the same
        file at the same step. Unlocked where locks are not to be had (no ``fcntl``; a folder that cannot be written,
        whose write then warns)."""
        try:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115 (closed below)
        except (ImportError, OSError):
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _write(self, entries: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.path, {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries})
        except OSError as ex:
            warn_once(f"cache-write-{self.path}", f"DataLoaderTuner: cannot write the cache {self.path} ({ex}).")


def entry_extra(trial: Trial | None) -> dict[str, Any]:
    """What an entry stores beside the settings: the measured throughput and stall of the settled config."""
    if trial is None:
        return {}
    return {"samples_per_s": trial.stats.samples_per_s, "stall_frac": trial.stats.effective_stall_frac}


def key_fields(
    loader: Any,
    cpus: float,
    accelerator: str,
    local_world_size: int,
    limits: dict[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The key of ``loader``'s entry: what must be the same for its settled settings to apply. ``limits``: the
    tuner arguments that bound the search (a config settled under ``max_workers=1`` is not valid under 8);
    ``rank`` and ``world_size``: under DDP each rank's entry is its own."""
    import psutil

    from lightning_dltune._version import __version__

    dataset = loader.dataset
    ranks = {"rank": rank, "world_size": world_size} if world_size > 1 else {}
    return {
        **ranks,
        "limits": dict(limits or {}),
        "start_method": start_method(loader),
        "cpus": cpus,
        "memory_gib": round(psutil.virtual_memory().total / 2**30),
        "accelerator": accelerator,
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "dataset_len": len(dataset) if hasattr(dataset, "__len__") else None,
        "batch_size": getattr(loader.batch_sampler, "batch_size", None) or loader.batch_size,
        "local_world_size": local_world_size,
        "version": __version__,
    }


def accelerator_name(device: Any) -> str:
    """``cpu``, or ``cuda:<device name>``: part of the key, since a config tuned for one GPU is not another's."""
    if getattr(device, "type", None) != "cuda":
        return str(getattr(device, "type", device))
    import torch

    return "cuda:" + torch.cuda.get_device_name(device)


class RunCache:
    """One run's use of the cache: look the first loader up, remember the result.

    Args:
        option: the tuner's ``cache`` argument (``None``: the default path, ``False``: off, else a path).

    Attributes:
        own: this rank's own entry, where it has one with the settings every rank starts on (``None``: none).
    """

    def __init__(self, option: str | os.PathLike[str] | bool | None) -> None:
        self.option = None if option is True else option
        self.fields: dict[str, Any] | None = None
        self.fingerprint: float | None = None
        self.own: dict[str, Any] | None = None

    @property
    def path(self) -> Path:
        return default_cache_path() if self.option is None else Path(str(self.option))

    def lookup(
        self,
        loader: Any,
        cpus: float,
        device: Any,
        local_world_size: int,
        limits: dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> tuple[LoaderSettings, dict[str, Any]] | None:
        """The cached settings and entry for ``loader``, if its key matches and its samples cost the same."""
        if self.option is False:
            return None
        accelerator = accelerator_name(device)
        self.fields = key_fields(loader, cpus, accelerator, local_world_size, limits, rank, world_size)
        # samples are loaded in this process only where the user's loader loads them here anyway: loaded before
        # workers fork, they would open the dataset's file handles (h5py, LMDB) in the process the workers copy
        self.fingerprint = sample_cost_s(loader.dataset) if getattr(loader, "num_workers", 0) == 0 else None
        hit = TuningCache(self.path).get(self.fields)
        if hit is None or not same_cost(hit[1].get("sample_cost_s"), self.fingerprint):
            return None
        return hit

    def start(
        self, state: Any, loader: Any, cpus: float, trainer: Any, limits: dict[str, Any], agreement: Any = None
    ) -> LoaderSettings | None:
        """Start the tuning ``state`` of ``loader`` from its cached settings (``TuningState.start_from_cache``), where
        it has not begun; returns them on a hit. Under DDP every rank starts on the same config: rank zero's hit,
        where every rank's key but for its rank is the same (``agreement``'s
        :meth:`~lightning_dltune.agreement.Agreement.same_start`); :attr:`own` keeps this rank's own entry, which
        ``agreement`` is told of (:meth:`~lightning_dltune.agreement.Agreement.cached`)."""
        if not state.tuning or state.target is not None or state.trials:
            return None
        rank, world = int(getattr(trainer, "global_rank", 0)), int(getattr(trainer, "world_size", 1))
        own = self.lookup(loader, cpus, trainer.strategy.root_device, trainer.num_devices, limits, rank, world)
        hit = own if agreement is None else agreement.same_start(self.key_apart_from_rank, own)
        if hit is None or not state.start_from_cache(*hit):
            return None
        self.own = own[1] if own is not None and own[0] == hit[0] else None
        if agreement is not None:
            agreement.cached(self.own)
        return hit[0]

    def teach(self, state: Any, own: dict[str, Any] | None = None) -> None:
        """Remember what ``state`` (a ``TuningState`` whose tuning ended) settled on; ``own``: what this rank's entry
        keeps beside it under DDP (:meth:`~lightning_dltune.agreement.Agreement.cache_extra`)."""
        settings = state.cacheable()
        if settings is not None and state.loads_ahead(settings.num_workers, settings.prefetch_factor):
            own = {**(own or {}), "loads_ahead": True}  # the next run judges it at the epoch's end, as this one did
        self.remember(settings, state.final_trial(settings) if settings else None, state.memory_limit, own)

    @property
    def key_apart_from_rank(self) -> str:
        """This run's key without the rank ("" before a lookup), for ranks to compare."""
        if self.fields is None:
            return ""
        return cache_key({k: v for k, v in self.fields.items() if k != "rank"})

    def forget(self) -> None:
        """Drop this run's entry."""
        if self.option is not False and self.fields is not None:
            TuningCache(self.path).drop(self.fields)

    def remember(
        self,
        settings: LoaderSettings | None,
        trial: Trial | None,
        memory_limit: int | None = None,
        own: dict[str, Any] | None = None,
    ) -> None:
        """Teach the cache ``settings``, measured by ``trial``, and the most workers the memory budget held
        (``memory_limit``, when a config went over it); an unmeasured result (a fallback after a failure) drops the
        entry instead: it would always "verify", and the entry it replaces may be the config that failed."""
        if settings is not None and trial is None:
            self.forget()
        if self.option is False or self.fields is None or settings is None or trial is None:
            return
        extra = {**entry_extra(trial), "sample_cost_s": self.fingerprint, **(own or {})}
        if memory_limit is not None:
            extra["memory_limit_workers"] = memory_limit
        TuningCache(self.path).put(self.fields, settings, extra)


def start_method(loader: Any) -> str:
    """How the loader's workers start (``fork``, ``spawn``, ``forkserver``): it changes their start-up cost."""
    import torch.multiprocessing as mp

    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        return str(context.get_start_method())
    return str(mp.get_start_method(allow_none=True) or mp.get_context().get_start_method())


def sample_cost_s(dataset: Any, samples: int = FINGERPRINT_SAMPLES) -> float | None:
    """Median seconds to load one sample in this process, over the first few: a cheap fingerprint of the
    per-sample cost. ``None`` when the dataset has no length or cannot be indexed. The random states are kept
    as they were, so a dataset that draws random numbers does not change the run's order."""
    import numpy as np
    import torch

    try:
        count = min(samples, len(dataset))
    except TypeError:
        return None
    times = []
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            for index in range(count):
                t0 = time.perf_counter()
                dataset[index]
                times.append(time.perf_counter() - t0)
    except Exception:
        return None
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return statistics.median(times) if times else None


def same_cost(cached: Any, now: float | None) -> bool:
    """Whether two per-sample costs are the same workload (a missing one cannot tell them apart)."""
    if not isinstance(cached, (int, float)) or now is None or cached <= 0 or now <= 0:
        return True
    if max(cached, now) < 1e-3:  # samples already in memory: the ratio of two microsecond timings is noise
        return True
    ratio = now / cached
    return 1 / FINGERPRINT_TOLERANCE <= ratio <= FINGERPRINT_TOLERANCE
