"""kvwire-vllm: a vLLM KV connector (``KVConnectorBase_V1``, push mode) on top of kvwire.

Load it with ``--kv-transfer-config '{"kv_connector": "KVWireConnector",
"kv_connector_module_path": "kvwire_vllm.connector", ...}'``; see ``docs/engines/vllm.md``.
This package imports nothing from vLLM until :mod:`kvwire_vllm.connector` is imported.
"""

__version__ = "0.1.0"
