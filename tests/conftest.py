import functools
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
def picture_only_where_asked(request, monkeypatch):
    """``DataLoaderTuner(plot=...)`` defaults to ``False`` in this process, except in the tests marked ``picture``:
    drawing the run's PNG takes 0.2-0.3 s a fit here (matplotlib's text layout), 42 s of the suite's 633, and
    every other test reads the tuner, its report or its logs, not the picture. The marked tests (test_view.py, the
    report path's, the demo's) and every test run in a process of its own (the docs' examples, the DDP scripts)
    draw it on the default arguments."""
    if request.node.get_closest_marker("picture") is not None:
        return
    from lightning_dltune import DataLoaderTuner

    init = DataLoaderTuner.__init__

    @functools.wraps(init)
    def without_picture(self, *args, **kwargs):
        kwargs.setdefault("plot", False)
        init(self, *args, **kwargs)

    monkeypatch.setattr(DataLoaderTuner, "__init__", without_picture)


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


def pytest_sessionstart(session):
    """``DLTUNE_RULES_FIRED=path``: record, over the session, each rule of the decision's tables that decided (a
    ``Decision`` made under its name), each reason a window was judged early or ran on, and each diagnosis, with the
    tests that fired it, and write them to ``path`` as JSON at the end (``docs/how-it-decides.md``, "What fires")."""
    import os

    if not os.environ.get("DLTUNE_RULES_FIRED"):
        return
    from helpers import count_rules_fired

    session.config._dltune_fired = (count_rules_fired(), {})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    fired = getattr(item.config, "_dltune_fired", None)
    before = None if fired is None else fired[0].copy()
    yield
    if fired is not None:
        for rule in fired[0] - before:
            fired[1].setdefault(rule, []).append(item.nodeid)


def pytest_sessionfinish(session):
    import json
    import os

    fired = getattr(session.config, "_dltune_fired", None)
    if fired is not None:
        counts, tests = fired
        with open(os.environ["DLTUNE_RULES_FIRED"], "w") as f:
            json.dump({"counts": dict(sorted(counts.items())), "tests": dict(sorted(tests.items()))}, f, indent=1)
