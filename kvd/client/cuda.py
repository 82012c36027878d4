"""Engine-side export of GPU buffers as ``cuda_ipc`` handles (needs torch; imported lazily).

``cuda_ipc_handle(tensor)`` describes a CUDA tensor's bytes (or ``[addr, addr+length)``
inside it) by the CUDA IPC handle of its caching-allocator segment plus the offset
from the segment's base (legacy IPC handles name a whole ``cudaMalloc`` segment, so
the offset is kept) and the GPU's UUID (ordinals differ between processes with
different ``CUDA_VISIBLE_DEVICES``). Requires the KV pool to be allocated with
expandable segments OFF (``PYTORCH_CUDA_ALLOC_CONF`` without
``expandable_segments:True``): those segments have no legacy IPC handle.
"""

from __future__ import annotations

from typing import Any

from kvd.protocol.memory import CUDA_IPC_HANDLE_BYTES, CudaIpcHandle


def device_uuid(device: int) -> str:
    """``GPU-...`` UUID of torch CUDA device ``device`` (nvidia-smi's spelling)."""
    import torch

    raw = str(torch.cuda.get_device_properties(device).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def cuda_ipc_handle(tensor: Any, addr: int | None = None, length: int | None = None
                    ) -> CudaIpcHandle:
    """The :class:`CudaIpcHandle` of ``[addr, addr + length)`` of CUDA ``tensor`` (default:
    the tensor's own bytes). Raises ValueError for a CPU tensor or a range outside its
    storage."""
    if not getattr(tensor, "is_cuda", False):
        raise ValueError("cuda_ipc_handle needs a CUDA tensor (use ShmPool/FdPool for host "
                         "memory)")
    storage = tensor.untyped_storage()
    addr = tensor.data_ptr() if addr is None else addr
    length = tensor.numel() * tensor.element_size() if length is None else length
    if not storage.data_ptr() <= addr <= addr + length <= storage.data_ptr() + storage.nbytes():
        raise ValueError(f"range [{addr:#x}, +{length}) is outside the tensor's storage")
    device, handle, _size, storage_offset = storage._share_cuda_()[:4]
    raw = bytes(handle)
    if len(raw) != CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"unexpected CUDA IPC handle of {len(raw)} bytes (expandable "
                         f"segments on? set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
    offset = int(storage_offset) + (addr - storage.data_ptr())
    return CudaIpcHandle(handle=raw, offset=offset, length=length,
                         device_uuid=device_uuid(int(device)), device=int(device))
