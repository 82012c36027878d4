"""kvd.transfer.backends.mooncake: the environment the native engine is configured from
(pure; no engine is started)."""

from __future__ import annotations

from kvd.config import Settings
from kvd.transfer.backends.mooncake import MooncakeOptions, native_env


def test_k39_the_tcp_connection_pool_is_off_unless_asked() -> None:
    """The binding cannot close a peer's pooled lanes, so the pool stays off by default:
    no socket outlives the transfer that opened it (K39)."""
    assert native_env(MooncakeOptions("127.0.0.1")) == {"MC_TCP_ENABLE_CONNECTION_POOL": "0"}
    assert native_env(MooncakeOptions("127.0.0.1", tcp_pool=True))[
        "MC_TCP_ENABLE_CONNECTION_POOL"] == "1"
    assert Settings(role="decode").transfer_tcp_pool is False


def test_the_port_range_goes_to_the_rpc_port_variables() -> None:
    env = native_env(MooncakeOptions("127.0.0.1", port_range=(15000, 15001)))
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("15000", "15001")
