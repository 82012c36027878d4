"""kvd.addr: host:port parsing (IPv4, hostnames, bracketed IPv6 with zone ids)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.addr import http_url, join_hostport, parse_hostport
from kvd.errors import ConfigError


def test_k13_address_parsing() -> None:
    assert parse_hostport("127.0.0.1:8998") == ("127.0.0.1", 8998)
    assert parse_hostport("[::1]:8998") == ("::1", 8998)
    assert parse_hostport("[fe80::1%lo]:8998") == ("fe80::1%lo", 8998)
    assert parse_hostport("localhost:8998") == ("localhost", 8998)
    with pytest.raises(ConfigError) as exc:
        parse_hostport("::1")
    message = str(exc.value)
    assert "'::1'" in message
    assert "[" in message and "port" in message  # tells the user how to write IPv6


@pytest.mark.parametrize("addr", ["h:0", "h:70000", "h:65536", "h:abc", "h:", "h:-1",
                                  "[::1]:0", "[::1]:70000", "[::1]:abc", "[::1]:"])
def test_bad_ports_refused(addr: str) -> None:
    with pytest.raises(ConfigError, match="port"):
        parse_hostport(addr)


@pytest.mark.parametrize("addr", ["", "localhost", ":8998", "[]:8998", "[::1]", "[::1]8998",
                                  "[::1:8998", "a:b:c", "fe80::1:8998", "1.2.3.4:80:90"])
def test_malformed_addresses_refused(addr: str) -> None:
    with pytest.raises(ConfigError, match="bad address"):
        parse_hostport(addr)


def test_port_bounds_accepted() -> None:
    assert parse_hostport("h:1") == ("h", 1)
    assert parse_hostport("h:65535") == ("h", 65535)
    assert parse_hostport("  10.0.0.2:80 \n") == ("10.0.0.2", 80)


def test_join_hostport() -> None:
    assert join_hostport("127.0.0.1", 80) == "127.0.0.1:80"
    assert join_hostport("::1", 80) == "[::1]:80"
    assert join_hostport("fe80::1%eth0", 80) == "[fe80::1%eth0]:80"


def test_http_url() -> None:
    assert http_url("[::1]:8998", "/route") == "http://[::1]:8998/route"
    assert http_url("example.org:80", "/health") == "http://example.org:80/health"
    with pytest.raises(ConfigError):
        http_url("::1", "/route")


hostnames = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z0-9]{1,8}){0,3}",
                          fullmatch=True)
hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.tuples(st.ip_addresses(v=6), st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True)).map(
        lambda t: f"{t[0]}%{t[1]}"),
    hostnames,
)


@given(hosts, st.integers(1, 65535))
def test_join_parse_round_trip(host: str, port: int) -> None:
    addr = join_hostport(host, port)
    assert parse_hostport(addr) == (host, port)
    if ":" in host:
        ipaddress.ip_address(host.split("%")[0])  # still a valid IPv6 literal after the trip
        assert addr.startswith("[")
