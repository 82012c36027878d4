"""The compatibility fingerprint (issue 22 item 5): every field it lists refuses a pair
that differs in it, naming the field and both values; page size and TP are not in it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import RegistrationError
from kvd.protocol import codec
from kvd.protocol.control import Compat
from kvd.transfer.compat import HASHED, check_compat, compat_problems, fingerprint

BASE = Compat(model_id="qwen2.5-0.5b", kv_dtype="bfloat16", scale_layout="none",
              layer_types="AAAA", spec_config="", wire_version=codec.VERSION, page_size=16)
OTHER = {"model_id": "llama-3-8b", "kv_dtype": "fp8_e4m3", "scale_layout": "per_tensor",
         "layer_types": "AALA", "spec_config": "eagle3:3", "wire_version": codec.VERSION - 1}


def test_i22_every_hashed_field_has_a_mismatch_case() -> None:
    assert set(OTHER) == set(HASHED)


@pytest.mark.parametrize("name", HASHED)
def test_i22_a_mismatch_in_each_field_is_refused_naming_it(name: str) -> None:
    other = msgspec.structs.replace(BASE, **{name: OTHER[name]})
    assert fingerprint(other) != fingerprint(BASE)
    with pytest.raises(RegistrationError, match=f"fingerprint mismatch .*{name} "
                       f"{getattr(BASE, name)!r} vs {OTHER[name]!r}"):
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
