"""Memory handles: how an engine (or a peer daemon) names a buffer kvd may map. PURE.

A handle is a tagged union, the tag on the wire being the field ``kind``:

=================  =========================================================================
``shm``            :class:`ShmHandle`: a file under the daemon's ``shm_dir`` (a ``/dev/shm``
                   name), opened once without following links and checked on the open
                   descriptor.
``fd``             :class:`FdHandle`: ANY file descriptor (a memfd, an open ``/dev/shm``
                   file) passed over the engine's Unix socket with ``SCM_RIGHTS``: no file
                   name travels; possession of the descriptor is the engine's proof of access.
``cuda_ipc``       :class:`CudaIpcHandle`: a CUDA IPC memory handle (``cudaIpcGetMemHandle``
                   of a ``cudaMalloc`` segment, what PyTorch's CUDA storage sharing gives)
                   plus the offset of the buffer inside that segment.
=================  =========================================================================

Every handle carries ``offset`` and ``length`` in bytes. Aux buffers use the
same union as KV buffers.

Daemon to daemon (the ``local`` transfer backend, both daemons on one host):
:class:`ExportedPool` lists a daemon's registered buffers -- their address in
the exporting daemon and a handle another process on the same host can import:
:class:`PassedFdHandle` for host memory (a region of a descriptor the exporter
passes over its authenticated peer channel: never a path, pid or descriptor number
to open, case S18) or :class:`CudaIpcHandle`. It rides in the control plane's
``RegisterRank`` message.

Bounds (case S19): every integer has a wire bound (:mod:`kvd.protocol.bounds`): offsets,
lengths, descriptor positions, device ordinals and pids are :data:`Count` (``[0, 2**63)``),
addresses :data:`Address` (u64); a pool lists at most :data:`MAX_EXPORTED_BUFFERS`
buffers. A handle or pool outside them does not decode (ProtocolError naming the field),
at the engine socket (``RegisterKV``) and on the control plane (``RegisterRank.pool``).

This module imports only :mod:`kvd.protocol.bounds`, itself a leaf, so every layer can
read these types without an import cycle.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

from kvd.protocol.bounds import Address, Count

#: Bytes of a CUDA IPC memory handle (``cudaIpcMemHandle_t``, CUDA runtime API).
CUDA_IPC_HANDLE_BYTES = 64
#: Most buffers an :class:`ExportedPool` lists: generous but finite, above every buffer one
#: rank may register (2 x ``MAX_BUFFERS`` KV and aux, ``MAX_STATE_BUFFERS`` +
#: ``MAX_WINDOW_BUFFERS`` state and window, ``MAX_GROUPS`` x ``MAX_GROUP_BUFFERS`` groups of
#: :mod:`kvd.protocol.control`: 14336 today; a unit test keeps it above their sum).
MAX_EXPORTED_BUFFERS = 1 << 14


class ShmHandle(msgspec.Struct, tag="shm", tag_field="kind", frozen=True):
    """A buffer in a shared-memory file: ``path`` under the daemon's ``shm_dir``
    (absolute, no ``..``), ``offset`` and ``length`` in bytes."""

    path: str
    offset: Count
    length: Count


class FdHandle(msgspec.Struct, tag="fd", tag_field="kind", frozen=True):
    """A buffer in a file passed with ``SCM_RIGHTS`` alongside the request.

    ``fd``: in the engine process, the descriptor number; on the wire, the
    position of that descriptor in the request's ``SCM_RIGHTS`` list
    (:func:`kvd.protocol.rpc.number_fds` rewrites one into the other).
    ``offset``/``length`` in bytes.
    """

    fd: Count
    offset: Count
    length: Count


class CudaIpcHandle(msgspec.Struct, tag="cuda_ipc", tag_field="kind", frozen=True):
    """A buffer in GPU memory: ``handle`` (64 bytes, ``cudaIpcMemHandle_t``) names a whole
    ``cudaMalloc`` segment; the buffer is ``[offset, offset + length)`` bytes of it.

    ``device_uuid`` ("GPU-xxxxxxxx-...", as ``nvidia-smi -L`` prints it) says which GPU
    holds the segment, whatever ``CUDA_VISIBLE_DEVICES`` each process has;
    ``device`` is the exporter's ordinal, kept for messages only.
    """

    handle: bytes
    offset: Count
    length: Count
    device_uuid: str
    device: Count = 0


class PassedFdHandle(msgspec.Struct, tag="passed_fd", frozen=True, tag_field="kind"):
    """Daemon to daemon on one host: ``[offset, offset + length)`` bytes of the ``file``-th
    descriptor the exporter passes over its peer channel (``SCM_RIGHTS``, case S18;
    :mod:`kvd.transfer.backends.peerchannel`). It names no path, pid or descriptor
    number: only a position in what the authenticated channel hands over."""

    file: Count
    offset: Count
    length: Count


#: What an engine may register (RegisterKV).
MemoryHandle: TypeAlias = ShmHandle | FdHandle | CudaIpcHandle

#: What a daemon may export to another daemon on its host.
PeerHandle: TypeAlias = PassedFdHandle | CudaIpcHandle


class ExportedBuffer(msgspec.Struct, frozen=True):
    """One registered buffer as a peer daemon imports it: ``address`` is the buffer's
    address in the EXPORTING daemon (the ``kv_data_ptrs``/``aux_data_ptrs`` entry peers
    plan with), ``length`` bytes, ``handle`` how to map the same memory."""

    address: Address
    length: Count
    handle: PeerHandle


class ExportedPool(msgspec.Struct, frozen=True):
    """A daemon's registered memory, for the ``local`` backend of a peer on the same host.

    ``host_id`` (:func:`kvd.hostid.host_identity`) says which host; ``channel`` is the
    NAME of the exporter's peer channel socket (joined to the importer's own
    ``peer_channel_dir``) and ``pid`` the exporting daemon's pid, which the channel's
    ``SO_PEERCRED`` must show (checked, never opened); ``buffers`` are the KV buffers then
    the aux buffers, in ``KVArgsWire`` order.
    """

    host_id: str
    buffers: Annotated[list[ExportedBuffer], msgspec.Meta(max_length=MAX_EXPORTED_BUFFERS)]
    channel: str = ""
    pid: Count = 0
