"""vLLM connector: ``"kv_connector": "KVRayConnector", "kv_connector_module_path":
"kvray.connector"``. Reading ``KVRayConnector`` imports vLLM; the package's other modules
(:mod:`kvray.connector.log_lines`, for tools that read an engine's log) do not need it."""

from __future__ import annotations

from typing import Any

__all__ = ["KVRayConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVRayConnector":
        from kvray.connector.connector import KVRayConnector

        return KVRayConnector
    raise AttributeError(f"module 'kvray.connector' has no attribute {name!r}")
