"""The hybrid reference model (issue 22): caches copied byte for byte decode to the
colocated tokens, and a wrong byte range in any cache kind changes them -- so a PD run
that is token-exact proves each cache kind moved."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd.refengine.hybridmodel import WINDOW, HybridModel

PROMPT = [5, 17, 3, 88, 41, 9, 2, 60, 33, 12, 71, 40, 8]


def test_i22_caches_copied_as_bytes_decode_to_the_colocated_tokens() -> None:
    m = HybridModel(5)
    want = m.generate_reference(PROMPT, 16)
    first, c = m.prefill(PROMPT)
    moved = copy.deepcopy(c)
    moved.kv = np.frombuffer(c.kv.tobytes(), np.float32).reshape(c.kv.shape).copy()
    moved.window = moved.window[:, :, -WINDOW:].copy()  # only the window travels
    assert m.decode(moved, first, 16) == want
    assert HybridModel(5).generate_reference(PROMPT, 16) == want  # seeded: same weights


@pytest.mark.parametrize("part", ["kv", "window", (1, "ssm"), (1, "conv")])
def test_i22_another_requests_cache_changes_the_tokens(part: object) -> None:
    """One cache kind taken from another prompt of the same length (the "previous
    prompt's answer" failure of a connector that drops state) changes the tokens."""
    m = HybridModel(5)
    want = m.generate_reference(PROMPT, 16)
    first, c = m.prefill(PROMPT)
    _, other = m.prefill([(t * 7 + 3) % 97 for t in PROMPT])
    if isinstance(part, str):
        setattr(c, part, getattr(other, part))
    else:
        c.state[part] = other.state[part]  # type: ignore[index]
    assert m.decode(c, first, 16) != want
