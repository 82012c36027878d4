"""How ``kvd status`` / ``rooms`` / ``peers`` reach a running daemon: its REST API.

The address comes from ``--addr HOST:PORT`` (or ``KVD_ADDR``), else from the
``http_host``/``http_port`` of ``--config FILE``, else :data:`DEFAULT_ADDR`.
A daemon that does not answer raises :class:`DaemonUnreachable`, whose
message is the one line the CLI prints before exiting 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from kvd.addr import http_url, join_hostport
from kvd.errors import ConfigError, DaemonUnreachable

DEFAULT_ADDR = "127.0.0.1:8998"
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}




def resolve_addr(addr: str | None, config: Path | None) -> str:
    """The daemon's ``host:port``; raises ConfigError if ``config`` cannot tell it."""
    if addr:
        return addr
    if config is None:
        return DEFAULT_ADDR
    from kvd.config import load_settings

    s = load_settings(config)
    if s.http_port == 0:
        raise ConfigError(f"{config} has http_port = 0 (any free port): pass --addr HOST:PORT "
                          f"(the daemon's ready line and log name the port)")
    return join_hostport(_WILDCARDS.get(s.http_host, s.http_host), s.http_port)


def get(addr: str, path: str, timeout: float = 3.0, **params: Any) -> Any:
    """GET ``path`` from the daemon at ``addr`` and decode its JSON.

    Raises DaemonUnreachable (one-line message) if nothing answers, the answer
    is an HTTP error, or it is not JSON.
    """
    url = http_url(addr, path)
    try:
        # trust_env=False: HTTP(S)_PROXY and friends are for the outside world; a proxy
        # would answer for a daemon that is down, or not reach a loopback one at all
        resp = httpx.get(url, params=params, timeout=timeout, trust_env=False)
    except httpx.ConnectError as exc:
        raise DaemonUnreachable(f"no kvd daemon answering at {addr} ({_why(exc)}); is it "
                                f"running? (kvd serve, or systemctl status 'kvd@*')") from exc
    except httpx.TimeoutException as exc:
        raise DaemonUnreachable(f"kvd at {addr} did not answer within {timeout:g}s") from exc
    except httpx.HTTPError as exc:
        raise DaemonUnreachable(f"cannot talk to kvd at {addr}: {exc}") from exc
    if resp.status_code != 200:
        raise DaemonUnreachable(_refusal(addr, path, resp))
    try:
        return resp.json()
    except ValueError as exc:
        raise DaemonUnreachable(f"{addr} answered {path} with something that is not JSON: "
                                f"not a kvd daemon?") from exc


def _refusal(addr: str, path: str, resp: httpx.Response) -> str:
    """One line for a non-200 answer: the daemon's own reason when it gives one."""
    code = resp.status_code
    if code in (401, 403):
        return f"kvd at {addr} refused {path} ({code}): {_detail(resp) or 'unauthenticated'}"
    if code == 404:
        return f"{addr} has no {path} (404): not a kvd daemon, or an older version?"
    detail = _detail(resp)
    if detail:
        return f"kvd at {addr} answered {code} for {path}: {detail}"
    return f"{addr} answered {code} for {path}: not a kvd daemon, or an older version?"


def _detail(resp: httpx.Response) -> str:
    """``error``/``detail`` of a JSON error body (kvd's and FastAPI's shapes), else ''."""
    try:
        body = resp.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    detail = body.get("detail", body.get("error", ""))
    if isinstance(detail, list):
        detail = "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d)
                           for d in detail)
    return " ".join(str(detail).split())


def _why(exc: Exception) -> str:
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    if "name or service" in text or "resolve" in text:
        return "unknown host"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
