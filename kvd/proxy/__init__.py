"""``kvd proxy``: a prefill/decode router for OpenAI-compatible engines that move KV
through kvd (vLLM with :mod:`kvd.adapters.vllm`).

* :mod:`kvd.proxy.legs` -- PURE: how one client request becomes a prefill leg and a
  decode leg (options adapted, rooms, transfer params).
* :mod:`kvd.proxy.pool` -- PURE: the servers of each role, their health and load, the
  least-outstanding-requests choice.
* :mod:`kvd.proxy.app` -- the FastAPI app: forwarding, streaming, cancellation, retries,
  health checks, metrics.
"""
