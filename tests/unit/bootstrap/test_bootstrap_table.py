"""kvd.bootstrap.table: the registry of prefill ranks (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvd.bootstrap.table import (
    BootstrapTable,
    Conflict,
    NotFound,
    NotReady,
    PrefillRegistration,
)
from kvd.errors import BootstrapError


def reg(**fields: Any) -> PrefillRegistration:
    base: dict[str, Any] = {"rank_ip": "10.0.0.1", "rank_port": 7000}
    base.update(fields)
    return PrefillRegistration(**base)


def test_errors_are_bootstrap_errors() -> None:
    for cls in (NotReady, NotFound, Conflict):
        assert issubclass(cls, BootstrapError)


def test_empty_table() -> None:
    t = BootstrapTable()
    assert t.expected is None
    with pytest.raises(NotReady, match="0/"):
        t.parallel_info()
    with pytest.raises(NotReady):
        t.lookup(0, 0, 0)


def test_registration_outcomes() -> None:
    t = BootstrapTable()
    assert t.register(reg(attn_tp_size=2)) == "registered"
    assert t.expected == 2
    assert t.register(reg(attn_tp_size=2)) == "unchanged"
    assert len(t.ranks) == 1
    assert t.register(reg(attn_tp_size=2, rank_port=7001)) == "replaced"
    assert len(t.ranks) == 1
    assert t.lookup(0, 0, 0).rank_port == 7001
    assert t.register(reg(attn_tp_size=2, rank_port=7001, instance_id="new")) == "replaced"
    assert t.lookup(0, 0, 0).instance_id == "new"


def test_full_registration_and_lookup() -> None:
    t = BootstrapTable()
    for dp in range(2):
        for tp in range(2):
            for pp in range(3):
                t.register(reg(attn_tp_size=2, attn_dp_size=2, pp_size=3, attn_tp_rank=tp,
                               attn_dp_rank=dp, pp_rank=pp, rank_port=1000 + 100 * dp
                               + 10 * tp + pp, page_size=32))
                if (dp, tp, pp) != (1, 1, 2):
                    with pytest.raises(NotReady):
                        t.parallel_info()
    info = t.parallel_info()
    assert (info.prefill_attn_tp_size, info.prefill_dp_size, info.prefill_pp_size,
            info.prefill_page_size) == (2, 2, 3, 32)
    assert t.lookup(1, 0, 2).rank_port == 1012  # (tp, dp, pp) argument order
    assert t.lookup(0, 1, 1).rank_port == 1101


def test_lookup_not_ready_and_not_found() -> None:
    t = BootstrapTable()
    t.register(reg(attn_tp_size=2))
    with pytest.raises(NotReady, match="1/2"):
        t.lookup(1, 0, 0)
    with pytest.raises(NotReady, match="1/2"):
        t.parallel_info()
    for key in ((2, 0, 0), (0, 1, 0), (0, 0, 1), (-1, 0, 0)):
        with pytest.raises(NotFound):
            t.lookup(*key)


def test_size_conflict() -> None:
    t = BootstrapTable()
    t.register(reg(attn_tp_size=2))
    with pytest.raises(Conflict, match="differ"):
        t.register(reg(attn_tp_size=4, attn_tp_rank=1))
    with pytest.raises(Conflict):
        t.register(reg(attn_tp_size=2, pp_size=2, attn_tp_rank=1))
    assert t.sizes == (2, 1, 1)
    assert len(t.ranks) == 1


def test_only_prefill_role_registers() -> None:
    t = BootstrapTable()
    with pytest.raises(Conflict, match="prefill"):
        t.register(reg(role="Decode"))
    assert t.register(reg(role="PREFILL")) == "registered"


@pytest.mark.parametrize("fields", [
    {"attn_tp_rank": 2, "attn_tp_size": 2},
    {"attn_dp_rank": 1},
    {"pp_rank": 3, "pp_size": 3},
    {"rank_port": 0},
    {"rank_port": 65536},
    {"rank_ip": ""},
    {"attn_tp_size": 0},
    {"page_size": 0},
])
def test_invalid_registration_bodies(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        reg(**fields)


def test_registration_ignores_extra_fields() -> None:
    r = reg(system_dp_rank=3, something_new="x")
    assert not hasattr(r, "something_new")
