"""PD roles on real vLLM engines sharing one pool: a ``kv_producer`` stores, a
``kv_consumer`` loads only with ``consumer_is_to_load`` and stores only with
``consumer_is_to_put``; and KVRayConnector as a child of vLLM's MultiConnector next to
vLLM's ExampleConnector (the P->D-style connector that runs on CPU here: it passes KV
through files; NIXL, P2P NCCL and Mooncake's P2P connector need GPUs or libraries this
machine lacks). Outputs always equal the run without any connector."""

from __future__ import annotations

import pytest

from kvray.connector.log_lines import request_counts

from .conftest import BLOCK, P1, P3, connector, prompts, run_engine

pytestmark = pytest.mark.e2e

P4 = prompts(5, 2 * BLOCK + 3)  # used by no other test: 2 full blocks


def role(name: str, **extra):  # type: ignore[no-untyped-def]
    return {**connector(**extra), "role": name}


def test_producer_stores_and_consumer_flags(pool, ray_cluster, tiny_model, baseline, tmp_path):
    out = run_engine(
        ray_cluster,
        tmp_path,
        "producer",
        {"model": tiny_model, "connector": role("kv_producer"), "runs": [[P3]],
         "wait_saves_for": "e2e"},
    )  # fmt: skip
    (line,) = request_counts(out["log"])
    assert line["saved"] == 3 and line["hit_pool"] == 0
    # consumer that loads but does not store; then one that does neither (second engine
    # run in the same process: two runs of the same prompt)
    out = run_engine(
        ray_cluster,
        tmp_path,
        "consumer-load",
        {"model": tiny_model, "connector": role("kv_consumer", consumer_is_to_load=True),
         "runs": [[P3]]},
    )  # fmt: skip
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    assert line["hit_pool"] == 3 and line["loaded"] == 3 and line["saved"] == 0
    out = run_engine(
        ray_cluster,
        tmp_path,
        "consumer-plain",
        {"model": tiny_model, "connector": role("kv_consumer"), "runs": [[P3]]},
    )
    assert out["runs"][0]["outputs"][0] == baseline["P3"]
    (line,) = request_counts(out["log"])
    assert line["hit_pool"] == 0 and line["loaded"] == 0 and line["saved"] == 0


def multi_connector(tmp_path, policy: str = "recompute") -> dict:  # type: ignore[no-untyped-def]
    """KVRayConnector first, ExampleConnector second; the policy on the top level only."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "KVRayConnector",
                    "kv_connector_module_path": "kvray.connector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": connector()["extra"],
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
                },
            ]
        },
    }


def test_inside_multiconnector_next_to_example_connector(
    pool, ray_cluster, tiny_model, baseline, tmp_path
):
    multi = multi_connector(tmp_path)
    out = run_engine(
        ray_cluster,
        tmp_path,
        "multi",
        {"model": tiny_model, "kv_transfer_config": multi, "runs": [[P1], [P1]],
         "wait_saves_for": "e2e"},
    )  # fmt: skip
    assert [r["outputs"][0] for r in out["runs"]] == [baseline["P1"], baseline["P1"]]
    lines = request_counts(out["log"])
    # KVRayConnector is first: it serves the second run's blocks from the pool.
    assert lines[-1]["hit_pool"] == 4 and lines[-1]["loaded"] == 4, lines
    assert (tmp_path / "kv").is_dir(), "the ExampleConnector next to it ran too"


def test_multiconnector_top_level_fail_policy_fails_a_request_whose_load_failed(
    pool, ray_cluster, tiny_model, tmp_path
):
    """``kv_load_failure_policy`` set on MultiConnector's top level (its children have
    none) governs KVRayConnector's failed loads: the first run stores P4, the second hits
    it, its blocks are removed between lookup and load, and the request fails."""
    out = run_engine(
        ray_cluster,
        tmp_path,
        "multi-fail",
        {"model": tiny_model, "kv_transfer_config": multi_connector(tmp_path, "fail"),
         "runs": [[P4], [P4]], "wait_saves_for": "e2e", "inject_drop": "e2e"},
    )  # fmt: skip
    first_reasons, second_reasons = (r["finish_reasons"] for r in out["runs"])
    assert first_reasons != ["error"] and second_reasons == ["error"]
    first, second = request_counts(out["log"])
    assert first["saved"] == 2 and second["failed"] == 2, (first, second)
