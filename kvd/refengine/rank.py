"""One rank of a demo's stand-in engine beside its own kvd process (the hybrid and the
speculative demo rows): the rank's pool registered over a fresh client, and one ``close``
that ends the client, the pool and the daemon."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from kvd.client import KvdClient
from kvd.launch import DaemonProcess
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
