"""vLLM connector: ``"kv_connector": "KVRayConnector", "kv_connector_module_path":
"kvray.connector"``. Importing this package imports vLLM."""

from kvray.connector.connector import KVRayConnector

__all__ = ["KVRayConnector"]
