"""The daemon's FastAPI app.

``/health`` always; with ``ops``: ``/ready``, ``/metrics`` (Prometheus text),
``/v1/status``, ``/v1/rooms`` (OpenAPI schema at ``/openapi.json``, docs at ``/docs``
only with ``docs``); SGLang's ``/route`` when serving bootstrap. With a cluster secret,
every route except ``/health``, ``/ready`` and ``/metrics`` needs a KVD-HMAC signature
addressed to this daemon (:mod:`kvd.bootstrap.guard`, which also caps bodies and checks
the Host header).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvd.bootstrap.guard import RELEASE_PATH, RequestGuard
from kvd.bootstrap.ratelimit import SourceBuckets
from kvd.bootstrap.table import (
    BootstrapTable,
    Conflict,
    NotFound,
    NotReady,
    ParallelInfo,
    PrefillRegistration,
    RankInfo,
)
from kvd.errors import AuthError, RoomError
from kvd.protocol.release import ReleaseAnswer, ReleaseError, ReleaseRequest, parse_request
from kvd.schemas import Readiness, Room, Status
from kvd.security import Authenticator

log = logging.getLogger(__name__)


class Ops(Protocol):
    """What the operations endpoints read (:class:`kvd.daemon.status.DaemonOps`)."""

    def readiness(self) -> Readiness: ...
    def status(self, failures: int = 20) -> Status: ...
    def rooms(self, include_done: bool = False, limit: int = 1000) -> list[Room]: ...
    def metrics(self) -> bytes: ...


def create_app(health: Callable[[], dict[str, Any]], table: BootstrapTable | None,
               ops: Ops | None = None, auth: Authenticator | None = None,
               on_auth_failure: Callable[[AuthError], None] | None = None,
               docs: bool = False, loopback: bool = False,
               body_timeout: float = 10.0,
               release: Callable[[ReleaseRequest], ReleaseAnswer] | None = None,
               clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """Build the app. ``health()`` returns the /health JSON; ``table`` enables /route;
    ``ops`` enables /ready, /metrics, /v1/status and /v1/rooms; ``docs`` (setting
    ``http_docs``) enables /docs and /redoc, whose pages load scripts from a CDN.

    Bad input answers 400 (never 422 or 500); an unknown rank 404; a rank not
    yet registered 503; a contradicting registration 409. With ``auth`` enabled,
    every request except to the open paths must carry a valid ``KVD-HMAC``
    authorization addressed to ``auth.instance_id`` (401 otherwise;
    ``on_auth_failure`` is told). ``loopback``: the listener is on a loopback
    address, so the Host header must name one (DNS rebinding). ``body_timeout``: s.
    """
    app = FastAPI(title="kvd", version="1", docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None)
    app.add_middleware(RequestGuard, auth=auth, loopback=loopback, body_timeout=body_timeout,
                       on_auth_failure=on_auth_failure)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": "bad request", "detail": errors}, status_code=400)

    @app.get("/health")
    async def get_health() -> dict[str, Any]:
        return health()

    if release is not None:
        _add_release_api(app, release, clock)
    if ops is not None:
        _add_ops_api(app, ops)
    if table is not None:
        _add_route_api(app, table, health)
    return app


def _add_release_api(app: FastAPI, release: Callable[[ReleaseRequest], ReleaseAnswer],
                     clock: Callable[[], float]) -> None:
    buckets = SourceBuckets()  # per source address, and a shared backstop

    @app.post(RELEASE_PATH, include_in_schema=False)
    async def post_release(request: Request) -> Response:
        source = request.client.host if request.client is not None else ""
        if not buckets.take(source, clock()):
            return JSONResponse({"error": "too many releases: retry later"}, status_code=429,
                                headers={"Retry-After": "1"})
        try:
            req = parse_request(await request.body())
        except ReleaseError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            answer = release(req)
        except RoomError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        return JSONResponse({"rooms": answer.rooms})


def _add_ops_api(app: FastAPI, ops: Ops) -> None:
    @app.get("/ready", response_model=Readiness,
             responses={503: {"model": Readiness, "description": "not ready yet"}})
    async def get_ready() -> JSONResponse:
        """Readiness: transfer engine up, engine registered, bootstrap registration done."""
        r = ops.readiness()
        return JSONResponse(r.model_dump(), status_code=200 if r.ready else 503)

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        """Prometheus text exposition."""
        return Response(ops.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def get_status(failures: int = Query(20, ge=0, le=1000)) -> Status:
        """Role, uptime, engine, peers, rooms by state, rates, totals, recent failures."""
        return ops.status(failures)

    @app.get("/v1/rooms")
    async def get_rooms(all: bool = Query(False, description="include finished rooms"),
                        limit: int = Query(1000, ge=1, le=100_000)) -> list[Room]:
        """Rooms held now (in flight unless ``all``), oldest first."""
        return ops.rooms(all, limit)


def _add_route_api(app: FastAPI, table: BootstrapTable,
                   health: Callable[[], dict[str, Any]]) -> None:
    @app.put("/route", response_class=PlainTextResponse)
    async def put_route(reg: PrefillRegistration) -> PlainTextResponse:
        try:
            outcome = table.register(reg)
        except Conflict as exc:
            return PlainTextResponse(str(exc), status_code=409)
        if outcome == "replaced":
            log.warning("bootstrap: rank tp=%d dp=%d pp=%d re-registered at %s:%d (replaced)",
                        reg.attn_tp_rank, reg.attn_dp_rank, reg.pp_rank, reg.rank_ip,
                        reg.rank_port)
        return PlainTextResponse("OK")

    @app.delete("/route", response_class=PlainTextResponse)
    async def delete_route(engine_rank: int = Query(ge=0), target_dp_group: int = Query(ge=0),
                           target_pp_rank: int = Query(0, ge=0),
                           instance_id: str | None = Query(None, max_length=64)
                           ) -> PlainTextResponse:
        """kvd extension: a prefill rank leaving (its own instance id must match)."""
        if table.deregister(engine_rank, target_dp_group, target_pp_rank, instance_id):
            return PlainTextResponse("OK")
        return PlainTextResponse("no such registration", status_code=404)

    @app.get("/route", response_model=None)
    async def get_route(engine_rank: int = Query(ge=-1),
                        target_dp_group: int = Query(ge=-1),
                        target_pp_rank: int = Query(-1, ge=-1)) -> ParallelInfo | RankInfo | \
            PlainTextResponse:
        try:
            if engine_rank == -1 and target_dp_group == -1 and target_pp_rank == -1:
                instance = health().get("instance_id")
                return table.parallel_info().model_copy(update={"instance_id": instance})
            if min(engine_rank, target_dp_group) < 0:
                return PlainTextResponse("engine_rank and target_dp_group must be >= 0",
                                         status_code=400)
            return table.lookup(engine_rank, target_dp_group, max(target_pp_rank, 0))
        except NotReady as exc:
            return PlainTextResponse(str(exc), status_code=503)
        except NotFound as exc:
            return PlainTextResponse(str(exc), status_code=404)
