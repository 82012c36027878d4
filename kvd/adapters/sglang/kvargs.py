"""SGLang ``KVArgs`` -> kvd ``RegisterKV``. PURE (no SGLang import: duck-typed ``args``).

SGLang describes a rank's KV pool by raw pointers (``kv_data_ptrs``/``_lens``/
``_item_lens``: MHA K buffers of every local layer, then V buffers; MLA one buffer per
layer) plus aux (metadata) buffers. Every pointer must lie in a SHARED mapping of a file
(:mod:`kvd.adapters.shmmaps`): a live file under ``/dev/shm`` is named (``shm`` handle),
any other (a memfd, an unlinked file) is passed as a descriptor (``fd`` handle, given
``fds``); anonymous memory cannot be shared and is refused. ``page_size``,
``kv_head_num``, ``total_kv_head_num``, ``kv_layout`` ("nhd"/"hnd") and
``prefill_start_layer`` carry over; the element size comes from ``kv_cache_dtype_str``
and ``head_dim`` from the item length.

Not supported (refused at registration, naming what): draft KV buffers (speculative
decoding), state buffers (SGLang 0.5.2x's ``state_types`` components: ``mamba``, ``swa``,
``dsa``... each named) and device (GPU) pointers. kvd itself moves state slots, window
pages and extra paged caches (``RegisterKV.state``, ``RegisterKV.groups``,
docs/transfer.md); this adapter does not yet describe SGLang's pools in those terms:
``KVArgs`` carries no state dtype, its conv states are sliced per sub-block
(``state_conv_shard_groups``) rather than head-major, and a room's ``state_indices`` are
not passed to kvd (:mod:`kvd.adapters.sglang.conn` fails such a room).
"""

from __future__ import annotations

from typing import Any

from kvd.adapters.shmmaps import Mapping, NotSharedMemory, handle_for, handle_or_fd
from kvd.protocol.memory import MemoryHandle
from kvd.protocol.rpc import RegisterKV

DTYPE_SIZES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
               "half": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1}


class KVArgsError(ValueError):
    """SGLang KV args that kvd cannot register."""


def dtype_size(name: str | None) -> int:
    """Bytes per element of SGLang's ``kv_cache_dtype_str`` (``"bfloat16"``,
    ``"torch.float16"``, ``"fp8_e4m3"``...). KVArgsError for an unknown name."""
    key = (name or "").removeprefix("torch.").lower()
    if key not in DTYPE_SIZES:
        raise KVArgsError(f"unknown KV cache dtype {name!r}")
    return DTYPE_SIZES[key]


def _handles(ptrs: list[int], lens: list[int], maps: list[Mapping], shm_dir: str,
             what: str, fds: dict[str, int] | None) -> list[MemoryHandle]:
    try:
        if fds is None:
            return [handle_for(int(p), int(n), maps, shm_dir)
                    for p, n in zip(ptrs, lens, strict=True)]
        return [handle_or_fd(int(p), int(n), maps, fds, shm_dir)
                for p, n in zip(ptrs, lens, strict=True)]
    except NotSharedMemory as exc:
        raise KVArgsError(f"{what}: {exc}") from exc
    except ValueError as exc:
        raise KVArgsError(f"{what}: pointer and length lists differ in length") from exc


def state_kinds(args: Any) -> list[str]:
    """The kinds of the state components ``args`` registers buffers for (SGLang 0.5.2x:
    ``state_types`` beside ``state_data_ptrs``, one list of buffers per component; older
    versions: one flat list), e.g. ``["mamba", "swa"]``; ``"state"`` where no type is
    named."""
    ptrs = list(getattr(args, "state_data_ptrs", None) or [])
    types = list(getattr(args, "state_types", None) or [])
    nested = any(isinstance(p, list | tuple) for p in ptrs)
    comps = ptrs if nested else ([ptrs] if any(ptrs) else [])
    kinds = []
    for i, comp in enumerate(comps):
        if any(comp):
            t = types[i] if i < len(types) else "state"
            kinds.append(str(getattr(t, "value", t)))
    return kinds


def _unsupported(args: Any) -> list[str]:
    problems = []
    if int(getattr(args, "num_draft_entries", 0) or 0):
        problems.append("draft KV buffers (speculative decoding)")
    kinds = state_kinds(args)
    if kinds:
        problems.append(f"state buffers ({', '.join(kinds)}: Mamba/SWA/DSA pools)")
    return problems


def registration(args: Any, is_mla: bool, maps: list[Mapping],
                 shm_dir: str = "/dev/shm", fds: dict[str, int] | None = None) -> RegisterKV:
    """The :class:`RegisterKV` of SGLang ``args`` (a ``KVArgs``). Raises KVArgsError.

    ``fds`` (a dict the caller owns): memory that is a shared file mapping without a name
    under ``shm_dir`` (a memfd, an unlinked file) is passed as a descriptor, opened into
    ``fds``; the caller keeps them open while kvd uses the memory. None: names only."""
    problems = _unsupported(args)
    if problems:
        raise KVArgsError("the SGLang adapter cannot register " + " and ".join(problems) +
                          " yet")
    ptrs, lens = list(args.kv_data_ptrs), list(args.kv_data_lens)
    items = [int(n) for n in args.kv_item_lens]
    per_layer = 1 if is_mla else 2
    if not ptrs or len(ptrs) % per_layer:
        raise KVArgsError(f"{len(ptrs)} KV buffers do not make whole layers "
                          f"({'MLA' if is_mla else 'MHA: K and V per layer'})")
    page_size = int(args.page_size)
    heads = 1 if is_mla else int(args.kv_head_num)
    size = dtype_size(getattr(args, "kv_cache_dtype_str", None))
    head_dim, rest = divmod(items[0], page_size * heads * size)
    if rest or head_dim < 1:
        raise KVArgsError(f"item length {items[0]} is not page_size {page_size} x {heads} "
                          f"heads x dtype {size} B x head_dim")
    layout = (getattr(args, "kv_layout", None) or "nhd").upper()
    if layout not in ("NHD", "HND"):
        raise KVArgsError(f"KV layout {layout.lower()!r} is not one kvd plans (nhd, hnd)")
    return RegisterKV(
        kv_buffers=_handles(ptrs, lens, maps, shm_dir, "KV buffer", fds), kv_item_lens=items,
        aux_buffers=_handles(list(args.aux_data_ptrs), list(args.aux_data_lens), maps, shm_dir,
                             "aux buffer", fds),
        aux_item_lens=[int(n) for n in args.aux_item_lens], page_size=page_size,
        num_kv_heads=heads, head_dim=head_dim, dtype_size=size,
        num_layers=len(ptrs) // per_layer,
        layer_start=int(getattr(args, "prefill_start_layer", 0) or 0), is_mla=is_mla,
        layout=layout,
        total_kv_heads=1 if is_mla else int(getattr(args, "total_kv_head_num", 0) or heads))
