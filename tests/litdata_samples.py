"""Writes the small litdata dataset of ``tests/test_loader_libraries.py`` with ``litdata.optimize``.

The test runs :func:`write` in a Python process of its own: ``litdata.optimize`` sets the global multiprocessing
start method to "spawn" (``force=True``), sets ``DATA_OPTIMIZER_NUM_WORKERS`` and leaves a helper process behind.
In the test process, every later DataLoader worker would then be spawned (seconds each on 2 cores), and the
leftover-process check would fail. :func:`make_sample` lives here, at module level, because the processes
``optimize`` spawns import it by name.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

LENGTH = 320
FEATURES = 32


def make_sample(index: int) -> dict[str, Any]:
    return {"index": index, "x": np.full(FEATURES, index, dtype=np.float32)}


def write(output_dir: str) -> None:
    import litdata

    litdata.optimize(fn=make_sample, inputs=list(range(LENGTH)), output_dir=output_dir, chunk_size=40, num_workers=1)


if __name__ == "__main__":
    write(sys.argv[1])
