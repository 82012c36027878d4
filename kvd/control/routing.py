"""Which prefill ranks feed a decode rank. PURE.

Mirrors SGLang's Mooncake connector (``CommonKVReceiver``'s target-rank rules):

* equal attn TP: the prefill rank with the same TP rank;
* decode TP > prefill TP: the prefill rank holding this decode rank's heads,
  ``tp_rank // (decode_tp // prefill_tp)``; that prefill rank is told how many
  decode ranks it feeds (``required_dst_info_num``);
* decode TP < prefill TP: the ``prefill_tp // decode_tp`` ranks whose heads
  this decode rank holds; all real for MHA, the first real and the others
  dummies for MLA (replicated latent KV);
* DP group: ``room % prefill_dp_size`` unless the request names one;
* every PP stage of the prefill instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.errors import RegistrationError


@dataclass(frozen=True)
class Target:
    """One prefill rank a decode rank must hear from for a room."""

    tp_rank: int
    dp_group: int
    pp_rank: int
    is_dummy: bool
    required_dst_info_num: int


def check_tp_pair(prefill_tp: int, decode_tp: int) -> None:
    """Raise :class:`RegistrationError` unless one TP size divides the other."""
    if prefill_tp < 1 or decode_tp < 1:
        raise RegistrationError(f"TP sizes must be >= 1 (prefill {prefill_tp}, decode {decode_tp})")
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise RegistrationError(
            f"unsupported TP pair: prefill attn_tp {prefill_tp} and decode attn_tp {decode_tp} "
            f"(one must divide the other)")


def resolve_targets(room: int, decode_tp_rank: int, decode_tp: int, prefill_tp: int,
                    prefill_dp: int, prefill_pp: int, is_mla: bool,
                    dp_rank: int | None = None) -> list[Target]:
    """Prefill ranks (every PP stage) that room ``room`` on this decode rank needs.

    Raises :class:`RegistrationError` for an unsupported TP pair or a DP rank
    outside ``[0, prefill_dp)``.
    """
    check_tp_pair(prefill_tp, decode_tp)
    if dp_rank is not None and not 0 <= dp_rank < prefill_dp:
        raise RegistrationError(f"target_dp_group {dp_rank} outside prefill dp_size {prefill_dp}")
    dp = room % prefill_dp if dp_rank is None else dp_rank
    if decode_tp == prefill_tp:
        tps, required = [(decode_tp_rank, False)], 1
    elif decode_tp > prefill_tp:
        ratio = decode_tp // prefill_tp
        tps, required = [(decode_tp_rank // ratio, False)], ratio
    else:
        ratio = prefill_tp // decode_tp
        first = decode_tp_rank * ratio
        tps = [(first + i, is_mla and i > 0) for i in range(ratio)]
        required = 1
    return [Target(tp, dp, pp, dummy, required) for pp in range(prefill_pp) for tp, dummy in tps]
