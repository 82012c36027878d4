"""kvd: a per-GPU sidecar daemon that moves KV cache from prefill to decode engines."""

__version__ = "0.1.0"
