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
                if dp == 0 and (tp, pp) != (1, 2):  # group 0 incomplete: nothing to route
                    with pytest.raises(NotReady, match="no DP group complete"):
                        t.parallel_info()
                elif dp == 1 and (tp, pp) != (1, 2):  # group 0 routable, group 1 not yet
                    assert t.parallel_info().ready_dp_groups == [0]
                    with pytest.raises(NotReady, match="DP group 1 has"):
                        t.lookup(1, 1, 2)
    info = t.parallel_info()
    assert info.ready_dp_groups == [0, 1]
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


def test_k38_one_dp_group_deregistered_leaves_the_other_routable() -> None:
    t = BootstrapTable()
    for dp in range(2):
        t.register(reg(attn_dp_size=2, attn_dp_rank=dp, rank_port=7000 + dp, instance_id="p"))
    assert t.parallel_info().ready_dp_groups == [0, 1]
    assert t.deregister(0, 1, 0, "p")
    assert t.parallel_info().ready_dp_groups == [0]
    assert t.lookup(0, 0, 0).rank_port == 7000
    with pytest.raises(NotReady, match="DP group 1 has 0/1 ranks"):
        t.lookup(0, 1, 0)
    t.register(reg(attn_dp_size=2, attn_dp_rank=1, rank_port=7101, instance_id="q"))
    assert t.parallel_info().ready_dp_groups == [0, 1]
    assert t.lookup(0, 1, 0).rank_port == 7101


def test_k38_a_missing_pp_stage_blocks_only_its_dp_group() -> None:
    """Partial membership per PP stage: DP group 1 lacks its second stage, so only rooms
    routed to group 1 (which need every stage's layers) wait; group 0 routes, and the
    answer for the missing rank names its stage and its group's count."""
    t = BootstrapTable()
    for dp in range(2):
        for pp in range(2):
            if (dp, pp) != (1, 1):
                t.register(reg(attn_dp_size=2, attn_dp_rank=dp, pp_size=2, pp_rank=pp,
                               rank_port=7000 + 10 * dp + pp, instance_id="p"))
    assert t.parallel_info().ready_dp_groups == [0]
    assert t.lookup(0, 0, 1).rank_port == 7001
    assert t.lookup(0, 1, 0).rank_port == 7010  # the stage that is there still answers
    with pytest.raises(NotReady, match=r"pp=1 not registered yet .*DP group 1 has 1/2 ranks"):
        t.lookup(0, 1, 1)
    t.register(reg(attn_dp_size=2, attn_dp_rank=1, pp_size=2, pp_rank=1, rank_port=7011,
                   instance_id="p"))
    assert t.parallel_info().ready_dp_groups == [0, 1]
