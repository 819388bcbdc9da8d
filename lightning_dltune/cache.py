"""A small JSON cache of settled loader settings, keyed by what makes them valid.

The key holds the host (usable CPUs, memory), the accelerator, the dataset's class and length, the batch
size, the local world size and the library version: change any of them and the cached result no longer
applies. Writes go through a temporary file and a rename; a corrupt or foreign file is ignored with one
warning and replaced on the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from lightning_dltune._warn import warn_once
from lightning_dltune.report import write_json_atomic
from lightning_dltune.settings import LoaderSettings

CACHE_FORMAT = "lightning-dltune-cache"
CACHE_VERSION = 1
CACHE_ENV = "DLTUNE_CACHE"


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
        entries = self._entries()
        entries[cache_key(fields)] = {
            "fields": json.loads(json.dumps(fields, default=str)),
            "settings": settings.to_loader_kwargs(),
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(extra or {}),
        }
        try:
            write_json_atomic(self.path, {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries})
        except OSError as ex:
            warn_once(f"cache-write-{self.path}", f"DataLoaderTuner: cannot write the cache {self.path} ({ex}).")
