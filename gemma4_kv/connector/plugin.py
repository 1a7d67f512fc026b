"""The vLLM plugin (entry point group `vllm.general_plugins`): vLLM runs `register` in
each of its processes, so `--kv-transfer-config '{"kv_connector": "Gemma4KVConnector",
"kv_role": "kv_both"}'` finds the connector without `kv_connector_module_path`."""

from __future__ import annotations

NAME = "Gemma4KVConnector"


def register() -> None:
    """Register the connector with vLLM's KVConnectorFactory (lazily: nothing of it is
    imported until an engine creates it). Safe to call more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, "gemma4_kv.connector", NAME)
    except ValueError:  # registered already (this process loaded the plugins before)
        pass
