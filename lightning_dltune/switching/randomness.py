"""The random states that samples loaded in the training process draw from, apart from training's.

A ``RandomSampler`` without a generator draws each epoch's order from the global random state. A dataset whose
``__getitem__`` draws from that state too (random augmentations) moves it by every sample loaded in the training
process, and by none loaded in a worker. Without a separate state, the next epoch's order would follow the worker
count the tuner chose, and the step it switched at. :class:`LoadingRandomness` is that separate state: samples loaded
in the training process draw from it, so a seeded run trains one order whatever the tuner chose. The augmentation
values themselves still follow the worker count, as they do in PyTorch (each worker has its own seed).
"""

from __future__ import annotations

import random
import zlib
from types import TracebackType
from typing import Any

import torch

from lightning_dltune import _imports

# keeps the loading states apart from the seeds the run draws from itself (`torch.initial_seed()` and simple offsets)
_APART = 0x9E3779B97F4A7C15


class LoadingRandomness:
    """Torch's CPU generator, Python's ``random`` and numpy's global state, for loading only: ``with`` it, those
    global states are the loading ones (and go on from where the last ``with`` left them); after it, training's again.

    Args:
        seed: where the loading states start (the run's ``torch.initial_seed()``, so a seeded run repeats).
        loop: whose loader loads with them (``"train"``, ``"val"``, ...): each loop's states are its own.
    """

    def __init__(self, seed: int, loop: str = "train") -> None:
        seed = (int(seed) ^ _APART ^ zlib.crc32(loop.encode())) % 2**63
        self._torch = torch.Generator().manual_seed(seed).get_state()
        self._python = random.Random(seed).getstate()
        self._np: Any = None
        self._numpy: Any = None
        if _imports._NUMPY_AVAILABLE:
            import numpy as np

            self._np, self._numpy = np, np.random.RandomState(seed % 2**32).get_state()
        self._training: tuple[Any, Any, Any] | None = None

    def __enter__(self) -> LoadingRandomness:
        self._training = (torch.get_rng_state(), random.getstate(), self._numpy_state())
        torch.set_rng_state(self._torch)
        random.setstate(self._python)
        self._set_numpy_state(self._numpy)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._training is not None
        self._torch, self._python, self._numpy = torch.get_rng_state(), random.getstate(), self._numpy_state()
        training, self._training = self._training, None
        torch.set_rng_state(training[0])
        random.setstate(training[1])
        self._set_numpy_state(training[2])

    def _numpy_state(self) -> Any:
        return None if self._np is None else self._np.random.get_state()

    def _set_numpy_state(self, state: Any) -> None:
        if self._np is not None:
            self._np.random.set_state(state)
