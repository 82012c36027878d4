"""One rank of a demo's stand-in engine beside its own kvd process (the hybrid and the
speculative demo rows): the rank's pool registered over a fresh client, and one ``close``
that ends the client, the pool and the daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from kvd.client import KvdClient
from kvd.launch import DaemonProcess, start_daemon
from kvd.protocol import rpc


class Shard(Protocol):
    """A stand-in pool that knows its own registration."""

    @property
    def registration(self) -> rpc.RegisterKV: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=Shard)


class DaemonRank(Generic[S]):
    """``shard`` registered with ``daemon`` (raises what ``KvdClient.call`` raises)."""

    def __init__(self, daemon: DaemonProcess, shard: S) -> None:
        self.daemon, self.shard = daemon, shard
        self.client = KvdClient(daemon.socket)
        self.client.call(shard.registration)

    def close(self) -> int:
        """Close the client and the pool, stop the daemon; its exit code."""
        self.client.close()
        self.shard.close()
        return self.daemon.stop()


def start_ranks(ranks: list[DaemonRank[S]], work: Path, prefill_tp: int, decode_tp: int,
                shard: Callable[[str, int, int], S]) -> None:
    """Start ``prefill_tp`` prefill kvds (rank 0 serves bootstrap) then ``decode_tp``
    decode kvds in ``work`` (Mooncake TCP), each with ``shard(role, tp_rank, tp_size)``
    registered, appended to ``ranks`` as they come up (so the caller closes what started
    even when a later one fails). Raises what :func:`start_daemon` raises."""
    for tp in range(prefill_tp):
        where: dict[str, Any] = ({"serve_bootstrap": True} if tp == 0
                                 else {"bootstrap_addr": ranks[0].daemon.http_addr})
        d = start_daemon("prefill", work, attn_tp_size=prefill_tp, attn_tp_rank=tp,
                         transfer_backend="mooncake", **where)
        ranks.append(DaemonRank(d, shard("prefill", tp, prefill_tp)))
    for tp in range(decode_tp):
        d = start_daemon("decode", work, attn_tp_size=decode_tp, attn_tp_rank=tp,
                         transfer_backend="mooncake")
        ranks.append(DaemonRank(d, shard("decode", tp, decode_tp)))
