"""Copies of an object whose running parts cannot be copied (threads, locks, closures over Lightning's loops).

Lightning pickles callbacks for ``ddp_spawn`` and deep-copies them in places; ``torch.utils.data.DataLoader`` drops
its iterator from a copy in the same way. A copy here holds plain values only and builds its running parts anew.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RebuiltWhenCopied:
    """A copy (``pickle``, ``copy.deepcopy``) holds the arguments ``__init__`` was called with (see
    :meth:`_copied_from`), what :meth:`_plain_state` returns, and the attributes set after ``__init__`` (a
    subclass's); it is built by :meth:`_rebuild` from those arguments and handed the state (:meth:`_load_plain_state`).
    """

    _arguments: dict[str, Any]
    _built_by_init: frozenset[str]

    def _copied_from(self, arguments: Mapping[str, Any]) -> None:
        """Call at the end of ``__init__`` with its arguments: what a copy is built from."""
        self._arguments = dict(arguments)
        self._built_by_init = frozenset(self.__dict__) | {"_built_by_init"}

    def _rebuild(self, **arguments: Any) -> None:
        """Run this class's own ``__init__`` with ``arguments`` (a subclass's may take others)."""
        raise NotImplementedError

    def _plain_state(self) -> dict[str, Any]:
        """What a copy keeps besides its arguments: plain values only."""
        return {}

    def _load_plain_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`_plain_state` returned."""

    def __getstate__(self) -> dict[str, Any]:
        added = {k: v for k, v in self.__dict__.items() if k not in self._built_by_init}
        return {"arguments": self._arguments, "state": self._plain_state(), "added": added}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._rebuild(**state["arguments"])
        self._load_plain_state(state["state"])
        self.__dict__.update(state["added"])
