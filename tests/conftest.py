import threading
import time

import pytest

from lightning_dltune._warn import reset_warnings

from helpers import describe, live_children


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets its own tuning cache, never the user's."""
    monkeypatch.setenv("DLTUNE_CACHE", str(tmp_path / "dltune_cache.json"))


@pytest.fixture
def lightning_log(caplog):
    """The records of Lightning's ``rank_zero_info``/``rank_zero_warn`` logger. Lightning stops that logger
    propagating to the root logger (where ``caplog`` listens) when the root had no handler at import time,
    which depends on the import order, so the capture handler is attached to Lightning's logger itself."""
    import logging

    logger = logging.getLogger("lightning.pytorch")
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    logger.propagate = False  # each record once, whichever way Lightning set it up
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fail a test that leaves worker processes or dltune threads behind."""
    reset_warnings()
    before = {p.pid for p in live_children()}
    yield
    deadline = time.monotonic() + 10
    while True:
        extra = [p for p in live_children() if p.pid not in before]
        threads = [t for t in threading.enumerate() if t.name.startswith("dltune")]
        if not extra and not threads:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"test left behind processes {[describe(p) for p in extra]} and threads {threads}")
        time.sleep(0.1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it (``scripts/gpu_check.sh`` runs them on a GPU machine)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
