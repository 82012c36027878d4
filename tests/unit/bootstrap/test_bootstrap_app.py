"""kvd.bootstrap.app: SGLang's /route API and /health over FastAPI's TestClient."""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.bootstrap.app import create_app
from kvd.bootstrap.table import BootstrapTable

PARALLEL = "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"


def rank_url(tp: int | str, dp: int | str = 0, pp: int | str = 0) -> str:
    return f"/route?engine_rank={tp}&target_dp_group={dp}&target_pp_rank={pp}"


def body(tp_rank: int = 0, tp_size: int = 2, port: int = 17000, **extra: Any) -> dict[str, Any]:
    out = {"role": "Prefill", "attn_tp_size": tp_size, "attn_tp_rank": tp_rank,
           "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
           "rank_ip": "10.1.2.3", "rank_port": port + tp_rank}
    out.update(extra)
    return out


@pytest.fixture
def table() -> BootstrapTable:
    return BootstrapTable()


@pytest.fixture
def client(table: BootstrapTable) -> TestClient:
    return TestClient(create_app(lambda: {"status": "ok", "instance_id": "i-1"}, table))


def test_health_returns_the_provided_dict() -> None:
    state = {"status": "ok", "role": "decode", "rooms": {"active": 3}}
    c = TestClient(create_app(lambda: state, None))
    r = c.get("/health")
    assert r.status_code == 200
    assert r.json() == state
    state["rooms"] = {"active": 4}  # the callable is called per request
    assert c.get("/health").json()["rooms"] == {"active": 4}


def test_no_route_api_without_table() -> None:
    c = TestClient(create_app(lambda: {"status": "ok"}, None))
    assert c.get(PARALLEL).status_code == 404
    assert c.put("/route", json=body()).status_code in (404, 405)


def test_k01_lookup_before_all_ranks_registered(client: TestClient) -> None:
    # Before any PUT the sizes are unknown: the message says "0/?" (it cannot say 0/2).
    r = client.get(PARALLEL)
    assert r.status_code == 503
    assert "0/" in r.text
    assert client.get(rank_url(0)).status_code == 503

    assert client.put("/route", json=body(0)).status_code == 200
    r = client.get(rank_url(0))
    assert r.status_code == 200
    assert r.json()["rank_ip"] == "10.1.2.3"
    assert r.json()["rank_port"] == 17000
    r = client.get(PARALLEL)
    assert r.status_code == 503
    assert "1/2" in r.text
    assert client.get(rank_url(1)).status_code == 503
    assert client.get(rank_url(9)).status_code == 404
    for bad in (rank_url("abc"), rank_url(0, "x"), rank_url(0, 0, "1.5"), "/route",
                "/route?engine_rank=0", rank_url(-2), rank_url(0, -1)):
        r = client.get(bad)
        assert r.status_code == 400, (bad, r.status_code, r.text)

    assert client.put("/route", json=body(1)).status_code == 200
    r = client.get(PARALLEL)
    assert r.status_code == 200
    info = r.json()
    assert info["prefill_attn_tp_size"] == 2
    assert info["prefill_dp_size"] == 1
    assert info["prefill_pp_size"] == 1
    assert info["instance_id"] == "i-1"  # the server's /health instance: the decode's baseline
    r = client.get(rank_url(1))
    assert r.status_code == 200 and r.json()["rank_port"] == 17001


def test_target_pp_rank_defaults_to_stage_0(client: TestClient) -> None:
    client.put("/route", json=body(0, tp_size=1, port=5000))
    r = client.get("/route?engine_rank=0&target_dp_group=0")
    assert r.status_code == 200 and r.json()["rank_port"] == 5000


def test_k02_idempotent_registration(client: TestClient, table: BootstrapTable) -> None:
    for _ in range(2):
        r = client.put("/route", json=body(0))
        assert r.status_code == 200
    assert len(table.ranks) == 1

    # same key, new port: replaces the entry (a restarted rank)
    assert client.put("/route", json=body(0, port=18000)).status_code == 200
    assert len(table.ranks) == 1
    assert client.get(rank_url(0)).json()["rank_port"] == 18000

    # different sizes: conflict
    r = client.put("/route", json=body(1, tp_size=4))
    assert r.status_code == 409
    assert len(table.ranks) == 1


@pytest.mark.parametrize("content, headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b"", {"content-type": "application/json"}),
    (b"[1, 2]", {"content-type": "application/json"}),
    (b'"Prefill"', {"content-type": "application/json"}),
    (b'{"rank_ip": "h"}', {"content-type": "application/json"}),
    (b'{"rank_port": 1}', {"content-type": "application/json"}),
    (b'{"rank_ip": "h", "rank_port": "not a port"}', {"content-type": "application/json"}),
    (b'{"rank_ip": "h", "rank_port": 1, "attn_tp_rank": 2, "attn_tp_size": 2}',
     {"content-type": "application/json"}),
    (b'{"rank_ip": "h", "rank_port": 1, "pp_rank": 1}', {"content-type": "application/json"}),
    (b'{"rank_ip": "h", "rank_port": 70000}', {"content-type": "application/json"}),
])
def test_bad_registrations_are_400(client: TestClient, table: BootstrapTable, content: bytes,
                                   headers: dict[str, str]) -> None:
    r = client.put("/route", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert table.ranks == {}
    assert table.sizes is None


def test_decode_role_refused(client: TestClient) -> None:
    assert client.put("/route", json=body(role="Decode")).status_code == 409


# --------------------------------------------------------------------------- fuzzing

@functools.cache
def fuzz_client() -> TestClient:
    """One client for every example, half registered (exercises the 200/404/503 paths)."""
    c = TestClient(create_app(lambda: {"status": "ok"}, BootstrapTable()))
    assert c.put("/route", json=body(0)).status_code == 200
    return c

PARAM_NAMES = st.sampled_from(["engine_rank", "target_dp_group", "target_pp_rank", "x", ""])
PARAM_VALUES = st.one_of(
    st.integers(-3, 3).map(str),
    st.integers(-(10**30), 10**30).map(str),
    st.text(max_size=12),
    st.sampled_from(["", "-1", "1e3", "0x1", " 1", "nan", "inf", "\u0661", "9" * 5000, "+1",
                     "1_0"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(PARAM_NAMES, PARAM_VALUES), max_size=5))
def test_random_route_queries_never_5xx(params: list[tuple[str, str]]) -> None:
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in params)
    r = fuzz_client().get("/route?" + query)
    assert r.status_code in (200, 400, 404, 503), (query, r.status_code, r.text)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=60))
def test_raw_query_strings_never_5xx(query: str) -> None:
    r = fuzz_client().get("/route?" + quote(query, safe="=&"))
    assert r.status_code in (200, 400, 404, 503), (query, r.status_code, r.text)


def test_docs_are_off_unless_asked_for() -> None:
    """/docs and /redoc load their scripts from a CDN (blank offline): off by default;
    the schema itself is always served."""
    off = TestClient(create_app(lambda: {"status": "ok"}, None))
    assert off.get("/docs").status_code == 404 and off.get("/redoc").status_code == 404
    assert "/health" in off.get("/openapi.json").json()["paths"]
    on = TestClient(create_app(lambda: {"status": "ok"}, None, docs=True))
    assert on.get("/docs").status_code == 200 and "swagger" in on.get("/docs").text.lower()
