"""The speculative-decoding reference models (issue 22 item 2): greedy speculation gives
the target's own tokens, and the trace (proposals, accepted counts) depends on the draft KV
and on the target's last hidden state -- so a PD row whose trace equals the colocated one
shows both moved."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.refengine import specmodel as sm


def _prompt(i: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + i).integers(0, sm.VOCAB, 9 + 5 * i)]


@pytest.mark.parametrize("i", range(3))
def test_i22_speculative_decode_equals_the_target_alone(i: int) -> None:
    m = sm.SpecPair(7)
    first, st = m.prefill(_prompt(i))
    got, trace = m.decode(st, first, 16)
    assert got == m.reference(_prompt(i), 16)
    assert all(len(t) == sm.K + 1 and 0 <= t[-1] <= sm.K for t in trace)


def test_i22_the_trace_changes_with_the_draft_kv_and_with_the_hidden_state() -> None:
    m = sm.SpecPair(7)
    kv_changed = hidden_changed = 0
    accepted = 0
    for i in range(3):
        first, st = m.prefill(_prompt(i))
        _, trace = m.decode(st, first, 16)
        accepted += sum(t[-1] for t in trace)
        _, other = m.prefill(_prompt(i + 5))  # another request's draft KV, cut to length
        first, st = m.prefill(_prompt(i))
        st.draft = np.resize(other.draft, st.draft.shape).astype(np.float32)
        kv_changed += m.decode(st, first, 16)[1] != trace
        first, st = m.prefill(_prompt(i))
        st.hidden[-1] = np.zeros_like(st.hidden[-1])
        hidden_changed += m.decode(st, first, 16)[1] != trace
    assert kv_changed == 3 and hidden_changed >= 2
    assert accepted > 0  # the draft is worth something: some proposals are accepted
