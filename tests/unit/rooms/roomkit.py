"""Builders shared by the tier-1 room tests: control messages, machines, effect filters.

Everything here is pure: machines take ``now`` (seconds) as an argument and the
tests pass it explicitly; nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvd.protocol import control
from kvd.protocol.codec import pack_indices, unpack_indices
from kvd.rooms.claims import AUX as AUX_SLOT
from kvd.rooms.claims import PAGE, REGION_KINDS, STATE, WINDOW
from kvd.rooms.effects import Effect
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.sender import Limits, RankPosition, SenderRooms
from kvd.rooms.state import KVPoll, RoomFailure, Timeouts

E = TypeVar("E")

#: Short, distinct timeouts so each deadline is recognisable in a test.
TIMEOUTS = Timeouts(bootstrap=10.0, waiting=20.0, transfer=5.0, release=3.0,
                    tombstone=50.0, finished_ttl=40.0)

P0 = "tcp://p0:1"      # prefill rank endpoints
P1 = "tcp://p1:1"
D0 = "tcp://d0:1"      # decode rank endpoints
D1 = "tcp://d1:1"
BOOT = "p-boot:8998"   # the prefill instance's bootstrap address

POOL = 64              # pages in every simulated KV pool
AUX = 4                # aux slots


def pages(*idx: int) -> np.ndarray:
    """int64 page indices (what the machines take from the engine)."""
    return np.asarray(idx, dtype=np.int64)


def kv_args(is_mla: bool = False) -> control.KVArgsWire:
    return control.KVArgsWire(session_id="s", kv_data_ptrs=[0], kv_data_lens=[POOL * 16],
                              kv_item_lens=[16], aux_data_ptrs=[], aux_data_lens=[],
                              aux_item_lens=[], page_size=16, num_kv_heads=1, head_dim=8,
                              dtype_size=2, num_layers=1, is_mla=is_mla)


def register(endpoint: str = D0, instance: str = "d-a", tp_rank: int = 0,
             tp_size: int = 1) -> control.RegisterRank:
    return control.RegisterRank(instance_id=instance, endpoint=endpoint, attn_tp_rank=tp_rank,
                                attn_tp_size=tp_size, kv_args=kv_args())


def room_pages(room: int, inc: int, dst: Sequence[int] = (0, 1), endpoint: str = D0,
               instance: str = "d-a", aux_index: int = 0, within: float = 20.0,
               required: int = 1, dummy: bool = False) -> control.RoomPages:
    return control.RoomPages(room=room, inc=inc, endpoint=endpoint, instance_id=instance,
                             dst_pages=pack_indices(np.asarray(dst, dtype=np.int64)),
                             aux_index=aux_index, write_within=within,
                             required_dst_info_num=required, is_dummy=dummy)


def room_abort(room: int, inc: int, endpoint: str = D0, instance: str = "d-a",
               kind: str = "aborted", reason: str = "decode gave up") -> control.RoomAbort:
    return control.RoomAbort(room=room, inc=inc, kind=kind, reason=reason, endpoint=endpoint,
                             instance_id=instance)


def room_status(room: int, inc: int, status: KVPoll, endpoint: str = P0,
                instance: str = "p-a", kind: str = "", reason: str = "",
                quiesced: bool = True, aux: Sequence[bytes] = ()) -> control.RoomStatus:
    return control.RoomStatus(room=room, inc=inc, status=int(status), kind=kind, reason=reason,
                              endpoint=endpoint, instance_id=instance, quiesced=quiesced,
                              aux=list(aux))


def sender(tp_rank: int = 0, tp_size: int = 1, limits: Limits | None = None,
           timeouts: Timeouts = TIMEOUTS) -> SenderRooms:
    """A prefill rank whose engine registered a pool of ``POOL`` pages, ``AUX`` aux slots."""
    s = SenderRooms(timeouts, RankPosition(tp_rank=tp_rank, tp_size=tp_size), limits or Limits())
    s.num_pages, s.num_aux_slots = POOL, AUX
    return s


def registered(s: SenderRooms, now: float = 0.0, endpoint: str = D0, instance: str = "d-a",
               tp_rank: int = 0, tp_size: int = 1, rejected: RoomFailure | None = None,
               payload: Any = "plan") -> list[Effect]:
    """Register a decode rank with ``s`` (its pool: ``POOL`` pages, ``AUX`` aux slots)."""
    return s.on_register(register(endpoint, instance, tp_rank, tp_size), POOL, AUX, rejected,
                         payload, now)


def receiver(endpoint: str = D0, instance: str = "d-a", first_inc: int = 1,
             timeouts: Timeouts = TIMEOUTS, aux_sizes: tuple[int, ...] = ()) -> ReceiverRooms:
    """A decode rank whose engine registered a pool of ``POOL`` pages, ``AUX`` aux slots."""
    r = ReceiverRooms(endpoint, instance, timeouts, first_inc=first_inc)
    r.num_pages, r.num_aux_slots, r.aux_sizes = POOL, AUX, aux_sizes
    return r


def targets(*endpoints: str, instance: str = "p-a", required: int = 1) -> list[Target]:
    return [Target(ep, instance, required) for ep in endpoints or (P0,)]


def of(effects: Iterable[Effect], kind: type[E]) -> list[E]:
    """The effects of one type, in order."""
    return [e for e in effects if isinstance(e, kind)]


def one(effects: Iterable[Effect], kind: type[E]) -> E:
    found = of(effects, kind)
    assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
    return found[0]


def live_regions(m: ReceiverRooms, now: float, timeouts: Timeouts = TIMEOUTS
                 ) -> dict[str, set[int]]:
    """Every destination region (kind -> indices) named by a room of ``m`` whose pages are
    not releasable at ``now``; AssertionError when two of them name one (K42)."""
    held: dict[str, set[int]] = {kind: set() for kind in REGION_KINDS}
    for r in m.rooms.values():
        if r.dst_pages is None or r.releasable(now, timeouts):
            continue
        named = {PAGE: set(unpack_indices(r.dst_pages).tolist()), AUX_SLOT: {r.aux_index},
                 STATE: {r.state_index} - {-1},
                 WINDOW: set(unpack_indices(r.window_pages).tolist())}
        for kind, idx in named.items():
            assert not held[kind] & idx, f"live rooms share {kind} {sorted(held[kind] & idx)}"
            held[kind] |= idx
    return held
