"""pytest plugin for scripts/lightning-suite.sh: runs Lightning's own tests with a DataLoaderTuner in every Trainer.

Loaded with ``-p lightning_suite_plugin`` (scripts/ on PYTHONPATH). It does three things:

* with ``DLTUNE_INJECT=1``, wraps ``lightning.pytorch.Trainer.__init__`` so that ``callbacks`` gets a fresh
  ``DataLoaderTuner()`` (all defaults) appended: ``callbacks=None`` becomes ``[tuner]``, a single Callback becomes
  ``[callback, tuner]``, a list or tuple gets the tuner at its end (a new list: the caller's is not changed); none
  is added where a DataLoaderTuner is already there. Without it, Trainer is left alone. With
  ``DLTUNE_INJECT_CLASS=module.Class`` another callback class (constructed without arguments) is appended instead:
  a control, to tell what any callback of that kind does to a test from what the tuner does (Lightning's own
  ``lightning.pytorch.callbacks.DeviceStatsMonitor`` logs through the logger every step, as the tuner does).
* in both modes, points ``$DLTUNE_CACHE`` at a fresh file in a temporary folder before each test, so that no
  test reads settings that another test (or an earlier run) settled.
* with ``DLTUNE_SUITE_REPORT=PATH``, writes ``{nodeid: {"outcome", "reason", "tuners"}}`` to PATH at the end of
  the session. outcome is passed, failed, error or skipped (xfailed counts as skipped); reason is the crash line
  of the failure (the exception type and the first line of its message) for failed and error, the skip reason
  for skipped; tuners, for a test that ran, is how many of its Trainers got a tuner appended (0 without injection).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from typing import Any

import pytest

_INJECT = os.environ.get("DLTUNE_INJECT") == "1"
_CLASS = os.environ.get("DLTUNE_INJECT_CLASS", "lightning_dltune.DataLoaderTuner")
_PID = os.getpid()
# the process that started the run; a pytest re-launched by a test (Lightning's subprocess launcher) is not it
_OWNER = os.environ.setdefault("DLTUNE_SUITE_OWNER", str(_PID)) == str(_PID)
_TMP = tempfile.mkdtemp(prefix="dltune-suite-cache-")
_counter = 0
# set now, before any test's environment snapshot (Lightning's conftest fails a test that adds a variable)
os.environ["DLTUNE_CACHE"] = os.path.join(_TMP, "cache-0.json")

_results: dict[str, dict[str, Any]] = {}
_injected = [0]  # tuners added so far in this process; each test's share goes into its report entry
_injected_at_setup = 0
# a teardown error after a failed call keeps the failure (its reason is the one that matters)
_RANK = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}


def _is_owner() -> bool:
    return _OWNER and os.getpid() == _PID  # not a forked worker or spawned child either


def _patch_trainer() -> None:
    import importlib

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    module, _, name = _CLASS.rpartition(".")
    injected = getattr(importlib.import_module(module), name)
    original = pl.Trainer.__init__
    if getattr(original, "_dltune_injected", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.get("callbacks")
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        else:
            callbacks = list(callbacks)
        if not any(isinstance(cb, injected) for cb in callbacks):
            callbacks.append(injected())
            _injected[0] += 1
        kwargs["callbacks"] = callbacks
        original(self, *args, **kwargs)

    __init__._dltune_injected = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if _INJECT:
        _patch_trainer()
    mode = f"with {_CLASS.rpartition('.')[2]}() injected into every Trainer" if _INJECT else "without injection"
    config.stash[_mode_key] = mode


_mode_key = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    return f"lightning-suite: {config.stash[_mode_key]}; DLTUNE_CACHE per test under {_TMP}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _counter, _injected_at_setup
    _counter += 1
    _injected_at_setup = _injected[0]
    os.environ["DLTUNE_CACHE"] = os.path.join(_TMP, f"cache-{_counter}.json")


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    # the crash line, as pytest's short summary shows it: "ExceptionType: first line of its message"
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[0].strip()[:400] if lines else ""


def _record(nodeid: str, outcome: str, reason: str) -> None:
    old = _results.get(nodeid)
    if old is None or _RANK[outcome] > _RANK[old["outcome"]]:
        _results[nodeid] = {**(old or {}), "outcome": outcome, "reason": reason}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _is_owner():
        return
    if report.when == "call":
        # pytest reports an xfailed test as skipped, an xpassed one under xfail_strict (Lightning's) as failed
        outcome = report.outcome
        _record(report.nodeid, outcome, _reason(report) if outcome != "passed" else "")
        _results[report.nodeid]["tuners"] = _injected[0] - _injected_at_setup
    elif report.failed:  # setup or teardown
        _record(report.nodeid, "error", f"[{report.when}] {_reason(report)}")
    elif report.skipped and report.when == "setup":
        _record(report.nodeid, "skipped", _reason(report))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _is_owner() and report.failed:
        _record(report.nodeid or "<collection>", "error", f"[collection] {_reason(report)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _is_owner():
        return
    path = os.environ.get("DLTUNE_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(
                {"inject": _INJECT, "exitstatus": int(exitstatus), "tests": _results}, f, indent=1, sort_keys=True
            )
    shutil.rmtree(_TMP, ignore_errors=True)
