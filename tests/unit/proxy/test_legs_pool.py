"""kvd proxy, pure parts: how a request splits into legs; which server takes it."""

from __future__ import annotations

import pytest

from kvd.proxy.legs import LegError, decode_body, prefill_body, transfer_params
from kvd.proxy.pool import NoServer, Pool


def test_k35_whole_request_options_are_adapted_for_the_prefill_leg() -> None:
    body = {"model": "m", "messages": [], "max_tokens": 50, "max_completion_tokens": 50,
            "min_tokens": 10, "n": 3, "best_of": 3, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7,
            "kv_transfer_params": {"junk": 1}}
    p = prefill_body(body, 42)
    assert p["max_tokens"] == p["max_completion_tokens"] == 1 and p["n"] == 1
    assert not {"min_tokens", "best_of", "stream", "stream_options"} & set(p)
    assert p["temperature"] == 0.7  # everything else passes through
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "bootstrap_room": 42,
                                       "num_samples": 3}
    assert body["n"] == 3 and body["min_tokens"] == 10  # the client's request is untouched
    d = decode_body(body, {"do_remote_prefill": True})
    assert d["max_tokens"] == 50 and d["n"] == 3 and d["min_tokens"] == 10
    assert d["kv_transfer_params"] == {"do_remote_prefill": True}
    assert "kv_transfer_params" not in decode_body(body, None)


def test_bad_n_is_named() -> None:
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(LegError, match="n must be a positive integer"):
            prefill_body({"n": bad}, 1)
    assert prefill_body({"n": None}, 1)["kv_transfer_params"]["num_samples"] == 1


def test_transfer_params_only_when_the_prefill_handed_off() -> None:
    assert transfer_params({"kv_transfer_params": {"do_remote_prefill": True}}) == {
        "do_remote_prefill": True}
    for answer in ({}, {"kv_transfer_params": None}, [], {"kv_transfer_params": {"x": 1}}):
        assert transfer_params(answer) is None


def test_least_outstanding_then_round_robin() -> None:
    pool = Pool.of("prefill", ["http://a", "http://b/", "http://c"])
    a, b, c = pool.servers
    assert b.url == "http://b"
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert pool.choose() is b
    b.outstanding = 1
    picks = {pool.choose().url for _ in range(4)}
    assert picks == {"http://b", "http://c"}  # ties share the load
    assert pool.choose(exclude={"http://b", "http://c"}) is a
    # every server tried already: a retry may go to any of them again
    assert pool.choose(exclude={"http://a", "http://b", "http://c"}) in (b, c)
    with pytest.raises(NoServer):
        Pool("prefill", []).choose()


def test_failing_servers_leave_the_choice_until_they_recover() -> None:
    pool = Pool.of("decode", ["http://a", "http://b"], max_failures=2)
    a, b = pool.servers
    pool.failed(a)
    assert a.healthy  # one failure is not enough
    pool.failed(a)
    assert not a.healthy
    assert {pool.choose().url for _ in range(4)} == {"http://b"}
    pool.failed(b)
    pool.failed(b)
    pool.failed(b)
    assert pool.choose() is a  # none healthy: the least-failed one is tried anyway
    pool.ok(a)
    assert a.healthy and a.failures == 0
