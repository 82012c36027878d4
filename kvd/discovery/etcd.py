"""The etcd discovery source: prefill registrations under leases, decode lookups from a
watched view. Performs what the pure parts decide (:mod:`kvd.discovery.lease`,
:mod:`kvd.discovery.events`); every etcd request goes through
:mod:`kvd.discovery.etcd_client`.

Prefill (:class:`EtcdRegistrar`): puts this rank's registration at
:func:`~kvd.discovery.keys.rank_key` under a lease of ``etcd_lease_ttl`` s, renews it
every third of the TTL, and when etcd was unreachable long enough to drop the lease,
grants and puts again once it answers (no restart). A clean shutdown revokes the lease,
which deletes the key at once.

Decode (:class:`EtcdLookups`): reads every prefill rank of the cluster's prefix, then
watches the prefix from the revision read. Each change becomes a typed
:data:`~kvd.discovery.events.PeerEvent` handed to ``on_event`` (the decode side fails
the membership machine, through ``DecodeSide.on_discovery``, fails the rooms bound to a
rank that died or restarted). While etcd is unreachable, lookups
answer from the last view for ``etcd_view_ttl`` s and then fail naming the reason; on
reconnect the prefix is read again, so what changed meanwhile (a lease that expired)
is delivered as events too -- a key missing from that read only after one lease TTL
without it coming back as the same instance (an etcd that lost its data is refilled by
the ranks within a renew period; rooms in flight are not failed for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvd.bootstrap.table import ParallelInfo, RankInfo
from kvd.config import Settings, etcd_endpoint_list, read_etcd_password
from kvd.control.routing import Target
from kvd.discovery.etcd_client import EtcdClient, EtcdOptions, WatchCompacted, WatchIdle
from kvd.discovery.events import Entry, PeerDeleted, PeerEvent, View
from kvd.discovery.keys import RankKey, instances_prefix, rank_key
from kvd.discovery.lease import Backoff, Freshness, Keeper, Step
from kvd.errors import DiscoveryError, DiscoveryUnavailable, NotReady

log = logging.getLogger("kvd.discovery")


def etcd_options(s: Settings) -> EtcdOptions:
    """The client options of settings ``s`` (reads the password file: ConfigError). One
    request is bounded by ``http_timeout`` and by a renew period (a third of the lease),
    so a hung etcd cannot hold a keepalive past the lease it is meant to renew."""
    return EtcdOptions(tuple(etcd_endpoint_list(s.etcd_endpoints)), s.etcd_user,
                       read_etcd_password(s), s.etcd_ca_file, s.etcd_cert_file,
                       s.etcd_key_file, min(s.http_timeout, s.etcd_lease_ttl / 3))


class EtcdRegistrar:
    """Keeps one prefill rank registered in etcd (see the module doc).

    ``name``: the instance name (``bootstrap_addr``); ``clock``: monotonic seconds.
    """

    def __init__(self, client: EtcdClient, prefix: str, name: str, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.prefix, self.name, self.clock = client, prefix, name, clock
        self.keeper = Keeper(ttl)
        self.key: str | None = None
        self.value = b""
        self._changed = asyncio.Event()
        self._down_logged = False

    @property
    def registered(self) -> bool:
        """Is the registration in etcd now, as far as this rank can tell (a put under a
        lease confirmed less than a TTL ago)?"""
        return self.keeper.registered(self.clock())

    def set_registration(self, registration: dict[str, Any]) -> None:
        """What to register (``PUT /route``'s body); a changed value is put again under
        the same lease. Raises KeyError/ValueError for a body without its rank fields,
        ValueError for an instance name that is no key segment."""
        rank = RankKey(int(registration["attn_dp_rank"]), int(registration["attn_tp_rank"]),
                       int(registration["pp_rank"]))
        value = json.dumps(registration, sort_keys=True).encode()
        key = rank_key(self.prefix, self.name, rank)
        if (key, value) != (self.key, self.value):
            self.key, self.value = key, value
            self.keeper.put_ok = False  # put the new value under the same lease
            self._changed.set()

    async def run(self) -> None:
        """Keep the registration for the daemon's life (cancelled at shutdown)."""
        try:
            while True:
                if self.key is None:
                    await self._changed.wait()
                    self._changed.clear()
                    continue
                action = self.keeper.next(self.clock())
                if action.step is Step.WAIT:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(),
                                               max(0.0, action.at - self.clock()))
                    self._changed.clear()
                    continue
                await self._perform(action.step)
        finally:
            await self.client.aclose()

    async def _perform(self, step: Step) -> None:
        assert self.key is not None
        try:
            if step is Step.GRANT:
                lease, ttl = await self.client.grant(self.keeper.ttl)
                self.keeper.granted(lease, ttl, self.clock())
            elif step is Step.PUT:
                assert self.keeper.lease is not None
                try:
                    await self.client.put(self.key, self.value, self.keeper.lease)
                except DiscoveryUnavailable:
                    raise
                except DiscoveryError:  # most likely "lease not found": start over
                    self.keeper.lease_lost()
                    raise
                self.keeper.put_done(self.clock())
                log.info("registered in etcd at %s (lease %x, ttl %gs)", self.key,
                         self.keeper.lease, self.keeper.ttl)
            else:
                assert self.keeper.lease is not None
                if await self.client.keepalive(self.keeper.lease) <= 0:
                    log.warning("etcd lease %x of %s expired: registering again",
                                self.keeper.lease, self.key)
                    self.keeper.lease_lost()
                else:
                    self.keeper.renewed(self.clock())
            if self._down_logged:
                log.info("etcd reachable again (%s)", self.client.endpoint)
                self._down_logged = False
        except DiscoveryError as exc:
            delay = self.keeper.failed(self.clock())
            if not self._down_logged:  # once per outage; the loop retries for ever
                log.warning("etcd: %s; retrying (registration %s)", exc, self.key)
                self._down_logged = True
            await asyncio.sleep(delay)

    async def deregister(self) -> None:
        """Revoke the lease (deletes the key at once); bounded by one request timeout
        (s), best effort: otherwise the lease expires after its TTL."""
        lease, self.key = self.keeper.lease, None  # key None: run() registers no more
        if lease is None:
            return
        try:
            await asyncio.wait_for(self.client.revoke(lease), self.client.opts.timeout)
            log.info("deregistered from etcd (lease %x revoked)", lease)
        except (DiscoveryError, TimeoutError) as exc:  # the lease expires on its own
            log.info("could not revoke etcd lease %x: %s", lease, exc)
        self.keeper.lease_lost()


class EtcdLookups:
    """Prefill lookups from a live view of etcd (implements
    :class:`~kvd.discovery.base.Lookups`); ``run()`` is the watch loop.

    ``budget``: how long a lookup waits for an instance or rank to appear (s);
    ``view_ttl``: how long the view serves lookups once etcd is unreachable;
    ``idle_s``: a watch silent this long is checked (a partition is silence).
    """

    def __init__(self, client: EtcdClient, prefix: str, budget: float, view_ttl: float,
                 idle_s: float, on_event: Callable[[PeerEvent], None],
                 clock: Callable[[], float] = time.monotonic,
                 resync_grace: float | None = None) -> None:
        self.client, self.prefix, self.budget, self.idle_s = client, prefix, budget, idle_s
        self.resync_grace = idle_s if resync_grace is None else resync_grace
        self.on_event, self.clock = on_event, clock
        self.view = View(prefix)
        self.fresh = Freshness(view_ttl)
        self._changed = asyncio.Event()
        self.events_seen = 0

    # ---- Lookups ---------------------------------------------------------------------

    @property
    def info(self) -> dict[str, ParallelInfo]:
        """Parallel info per instance name, from its newest registration (for status)."""
        out: dict[str, ParallelInfo] = {}
        for (addr, _), e in sorted(self.view.entries.items(), key=lambda kv: kv[1].revision):
            out[addr] = e.parallel_info()  # the newest registration's sizes win
        return out

    @property
    def ranks(self) -> dict[tuple[str, int, int, int], RankInfo]:
        """Every rank in the view per (name, tp, dp, pp) (for status)."""
        return {(a, r.tp, r.dp, r.pp): e.rank_info() for (a, r), e in self.view.entries.items()}

    async def parallel_info(self, addr: str, retry: bool = True,
                            seen: Callable[[ParallelInfo], object] | None = None
                            ) -> ParallelInfo:
        """The newest rank's sizes from the watched view (``retry``/``seen``: unused, the
        view follows the store live; liveness comes from its leases)."""
        def newest() -> Entry | None:
            ranks = self.view.instance(addr)
            return max(ranks.values(), key=lambda e: e.revision) if ranks else None

        return (await self._wait(addr, "any rank", newest)).parallel_info()

    async def rank(self, addr: str, t: Target) -> RankInfo:
        """Where rank ``t`` of ``addr`` listens, from the view; waits up to ``budget`` s
        for it (NotReady), DiscoveryUnavailable once the view is older than
        ``view_ttl`` s."""
        key = RankKey(t.dp_group, t.tp_rank, t.pp_rank)
        entry = await self._wait(addr, f"rank dp {key.dp} tp {key.tp} pp {key.pp}",
                                 lambda: self.view.instance(addr).get(key))
        return entry.rank_info()

    def all_current(self, addr: str, targets: Iterable[Any]) -> bool:
        """Does the view still hold every target (``.endpoint``, ``.instance``) as a rank
        of ``addr``? False when one restarted or left while the room was being resolved."""
        now = {(e.endpoint, e.instance) for e in self.view.instance(addr).values()}
        return all((t.endpoint, t.instance) in now for t in targets)

    def forget(self, addr: str) -> set[str]:
        """Nothing cached to drop (the view follows the store); the endpoints of
        ``addr``'s ranks."""
        return {e.endpoint for e in self.view.instance(addr).values()}

    async def _wait(self, addr: str, what: str, find: Callable[[], Entry | None]) -> Entry:
        """``find()`` once the view has it; raises DiscoveryUnavailable when the view is
        too old to trust, NotReady after ``budget`` s without it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget
        while True:
            stale = self.fresh.stale(self.clock())
            if stale is not None:
                raise DiscoveryUnavailable(f"prefill {addr}: {stale}")
            found = find() if self.fresh.synced else None
            if found is not None:
                return found
            left = deadline - loop.time()
            if left <= 0:
                why = ("" if self.fresh.synced else
                       f" (etcd not read yet: {self.fresh.last_error or 'connecting'})")
                raise NotReady(f"no {what} of prefill {addr} registered under etcd prefix "
                               f"{self.prefix} after {self.budget:g}s{why}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    # ---- the watch -------------------------------------------------------------------

    async def run(self) -> None:
        """Read, then watch, the prefix for the daemon's life (cancelled at shutdown)."""
        backoff, prefix, need_read = Backoff(cap=1.0), instances_prefix(self.prefix), True
        try:
            while True:
                try:
                    if need_read:
                        kvs, revision = await self.client.range_prefix(prefix)
                        self._emit(self.view.resync(kvs, revision), resync=True)
                        self._up()
                        need_read = False
                    async for batch in self.client.watch(prefix, self.view.revision + 1,
                                                         self.idle_s):
                        self._up()
                        for ev in batch.events:
                            self._emit(self.view.apply_event(ev, batch.revision))
                        backoff.reset()
                except WatchIdle:
                    try:  # quiet is fine if etcd answers; else the view ages from now
                        await self.client.status()
                        self._up()
                    except DiscoveryError as exc:
                        self._down(exc)
                        need_read = True
                except WatchCompacted:
                    need_read = True
                except DiscoveryError as exc:
                    self._down(exc)
                    need_read = True
                    await asyncio.sleep(backoff.delay())
        finally:
            await self.client.aclose()

    def _emit(self, events: list[PeerEvent], resync: bool = False) -> None:
        for ev in events:
            if resync and isinstance(ev, PeerDeleted) and self.resync_grace > 0:
                # A key missing after an outage may only be missing because etcd lost
                # its data: its rank puts it back within a renew period. Rooms bound
                # to it fail only if it is not back as the same instance in a TTL.
                asyncio.get_running_loop().call_later(self.resync_grace, self._confirm, ev)
                continue
            self._deliver(ev)
        self._changed.set()

    def _confirm(self, ev: PeerDeleted) -> None:
        now = self.view.instance(ev.addr).get(ev.rank)
        if now is None or now.instance != ev.instance:
            self._deliver(ev)

    def _deliver(self, ev: PeerEvent) -> None:
        self.events_seen += 1
        log.info("etcd: %s", ev)
        self.on_event(ev)

    def _up(self) -> None:
        if self.fresh.down_since is not None:
            log.info("etcd reachable again (%s)", self.client.endpoint)
        self.fresh.up()
        self._changed.set()

    def _down(self, exc: Exception) -> None:
        if self.fresh.down_since is None:
            log.warning("etcd: %s; lookups use the last known view for %gs", exc,
                        self.fresh.ttl)
        self.fresh.down(self.clock(), str(exc))
        self._changed.set()


async def probe(s: Settings) -> str:
    """What ``kvd doctor`` checks of the store: etcd answers (version), the credentials
    are accepted, and the cluster's prefix is readable. Returns a one-line summary;
    raises ConfigError (password file), DiscoveryUnavailable, DiscoveryAuthError or
    DiscoveryError."""
    client = EtcdClient(etcd_options(s))
    try:
        status = await client.status()
        kvs, revision = await client.range_prefix(instances_prefix(s.etcd_prefix))
    finally:
        await client.aclose()
    view = View(s.etcd_prefix)
    view.resync(kvs, revision)
    names = {addr for addr, _ in view.entries}
    who = f"user {s.etcd_user!r}" if s.etcd_user else "no user"
    return (f"etcd {client.endpoint} (v{status.get('version', '?')}, {who}): prefix "
            f"{s.etcd_prefix} readable, {len(view.entries)} prefill ranks of {len(names)} "
            f"instances registered")
