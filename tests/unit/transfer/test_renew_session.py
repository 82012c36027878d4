"""K39: a transfer session whose peer is a new instance is renewed before the first write
to it (:meth:`TransferExecutor.renew`), and the Mooncake route to the engine's
``syncSegmentCache`` is taken only where it was checked (no engine is started)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading

import numpy as np
import pytest

from kvd.transfer.backends.mooncake import (
    SYNC_VERSIONS,
    SegmentCacheSync,
    _CxxString,
    cxx_string,
)
from kvd.transfer.executor import TransferExecutor
from kvd.transfer.plan import Descriptors


class Recording:
    """A blocking backend that records renewals and writes in order; a renewal waits for
    ``gate``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.gate = threading.Event()

    @property
    def session_id(self) -> str:
        return "me"

    def register(self, addr: int, length: int, device: str = "cpu") -> None: ...

    def unregister(self, addr: int) -> None: ...

    def renew_session(self, peer_session: str) -> None:
        assert self.gate.wait(30)
        self.events.append(("renew", peer_session))

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None
              ) -> None:
        self.events.append(("write", peer_session))


def _desc() -> Descriptors:
    one = np.array([1], dtype=np.uint64)
    return Descriptors(one, one, one)


def test_k39_a_write_after_renew_waits_for_the_renewal() -> None:
    async def main() -> list[tuple[str, str]]:
        engine = Recording()
        ex = TransferExecutor(engine)
        ex.renew("peer:1")
        write = asyncio.ensure_future(ex.write("peer:1", _desc()))
        other = asyncio.ensure_future(ex.write("peer:2", _desc()))  # not held
        await other
        for _ in range(20):
            await asyncio.sleep(0)
        assert not write.done()  # held behind the renewal
        engine.gate.set()
        await write
        ex.shutdown()
        assert ex.renewals == 1
        return engine.events

    assert asyncio.run(main()) == [("write", "peer:2"), ("renew", "peer:1"),
                                   ("write", "peer:1")]


def test_k39_renewals_of_one_session_run_in_order_and_a_failed_one_lets_writes_go() -> None:
    class Failing(Recording):
        def renew_session(self, peer_session: str) -> None:
            super().renew_session(peer_session)
            if len(self.events) == 1:
                raise OSError("peer gone")

    async def main() -> list[tuple[str, str]]:
        engine = Failing()
        engine.gate.set()
        ex = TransferExecutor(engine)
        ex.renew("peer:1")
        ex.renew("peer:1")
        await ex.write("peer:1", _desc())
        ex.shutdown()
        return engine.events

    assert asyncio.run(main()) == [("renew", "peer:1"), ("renew", "peer:1"),
                                   ("write", "peer:1")]


def test_k39_a_backend_without_a_session_cache_is_not_held() -> None:
    class Plain:
        session_id = "me"
        written: list[str] = []

        def write(self, peer_session: str, desc: Descriptors,
                  deadline: float | None = None) -> None:
            self.written.append(peer_session)

    async def main() -> list[str]:
        engine = Plain()
        ex = TransferExecutor(engine)  # type: ignore[arg-type]
        ex.renew("peer:1")
        await ex.write("peer:1", _desc())
        ex.shutdown()
        assert ex.renewals == 0
        return engine.written

    assert asyncio.run(main()) == ["peer:1"]


def test_the_hand_built_std_string_has_libstdcxx_layout() -> None:
    arg, buf = cxx_string(b"127.0.0.1:15001")
    assert ctypes.sizeof(_CxxString) == 32
    assert arg.size == arg.capacity == 15
    assert ctypes.string_at(arg.data, arg.size + 1) == b"127.0.0.1:15001\0"
    assert arg.data == ctypes.addressof(buf)


def test_k39_an_unchecked_version_falls_back_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    class Native:
        def get_engine_ptr(self) -> int:
            raise AssertionError("not reached for an unchecked version")

    with caplog.at_level(logging.WARNING):
        assert SegmentCacheSync.of(Native(), "0.3.99") is None
    assert "0.3.99 is not one kvd has checked" in caplog.text
    assert "0.3.99" not in SYNC_VERSIONS


def test_k39_a_binding_without_the_engine_pointer_falls_back(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert SegmentCacheSync.of(object(), next(iter(SYNC_VERSIONS))) is None
    assert "get_engine_ptr" in caplog.text
