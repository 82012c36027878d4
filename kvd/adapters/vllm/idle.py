"""Let a vLLM engine whose only work is waiting for kvd sleep (K36).

vLLM keeps stepping an engine for as long as a finished request's blocks wait for the
connector (``Scheduler.has_finished_requests``), model or not, and on CPU every step is a
round trip through the multiprocessing executor's shared-memory queues, whose readers
busy-wait (``sched_yield``) for a second after each message. A prefill whose rooms wait
for their decode therefore burns a core or more in steps that do nothing.

:class:`IdleSleeper` is called by the scheduler-side connector in ``build_connector_meta``
of a step that schedules no tokens and has nothing to hand to the workers: it blocks the
engine thread -- before any worker is involved -- until one of the rooms in flight ends
(a helper thread waits in kvd's ``Wait`` on the local rank-0 kvd), the engine gets new
input (the engine thread waits on its input queue's condition, which every ``put``
notifies), or ``max_sleep`` s passed. Nothing polls: the engine and its workers use no
CPU meanwhile, and a new request is seen at once.

It sleeps only when every unfinished request of the scheduler is one whose KV is in
flight through kvd (the prefill: none at all, only finished requests holding blocks): a
request waiting for anything else (a grammar, streamed input) is never delayed.

The engine's input queue and its scheduler are found once, by walking up the calling
frames to the objects with an ``input_queue`` that is a ``queue.Queue`` (vLLM's
``EngineCore``) and a ``get_num_unfinished_requests`` method (its ``Scheduler``). If either
is not found (another vLLM version), the sleeper does nothing and the engine steps as
before.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from types import FrameType
from typing import Any

from kvd.client import KvdClient
from kvd.errors import KvdError

#: Frames searched above ``build_connector_meta`` for the engine (it is 3 up in vLLM 0.32).
MAX_FRAMES = 12


def find_callers(max_frames: int = MAX_FRAMES) -> tuple[queue.Queue[Any] | None, Any]:
    """The ``input_queue`` of the nearest caller object that has one, and the nearest
    caller object with a ``get_num_unfinished_requests`` method (None where not found)."""
    frame: FrameType | None = sys._getframe(1)
    found_q, found_s = None, None
    for _ in range(max_frames):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None)
        if found_q is None and isinstance(q, queue.Queue):
            found_q = q
        if found_s is None and callable(getattr(owner, "get_num_unfinished_requests", None)):
            found_s = owner
        frame = frame.f_back
    return found_q, found_s


def find_input_queue(max_frames: int = MAX_FRAMES) -> queue.Queue[Any] | None:
    """The ``input_queue`` of the nearest caller object that has one, or None."""
    return find_callers(max_frames + 1)[0]


class IdleSleeper:
    """Blocks an idle engine step until a room ends or input arrives (see module doc).

    ``max_sleep`` is long on purpose: each step that does happen costs the workers a second
    of busy waiting, and every room ends by kvd's deadlines anyway (which wakes the engine).

    ``socket``: rank 0's kvd engine socket; ``expected_uid``: as :class:`KvdClient`'s.
    Times in seconds. ``sleeps`` and ``slept_s`` count what it did (for logs and tests)."""

    def __init__(self, socket: str, max_sleep: float = 60.0, rpc_timeout: float = 30.0,
                 expected_uid: int | None = None) -> None:
        self.socket, self.rpc_timeout, self.max_sleep = socket, rpc_timeout, max_sleep
        self.expected_uid = expected_uid
        self.queue: queue.Queue[Any] | None = None
        self.scheduler: Any = None
        self.searched = False
        self.sleeps, self.slept_s = 0, 0.0

    def sleep(self, rooms: list[int], waiting_on_kvd: int = 0) -> None:
        """Block until one of ``rooms`` ends in kvd (or its pages are released), new input
        arrives, or ``max_sleep`` passes. ``waiting_on_kvd``: unfinished requests that wait
        for these rooms; with any other unfinished request, or without rooms, engine queue
        or scheduler, it returns at once."""
        if not self.searched:
            (self.queue, self.scheduler), self.searched = find_callers(MAX_FRAMES + 1), True
        if not rooms or self.queue is None or self.scheduler is None:
            return
        if self.scheduler.get_num_unfinished_requests() > waiting_on_kvd:
            return
        q, woke = self.queue, threading.Event()
        client = self.connect()  # one per sleep: an interrupted one may linger a while

        def watch() -> None:  # blocks in kvd until a room ends; then wakes the engine
            try:
                client.wait(rooms, self.max_sleep, any_done=True)
            except KvdError:
                pass  # interrupted, or kvd gone: the workers' own calls report that
            finally:
                woke.set()
                with q.not_empty:
                    q.not_empty.notify_all()
                client.close()

        started = time.monotonic()
        self.sleeps += 1
        threading.Thread(target=watch, name="kvd-idle-wait", daemon=True).start()
        with q.not_empty:  # Queue.put notifies this condition; len(q.queue) under its lock
            q.not_empty.wait_for(lambda: woke.is_set() or len(q.queue) > 0, self.max_sleep)
        if not woke.is_set():  # new input: stop the Wait (if it is not connected yet, it
            client.interrupt()  # ends by itself within max_sleep; nobody waits for it)
        self.slept_s += time.monotonic() - started

    def connect(self) -> KvdClient:
        """A fresh connection to the rank-0 kvd (tests replace this)."""
        return KvdClient(self.socket, timeout=self.rpc_timeout, expected_uid=self.expected_uid)

