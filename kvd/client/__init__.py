"""What an engine imports to use its kvd (stdlib + numpy + msgspec; no torch needed)."""

from kvd.client.pool import ShmPool
from kvd.client.rooms import Receiver, Sender, poll_many, wait_many
from kvd.client.rpc import KvdClient
from kvd.errors import KVTransferError
from kvd.protocol.rpc import RegisterKV, ShmHandle
from kvd.rooms import UNKNOWN_ROOM, KVPoll

__all__ = ["UNKNOWN_ROOM", "KVPoll", "KVTransferError", "KvdClient", "Receiver", "RegisterKV",
           "Sender", "ShmHandle", "ShmPool", "poll_many", "wait_many"]
