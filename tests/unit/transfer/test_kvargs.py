"""kvd.transfer.kvargs: RankArgs derivation/validation and prefill/decode compatibility."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from kvd.errors import RegistrationError
from kvd.protocol.control import MAX_AUX_BUFFERS, MAX_AUX_ITEM, KVArgsWire
from kvd.transfer.kvargs import RankArgs, check_aux_for_control, check_compatible


def wire(num_layers: int = 2, is_mla: bool = False, item: int = 256, pages: int = 10,
         base: int = 0x7F00_0000_0000, aux_slots: int = 4, aux_item: int = 64,
         **changes: Any) -> KVArgsWire:
    nbuf = num_layers * (1 if is_mla else 2)
    w = KVArgsWire(
        session_id="127.0.0.1:1234",
        kv_data_ptrs=[base + b * (item * pages + 4096) for b in range(nbuf)],
        kv_data_lens=[item * pages] * nbuf,
        kv_item_lens=[item] * nbuf,
        aux_data_ptrs=[base + 2**30],
        aux_data_lens=[aux_item * aux_slots],
        aux_item_lens=[aux_item],
        page_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype_size=2,
        num_layers=num_layers,
        is_mla=is_mla,
    )
    return msgspec.structs.replace(w, **changes)


def test_of_derives_arrays_and_counts() -> None:
    w = wire(num_layers=3, item=128, pages=7, aux_slots=5, aux_item=32)
    ra = RankArgs.of(w)
    assert ra.wire is w
    assert ra.num_pages == 7
    assert ra.num_aux_slots == 5
    assert ra.kv_ptrs.dtype == np.uint64 and ra.kv_ptrs.tolist() == w.kv_data_ptrs
    assert ra.kv_item_lens.tolist() == [128] * 6
    assert ra.aux_ptrs.tolist() == w.aux_data_ptrs
    assert ra.aux_item_lens.tolist() == [32]
    # every KV and aux buffer is a registered region
    assert sorted(zip(ra.regions.start.tolist(), ra.regions.end.tolist(), strict=True)) == sorted(
        (p, p + n) for p, n in zip(w.kv_data_ptrs + w.aux_data_ptrs,
                                   w.kv_data_lens + w.aux_data_lens, strict=True))


def test_num_pages_is_the_smallest_whole_page_count() -> None:
    w = wire(num_layers=1, item=100, pages=10)
    w = msgspec.structs.replace(w, kv_data_lens=[1000, 999], aux_data_lens=[64 * 4 + 63])
    ra = RankArgs.of(w)
    assert ra.num_pages == 9
    assert ra.num_aux_slots == 4


def test_no_aux_buffers() -> None:
    w = wire(aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[])
    ra = RankArgs.of(w)
    assert ra.num_aux_slots == 0
    assert ra.aux_ptrs.size == 0
    assert ra.num_pages == 10


def test_high_bit_pointers() -> None:
    base = 0xFFFF_8000_0000_0000
    w = wire(base=base)
    w = msgspec.structs.replace(w, aux_data_ptrs=[base + 2**40])
    ra = RankArgs.of(w)
    assert ra.kv_ptrs.dtype == np.uint64
    assert ra.kv_ptrs.tolist() == w.kv_data_ptrs
    assert ra.regions.start.tolist()[0] == base


def test_pointers_straddling_bit_63_in_one_list() -> None:
    """u64 pointers below and above 2**63 in the same list are valid KV args."""
    w = wire(num_layers=1)
    w = msgspec.structs.replace(w, kv_data_ptrs=[0x1000, 0xFFFF_0000_0000_0000])
    ra = RankArgs.of(w)
    assert ra.kv_ptrs.dtype == np.uint64
    assert ra.kv_ptrs.tolist() == [0x1000, 0xFFFF_0000_0000_0000]


@pytest.mark.parametrize("num_layers", [1, 2, 5])
def test_mha_needs_two_buffers_per_layer(num_layers: int) -> None:
    assert RankArgs.of(wire(num_layers=num_layers)).kv_ptrs.size == 2 * num_layers
    mla_shaped = wire(num_layers=num_layers, is_mla=True)
    with pytest.raises(RegistrationError, match=f"MHA needs {2 * num_layers}"):
        RankArgs.of(msgspec.structs.replace(mla_shaped, is_mla=False))


@pytest.mark.parametrize("num_layers", [1, 2, 5])
def test_mla_needs_one_buffer_per_layer(num_layers: int) -> None:
    assert RankArgs.of(wire(num_layers=num_layers, is_mla=True)).kv_ptrs.size == num_layers
    mha_shaped = wire(num_layers=num_layers)
    with pytest.raises(RegistrationError, match=f"MLA needs {num_layers}"):
        RankArgs.of(msgspec.structs.replace(mha_shaped, is_mla=True))


@pytest.mark.parametrize("field, value, message", [
    ("kv_data_lens", [2560] * 3, "kv_data_ptrs, kv_data_lens and kv_item_lens differ"),
    ("kv_item_lens", [256], "kv_data_ptrs, kv_data_lens and kv_item_lens differ"),
    ("aux_data_lens", [], "aux_data_ptrs, aux_data_lens and aux_item_lens differ"),
    ("aux_item_lens", [64, 64], "aux_data_ptrs, aux_data_lens and aux_item_lens differ"),
    ("kv_item_lens", [256, 0, 256, 256], "item lengths must be positive"),
    ("aux_item_lens", [-1], "item lengths must be positive"),
    ("kv_data_ptrs", [-1, 0, 1, 2], "must be non-negative"),
    ("page_size", 0, "page_size, dtype_size and num_layers must be >= 1"),
    ("dtype_size", 0, "page_size, dtype_size and num_layers must be >= 1"),
    ("layout", "NCHW", "unknown layout 'NCHW'"),
])
def test_inconsistent_lists_refused(field: str, value: Any, message: str) -> None:
    with pytest.raises(RegistrationError, match=message):
        RankArgs.of(wire(**{field: value}))


def test_all_problems_listed() -> None:
    with pytest.raises(RegistrationError) as exc:
        RankArgs.of(wire(kv_item_lens=[1], aux_item_lens=[0, 1], layout="X"))
    text = str(exc.value)
    for part in ("kv_data_ptrs", "aux_data_ptrs", "unknown layout"):
        assert part in text


def test_hnd_layout_accepted() -> None:
    assert RankArgs.of(wire(layout="HND")).wire.layout == "HND"


# --------------------------------------------------------------------------- check_compatible

def test_compatible_pair_passes() -> None:
    check_compatible(RankArgs.of(wire(pages=10)), RankArgs.of(wire(pages=50, base=2**40)))


@pytest.mark.parametrize("field, a, b", [
    ("page_size", 16, 64),
    ("head_dim", 64, 128),
    ("dtype_size", 2, 1),
    ("num_kv_heads", 4, 8),
    ("layout", "NHD", "HND"),
])
def test_incompatible_field_names_both_values(field: str, a: Any, b: Any) -> None:
    with pytest.raises(RegistrationError) as exc:
        check_compatible(RankArgs.of(wire(**{field: a})), RankArgs.of(wire(**{field: b})))
    assert f"{field} {a} vs {b}" in str(exc.value)


def test_layer_count_and_mla_mismatch() -> None:
    with pytest.raises(RegistrationError, match="num_layers 2 vs 3"):
        check_compatible(RankArgs.of(wire(num_layers=2)), RankArgs.of(wire(num_layers=3)))
    with pytest.raises(RegistrationError, match="is_mla False vs True"):
        check_compatible(RankArgs.of(wire(num_layers=2)),
                         RankArgs.of(wire(num_layers=2, is_mla=True)))


def test_kv_item_len_mismatch_names_both_values() -> None:
    with pytest.raises(RegistrationError, match="kv item len mismatch 256 vs 512"):
        check_compatible(RankArgs.of(wire(item=256)), RankArgs.of(wire(item=512)))


def test_kv_item_len_mismatch_in_a_later_buffer_names_the_differing_values() -> None:
    """Only buffer 3 differs (256 vs 128): the message must name those values."""
    src = wire(item=256)
    dst = wire(item=256)
    dst = msgspec.structs.replace(dst, kv_item_lens=[256, 256, 256, 128])
    with pytest.raises(RegistrationError, match="kv item len mismatch") as exc:
        check_compatible(RankArgs.of(src), RankArgs.of(dst))
    assert "128" in str(exc.value)


def test_aux_mismatches() -> None:
    with pytest.raises(RegistrationError, match="aux buffers 1 vs 0"):
        check_compatible(RankArgs.of(wire()), RankArgs.of(
            wire(aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[])))
    with pytest.raises(RegistrationError, match=r"aux item len mismatch \[64\] vs \[32\]"):
        check_compatible(RankArgs.of(wire(aux_item=64)), RankArgs.of(wire(aux_item=32)))


def test_several_mismatches_listed_together() -> None:
    with pytest.raises(RegistrationError) as exc:
        check_compatible(RankArgs.of(wire(page_size=16, head_dim=64)),
                         RankArgs.of(wire(page_size=32, head_dim=128)))
    assert "page_size 16 vs 32" in str(exc.value)
    assert "head_dim 64 vs 128" in str(exc.value)


def test_k16_aux_that_no_room_status_could_carry_is_refused_at_registration() -> None:
    """aux_transport = "control": a prefill rank whose aux item is larger than a RoomStatus
    carries (or that has more aux buffers) would send every room's final status in a frame
    no decode takes; the registration is refused naming the bound instead (K16's kind)."""
    check_aux_for_control(RankArgs.of(wire(aux_item=MAX_AUX_ITEM)))  # at the bound: fine
    with pytest.raises(RegistrationError, match=f"item is {MAX_AUX_ITEM + 8} bytes, at most "
                                                f"{MAX_AUX_ITEM}"):
        check_aux_for_control(RankArgs.of(wire(aux_item=MAX_AUX_ITEM + 8)))
    n = MAX_AUX_BUFFERS + 1
    many = wire(aux_data_ptrs=[2**30 + 4096 * i for i in range(n)], aux_data_lens=[256] * n,
                aux_item_lens=[64] * n)
    with pytest.raises(RegistrationError, match=f"{n} aux buffers, at most {MAX_AUX_BUFFERS}"):
        check_aux_for_control(RankArgs.of(many))
