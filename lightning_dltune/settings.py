"""The loader settings the tuner chooses between, validated once, ready for ``DataLoader(**kwargs)``."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

Mode = Literal["auto", "epoch", "in_epoch"]
MODES: tuple[str, ...] = ("auto", "epoch", "in_epoch")  # `DataLoaderTuner(mode=...)`

DEFAULT_PREFETCH_FACTOR = 2


@dataclass(frozen=True, order=True)
class LoaderSettings:
    """One DataLoader configuration.

    ``prefetch_factor`` is ``None`` exactly when ``num_workers == 0`` (PyTorch rejects any other value there),
    and ``persistent_workers`` is only ``True`` with workers. Use :meth:`normalized` to get a consistent copy
    from loose input, or the constructor to get an error for inconsistent input.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)
        check_prefetch_factor(self.prefetch_factor, self.num_workers)
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError(
                "`persistent_workers=True` needs `num_workers > 0`, got `num_workers=0`. "
                "Set `persistent_workers=False` when loading in the main process."
            )

    @classmethod
    def normalized(
        cls,
        num_workers: int,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool | None = None,
    ) -> LoaderSettings:
        """Settings with the dependent fields made consistent with ``num_workers``.

        ``prefetch_factor`` becomes ``None`` for 0 workers and defaults to 2 otherwise; ``persistent_workers``
        defaults to ``True`` with workers, so that a rebuilt loader does not restart its workers every epoch.
        """
        check_num_workers(num_workers)
        if num_workers == 0:
            return cls(0, None, bool(pin_memory), False)
        pf = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
        persistent = True if persistent_workers is None else bool(persistent_workers)
        return cls(num_workers, pf, bool(pin_memory), persistent)

    def with_workers(self, num_workers: int) -> LoaderSettings:
        """The same settings with another worker count (dependent fields made consistent)."""
        return LoaderSettings.normalized(
            num_workers,
            self.prefetch_factor,
            self.pin_memory,
            True if self.num_workers == 0 else self.persistent_workers,
        )

    def with_prefetch(self, prefetch_factor: int) -> LoaderSettings:
        return replace(self, prefetch_factor=prefetch_factor)

    def only_prefetch_differs(self, other: LoaderSettings) -> bool:
        """Whether ``other`` is these settings with another ``prefetch_factor`` only (workers on both): a change the
        loader switcher makes in place, on the running workers (``_lightning.change_prefetch``)."""
        if self.num_workers == 0 or other.num_workers != self.num_workers or self == other:
            return False
        return replace(other, prefetch_factor=self.prefetch_factor) == self

    def adds_workers_to(self, other: LoaderSettings) -> bool:
        """Whether ``other`` is these settings with more workers (and perhaps another ``prefetch_factor``): a change
        the loader switcher makes on the running loader, starting only the added workers
        (``_lightning.add_workers``)."""
        if not 0 < self.num_workers < other.num_workers:
            return False
        return (self.pin_memory, self.persistent_workers) == (other.pin_memory, other.persistent_workers)

    @property
    def cost(self) -> tuple[int, int, int]:
        """Ordering key for "cheaper": fewer worker processes first, then fewer batches in flight, then no
        page-locked (pinned) memory."""
        return (self.num_workers, self.batches_in_flight, int(self.pin_memory))

    @property
    def batches_in_flight(self) -> int:
        """Batches the workers may hold at once (each worker prefetches ``prefetch_factor``): what crosses
        /dev/shm and, pinned, what page-locked memory holds."""
        return self.num_workers * (self.prefetch_factor or 0)

    def to_loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader`` (valid for 0 workers too)."""
        return asdict(self)

    def describe(self) -> str:
        text = "workers=0" if self.num_workers == 0 else f"workers={self.num_workers} prefetch={self.prefetch_factor}"
        return text + " pinned" if self.pin_memory else text

    @classmethod
    def from_loader(cls, loader: Any) -> LoaderSettings:
        """Read the settings of an existing ``DataLoader``."""
        return cls.normalized(
            int(getattr(loader, "num_workers", 0)),
            getattr(loader, "prefetch_factor", None),
            bool(getattr(loader, "pin_memory", False)),
            bool(getattr(loader, "persistent_workers", False)),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoaderSettings:
        return cls.normalized(
            int(data.get("num_workers", 0)),
            data.get("prefetch_factor"),
            bool(data.get("pin_memory", False)),
            data.get("persistent_workers"),
        )


def check_num_workers(value: Any, name: str = "num_workers") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}. Use 0 to load in the main process.")
    return value


def check_prefetch_factor(value: Any, num_workers: int, name: str = "prefetch_factor") -> int | None:
    if num_workers == 0:
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `num_workers=0`, got {value!r}. "
                "PyTorch only prefetches with worker processes; pass None."
            )
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int or None, got {value!r}. Use None when `num_workers=0`.")
    return value


def check_int(value: Any, name: str, minimum: int, fix: str = "") -> int:
    """``value`` if it is an int >= ``minimum``, else a ``ValueError`` naming ``name`` and the ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}." + (f" {fix}" if fix else ""))
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...], fix: str) -> str:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}. {fix}")
    return str(value)


def check_float(value: Any, name: str, allowed: str, ok: bool | Callable[[], bool], fix: str) -> float:
    """``value`` if it is a number and ``ok`` (a bool, or a test run only once ``value`` is known to be a
    number): else a ``TypeError``/``ValueError`` naming ``name``, the ``allowed`` values and the ``fix``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float ({allowed}), got {value!r}. {fix}")
    if not (ok() if callable(ok) else ok):
        raise ValueError(f"`{name}` must be {allowed}, got {value}. {fix}")
    return float(value)


def check_one_tuner(tuners: list[Any]) -> None:
    """A ``MisconfigurationException`` where a ``Trainer`` holds more than one ``DataLoaderTuner``: each would rebuild
    the loaders, and report a config the other one replaced."""
    if len(tuners) > 1:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        raise MisconfigurationException(
            f"`Trainer(callbacks=...)` holds {len(tuners)} DataLoaderTuner callbacks; one tunes the run's loaders. "
            "Keep one, with the arguments you want."
        )


def check_path_option(value: Any, name: str, fix: str) -> None:
    """``value`` is ``None``, a bool or a path (``str``/``os.PathLike``), else a ``TypeError`` naming ``name``."""
    if value is not None and not isinstance(value, (bool, str, os.PathLike)):
        raise TypeError(f"`{name}` must be None, a bool or a path, got {value!r}. {fix}")


def check_bool(value: Any, name: str, fix: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r}. {fix}")
    return value


MIB = 2**20


def check_tuner_arguments(
    stall_threshold: Any,
    max_trials: Any,
    max_workers: Any,
    max_prefetch: Any,
    max_memory: Any,
    min_steps: Any,
    observe_only: Any,
    tune_iterable: Any,
    mode: Any,
    window_steps: Any,
    log_gpu: Any,
    cache: Any,
    report_path: Any,
    verbose: Any,
    plot: Any,
    seamless_epochs: Any,
    eval_loops: Any = ("val", "test", "predict"),
) -> None:
    """Check ``DataLoaderTuner``'s arguments: a ``TypeError``/``ValueError`` naming the first bad one."""
    in_range = lambda: 0 < stall_threshold < 1  # noqa: E731
    check_float(stall_threshold, "stall_threshold", "in (0, 1)", in_range, "Use 0.05 to accept a 5% stall.")
    check_int(max_trials, "max_trials", 1, "Use 1 to measure without retuning.")
    if max_workers is not None:
        check_num_workers(max_workers, "max_workers")
    check_int(max_prefetch, "max_prefetch", 1, "PyTorch's default is 2.")
    if max_memory is not None:
        # between 1 and 1 MiB a value is neither a fraction nor a plausible budget in bytes: a typo, not a limit
        ok = lambda: 0 < max_memory <= 1 or MIB <= max_memory < math.inf  # noqa: E731
        allowed = "a fraction in (0, 1], or a finite number of bytes >= 1 MiB (1048576)"
        fix = "Use 0.5 for half of the available memory, 1.0 for all of it, or bytes such as 8 * 2**30."
        check_float(max_memory, "max_memory", allowed, ok, fix)
    check_int(min_steps, "min_steps", 1)
    check_bool(observe_only, "observe_only", "Use True to measure and report without rebuilding the loader.")
    if not (isinstance(tune_iterable, bool) or tune_iterable == "auto"):
        raise TypeError(
            f"`tune_iterable` must be True, False or 'auto', got {tune_iterable!r}. Use 'auto' to retune an "
            "IterableDataset's loader where its sharding by worker can be checked, True only for one that shards "
            "itself."
        )
    check_choice(mode, "mode", MODES, "Use 'auto' to switch inside long epochs only.")
    check_int(window_steps, "window_steps", 2, "The default is 20.")
    check_bool(log_gpu, "log_gpu", "Use False to skip NVML sampling.")
    check_path_option(cache, "cache", "Use None for the default cache file, a path for another, False for none.")
    check_path_option(report_path, "report_path", "Use None to write it in the logger's directory, False for none.")
    if isinstance(report_path, (str, os.PathLike)) and os.path.isdir(report_path):
        raise ValueError(
            f"`report_path` must be a file path, got the directory {str(report_path)!r}. "
            f"Use {os.path.join(str(report_path), 'dltune_report.json')!r}."
        )
    check_bool(verbose, "verbose", "Use False to print no summary.")
    check_bool(plot, "plot", "Use False to skip the PNG of the run.")
    if not (seamless_epochs is True or seamless_epochs is False or seamless_epochs == "auto"):
        raise ValueError(
            f"`seamless_epochs` must be one of ('auto', True, False), got {seamless_epochs!r}. Use 'auto' to load the "
            "next epoch's first batches ahead where its order is known, False to start every epoch afresh."
        )
    loops = ("val", "test", "predict")
    if isinstance(eval_loops, str) or not all(isinstance(x, str) and x in loops for x in _items(eval_loops)):
        raise ValueError(
            f"`eval_loops` must be a sequence of loop names from {loops}, got {eval_loops!r}. Use "
            "('val', 'test', 'predict') to tune every evaluation loader, ('val',) for validation alone, () for none."
        )


def _items(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        return [None]
