"""What an engine imports to use its kvd (stdlib + numpy + msgspec; torch only for
:func:`kvd.client.cuda.cuda_ipc_handle`, imported lazily)."""

from kvd.client.pool import FdPool, ShmPool
from kvd.client.rooms import Receiver, Sender, poll_array, poll_many, wait_many
from kvd.client.rpc import KvdClient
from kvd.errors import KVTransferError
from kvd.protocol.memory import CudaIpcHandle, FdHandle, MemoryHandle, ShmHandle
from kvd.protocol.rpc import RegisterKV
from kvd.rooms import UNKNOWN_ROOM, KVPoll

__all__ = ["UNKNOWN_ROOM", "CudaIpcHandle", "FdHandle", "FdPool", "KVPoll", "KVTransferError",
           "KvdClient", "MemoryHandle", "Receiver", "RegisterKV", "Sender", "ShmHandle",
           "ShmPool", "poll_array", "poll_many", "wait_many"]
