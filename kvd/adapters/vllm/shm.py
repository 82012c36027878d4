"""Place an engine's CPU KV cache in ``/dev/shm`` at allocation time, so kvd can map it.

kvd maps engine memory only from shared-memory files (:class:`~kvd.protocol.rpc.ShmHandle`),
but vLLM's CPU KV cache is one ordinary ``torch.zeros(nbytes, dtype=torch.int8)`` tensor
(``vllm.v1.worker.utils.allocate_kv_cache``) that every layer's cache is a strided VIEW of.
Copying it into shared memory after the fact would not help: the attention layers keep their
views of the old storage (bound through ``bind_kv_cache``, possibly re-viewed per kernel
block size), so either every step would need a copy or every view would need re-pointing.

vLLM has a hook for exactly this: the worker connector's ``get_mem_pool_context()`` returns
a context manager that the worker wraps around the KV cache allocation
(``Worker.initialize_from_config`` -> ``initialize_kv_cache(kv_cache_allocation_context=...)``).
:class:`ShmAllocation` is that context manager: a ``TorchFunctionMode`` that answers CPU
``torch.zeros`` / ``torch.empty`` calls of at least ``min_bytes`` with a tensor over a fresh
:class:`~kvd.client.ShmPool` file (a new file reads as zeros, so ``zeros`` needs no memset).
Every view vLLM then makes, and the attention kernels' reads and writes, land in the shared
file: nothing is copied at start-up or per request. Smaller allocations pass through.

The pools are owned by this object: :meth:`close` unlinks their files (kvd keeps its own
mapping of an unlinked file until it exits; a restarted kvd needs the file, so close only
at engine shutdown); it also runs at interpreter exit. A process killed outright cannot
clean up, so file names carry the owner's pid (``kvd-vllm-<pid>-<random>``) and each new
allocation first removes the files of owners that no longer exist.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvd.client import ShmPool
from kvd.protocol.rpc import ShmHandle

MIN_BYTES = 1 << 20
"""Smaller allocations inside the context stay ordinary process memory."""


@dataclass(frozen=True)
class Region:
    """One allocation placed in shared memory: its pool file and address range."""

    pool: ShmPool
    addr: int
    nbytes: int

    def handle(self, addr: int, length: int) -> ShmHandle:
        """The :class:`ShmHandle` of ``[addr, addr + length)``; ValueError if outside."""
        if not (self.addr <= addr and addr + length <= self.addr + self.nbytes):
            raise ValueError(f"[{addr:#x}, +{length}) is outside {self.pool.path}")
        return ShmHandle(self.pool.path, addr - self.addr, length)


def _is_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


def _numel(size: tuple[Any, ...]) -> int:
    if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size):
        size = tuple(size[0])
    return math.prod(int(s) for s in size)


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


class _Mode(TorchFunctionMode):
    def __init__(self, owner: ShmAllocation) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and self._takes(args, kwargs):
            return self.owner.allocate(_shape(args), kwargs.get("dtype"))
        return func(*args, **kwargs)

    def _takes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if not args or not _is_cpu(kwargs.get("device")) or kwargs.get("out") is not None:
            return False
        if kwargs.get("layout", torch.strided) != torch.strided:
            return False
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        itemsize = torch.empty((), dtype=dtype).element_size()
        return _numel(args) * itemsize >= self.owner.min_bytes


class ShmAllocation:
    """Context manager: CPU ``torch.zeros``/``torch.empty`` of >= ``min_bytes`` inside it
    return tensors over new ``/dev/shm`` files (one :class:`ShmPool` per allocation).

    ``regions`` lists what was placed, in order; :meth:`handle_of` turns any address
    inside them into a :class:`ShmHandle`. Re-entrant use allocates more pools.
    """

    def __init__(self, min_bytes: int = MIN_BYTES, shm_dir: str = "/dev/shm",
                 name_prefix: str = "kvd-vllm") -> None:
        self.min_bytes = min_bytes
        self.shm_dir = shm_dir
        self.name_prefix = name_prefix
        self.regions: list[Region] = []
        self._mode: _Mode | None = None
        atexit.register(self.close)

    def __enter__(self) -> ShmAllocation:
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """A zero-filled C-contiguous tensor of ``shape``/``dtype`` in a new shm file."""
        dtype = dtype or torch.get_default_dtype()
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(1, math.prod(shape) * itemsize)
        remove_stale(self.shm_dir, self.name_prefix)
        name = f"{self.name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pool = ShmPool(nbytes, name=name, shm_dir=self.shm_dir)
        raw = torch.from_numpy(pool.bytes)  # shares the mapping; keeps it alive
        tensor = raw.view(dtype).view(shape)
        self.regions.append(Region(pool, raw.data_ptr(), nbytes))
        return tensor

    def handle_of(self, addr: int, length: int) -> ShmHandle:
        """The handle of ``[addr, addr + length)``; ValueError if no region holds it."""
        for region in self.regions:
            if region.addr <= addr < region.addr + region.nbytes:
                return region.handle(addr, length)
        raise ValueError(f"address {addr:#x} is not in shared memory placed by kvd "
                         f"({len(self.regions)} regions)")

    def close(self) -> None:
        """Unlink every pool file (mappings stay valid while tensors use them)."""
        for region in self.regions:
            region.pool.close(unlink=True)
        self.regions.clear()


def remove_stale(shm_dir: str, prefix: str) -> list[str]:
    """Unlink ``<prefix>-<pid>-*`` files in ``shm_dir`` whose pid is not alive; returns them."""
    removed = []
    for path in Path(shm_dir).glob(f"{prefix}-*-*"):
        pid = path.name[len(prefix) + 1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
