"""The compatibility fingerprint (issue 22 item 5): every field it lists refuses a pair
that differs in it, naming the field and both values; page size and TP are not in it."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import RegistrationError
from kvd.protocol import codec
from kvd.protocol.control import AuxField, Compat
from kvd.protocol.rpc import RegisterKV
from kvd.transfer.compat import HASHED, aux_layout, check_compat, compat_problems, fingerprint

BASE = Compat(model_id="qwen2.5-0.5b", kv_dtype="bfloat16", scale_layout="none",
              layer_types="AAAA", spec_config="", wire_version=codec.VERSION, page_size=16)
OTHER = {"model_id": "llama-3-8b", "kv_dtype": "fp8_e4m3", "scale_layout": "per_tensor",
         "layer_types": "AALA", "spec_config": "eagle3:3",
         "aux_layout": "items 64; 0:hidden:bfloat16@0+64", "wire_version": codec.VERSION - 1}


def test_i22_every_hashed_field_has_a_mismatch_case() -> None:
    assert set(OTHER) == set(HASHED)


@pytest.mark.parametrize("name", HASHED)
def test_i22_a_mismatch_in_each_field_is_refused_naming_it(name: str) -> None:
    other = msgspec.structs.replace(BASE, **{name: OTHER[name]})
    assert fingerprint(other) != fingerprint(BASE)
    with pytest.raises(RegistrationError, match="fingerprint mismatch .*" + re.escape(
            f"{name} {getattr(BASE, name)!r} vs {OTHER[name]!r}")):
        check_compat(BASE, other)


@given(st.sets(st.sampled_from(HASHED), min_size=1))
def test_i22_every_differing_field_is_named(names: set[str]) -> None:
    other = msgspec.structs.replace(BASE, **{n: OTHER[n] for n in names})
    got = compat_problems(BASE, other)
    assert [p.split(" ")[0] for p in got] == [n for n in HASHED if n in names]


def test_i22_page_size_is_not_in_the_fingerprint() -> None:
    other = msgspec.structs.replace(BASE, page_size=64)
    assert fingerprint(other) == fingerprint(BASE)
    check_compat(BASE, other)


def test_i22_a_peer_without_a_fingerprint_is_left_to_the_kv_args_checks() -> None:
    check_compat(BASE, None)
    check_compat(None, BASE)


def _aux_call(fields: list[AuxField], items: tuple[int, ...] = (64,)) -> RegisterKV:
    return RegisterKV(kv_buffers=[], kv_item_lens=[], aux_buffers=[],
                      aux_item_lens=list(items), page_size=16, num_kv_heads=1, head_dim=8,
                      dtype_size=2, num_layers=1, aux_fields=fields)


def test_i22_typed_aux_fields_make_a_canonical_layout_and_differ_when_a_field_does() -> None:
    """Typed aux (issue 22 item 2): the named fields go into the fingerprint, so a decode
    whose aux slot holds a hidden state of another dtype or size is refused at pairing."""
    ids, hidden = AuxField("ids", "int32", 0, 4), AuxField("hidden", "float32", 4, 32)
    text = aux_layout(_aux_call([ids, hidden]))
    assert text == "items 64; 0:ids:int32@0+4; 0:hidden:float32@4+32"
    assert aux_layout(_aux_call([])) == ""
    other = aux_layout(_aux_call([ids, AuxField("hidden", "bfloat16", 4, 16)]))
    a = msgspec.structs.replace(BASE, aux_layout=text)
    b = msgspec.structs.replace(BASE, aux_layout=other)
    with pytest.raises(RegistrationError, match="aux_layout"):
        check_compat(a, b)


@pytest.mark.parametrize(("fields", "why"), [
    ([AuxField("h", "f32", 60, 8)], "outside the 64-byte aux item"),
    ([AuxField("h", "f32", 0, 0)], "outside"),
    ([AuxField("h", "f32", 0, 4, buffer=1)], "names aux buffer 1 of 1"),
    ([AuxField("a", "f32", 0, 8), AuxField("b", "f32", 4, 8)], "'a' and 'b' overlap")])
def test_i22_a_bad_aux_field_is_refused(fields: list[AuxField], why: str) -> None:
    with pytest.raises(RegistrationError, match=why):
        aux_layout(_aux_call(fields))

