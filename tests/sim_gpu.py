"""A CUDA stream stand-in on a host clock, for testing the GPU timeline on machines without CUDA.

Work queued on the stream runs in order, each piece after everything queued before it; an event completes when
the stream reaches it (at once if the stream is idle). ``max_ahead_s`` models the point where the host blocks
(a full launch queue, or a sync): ``launch`` sleeps while more than that much work is queued.
"""

import math
import time


class SimStream:
    def __init__(self, clock=time.perf_counter, sleep=time.sleep, max_ahead_s: float = math.inf) -> None:
        self.clock = clock
        self.sleep = sleep
        self.max_ahead_s = max_ahead_s
        self.busy_until = -math.inf
        self.synchronized = 0

    def launch(self, seconds: float) -> None:
        now = self.clock()
        self.busy_until = max(now, self.busy_until) + seconds
        over = self.busy_until - now - self.max_ahead_s
        if over > 0:
            self.sleep(over)

    def event(self) -> "SimEvent":
        return SimEvent(self)


class SimEvent:
    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        self.at = max(self.stream.clock(), self.stream.busy_until)

    def query(self) -> bool:
        if self.at is None:
            raise RuntimeError("event was never recorded")
        return self.stream.clock() >= self.at

    def elapsed_ms(self, end: "SimEvent") -> float:
        if not (self.query() and end.query()):  # as CUDA: both must have completed
            raise RuntimeError("elapsed_ms on an event the stream has not reached")
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3

    def synchronize(self) -> None:
        self.stream.synchronized += 1
        assert self.at is not None
        wait = self.at - self.stream.clock()
        if wait > 0:
            self.stream.sleep(wait)
