"""The random states that samples loaded in the training process draw from, apart from training's.

A ``RandomSampler`` without a generator draws each epoch's order from torch's global random state. A dataset whose
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

# keeps the loading states apart from the seeds the run draws from itself (`torch.initial_seed()` and simple offsets)
_APART = 0x9E3779B97F4A7C15


class LoadingRandomness:
    """Torch's CPU generator and Python's ``random``, for loading only: ``with`` it, those global states are the
    loading ones (going on from where the last ``with`` left them); after it, training's again. numpy's global state
    is left shared: no sampler draws from it, and its round trip costs about 80 us a batch (torch's about 1 us,
    Python's about 13 us).

    Args:
        seed: where the loading states start (the run's ``torch.initial_seed()``, so a seeded run repeats).
        loop: whose loader loads with them (``"train"``, ``"val"``, ...): each loop's states are its own.
    """

    def __init__(self, seed: int, loop: str = "train") -> None:
        seed = (int(seed) ^ _APART ^ zlib.crc32(loop.encode())) % 2**63
        self._torch = torch.Generator().manual_seed(seed).get_state()
        self._python = random.Random(seed).getstate()
        self._training: tuple[Any, Any] | None = None

    def __enter__(self) -> LoadingRandomness:
        self._training = (torch.get_rng_state(), random.getstate())
        torch.set_rng_state(self._torch)
        random.setstate(self._python)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._training is not None
        self._torch, self._python = torch.get_rng_state(), random.getstate()
        training, self._training = self._training, None
        torch.set_rng_state(training[0])
        random.setstate(training[1])
