"""The interface every transfer backend implements (``mooncake``, ``fake``, ...).

A backend moves bytes from this process's registered memory to a peer's
registered memory. Peers are named by an opaque address string that the
backend hands out (:attr:`TransferEngine.session_id`) and that travels on the
wire unchanged; nothing outside the backend parses it.

Backends that copy into a same-host peer's memory (``local``, ``auto``) also take
the peer's exported pool (:class:`PeerAttach`): the daemon calls
``attach_peer(address, pool)`` when a decode rank registers with an
:class:`~kvd.protocol.memory.ExportedPool`, and ``detach_peer`` when it goes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvd.protocol.memory import ExportedPool
from kvd.transfer.plan import Descriptors

#: ``(peer, batch_no, attempt) -> forced rc or None`` (fault injection, tests only).
SubmitHook = Callable[[str, int, int], int | None]


class TransferEngine(Protocol):
    """What kvd needs from a transfer backend. All methods block; sizes in bytes."""

    @property
    def session_id(self) -> str:
        """This backend's address, the opaque name peers write to."""
        ...

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        """Register ``[addr, addr+length)`` for transfers; ``device`` says where the bytes
        live (``"cpu"`` or ``"cuda:N"``, :class:`kvd.memory.Buffer`); ``stable``: host
        memory that can never shrink under kvd (:attr:`kvd.memory.Buffer.stable`, S16).
        Raises TransportError."""
        ...

    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` for the region starting at ``addr``."""
        ...

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        """Write every descriptor to ``peer_session``; returns once all bytes landed.

        Refused sub-batches are retried until ``deadline`` (``time.monotonic()``
        seconds) or the backend's own retry budget, whichever is first. Raises
        TransportError if any sub-batch still fails (its bytes may have partly landed).
        """
        ...


def submit_with_retry(submit: Callable[[int], int], budget: float, deadline: float | None,
                      backoff: float = 0.001) -> tuple[int, int]:
    """Call ``submit(attempt)`` until it returns 0 (accepted), retrying a refusal (a full
    queue answers like a dead peer) with backoff from ``backoff`` doubling up to 50 ms,
    for at most ``budget`` seconds and never past ``deadline`` (monotonic s). Returns
    ``(rc, attempts)``; rc is the last refusal's code when it gave up.
    """
    stop = time.monotonic() + budget
    if deadline is not None:
        stop = min(stop, deadline)
    delay, rc = backoff, 0
    for attempt in itertools.count():
        rc = submit(attempt)
        if rc == 0 or time.monotonic() + delay > stop:
            return rc, attempt + 1
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    raise AssertionError("unreachable")


class CancelToken:
    """Whether the room attempt a write belongs to still wants it (K43).

    The prefill side makes one per :class:`~kvd.rooms.effects.Write` (``key``: room,
    attempt) and calls :meth:`cancel` when the machine says the attempt ended
    (:class:`~kvd.rooms.effects.CancelWrites`). Whoever is about to start a part of the
    write checks :attr:`cancelled` first: the pump before each entry it submits, an
    executor lane before it hands a write to its thread and again in the thread. What is
    already in flight is never interrupted (it may still land; the write returns once
    it did). Set from the loop, read from any thread: a plain bool is enough under the
    GIL; ``callbacks`` (loop thread) run once, on :meth:`cancel`."""

    __slots__ = ("callbacks", "cancelled", "key")

    def __init__(self, key: tuple[int, int] = (0, 0)) -> None:
        self.key = key
        self.cancelled = False
        self.callbacks: list[Callable[[], object]] = []

    def cancel(self) -> None:
        """Drop every part of the write not started yet (idempotent; loop thread)."""
        self.cancelled = True
        callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            cb()

    def on_cancel(self, cb: Callable[[], object]) -> Callable[[], None]:
        """Run ``cb`` on :meth:`cancel` (at once if already cancelled); returns the undo."""
        if self.cancelled:
            cb()
            return lambda: None
        self.callbacks.append(cb)

        def undo() -> None:
            if cb in self.callbacks:
                self.callbacks.remove(cb)

        return undo


#: ``done(error)``: a started write returned (error None) or failed (a TransportError).
WriteDone = Callable[[BaseException | None], None]


@runtime_checkable
class StartWrite(Protocol):
    """Backends that write without holding a thread per write (``mooncake``, and ``auto``
    for its mooncake peers).

    ``start_write`` returns at once; ``done(error)`` is called exactly once, from any
    thread, when every byte of ``desc`` that was handed to the transport has landed or
    failed -- never while a submitted entry may still land. ``can_start(peer)`` says
    whether writes to ``peer`` go this way (AutoEngine: not for locally attached peers).
    ``cancel``: entries not submitted once it is cancelled are dropped, and ``done``
    gets a :class:`~kvd.errors.WriteCancelled` (K43).
    """

    def can_start(self, peer_session: str) -> bool: ...

    def start_write(self, peer_session: str, desc: Descriptors, deadline: float | None,
                    done: WriteDone, cancel: CancelToken | None = None) -> None: ...

    def close_writes(self, timeout: float | None = None) -> None:
        """Fail writes not started yet; wait up to ``timeout`` s for those in flight."""
        ...


@runtime_checkable
class RenewSession(Protocol):
    """Backends that cache what they learned about a peer session (``mooncake``: its
    segment descriptor, with the data port and buffers of the instance that answered).

    ``renew_session(peer)`` is called when the peer behind ``peer`` is a new instance (a
    decode restarted on the same session name): everything cached for it is dropped or
    read again, so the next write reaches the new instance (K39). Blocking; it runs off
    the loop, and writes to ``peer`` wait for it (:meth:`TransferExecutor.renew`). A
    session never written to has nothing cached: a no-op."""

    def renew_session(self, peer_session: str) -> None: ...


@runtime_checkable
class PeerAttach(Protocol):
    """Backends that can write into a same-host peer's imported memory."""

    def attach_peer(self, address: str, pool: ExportedPool | None,
                    peer_instance: str = "", peer_endpoint: str = "") -> str:
        """Import ``pool`` for peer ``address`` (daemon ``peer_instance`` at control
        endpoint ``peer_endpoint``, which its peer channel must prove: case S18); returns
        the backend that will carry its writes (``"local"`` or ``"mooncake"``). Raises
        HandleError if a ``local``-only backend cannot import it (or got no pool)."""
        ...

    def detach_peer(self, address: str) -> None:
        """Forget the peer's imported memory (after its writes returned)."""
        ...
