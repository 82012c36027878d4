"""kvd/adapters/vllm/idle.py: an idle engine step sleeps in kvd until a room ends or input
arrives (K36); no vLLM needed."""

from __future__ import annotations

import queue
import threading
from typing import Any

from kvd.adapters.vllm.idle import IdleSleeper, find_input_queue
from kvd.errors import KvdUnreachable
from kvd.protocol.rpc import PollResult


class Scheduler:
    """Stands in for vLLM's Scheduler: it knows its unfinished requests."""

    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def schedule(self, sleeper: IdleSleeper, rooms: list[int], receiving: int) -> None:
        sleeper.sleep(rooms, receiving)


class Engine:
    """Stands in for vLLM's EngineCore: it has an input queue and calls the scheduler."""

    def __init__(self, unfinished: int = 0) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.scheduler = Scheduler(unfinished)

    def step(self, sleeper: IdleSleeper, rooms: list[int], receiving: int = 0) -> None:
        self.scheduler.schedule(sleeper, rooms, receiving)


class FakeKvd:
    """Answers the sleeper's Wait: its rooms end after ``end_after`` s (None: never);
    ``interrupt`` ends a Wait in progress the way a shut-down socket does."""

    def __init__(self, end_after: float | None) -> None:
        self.end_after = end_after
        self.calls = 0
        self.interrupted = threading.Event()

    def wait(self, rooms: list[int], timeout: float, any_done: bool = False) -> PollResult:
        assert any_done
        self.calls += 1
        limit = timeout if self.end_after is None else min(self.end_after, timeout)
        if self.interrupted.wait(limit):
            raise KvdUnreachable("interrupted", "KvdUnreachable")
        ended = self.end_after is not None
        return PollResult(statuses=[4 if ended else 2] * len(rooms), releasable=list(rooms))

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        pass


def sleeper(end_after: float | None) -> tuple[IdleSleeper, FakeKvd]:
    s = IdleSleeper("/nonexistent.sock", max_sleep=30.0)
    fake = FakeKvd(end_after)
    s.connect = lambda: fake  # type: ignore[assignment, method-assign, return-value]
    return s, fake


def test_k36_the_engine_queue_is_found_from_the_calling_frames() -> None:
    engine = Engine()

    class Scheduler:
        def schedule(self) -> Any:
            return find_input_queue()

    def step(self: Engine) -> Any:
        return Scheduler().schedule()

    assert step(engine) is engine.input_queue
    assert find_input_queue() is None  # no engine above this test


def test_k36_sleeps_until_a_room_ends() -> None:
    s, fake = sleeper(end_after=0.2)
    Engine().step(s, [5, 6])
    assert fake.calls == 1 and s.sleeps == 1 and not fake.interrupted.is_set()
    assert s.slept_s < s.max_sleep


def test_k36_new_input_ends_the_sleep_and_the_wait_in_kvd() -> None:
    s, fake = sleeper(end_after=None)  # the room never ends
    engine = Engine()
    timer = threading.Timer(0.1, engine.input_queue.put, args=(("add", None),))
    timer.start()
    engine.step(s, [5])
    timer.join()
    assert not engine.input_queue.empty() and fake.interrupted.wait(5)
    assert s.slept_s < s.max_sleep


def test_k36_without_an_engine_queue_or_rooms_it_does_not_sleep() -> None:
    s, fake = sleeper(end_after=None)
    s.sleep([5])  # not called from an engine: nothing to wake it, so no sleep
    Engine().step(s, [])
    assert fake.calls == 0


def test_k36_a_request_waiting_for_something_else_is_never_delayed() -> None:
    """Two unfinished requests, one of them waiting for its KV: the other may be waiting
    for a grammar or streamed input, which wakes nobody -- no sleep."""
    s, fake = sleeper(end_after=None)
    Engine(unfinished=2).step(s, [5], receiving=1)
    assert fake.calls == 0
    s2, fake2 = sleeper(end_after=0.05)
    Engine(unfinished=1).step(s2, [5], receiving=1)  # the only one waits for kvd: sleep
    assert fake2.calls == 1
