"""The library's warning category and a once-per-process cache, so a condition never warns per batch. Lightning's
rank-zero utilities are imported when a message is first said: what warns (the budget's readers) loads no Lightning."""

from __future__ import annotations

import warnings


class DLTuneWarning(UserWarning):
    """Warnings from lightning-dltune (filter them with this category)."""


_seen: set[str] = set()


def warn_once(key: str, message: str, every_rank: bool = False) -> None:
    """Warn the first time ``key`` is seen in this process: on rank zero, or on ``every_rank`` for what only
    one rank saw (a worker dying there)."""
    if key in _seen:
        return
    _seen.add(key)
    if every_rank:
        warnings.warn(message, DLTuneWarning, stacklevel=2)
    else:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(message, category=DLTuneWarning)


def info_once(key: str, message: str) -> None:
    """Say ``message`` on rank zero, through Lightning's logger, the first time ``key`` is seen in this process:
    for what is not a problem but would surprise (the tuner starting more workers than cores)."""
    if key in _seen:
        return
    _seen.add(key)
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def reset_warnings() -> None:
    """Forget which warnings were given (tests, or a new ``fit``)."""
    _seen.clear()
