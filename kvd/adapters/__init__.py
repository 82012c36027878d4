"""Engine adapters: hand a real engine's KV transfer to kvd without forking the engine.

``kvd.adapters.vllm``    a vLLM ``KVConnectorBase_V1`` (load it with ``kv_connector_module_path``)
``kvd.adapters.sglang``  SGLang ``disaggregation.base.conn`` classes + a ``sglang.srt.plugins``
                         plugin that adds ``--disaggregation-transfer-backend kvd``
``kvd.adapters.hfmodel`` the reference model as a Hugging Face directory (offline conversion)

Nothing here is imported by the daemon; each adapter imports its engine lazily.
"""
