"""Where an engine rank sits in its instance: attention TP/DP and PP rank and size. PURE.

The engine knows its ranks; kvd's settings may name them too (``attn_tp_rank`` ...). At
registration (:class:`~kvd.protocol.rpc.RegisterKV`, field ``ranks``) :func:`resolve`
combines both: a setting left unset takes the engine's value, a setting that is set must
equal it, so one config template serves every rank of a pod. An engine that does not say
(an older client) gets the settings, and rank 0 of size 1 where those are unset too.

The daemon then uses only the resolved :class:`Ranks` (bootstrap registration, routing,
layouts); the settings' own fields are never read for ranks after that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvd.errors import RegistrationError
from kvd.protocol.rpc import EngineRanks

#: (rank field, size field) pairs, in the settings' and the wire's names.
PAIRS = (("attn_tp_rank", "attn_tp_size"), ("attn_dp_rank", "attn_dp_size"),
         ("pp_rank", "pp_size"))


@dataclass(frozen=True)
class Ranks:
    """The resolved position of one engine rank (ranks in ``[0, size)``)."""

    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    attn_dp_rank: int = 0
    attn_dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def describe(self) -> str:
        """``attn_tp 1/2, attn_dp 0/1, pp 0/1`` (for logs and errors)."""
        return ", ".join(f"{r.removesuffix('_rank')} {getattr(self, r)}/{getattr(self, s)}"
                         for r, s in PAIRS)


def resolve(configured: Mapping[str, int | None], engine: EngineRanks | None) -> Ranks:
    """The ranks to use for an engine that registered with ``engine`` (None: it did not say)
    under settings ``configured`` (field name -> value, None = unset).

    Raises :class:`RegistrationError` listing every field where the settings and the engine
    disagree, and every rank outside ``[0, size)`` after combining.
    """
    problems = []
    values: dict[str, int] = {}
    defaults = Ranks()
    for f in fields(Ranks):
        mine = configured.get(f.name)
        theirs = getattr(engine, f.name) if engine is not None else None
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{f.name}: kvd is configured with {mine}, the engine says {theirs}")
        chosen = mine if mine is not None else theirs
        values[f.name] = chosen if chosen is not None else getattr(defaults, f.name)
    for rank, size in PAIRS:
        if values[size] < 1 or not 0 <= values[rank] < values[size]:
            problems.append(f"{rank} {values[rank]} outside [0, {size} {values[size]})")
    if problems:
        raise RegistrationError("engine ranks refused: " + "; ".join(problems) + " (leave "
                                "the rank settings unset to take them from the engine)")
    return Ranks(**values)
