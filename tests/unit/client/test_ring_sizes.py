"""KvdClient(use_ring=True) refuses ring sizes kvd would refuse, when it is made: before,
the registration's OpenRing was refused and swallowed, and the engine ran over the socket
with no word of why (an engine that asked for a ring silently had none)."""

from __future__ import annotations

import pytest

from kvd.client import KvdClient
from kvd.engine_rpc.ring import check_sizes
from kvd.errors import ProtocolError
from kvd.protocol import rpc

BAD = [(3, 4096), (0, 4096), (-1, 4096), (rpc.MAX_RING_CAPACITY * 2, 4096), (256, 100),
       (256, 4100), (rpc.MAX_RING_CAPACITY, rpc.MAX_RING_RECORD)]


@pytest.mark.parametrize("capacity, record_bytes", BAD)
def test_ring_sizes_kvd_refuses_are_a_value_error_when_the_client_is_made(
        capacity: int, record_bytes: int) -> None:
    with pytest.raises(ValueError, match=r"ring|record"):
        KvdClient("/nonexistent/kvd.sock", use_ring=True, ring_capacity=capacity,
                  ring_record_bytes=record_bytes)
    with pytest.raises(ProtocolError):  # kvd's rule is the same one
        check_sizes(capacity, record_bytes)
    KvdClient("/nonexistent/kvd.sock", ring_capacity=capacity,  # no ring asked: no check
              ring_record_bytes=record_bytes)


@pytest.mark.parametrize("capacity, record_bytes", [(1, rpc.MIN_RING_RECORD), (256, 4096),
                                                    (rpc.MAX_RING_CAPACITY, 1024)])
def test_ring_sizes_within_the_bounds_are_taken(capacity: int, record_bytes: int) -> None:
    KvdClient("/nonexistent/kvd.sock", use_ring=True, ring_capacity=capacity,
              ring_record_bytes=record_bytes)
    assert check_sizes(capacity, record_bytes) == rpc.ring_sizes(capacity, record_bytes)


def test_a_ring_without_the_table_is_a_value_error_not_a_silent_socket() -> None:
    """The ring is used only while the status table says kvd is alive: before, a client
    made with ``use_ring=True, use_table=False`` never opened one and said nothing."""
    with pytest.raises(ValueError, match="use_ring needs use_table"):
        KvdClient("/nonexistent/kvd.sock", use_ring=True, use_table=False)
    KvdClient("/nonexistent/kvd.sock", use_table=False)
