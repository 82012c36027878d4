"""Rich rendering of what the daemon reports (``/v1/status``, ``/v1/rooms``) and of local
reports (``config show``, ``doctor``). Every function takes the JSON-shaped data, so
``--json`` prints the same data unrendered."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

_MARK = {"ok": "[green]  ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def console(stderr: bool = False) -> Console:
    """A console that keeps long lines whole when output is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 160, highlight=False)


def print_json(data: Any) -> None:
    """``--json`` output: indented, stable key order as produced."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def human_bytes(n: float) -> str:
    """1536 -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(s: float) -> str:
    """3725 -> ``1h 02m 05s``; 4.2 -> ``4.2s``."""
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h:02d}h {m:02d}m"
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


def status(data: dict[str, Any]) -> None:
    """``kvd status``."""
    out = console()
    r = data["readiness"]
    ready = "[green]ready[/]" if r["ready"] else "[yellow]not ready[/]"
    out.print(f"[bold]kvd {data['role']}[/]  {ready}  instance {data['instance_id']}  "
              f"pid {data['pid']}  version {data['version']}  up "
              f"{human_seconds(data['uptime_s'])}")
    out.print("  checks: " + "  ".join(
        f"{k}={'n/a' if v is None else 'yes' if v else 'no'}" for k, v in r.items()
        if k != "ready"))
    out.print("  endpoints: " + "  ".join(f"{k} {v}" for k, v in data["endpoints"].items() if v))
    eng = data.get("engine")
    out.print("  engine: " + ("not registered" if not eng else
                              f"{eng['num_pages']} pages of {eng['page_size']} tokens, "
                              f"{eng['num_aux_slots']} aux slots, layout {eng['layout']}"
                              + (", MLA" if eng.get("is_mla") else "")))
    out.print("  rooms: " + "  ".join(f"{k} {v}" for k, v in data["rooms"].items()))
    out.print(f"  last {data['rate_window_s']:g}s: {data['rooms_per_s']:.1f} rooms/s, "
              f"{human_bytes(data['bytes_per_s'])}/s")
    t = data["totals"]
    out.print("  totals: " + "  ".join(
        f"{k} {human_bytes(v) if k.startswith('bytes') else v}" for k, v in t.items()))
    peers(data["peers"], out)
    failures(data["recent_failures"], out)


def peers(rows: list[dict[str, Any]], out: Console | None = None) -> None:
    """``kvd peers`` (and the peers part of ``kvd status``)."""
    out = out or console()
    if not rows:
        out.print("  peers: none yet")
        return
    table = Table(title="peers", title_justify="left")
    for col in ("endpoint", "kind", "state", "heartbeat", "last heard", "clock", "bootstrap",
                "instance", "detail", "last error"):
        table.add_column(col, overflow="fold")
    now = time.time()
    for p in rows:
        hb = p["heartbeat"]
        style = "green" if hb == "ok" else "red" if hb == "down" else "yellow" \
            if hb.startswith("missed") else ""
        heard = max(filter(None, (p.get("last_message"), p.get("last_heartbeat"))),
                    default=None)
        error = p.get("last_error") or ""
        if error and p.get("last_error_time"):
            error = f"{ago(now, p['last_error_time'])}: {error}"
        table.add_row(p["endpoint"], p["kind"], p["state"], Text(hb, style=style),
                      ago(now, heard), clock(p.get("clock_offset_s")), p.get("bootstrap", ""),
                      p.get("instance_id", ""),
                      p.get("detail", ""), Text(error, style="red" if error else ""))
    out.print(table)


def clock(offset_s: float | None) -> str:
    """A peer's clock offset: ``+0.002s`` (its clock minus this daemon's), ``-`` unknown."""
    return "-" if offset_s is None else f"{offset_s:+.3f}s"


def ago(now: float, then: float | None) -> str:
    """``3.2s ago`` (``-`` for never)."""
    return "-" if then is None else f"{human_seconds(max(0.0, now - then))} ago"


def failures(rows: list[dict[str, Any]], out: Console) -> None:
    """Recent failures, newest first."""
    if not rows:
        out.print("  recent failures: none")
        return
    table = Table(title="recent failures", title_justify="left")
    for col in ("time", "room", "peer", "category", "reason"):
        table.add_column(col, overflow="fold")
    for f in rows:
        table.add_row(time.strftime("%H:%M:%S", time.localtime(f["time"])), str(f["room"]),
                      f["peer"] or "-", f["category"], f["reason"])
    out.print(table)


def rooms(rows: list[dict[str, Any]]) -> None:
    """``kvd rooms``."""
    out = console()
    if not rows:
        out.print("no rooms in flight")
        return
    table = Table()
    for col in ("room", "state", "age", "in state", "peer", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(str(r["room"]), r["state"], human_seconds(r["age_s"]),
                      human_seconds(r["state_age_s"]), r["peer"], r.get("reason", ""))
    out.print(table)
    out.print(f"{len(rows)} room(s)")


def config(rows: dict[str, dict[str, Any]]) -> None:
    """``kvd config show``: value and source of every setting."""
    table = Table()
    for col in ("setting", "value", "source"):
        table.add_column(col, overflow="fold")
    for name, row in rows.items():
        source = row["source"] + (f" ({row['origin']})" if row.get("origin") else "")
        style = "" if row["source"] == "default" else "bold"
        table.add_row(name, Text(json.dumps(row["value"]), style=style), source)
    console().print(table)


def doctor(checks: list[dict[str, Any]]) -> None:
    """``kvd doctor``: one line per check, then what to fix."""
    out = console()
    for c in checks:
        out.print(f"{_MARK[c['status']]}  [bold]{c['name']}[/]: {c['detail']}")
        if c.get("fix") and c["status"] != "ok":
            out.print(f"      fix: {c['fix']}")
    bad = [c for c in checks if c["status"] == "fail"]
    warn = [c for c in checks if c["status"] == "warn"]
    out.print(f"{len(bad)} problem(s), {len(warn)} warning(s)")
