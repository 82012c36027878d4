"""Let a vLLM engine whose only work is waiting for kvd sleep (K36).

vLLM keeps stepping an engine for as long as a finished request's blocks wait for the
connector (``Scheduler.has_finished_requests``), model or not, and on CPU every step is a
round trip through the multiprocessing executor's shared-memory queues, whose readers
busy-wait (``sched_yield``) for a second after each message. A prefill whose rooms wait
for their decode therefore burns a core or more in steps that do nothing.

:class:`IdleSleeper` is called by the scheduler-side connector in ``build_connector_meta``
of a step that schedules no tokens and has nothing to hand to the workers: it blocks the
engine thread -- before any worker is involved -- in kvd's ``Wait`` (on the local rank-0
kvd, for the rooms in flight) until one of them ends, or until the engine gets new input
(its input queue), or ``max_sleep`` s passed. Checking the input queue every ``slice_s``
s keeps a new request's extra wait that short. The workers see no step meanwhile and go
idle too.

The engine's input queue is found once, by walking up the calling frames to the object
whose ``input_queue`` is a ``queue.Queue`` (vLLM's ``EngineCore``). If it is not found
(another vLLM version), the sleeper does nothing and the engine steps as before.
"""

from __future__ import annotations

import queue
import sys
import time
from types import FrameType
from typing import Any

from kvd.client import KvdClient
from kvd.errors import KvdError

#: Frames searched above ``build_connector_meta`` for the engine (it is 3 up in vLLM 0.32).
MAX_FRAMES = 12


def find_input_queue(max_frames: int = MAX_FRAMES) -> queue.Queue[Any] | None:
    """The ``input_queue`` of the nearest caller object that has one, or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None)
        if isinstance(q, queue.Queue):
            return q
        frame = frame.f_back
    return None


class IdleSleeper:
    """Blocks an idle engine step until a room ends or input arrives (see module doc).

    ``socket``: rank 0's kvd engine socket. Times in seconds. ``sleeps`` and ``slept_s``
    count what it did (for logs and tests)."""

    def __init__(self, socket: str, slice_s: float = 0.02, max_sleep: float = 10.0,
                 rpc_timeout: float = 30.0) -> None:
        self.client = KvdClient(socket, timeout=rpc_timeout)
        self.slice_s, self.max_sleep = slice_s, max_sleep
        self.queue: queue.Queue[Any] | None = None
        self.searched = False
        self.sleeps, self.slept_s = 0, 0.0

    def sleep(self, rooms: list[int]) -> None:
        """Block until one of ``rooms`` ends in kvd (or its pages are released), new input
        arrives, or ``max_sleep`` passes. Returns at once without rooms or engine queue."""
        if not self.searched:
            self.queue, self.searched = find_input_queue(MAX_FRAMES + 1), True
        if not rooms or self.queue is None:
            return
        started = time.monotonic()
        self.sleeps += 1
        try:
            while self.queue.empty() and time.monotonic() - started < self.max_sleep:
                res = self.client.wait(rooms, self.slice_s, any_done=True)
                free = set(res.releasable)
                if any(s not in (1, 2, 3) and r in free
                       for r, s in zip(rooms, res.statuses, strict=True)):
                    return
        except KvdError:
            return  # the workers' own calls will report what is wrong
        finally:
            self.slept_s += time.monotonic() - started

    def close(self) -> None:
        self.client.close()
