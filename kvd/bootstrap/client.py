"""Signed HTTP requests to another kvd (bootstrap ``/route``, ``/v1/*``), async and sync.

A signature is addressed to the instance id of the kvd that serves the URL (case
S09), which the sender learns from that server's open ``/health`` and caches per
``host:port`` in :class:`Recipients`. When the server has restarted since, it
refuses with 401 and names its instance in ``KVD-Instance``: the request is
re-addressed and sent once more. Trusting an unauthenticated ``/health`` for the
address is safe: a signature addressed to a wrong instance is useless anywhere else,
and whoever can answer for the address can relay requests anyway.

Requests to the open paths (:data:`~kvd.bootstrap.guard.OPEN_PATHS`) go unsigned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import httpx

from kvd.bootstrap.guard import OPEN_PATHS
from kvd.security import INSTANCE_HEADER, Authenticator

#: Servers whose instance is remembered (least recently learned forgotten first).
MAX_RECIPIENTS = 4096


class Recipients:
    """Instance id of the kvd serving each ``host:port`` (bounded)."""

    def __init__(self, capacity: int = MAX_RECIPIENTS) -> None:
        self.capacity = capacity
        self._known: OrderedDict[str, str] = OrderedDict()

    def get(self, netloc: str) -> str | None:
        return self._known.get(netloc)

    def set(self, netloc: str, instance: str) -> None:
        self._known[netloc] = instance
        self._known.move_to_end(netloc)
        if len(self._known) > self.capacity:
            self._known.popitem(last=False)

    def forget(self, netloc: str) -> None:
        self._known.pop(netloc, None)


def needs_signature(auth: Authenticator, request: httpx.Request) -> bool:
    """True unless insecure, or the path is open."""
    return auth.enabled and request.url.path not in OPEN_PATHS


def sign(auth: Authenticator, request: httpx.Request, instance: str) -> None:
    """Add (or replace) ``request``'s authorization, addressed to ``instance``."""
    request.headers.update(auth.http_header(request.method, request.url.path,
                                            request.url.query.decode(), request.content,
                                            instance))


def readdressed(response: httpx.Response, instance: str) -> str | None:
    """The instance to retry with, if ``response`` refused a request addressed to
    ``instance`` because another instance now serves the address."""
    other = response.headers.get(INSTANCE_HEADER)
    return other if response.status_code == 401 and other and other != instance else None


def _health_url(request: httpx.Request) -> httpx.URL:
    return request.url.copy_with(path="/health", query=None)


def _instance_from(response: httpx.Response) -> str:
    """``instance_id`` of a /health answer; raises httpx.HTTPError if there is none."""
    try:
        instance = response.json().get("instance_id") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        instance = None
    if not isinstance(instance, str) or not instance:
        raise httpx.HTTPError(f"{response.request.url.netloc.decode()} did not name its kvd "
                              f"instance on /health ({response.status_code})")
    return instance


async def request(client: httpx.AsyncClient, auth: Authenticator, recipients: Recipients,
                  method: str, url: str, *, params: Mapping[str, Any] | None = None,
                  json: Any = None, limit_s: float | None = None) -> httpx.Response:
    """One signed request (unsigned to open paths); raises httpx errors. ``limit_s``:
    httpx timeout in seconds (None: the client's)."""
    limit: dict[str, Any] = {} if limit_s is None else {"timeout": limit_s}
    req = client.build_request(method, url, params=params, json=json, **limit)
    if not needs_signature(auth, req):
        return await client.send(req)
    netloc = req.url.netloc.decode()
    instance = recipients.get(netloc)
    if instance is None:
        health = await client.get(_health_url(req), **limit)
        instance = _instance_from(health)
        recipients.set(netloc, instance)
    sign(auth, req, instance)
    resp = await client.send(req)
    other = readdressed(resp, instance)
    if other is None:
        return resp
    recipients.set(netloc, other)
    sign(auth, req, other)
    return await client.send(req)


def request_sync(client: httpx.Client, auth: Authenticator, method: str, url: str, *,
                 params: Mapping[str, Any] | None = None, json: Any = None,
                 limit_s: float | None = None) -> httpx.Response:
    """:func:`request` for blocking callers (CLI, engine adapters); no cache."""
    limit: dict[str, Any] = {} if limit_s is None else {"timeout": limit_s}
    req = client.build_request(method, url, params=params, json=json, **limit)
    if not needs_signature(auth, req):
        return client.send(req)
    instance = _instance_from(client.get(_health_url(req), **limit))
    sign(auth, req, instance)
    resp = client.send(req)
    other = readdressed(resp, instance)
    if other is None:
        return resp
    sign(auth, req, other)
    return client.send(req)
