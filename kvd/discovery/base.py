"""The small interface every discovery source implements.

A decode's side holds one :class:`Lookups` (what the room machine's ``Resolve`` effect
needs); a prefill's side holds one :class:`Registrar` per source it registers with.
A new source is one module in this package implementing them (docs/architecture.md,
"where a change goes").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvd.bootstrap.table import ParallelInfo, RankInfo
from kvd.control.routing import Target


class Lookups(Protocol):
    """Where the prefill ranks of an instance name (a room's ``bootstrap_addr``) listen.

    Lookups raise :class:`~kvd.errors.BootstrapError` (a subclass for the cause) after
    the source's retry budget; they never block past it.
    """

    @property
    def info(self) -> dict[str, ParallelInfo]:
        """Parallel info known per instance name (for status)."""

    @property
    def ranks(self) -> dict[tuple[str, int, int, int], RankInfo]:
        """Known ranks per (name, tp, dp, pp) (for status)."""

    async def parallel_info(self, addr: str, retry: bool = True,
                            seen: Callable[[ParallelInfo], object] | None = None
                            ) -> ParallelInfo:
        """The instance's sizes (attn TP, DP, PP, page size). ``retry``: whether a source
        that polls may retry within its budget (False: one try, the peer is down);
        ``seen``: told of a freshly fetched answer before it is cached (the membership
        machine learns the instance it names); a source that follows the store live may
        ignore both."""

    async def rank(self, addr: str, t: Target) -> RankInfo:
        """Where prefill rank ``t`` of ``addr`` listens, and its instance id."""

    def forget(self, addr: str) -> set[str]:
        """Drop what is cached for ``addr`` (a source that follows the store live keeps
        its view); returns the control endpoints of its ranks."""


class Registrar(Protocol):
    """A prefill rank's registration with one source."""

    @property
    def registered(self) -> bool:
        """Is the registration in the source now (as far as this rank can tell)?"""

    def set_registration(self, registration: dict[str, object]) -> None:
        """What to register (``PUT /route``'s body); registers again when it changed."""

    async def deregister(self) -> None:
        """Remove the registration (clean shutdown); best effort, bounded."""
