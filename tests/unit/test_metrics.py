"""kvd.metrics: room-event hooks -> Prometheus text, parsed back with prometheus-client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvd.metrics import (
    FAILURE_HISTORY,
    MAX_PEER_RECORDS,
    OTHER,
    Metrics,
    PeerLabels,
    PeerRecord,
    RateWindow,
    RoomEvents,
    StateSample,
    classify_failure,
    peer_identity,
    state_label,
)
from kvd.rooms.state import FailureKind, RoomFailure


def scrape(events: RoomEvents) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the text exposition: (name, sorted labels) -> value."""
    text = events.metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_rooms_move_counters_and_histograms() -> None:
    ev = RoomEvents()
    before = scrape(ev)
    assert value(before, "kvd_rooms_finished_total", status="success") == 0
    for room in (1, 2, 3):
        ev.room_started("prefill", room)
        ev.chunks_sent([("tcp://d:1", 1000), ("tcp://d:2", 0)])  # dummy write: skipped
        ev.room_done("prefill", room, None, 1000, 0.002, "tcp://d:1")
    ev.room_started("prefill", 4)
    ev.room_done("prefill", 4, RoomFailure(FailureKind.TIMEOUT, "room 4: timed out in "
                                           "Bootstrapping after 1.0s"), peer="tcp://d:1")
    s = scrape(ev)
    assert value(s, "kvd_rooms_finished_total", status="success") == 3
    assert value(s, "kvd_rooms_finished_total", status="failed") == 1
    assert value(s, "kvd_room_failures_total", reason="timeout") == 1
    assert value(s, "kvd_transfers_total", peer="d") == 3  # the host: ports are ephemeral
    assert value(s, "kvd_transfer_bytes_total", peer="d") == 3000
    assert value(s, "kvd_transfers_total", peer="tcp://d:2") == 0  # dummy write skipped
    for hist in ("kvd_room_latency_seconds", "kvd_room_transfer_seconds", "kvd_room_bytes"):
        assert value(s, f"{hist}_count") == 3, hist  # once per successful room
    assert value(s, "kvd_room_transfer_seconds_sum") == 0.006
    assert value(s, "kvd_room_bytes_bucket", le="4096.0") == 3
    assert value(s, "kvd_room_latency_seconds_bucket", le="+Inf") == 3
    assert ev.started == {}


def test_decode_rooms_have_latency_but_no_transfer_time() -> None:
    ev = RoomEvents()
    ev.room_started("decode", 9, "10.0.0.1:8998")
    ev.room_done("decode", 9, None, peer="tcp://p:1")
    s = scrape(ev)
    assert value(s, "kvd_room_latency_seconds_count") == 1
    assert value(s, "kvd_room_transfer_seconds_count") == 0


def test_recent_failures_are_bounded_and_newest_first() -> None:
    ev = RoomEvents()
    for room in range(FAILURE_HISTORY + 10):
        ev.room_done("decode", room, RoomFailure(FailureKind.ABORTED,
                                                 f"room {room} aborted on decode: x"), peer="p")
    recent = ev.recent_failures(5)
    assert [f["room"] for f in recent] == [FAILURE_HISTORY + 9 - i for i in range(5)]
    assert recent[0]["category"] == "aborted" and recent[0]["peer"] == "p"
    assert len(ev.failures) == FAILURE_HISTORY


def test_peer_labels_are_bounded() -> None:
    labels = PeerLabels(limit=3)
    assert [labels(f"p{i}") for i in range(5)] == ["p0", "p1", "p2", OTHER, OTHER]
    assert labels("p1") == "p1"
    ev = RoomEvents(metrics=Metrics(max_peers=2))
    for i in range(10):
        ev.bytes_sent(f"tcp://10.0.0.{i}:5000", 10)
    for i in range(10):
        ev.heartbeat_missed(f"boot:{i}")
    s = scrape(ev)
    peers = {dict(k[1]).get("peer") for k in s if k[0] == "kvd_transfer_bytes_total"}
    assert peers == {"10.0.0.0", "10.0.0.1", OTHER}
    assert value(s, "kvd_transfer_bytes_total", peer=OTHER) == 80
    assert value(s, "kvd_heartbeat_misses_total", peer=OTHER) == 10  # same label budget


def test_failure_category_is_the_kind_set_where_it_happened() -> None:
    """No category is recovered from text: a reason that mentions a timeout but was a
    transport failure counts as transport (K23)."""
    for kind in FailureKind:
        failure = RoomFailure(kind, "room 5: timed out ... heartbeat ... rc=-1 (misleading)")
        assert classify_failure(failure) == kind.value
    ev = RoomEvents()
    ev.room_done("prefill", 1, RoomFailure(FailureKind.TRANSPORT, "timed out, unreachable"))
    assert value(scrape(ev), "kvd_room_failures_total", reason="transport") == 1
    assert value(scrape(ev), "kvd_room_failures_total", reason="timeout") == 0


def test_peer_labels_do_not_churn_when_a_peer_restarts_on_a_new_port() -> None:
    ev = RoomEvents(metrics=Metrics(max_peers=4))
    for port in range(40000, 40100):  # one decode kvd restarted 100 times (zmq_port = 0)
        ev.bytes_sent(f"tcp://10.0.0.7:{port}", 1)
    ev.bytes_sent("tcp://[fd00::7]:41000", 1)
    ev.heartbeat_missed("10.0.0.9:8998")  # a bootstrap address: its port is fixed, kept
    s = scrape(ev)
    labels = {dict(k[1])["peer"] for k in s if k[0] == "kvd_transfers_total"}
    assert labels == {"10.0.0.7", "[fd00::7]"}
    assert value(s, "kvd_transfers_total", peer="10.0.0.7") == 100
    assert value(s, "kvd_heartbeat_misses_total", peer="10.0.0.9:8998") == 1
    assert peer_identity("tcp://host-a:17000") == "host-a"
    assert peer_identity("host-a:8998") == "host-a:8998"


def test_no_created_series_in_this_registry_only() -> None:
    from prometheus_client import REGISTRY, Counter, generate_latest

    ev = RoomEvents()
    ev.room_done("prefill", 1, RoomFailure(FailureKind.TIMEOUT, "timed out"), peer="tcp://d:1")
    ev.bytes_sent("tcp://d:1", 5)
    text = ev.metrics.render().decode()
    assert "_created" not in text
    assert "kvd_rooms_finished_total" in text and "kvd_room_latency_seconds_count" in text
    other = Counter("kvd_test_other_registry", "another library's counter")  # global registry
    try:
        assert b"kvd_test_other_registry_created" in generate_latest(REGISTRY)  # untouched
    finally:
        REGISTRY.unregister(other)


def test_state_labels_are_lower_snake() -> None:
    assert state_label("WaitingForInput") == "waiting_for_input"
    assert state_label("Failed") == "failed"
    ev = RoomEvents()
    ev.metrics.add_state(lambda: _sample(rooms_by_state={"WaitingForInput": 2,
                                                          "Bootstrapping": 1}))
    s = scrape(ev)
    assert value(s, "kvd_rooms", state="waiting_for_input") == 2
    assert value(s, "kvd_rooms", state="bootstrapping") == 1
    assert value(s, "kvd_rooms", state="WaitingForInput") == 0


def test_auth_failures_are_a_counter() -> None:
    ev = RoomEvents()
    ev.metrics.add_state(lambda: _sample(auth_failures=7))
    assert value(scrape(ev), "kvd_auth_failures_total") == 7


def test_peer_records_keep_last_message_and_last_error_bounded() -> None:
    ev = RoomEvents()
    ev.peer_message("tcp://d:1", now=100.0)
    ev.room_done("prefill", 5, RoomFailure(FailureKind.TIMEOUT, "room 5: timed out"),
                 peer="tcp://d:1,tcp://d:2")
    ev.heartbeat_missed("p:8998")
    rec = ev.peer_record("tcp://d:1")
    assert rec.last_message == 100.0 and rec.last_error == "room 5: timed out"
    assert rec.last_error_time is not None
    assert ev.peer_record("tcp://d:2").last_error == "room 5: timed out"
    assert ev.peer_record("p:8998").last_error == "heartbeat unanswered"
    assert ev.peer_record("nobody") == PeerRecord()
    for i in range(MAX_PEER_RECORDS + 50):
        ev.peer_message(f"tcp://x:{i}")
    assert len(ev.peers) == MAX_PEER_RECORDS
    assert f"tcp://x:{MAX_PEER_RECORDS + 49}" in ev.peers and "tcp://d:1" not in ev.peers


def _sample(**overrides: object) -> StateSample:
    base: dict[str, object] = dict(
        role="prefill", version="9.9", instance_id="abc", uptime_s=1.0, rooms_by_state={},
        queue_depth=0, executor_busy=0, executor_threads=1, protocol_errors=0, peers=0,
        engine_registered=True, ready=True)
    return StateSample(**(base | overrides))  # type: ignore[arg-type]



def test_state_collector_reports_gauges_at_scrape_time() -> None:
    ev = RoomEvents()
    state = {"queue": 0}
    ev.metrics.add_state(lambda: StateSample(
        role="prefill", version="9.9", instance_id="abc", uptime_s=12.5,
        rooms_by_state={"Transferring": 2, "Success": 7}, queue_depth=state["queue"],
        executor_busy=1, executor_threads=4, protocol_errors=3, peers=2,
        engine_registered=True, ready=False))
    state["queue"] = 5
    s = scrape(ev)
    assert value(s, "kvd_rooms", state="transferring") == 2
    assert value(s, "kvd_transfer_queue_depth") == 5
    assert value(s, "kvd_executor_busy") == 1 and value(s, "kvd_executor_threads") == 4
    assert value(s, "kvd_protocol_errors_total") == 3
    assert value(s, "kvd_ready") == 0 and value(s, "kvd_engine_registered") == 1
    assert value(s, "kvd_info", role="prefill", version="9.9", instance_id="abc") == 1


def test_registries_are_per_daemon() -> None:
    a, b = RoomEvents(), RoomEvents()
    a.room_done("prefill", 1, None)
    assert value(scrape(a), "kvd_rooms_finished_total", status="success") == 1
    assert value(scrape(b), "kvd_rooms_finished_total", status="success") == 0


def test_rate_window() -> None:
    now = [100.0]
    w = RateWindow(span=10.0, clock=lambda: now[0])
    now[0] = 105.0
    for _ in range(10):
        w.add(rooms=1, nbytes=100)
    assert w.rates() == (2.0, 200.0)  # 5 s of uptime so far
    now[0] = 130.0
    assert w.rates() == (0.0, 0.0)  # outside the window
