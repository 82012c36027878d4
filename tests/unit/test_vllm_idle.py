"""kvd/adapters/vllm/idle.py: an idle engine step sleeps in kvd until a room ends or input
arrives (K36); no vLLM needed."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from kvd.adapters.vllm.idle import IdleSleeper, find_input_queue
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


def sleeper(answers: list[list[int]]) -> tuple[IdleSleeper, list[float]]:
    """A sleeper whose kvd answers ``answers[i]`` (statuses) to its i-th Wait (the last one
    from then on); the returned list collects each call's time."""
    s = IdleSleeper("/nonexistent.sock", slice_s=0.01)
    calls: list[float] = []

    def wait(rooms: list[int], timeout: float, any_done: bool = False) -> PollResult:
        assert any_done
        calls.append(time.monotonic())
        time.sleep(timeout)
        statuses = answers[min(len(calls) - 1, len(answers) - 1)]
        return PollResult(statuses=statuses, releasable=list(rooms))

    s.client.wait = wait  # type: ignore[method-assign]
    return s, calls


def test_the_engine_queue_is_found_from_the_calling_frames() -> None:
    engine = Engine()

    class Scheduler:
        def schedule(self) -> Any:
            return find_input_queue()

    def step(self: Engine) -> Any:
        return Scheduler().schedule()

    assert step(engine) is engine.input_queue
    assert find_input_queue() is None  # no engine above this test


def test_sleeps_until_a_room_ends() -> None:
    s, calls = sleeper([[2, 2], [2, 2], [2, 4]])
    Engine().step(s, [5, 6])
    assert len(calls) == 3 and s.sleeps == 1


def test_new_input_ends_the_sleep() -> None:
    s, calls = sleeper([[2]])  # the room never ends
    engine = Engine()
    timer = threading.Timer(0.1, engine.input_queue.put, args=(("add", None),))
    timer.start()
    engine.step(s, [5])
    timer.join()
    assert not engine.input_queue.empty() and len(calls) >= 2
    assert s.slept_s < s.max_sleep


def test_without_an_engine_queue_or_rooms_it_does_not_sleep() -> None:
    s, calls = sleeper([[2]])
    s.sleep([5])  # not called from an engine: nothing to wake it, so no sleep
    Engine().step(s, [])
    assert not calls


def test_a_request_waiting_for_something_else_is_never_delayed() -> None:
    """Two unfinished requests, one of them waiting for its KV: the other may be waiting
    for a grammar or streamed input, which wakes nobody -- no sleep."""
    s, calls = sleeper([[2]])
    Engine(unfinished=2).step(s, [5], receiving=1)
    assert not calls
    s2, calls2 = sleeper([[2], [4]])
    Engine(unfinished=1).step(s2, [5], receiving=1)  # the only one waits for kvd: sleep
    assert len(calls2) == 2
