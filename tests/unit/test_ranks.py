"""kvd/ranks.py: settings and engine ranks combined (issue 13: ranks come from the engine)."""

from __future__ import annotations

import pytest

from kvd.errors import RegistrationError
from kvd.protocol.rpc import EngineRanks
from kvd.ranks import Ranks, resolve

UNSET = dict.fromkeys(("attn_tp_rank", "attn_tp_size", "attn_dp_rank", "attn_dp_size",
                       "pp_rank", "pp_size"))


def test_unset_settings_take_the_engines_ranks() -> None:
    engine = EngineRanks(attn_tp_rank=3, attn_tp_size=4, attn_dp_rank=1, attn_dp_size=2,
                         pp_rank=1, pp_size=2)
    assert resolve(UNSET, engine) == Ranks(3, 4, 1, 2, 1, 2)


def test_set_settings_must_match_and_every_mismatch_is_named() -> None:
    engine = EngineRanks(attn_tp_rank=1, attn_tp_size=2)
    assert resolve({**UNSET, "attn_tp_size": 2}, engine).attn_tp_rank == 1
    with pytest.raises(RegistrationError) as err:
        resolve({**UNSET, "attn_tp_rank": 0, "attn_tp_size": 4}, engine)
    text = str(err.value)
    assert "attn_tp_rank: kvd is configured with 0, the engine says 1" in text
    assert "attn_tp_size: kvd is configured with 4, the engine says 2" in text


def test_an_engine_that_does_not_say_gets_the_settings_then_rank_0_of_1() -> None:
    assert resolve(UNSET, None) == Ranks()
    assert resolve({**UNSET, "attn_tp_rank": 1, "attn_tp_size": 2}, None) == Ranks(1, 2)
    with pytest.raises(RegistrationError, match=r"attn_tp_rank 1 outside \[0, attn_tp_size 1\)"):
        resolve({**UNSET, "attn_tp_rank": 1}, None)  # a rank whose size nobody gave


def test_describe() -> None:
    assert Ranks(1, 2).describe() == "attn_tp 1/2, attn_dp 0/1, pp 0/1"
