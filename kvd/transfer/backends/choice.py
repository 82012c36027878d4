"""Which backend carries a peer's writes: a PURE decision, and the ``auto`` composite.

:func:`choose_backend` (settings ``transfer_backend``): ``mooncake`` and ``local`` are
what they say; ``auto`` is ``local`` when the peer exported its pool, from this very
host (:func:`kvd.hostid.same_host`), and every buffer is of a kind this daemon can
import (``passed_fd`` always; ``cuda_ipc`` where CUDA works), else ``mooncake``. The
import itself may still fail (the peer channel refused: another user, pid namespace or
mount namespace, a wrong proof, a bad descriptor; case S18): :class:`AutoEngine` then
falls back to ``mooncake`` for that peer and logs why; ``local`` refuses the pairing.
"""

from __future__ import annotations

import logging
from typing import Literal

from kvd.errors import HandleError, RegistrationError
from kvd.hostid import same_host
from kvd.protocol.memory import ExportedPool
from kvd.transfer.backends.base import (
    CancelToken,
    RenewSession,
    StartWrite,
    TransferEngine,
    WriteDone,
)
from kvd.transfer.backends.local import LocalEngine
from kvd.transfer.plan import Descriptors

log = logging.getLogger(__name__)

Choice = Literal["local", "mooncake"]
KIND_TAGS = {"PassedFdHandle": "passed_fd", "CudaIpcHandle": "cuda_ipc"}


def choose_backend(setting: str, host_id: str, pool: ExportedPool | None,
                   importable: frozenset[str]) -> tuple[Choice, str]:
    """``(backend, why)`` for one peer. ``host_id``: this daemon's; ``pool``: the peer's
    export (None: it sent none); ``importable``: handle kinds this daemon can map.
    Raises :class:`RegistrationError` when ``setting`` is ``local`` and the peer cannot
    be served locally."""
    if setting == "mooncake":
        return "mooncake", "transfer_backend = mooncake"
    problem = _local_problem(host_id, pool, importable)
    if problem is None:
        return "local", "peer on this host with importable memory"
    if setting == "local":
        raise RegistrationError(f"transfer_backend = local, but {problem}")
    return "mooncake", problem


def _local_problem(host_id: str, pool: ExportedPool | None,
                   importable: frozenset[str]) -> str | None:
    if pool is None:
        return "the peer exported no memory"
    if not same_host(host_id, pool.host_id):
        return f"the peer is on another host ({pool.host_id or 'unknown'})"
    kinds = {KIND_TAGS.get(type(b.handle).__name__, "?") for b in pool.buffers}
    if not kinds <= importable:
        return f"this daemon cannot import {', '.join(sorted(kinds - importable))} memory"
    return None


class AutoEngine:
    """``local`` for peers attached on this host, ``mooncake`` for every other peer.

    Its address is the Mooncake engine's (peers that cannot copy locally still reach
    it); memory registers with both.
    """

    def __init__(self, mooncake: TransferEngine, local: LocalEngine,
                 importable: frozenset[str], setting: str = "auto") -> None:
        self.mooncake, self.local = mooncake, local
        self.importable, self.setting = importable, setting
        self.routes: dict[str, Choice] = {}

    @property
    def session_id(self) -> str:
        return self.mooncake.session_id

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        self.mooncake.register(addr, length, device)
        self.local.register(addr, length, device, stable)

    def unregister(self, addr: int) -> None:
        self.local.unregister(addr)
        self.mooncake.unregister(addr)

    def attach_peer(self, address: str, pool: ExportedPool | None,
                    peer_instance: str = "", peer_endpoint: str = "") -> Choice:
        choice, why = choose_backend(self.setting, self.local.host_id, pool, self.importable)
        if choice == "local" and pool is not None:
            try:
                self.local.attach_peer(address, pool, peer_instance, peer_endpoint)
            except HandleError as exc:
                if self.setting == "local":
                    raise
                choice, why = "mooncake", f"local import refused, falling back: {exc}"
        self.routes[address] = choice
        log.info("peer %s: %s backend (%s)", address, choice, why)
        return choice

    def detach_peer(self, address: str) -> None:
        self.routes.pop(address, None)
        self.local.detach_peer(address)

    def renew_session(self, peer_session: str) -> None:
        """The Mooncake engine's cache of a restarted peer (a locally attached one is
        attached anew at its registration)."""
        if isinstance(self.mooncake, RenewSession):
            self.mooncake.renew_session(peer_session)

    def can_start(self, peer_session: str) -> bool:
        """Writes to a peer that is not copied locally go through the mooncake pump."""
        return self.routes.get(peer_session) != "local" and isinstance(self.mooncake,
                                                                       StartWrite)

    def start_write(self, peer_session: str, desc: Descriptors, deadline: float | None,
                    done: WriteDone, cancel: CancelToken | None = None) -> None:
        assert isinstance(self.mooncake, StartWrite)
        self.mooncake.start_write(peer_session, desc, deadline, done, cancel)

    def close_writes(self, timeout: float | None = None) -> None:
        if isinstance(self.mooncake, StartWrite):
            self.mooncake.close_writes(timeout)

    def write(self, peer_session: str, desc: Descriptors, deadline: float | None = None) -> None:
        if self.routes.get(peer_session) == "local":
            self.local.write(peer_session, desc, deadline)
        else:
            self.mooncake.write(peer_session, desc, deadline)
