"""The library's warning category and a once-per-process cache, so a condition never warns per batch."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn


class DLTuneWarning(UserWarning):
    """Warnings from lightning-dltune (filter them with this category)."""


_seen: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn on rank zero the first time ``key`` is seen in this process."""
    if key in _seen:
        return
    _seen.add(key)
    rank_zero_warn(message, category=DLTuneWarning)


def reset_warnings() -> None:
    """Forget which warnings were given (tests, or a new ``fit``)."""
    _seen.clear()
