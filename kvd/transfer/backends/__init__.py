"""Transfer backends behind one interface (:mod:`.base`), chosen by ``transfer_backend``:

``mooncake`` (:mod:`.mooncake`, the real transfer engine, the only module importing
``mooncake``), ``local`` (:mod:`.local`, same-host direct copies), ``auto``
(:mod:`.choice`: local per peer where possible, else mooncake), and ``fake``
(:mod:`.fake`, in-process copies for the in-process test tier).
"""

from __future__ import annotations

from collections.abc import Callable

from kvd.config import Settings, effective_bind_host, effective_transfer_host, parse_port_range
from kvd.config import transfer_devices as _devices
from kvd.transfer.backends.base import TransferEngine


def importable_kinds() -> frozenset[str]:
    """Peer handle kinds this process can import: ``passed_fd`` always, ``cuda_ipc`` when a
    CUDA device is usable."""
    from kvd.memory.cuda import device_count

    return frozenset({"passed_fd", "cuda_ipc"} if device_count() else {"passed_fd"})


def make_engine(s: Settings, submit_hook: Callable[[str, int, int], int | None] | None = None
                ) -> TransferEngine:
    """The backend ``s.transfer_backend`` names (raises TransportError / ConfigError)."""
    from kvd.transfer.backends.choice import AutoEngine
    from kvd.transfer.backends.local import LocalEngine

    if s.transfer_backend == "local":
        return AutoEngine(_NoMooncake(), LocalEngine(), importable_kinds(), "local")
    mc = make_mooncake(s, submit_hook)
    if s.transfer_backend == "auto":
        return AutoEngine(mc, LocalEngine(), importable_kinds(), "auto")
    return mc


def make_mooncake(s: Settings, submit_hook: Callable[[str, int, int], int | None] | None = None
                  ) -> TransferEngine:
    from kvd.transfer.backends.mooncake import MooncakeEngine, MooncakeOptions

    opts = MooncakeOptions(
        host=effective_transfer_host(s), bind_host=effective_bind_host(s),
        protocol=s.transfer_protocol, devices=_devices(s),
        port_range=parse_port_range(s.transfer_port_range) if s.transfer_port_range else None,
        handshake_front=s.transfer_handshake_front, tcp_pool=s.transfer_tcp_pool)
    return MooncakeEngine(opts, s.max_batch_entries, retry_budget=s.transient_retry_s,
                          submit_hook=submit_hook, per_peer_inflight=s.inflight_entries,
                          per_peer_bytes=s.inflight_bytes,
                          per_peer_min_entries=s.inflight_min_entries)


class _NoMooncake:
    """``transfer_backend = local``: no transfer engine; writes to a peer that is not
    attached fail with a clear reason."""

    def __init__(self) -> None:
        import os

        from kvd.hostid import host_identity

        self._address = f"local:{host_identity()}:{os.getpid()}"

    @property
    def session_id(self) -> str:
        return self._address

    def register(self, addr: int, length: int, device: str = "cpu",
                 stable: bool = False) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass

    def write(self, peer_session: str, desc: object, deadline: float | None = None) -> None:
        from kvd.errors import TransportError

        raise TransportError(f"transfer_backend = local and peer {peer_session} is not "
                             f"attached (not on this host, or its memory is not importable)")


def handshake_counts(engine: object) -> dict[str, int]:
    """Connections to the transfer engine's handshake front, by outcome (relayed, idle,
    malformed, evicted, unanswered); empty without a front (:mod:`.handshake`)."""
    front = getattr(getattr(engine, "mooncake", engine), "front", None)
    return dict(front.counts) if front is not None else {}
