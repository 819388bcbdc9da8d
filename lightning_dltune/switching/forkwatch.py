"""Stop a forked worker that hangs inside Python's own after-fork code.

On CPython before 3.10.15 and 3.11.10 (issue gh-112275), a process forked while another thread of its parent held
the runtime's thread-state lock waits for that lock for ever, before any code of its own runs. A DataLoader worker
stuck there is alive and never reads its queue: its loader waits for it for ever, and under DDP every other rank
waits with it. Nothing in the parent can free it.

:class:`ForkWatch` tells such a child from a healthy one. Around every ``os.fork`` of this process
(multiprocessing's ``fork`` start method included), ``os.register_at_fork`` hooks note the new child's pid in the
parent and, in the child, report that pid on a pipe: Python runs a child's hook only once its after-fork code is
done. A child that has not reported ``after_s`` seconds after its fork is stuck there, and is killed. Its loader then
fails as for any worker death, and the tuner goes on from the batch it reached on the same settings (see
:func:`stopped_by_watch`). Only a child in a wait (state ``S``, as one stuck on that lock is) is killed. Children
started without Python's fork hooks (``subprocess`` without ``preexec_fn``, a ``spawn`` or ``forkserver`` worker) are
not watched; a child counts only if it started at the fork (not one handed to the forking thread as it forked). Linux
only: the hooks read a thread's children from ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from lightning_dltune._warn import warn_once

__all__ = ["MAX_FORK_RESTARTS", "ForkWatch", "forks_may_hang", "stopped_by_watch", "stuck", "watch_forks"]

MAX_FORK_RESTARTS = 3  # a loader started again on the same settings after a worker hung in its fork, per run


def forks_may_hang(version: Sequence[Any]) -> bool:
    """Whether this Python (``sys.version_info``) can leave a forked process stuck in its own after-fork code, where
    another thread held the runtime's thread-state lock at the fork (CPython issue gh-112275)."""
    major, minor, micro = version[:3]
    fixed = {8: 20, 9: 20, 10: 15, 11: 10}  # the first release of each line with the fix; 3.12 had it
    return major == 3 and minor in fixed and micro < fixed[minor]


def stuck(forked: dict[int, float], reported: set[int], now: float, after_s: float) -> list[int]:
    """The pids among ``forked`` (pid: when it was forked) stuck in their after-fork code at ``now``: not
    ``reported`` past that code, and forked ``after_s`` seconds ago or more."""
    return [pid for pid, at in forked.items() if pid not in reported and now - at >= after_s]


class ForkWatch:
    """Kills the children of this process that never got past Python's after-fork code (see the module's docstring).
    It watches from :meth:`start` to :meth:`stop`, while one owner or more holds it (:meth:`acquire`, :meth:`release`).

    Args:
        after_s: how long a child may take from its fork to its report. The after-fork code runs before anything
            else in the child, in milliseconds even on a loaded host.
        poll_s: how often it looks while a child has not reported.
        clock: monotonic seconds.
        on_kill: called with each pid it killed, from the watch's thread.
    """

    def __init__(
        self,
        after_s: float = 10.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_kill: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self.after_s, self.poll_s, self.clock, self.on_kill = after_s, poll_s, clock, on_kill
        self.forked: dict[int, float] = {}  # children not yet reported: pid -> when forked
        self.killed: set[int] = set()  # pids killed, until a death is matched to them (`take_killed`)
        self._started: dict[int, int] = {}  # a watched child's start, in clock ticks since boot
        self._reported: set[int] = set()  # reports read (a child may report before its fork is recorded)
        self._pipe: tuple[int, int] | None = None
        self._owner = 0  # the process whose children are watched (a forked child inherits this object)
        self._owners = 0
        self._hooked = False
        self._before: dict[int, tuple[set[str], int]] = {}  # a forking thread's children and the time, before its fork
        self._lock = threading.Lock()
        self._looking: threading.Thread | None = None  # the thread that looks while a child is waited for
        self._stopping = threading.Event()

    @property
    def running(self) -> bool:
        return self._pipe is not None and self._owner == os.getpid()

    def acquire(self) -> bool:
        """An owner needs the watch: it starts with the first one. True where it watches (see :meth:`start`)."""
        if not self.running and not self.start():
            return False
        self._owners += 1
        return True

    def release(self) -> None:
        """An owner is done: the watch stops with the last one."""
        self._owners = max(0, self._owners - 1)
        if not self._owners:
            self.stop()

    def start(self) -> bool:
        """Watch every child forked from now on; True where it can (Linux's ``/proc/<pid>/task/<tid>/children``
        lists a thread's children). A second call does nothing. The hooks are registered once for the process's
        life (Python cannot unregister them) and do nothing while the watch is stopped; a thread looks while a child
        has not reported, and ends once none is left."""
        if self.running:
            return True
        try:
            _children()
        except OSError:
            return False
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)  # a full pipe drops a report, never blocks a child
        self.forked, self._started, self._reported, self._before = {}, {}, set(), {}
        self._stopping.clear()
        self._pipe, self._owner = (read, write), os.getpid()
        if not self._hooked:
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork, after_in_child=self._report)
            self._hooked = True
        return True

    def stop(self) -> None:
        """Stop watching; the looking thread (if any) ends before this returns."""
        if not self.running:
            return
        with self._lock:  # not in the middle of a look
            pipe, self._pipe = self._pipe, None
            thread = self._looking
        self._stopping.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        assert pipe is not None
        for fd in pipe:
            os.close(fd)
        self.forked, self._started = {}, {}

    def _before_fork(self) -> None:
        if self.running:
            self._before[threading.get_native_id()] = (_children(), _boot_ticks())

    def _after_fork(self) -> None:
        before = self._before.pop(threading.get_native_id(), None)
        if not self.running or before is None:
            return
        children, ticks = before
        at = self.clock()
        for pid in map(int, _children() - children):  # this thread's new child, started at the fork
            started = _start_ticks(pid)
            if started is not None and started >= ticks - 1:  # the kernel's start is whole ticks, rounded down
                self._started[pid] = started
                self.forked[pid] = at
        with self._lock:
            start = self._looking is None
            if start:
                self._looking = threading.Thread(target=self._run, name="dltune-fork-watch", daemon=True)
        if start:
            assert self._looking is not None
            self._looking.start()

    def _report(self) -> None:
        """In a new child, once Python's after-fork code is done: say so, and let go of the parent's pipe."""
        pipe, self._pipe = self._pipe, None
        self.forked, self._started, self._owners = {}, {}, 0
        if pipe is None:
            return
        with contextlib.suppress(OSError):  # a full pipe (the parent reads it within `poll_s`)
            os.write(pipe[1], os.getpid().to_bytes(4, "little"))
        for fd in pipe:
            os.close(fd)

    def _run(self) -> None:
        while True:
            self._stopping.wait(self.poll_s)
            if self.running and self.check():
                continue
            with self._lock:  # a child forked since the look keeps this thread looking
                if not self.forked or not self.running:
                    self._looking = None
                    return

    def check(self) -> int:
        """One look: forget the children that reported or ended, kill the stuck ones; how many are still waited for."""
        with self._lock:
            return self._look() if self.running else 0

    def _look(self) -> int:
        self._reported |= self._drain()
        for pid in list(self.forked):
            if pid in self._reported or self._state(pid) is None:
                self._forget(pid)
        now = self.clock()
        for pid in stuck(dict(self.forked), self._reported, now, self.after_s):
            if self._state(pid) != psutil.STATUS_SLEEPING:  # stopped, say (a job suspended): not stuck on a lock
                continue
            self.killed.add(pid)  # before the signal: the loader may see the death at once
            if not self._kill(pid):
                self.killed.discard(pid)
                continue
            self._forget(pid)
            self.on_kill(pid)
        self._reported = {pid for pid in self._reported if pid in self.forked or _start_ticks(pid) is not None}
        return len(self.forked)

    def take_killed(self, pids: set[int]) -> bool:
        """Whether the watch killed every one of ``pids`` (a death it caused); forgets them if so."""
        if not pids or not pids <= self.killed:
            return False
        self.killed -= pids
        return True

    def _forget(self, pid: int) -> None:
        self.forked.pop(pid, None)
        self._started.pop(pid, None)

    def _state(self, pid: int) -> str | None:
        """The process state of ``pid`` while it is still the child that was forked (``None``: it is not)."""
        try:
            process = psutil.Process(pid)
            state = process.status()
            same = process.ppid() == os.getpid() and _start_ticks(pid) == self._started.get(pid)
        except psutil.Error:
            return None
        return state if same and state != psutil.STATUS_ZOMBIE else None

    def _kill(self, pid: int) -> bool:
        """SIGKILL ``pid`` through a pidfd, checked to be the watched child after it is opened (no other process
        that took its pid can be reached)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            if self._state(pid) is None:
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _drain(self) -> set[int]:
        assert self._pipe is not None
        data = b""
        while True:
            try:
                chunk = os.read(self._pipe[0], 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return {int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) - 3, 4)}


def _children() -> set[str]:
    """The pids of the calling thread's children, as the kernel lists them."""
    with open(f"/proc/self/task/{threading.get_native_id()}/children") as f:
        return set(f.read().split())


def _boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field); ``None``: it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _say_stopped(pid: int) -> None:
    """The one message of the watch, said only where a fork did hang (the Python that can is named in it)."""
    version = ".".join(map(str, sys.version_info[:3]))
    warn_once(
        f"fork-stuck-{pid}",
        f"DataLoaderTuner: a process forked by this one (pid {pid}) hung in Python's after-fork code for "
        f"{_WATCH.after_s:g} s, a bug of Python {version} (CPython issue gh-112275, fixed in 3.10.15, 3.11.10 and "
        "3.12), and was stopped: a loader the tuner serves goes on from the batch it reached, any other fails as when "
        "a worker dies. Upgrade Python to avoid the wait.",
        every_rank=True,
    )


_WATCH = ForkWatch(on_kill=_say_stopped)


def watch_forks(version: Sequence[Any] = sys.version_info) -> ForkWatch | None:
    """Hold the process's watch where this Python (``version``) can hang in a fork and the watch can run: the watch
    (its owner calls :meth:`ForkWatch.release` when done), or ``None``."""
    if not forks_may_hang(version) or not _WATCH.acquire():
        return None
    return _WATCH


_PIDS = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\)")


def stopped_by_watch(error: BaseException) -> bool:
    """Whether ``error`` (PyTorch's "a worker died") names only workers the watch stopped for hanging in a fork."""
    found = _PIDS.search(str(error))
    if found is None:
        return False
    return _WATCH.take_killed({int(p) for p in found.group(1).split(",") if p.strip()})
