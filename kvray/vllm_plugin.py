"""vLLM general plugin (entry point ``vllm.general_plugins``): registers KVRayConnector by
name in every vLLM process, the API server's included.

``kv_connector_module_path`` is enough for vLLM to build the connector, but some code
finds connectors by name only: MultiConnector rebuilds its children's stats in the API
server process through ``KVConnectorFactory.get_connector_class_by_name``, and without
this registration every stats interval fails there ("Connector 'KVRayConnector' is not
registered") and takes the server's output handler down. With it, ``"kv_connector":
"KVRayConnector"`` also works without a module path.
"""

from __future__ import annotations

import contextlib

CONNECTOR = "KVRayConnector"


def register() -> None:
    """Idempotent; imports nothing of kvray's connector until vLLM asks for the class."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # ValueError: registered already (plugins load once per process, tests more often)
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR, "kvray.connector", CONNECTOR)
