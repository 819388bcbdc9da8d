"""The fork watch: a forked worker stuck in Python's after-fork code (CPython gh-112275) is stopped, and the tuner's
loader goes on from its batch on the same settings."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_dltune.switching.forkwatch import ForkWatch, forks_may_hang, stopped_by_watch, stuck, watch_forks

SCRIPT = Path(__file__).with_name("stuck_fork_script.py")


@pytest.mark.parametrize(
    ("forked", "reported", "now", "stuck_pids"),
    [
        ({1: 0.0}, set(), 9.9, []),  # not yet
        ({1: 0.0}, set(), 10.0, [1]),
        ({1: 0.0, 2: 5.0}, set(), 12.0, [1]),  # each from its own fork
        ({1: 0.0, 2: 0.0}, {2}, 30.0, [1]),  # a reported child is never stuck
        ({}, {3}, 30.0, []),
    ],
)
def test_a_child_is_stuck_once_it_has_not_reported_for_after_s(forked, reported, now, stuck_pids):
    assert stuck(forked, reported, now, after_s=10.0) == stuck_pids


@pytest.mark.parametrize(
    ("message", "ours"),
    [
        ("DataLoader worker (pid(s) 41) exited unexpectedly", True),
        ("DataLoader worker (pid 41) is killed by signal: Killed. ", True),
        ("DataLoader worker (pid(s) 41, 42) exited unexpectedly", False),  # 42 died of something else
        ("DataLoader worker (pid(s) 43) exited unexpectedly", False),
        ("CUDA error: out of memory", False),
    ],
)
def test_only_a_death_the_watch_caused_is_taken_for_a_hung_fork(message, ours, monkeypatch):
    from lightning_dltune.switching import forkwatch

    monkeypatch.setattr(forkwatch._WATCH, "killed", {41})
    assert stopped_by_watch(RuntimeError(message)) is ours
    assert forkwatch._WATCH.killed == (set() if ours else {41})  # a death is matched once


def test_the_watch_runs_where_the_python_can_hang_while_an_owner_holds_it():
    assert watch_forks((3, 12, 0)) is None
    watch = watch_forks((3, 11, 7))
    assert watch is not None and watch.running and watch.after_s == 10.0
    assert watch_forks((3, 11, 7)) is watch  # one per process, held twice
    watch.release()
    assert watch.running
    watch.release()
    assert not watch.running


_hang_next = False


def _hang_if_asked() -> None:
    if _hang_next:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a futex wait for ever, as CPython's hang is


def _fork_one(hang: bool, live_s: float = 0.0) -> int:
    global _hang_next
    _hang_next = hang
    try:
        pid = os.fork()
        if pid == 0:
            time.sleep(live_s)
            os._exit(0)
    finally:
        _hang_next = False
    return pid


def test_a_real_child_that_never_reports_is_killed_and_one_that_reports_is_not():
    os.register_at_fork(after_in_child=_hang_if_asked)  # before the watch's own: a child it holds never reports
    killed: list[int] = []
    # a short wait (the default is 10 s): the stuck child is a real one either way
    watch = ForkWatch(after_s=0.5, poll_s=0.1, on_kill=killed.append)
    assert watch.start()
    try:
        for _ in range(2):  # the looking thread ends once no child is waited for, and starts again with the next
            healthy, hung = _fork_one(hang=False, live_s=1.5), _fork_one(hang=True)
            assert hung in watch.forked
            deadline = time.monotonic() + 10
            while hung not in killed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert killed[-1] == hung and hung in watch.killed
            assert os.waitpid(hung, 0)[1] == signal.SIGKILL  # alive, in its wait, until killed
            assert os.waitpid(healthy, 0)[1] == 0  # the one that reported ran to its end
            assert watch.forked == {}
            while any(t.name == "dltune-fork-watch" for t in threading.enumerate()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(t.name == "dltune-fork-watch" for t in threading.enumerate())  # none waited for: it ended
        assert watch.killed == set(killed) and len(killed) == 2
    finally:
        watch.stop()
    assert not watch.running and _fork_one(hang=False) not in watch.forked  # stopped: no fork is watched
    os.waitpid(-1, 0)


def test_a_validation_pass_is_off_pytorchs_sigchld_handler_so_a_death_is_recovered_inside_next():
    """With PyTorch's handler, a worker killed while the main thread is elsewhere (a validation step) raises there."""
    from torch.utils.data import DataLoader

    from lightning_dltune.switching.evaluation import PassGuard
    from lightning_dltune.tools.synthetic import SyntheticDataset

    recovered: list[BaseException] = []

    def recover(error, guard):
        recovered.append(error)
        guard.inner = iter(DataLoader(SyntheticDataset(length=8), batch_size=4))
        return True

    loader = DataLoader(SyntheticDataset(length=64), batch_size=4, num_workers=1)
    guard = PassGuard(iter(loader), recover)
    next(guard)
    os.kill(guard.inner._workers[0].pid, signal.SIGKILL)
    time.sleep(1.0)  # the "validation step": a SIGCHLD handler still attached would raise here
    assert len(list(guard)) == 2 and len(recovered) == 1  # the death, raised inside next(), recovered there


def _run_script(tmp_path: Path, *args: str) -> dict:
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = process.communicate(timeout=150)
        assert process.returncode == 0, err.decode()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its workers too, should it fail
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.skipif(
    not forks_may_hang(sys.version_info), reason="this Python's forks cannot hang: nothing watches them"
)
@pytest.mark.parametrize(("where", "after_s"), [("train", 10), ("val", 2)])
def test_a_fit_whose_worker_hangs_in_its_fork_goes_on_exactly_on_the_same_settings(tmp_path, where, after_s):
    """A real hang (the script holds its first forked worker in a wait before the watch's hook runs in it): in the
    train loader's first trial, with defaults, or in the validation sanity check's loader, stopped after 2 s (the
    suite's time: the default wait is the train case's)."""
    result = _run_script(tmp_path, where, *(() if after_s == 10 else (str(after_s),)))
    assert result["epochs"] == result["drawn"] and [sorted(e) for e in result["epochs"]] == [list(range(192))] * 2
    assert result["val_passes"] == [list(range(16))] + [list(range(96))] * 2  # the sanity check's 2 batches first
    assert len(result["stopped"]) == 1
    said = "\n".join(result["warnings"])
    assert f"(pid {result['stopped'][0]}) hung in Python's after-fork code for {after_s} s" in said
    assert f"a {where} loader worker hung in its fork and was stopped; started the loader again on" in said
    assert result["failed"] == []  # the settings it ran are not taken for failed
    assert max(result["startup_s"]) < after_s / 2  # the wait for the hung worker is no window's start-up
