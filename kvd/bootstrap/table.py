"""The bootstrap registry of prefill ranks. PURE (no I/O).

Speaks SGLang's ``/route`` semantics: prefill ranks register with
``PUT /route``; decode ranks ask ``GET /route?engine_rank=-1&
target_dp_group=-1&target_pp_rank=-1`` for the parallel info and then
``GET /route?engine_rank=T&target_dp_group=D&target_pp_rank=P`` for one rank.

Membership is per DP group (K38): the parallel info answers as soon as one DP
group has every rank (all its TP ranks of every PP stage) registered, and names the
groups that do (``ready_dp_groups``, a kvd extension); a rank not registered answers
503 naming its group. A single-group instance thus answers 503 until every rank
registered, as SGLang's server does (K01).

Rules: the first registration fixes the instance's sizes (attn TP, DP, PP);
a later one with other sizes is refused (409). The same key (dp, tp, pp)
registered again with the same endpoint is idempotent; with a different
endpoint or instance id it REPLACES the old entry (a restarted rank) and the
replacement is reported to the caller so it can be logged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvd.errors import Conflict, NotFound, NotReady


class PrefillRegistration(BaseModel):
    """Body of ``PUT /route`` (SGLang's field names; extra fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    role: str = "Prefill"
    attn_tp_size: int = Field(1, ge=1)
    attn_tp_rank: int = Field(0, ge=0)
    attn_dp_size: int = Field(1, ge=1)
    attn_dp_rank: int = Field(0, ge=0)
    pp_size: int = Field(1, ge=1)
    pp_rank: int = Field(0, ge=0)
    page_size: int | None = Field(None, ge=1)
    rank_ip: str = Field(min_length=1, max_length=255)
    rank_port: int = Field(ge=1, le=65535)
    instance_id: str | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _ranks_in_range(self) -> PrefillRegistration:
        for rank, size in (("attn_tp_rank", "attn_tp_size"), ("attn_dp_rank", "attn_dp_size"),
                           ("pp_rank", "pp_size")):
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(f"{rank} must be < {size}")
        return self


class RankInfo(BaseModel):
    """Answer for one rank: where its kvd's control socket listens."""

    rank_ip: str
    rank_port: int
    instance_id: str | None = None


class ParallelInfo(BaseModel):
    """Answer for the parallel-info query (SGLang's keys)."""

    prefill_attn_tp_size: int
    prefill_dp_size: int
    prefill_pp_size: int
    prefill_page_size: int | None = None
    # kvd extension: the instance id of the daemon serving this bootstrap (the one its
    # /health names). A decode records it with the lookups it caches, so its heartbeat can
    # tell a restart even when no heartbeat ran before it (rooms resolved from a cache the
    # heartbeat never saw, the K21 kind). None from other bootstrap servers.
    instance_id: str | None = None
    # kvd extension: the DP groups with every rank registered (None from other bootstrap
    # servers: all of them). A decode resolves rooms of these groups; a room of another
    # group waits within its lookup budget for that group's ranks (K38).
    ready_dp_groups: list[int] | None = None


Key = tuple[int, int, int]  # (dp, tp, pp)


class BootstrapTable:
    """Registered prefill ranks of one prefill instance."""

    def __init__(self) -> None:
        self.sizes: tuple[int, int, int] | None = None  # (tp, dp, pp)
        self.page_size: int | None = None
        self.ranks: dict[Key, RankInfo] = {}
        #: Bumped whenever a registered rank is replaced or removed: decode ranks that see
        #: it change (in /health) refresh their cached endpoints.
        self.epoch = 0

    @property
    def expected(self) -> int | None:
        """How many ranks the instance has, once known."""
        return None if self.sizes is None else self.sizes[0] * self.sizes[1] * self.sizes[2]

    def register(self, reg: PrefillRegistration) -> str:
        """Record ``reg``; returns "registered", "unchanged" or "replaced".

        Raises :class:`Conflict` if its sizes differ from the instance's.
        """
        if reg.role.lower() != "prefill":
            raise Conflict(f"only prefill ranks register here, got role {reg.role!r}")
        sizes = (reg.attn_tp_size, reg.attn_dp_size, reg.pp_size)
        if self.sizes is None:
            self.sizes, self.page_size = sizes, reg.page_size
        elif sizes != self.sizes:
            raise Conflict(f"registration sizes (tp, dp, pp)={sizes} differ from the "
                           f"instance's {self.sizes}")
        key = (reg.attn_dp_rank, reg.attn_tp_rank, reg.pp_rank)
        info = RankInfo(rank_ip=reg.rank_ip, rank_port=reg.rank_port,
                        instance_id=reg.instance_id)
        old = self.ranks.get(key)
        self.ranks[key] = info
        if old is None:
            return "registered"
        if old == info:
            return "unchanged"
        self.epoch += 1
        return "replaced"

    def deregister(self, tp_rank: int, dp_group: int, pp_rank: int,
                   instance_id: str | None) -> bool:
        """Remove a rank (SIGTERM of its kvd). Only the registered instance may remove it;
        returns False if nothing was removed."""
        key = (dp_group, tp_rank, pp_rank)
        info = self.ranks.get(key)
        if info is None or (info.instance_id is not None and info.instance_id != instance_id):
            return False
        del self.ranks[key]
        self.epoch += 1
        return True

    def ready_groups(self) -> list[int]:
        """DP groups with every rank (each TP rank of each PP stage) registered."""
        if self.sizes is None:
            return []
        tp, dp, pp = self.sizes
        counts = [0] * dp
        for (d, _t, _p) in self.ranks:
            counts[d] += 1
        return [d for d in range(dp) if counts[d] == tp * pp]

    def parallel_info(self) -> ParallelInfo:
        """Sizes of the instance and its ready DP groups; raises :class:`NotReady` until
        one DP group has every rank registered."""
        ready = self.ready_groups()
        if self.sizes is None or not ready:
            raise NotReady(f"prefill not fully registered: {len(self.ranks)}/"
                           f"{self.expected if self.expected is not None else '?'} registered"
                           f" (no DP group complete)")
        tp, dp, pp = self.sizes
        return ParallelInfo(prefill_attn_tp_size=tp, prefill_dp_size=dp, prefill_pp_size=pp,
                            prefill_page_size=self.page_size, ready_dp_groups=ready)

    def lookup(self, tp_rank: int, dp_group: int, pp_rank: int) -> RankInfo:
        """The rank at (tp, dp, pp). Raises NotFound outside the sizes, NotReady if
        inside them but not registered yet."""
        if self.sizes is not None:
            tp, dp, pp = self.sizes
            if not (0 <= tp_rank < tp and 0 <= dp_group < dp and 0 <= pp_rank < pp):
                raise NotFound(f"no prefill rank tp={tp_rank} dp={dp_group} pp={pp_rank} "
                               f"(instance has tp={tp} dp={dp} pp={pp})")
        info = self.ranks.get((dp_group, tp_rank, pp_rank))
        if info is None:
            if self.sizes is None:
                raise NotReady("no prefill rank registered yet")
            tp, _dp, pp = self.sizes
            group = sum(d == dp_group for (d, _t, _p) in self.ranks)
            raise NotReady(f"prefill rank tp={tp_rank} dp={dp_group} pp={pp_rank} "
                           f"not registered yet ({len(self.ranks)}/{self.expected}; DP group "
                           f"{dp_group} has {group}/{tp * pp} ranks)")
        return info
