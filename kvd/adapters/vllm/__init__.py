"""kvd as vLLM's KV connector: ``kv_connector_module_path = "kvd.adapters.vllm"``,
``kv_connector = "KvdConnector"`` (see :mod:`kvd.adapters.vllm.connector`).

``KvdConnector`` is imported lazily (PEP 562), so the pure parts (:mod:`.spec`) load
without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvdConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvdConnector":
        from kvd.adapters.vllm.connector import KvdConnector

        return KvdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
