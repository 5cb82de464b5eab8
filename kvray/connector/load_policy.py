"""What vLLM does with a load from the pool that fails: its ``kv_load_failure_policy``.

vLLM's scheduler, not the connector, applies the policy: ``recompute`` recomputes the
blocks whose load failed, ``fail`` (vLLM's default) ends the request with an error. The
policy that counts is the top-level ``kv_transfer_config``'s: as a child of vLLM's
MultiConnector, kvray gets a fresh ``KVTransferConfig`` of its own (its entry of
``connectors``), while the scheduler applies MultiConnector's. A worker reaches the top
level through ``get_kv_transfer_group()`` once vLLM has made it (before it registers the
KV caches); it tells the scheduler side in its handshake, which warns once and registers
the policy with the pool (``kvray status`` and ``kvray doctor`` list it per engine).

A pool's loads fail by design now and then: a block the node's index still shows that
the backend evicted by the time of the load, a checksum mismatch, a node lost with its
memory. Under ``fail`` each of those ends a user's request.
"""

from __future__ import annotations

from typing import Any

FAIL = "fail"
RECOMPUTE = "recompute"

FAIL_WARNING = (
    "KVRayConnector: vLLM's kv_load_failure_policy is 'fail' (vLLM's default): a request "
    "whose load from the pool fails (a checksum mismatch, a block gone at load, a lost "
    "node) ends with an error instead of being recomputed. Set "
    '"kv_load_failure_policy": "recompute" in --kv-transfer-config (at its top level, '
    "where vLLM's MultiConnector is used)"
)
"""Logged once by the scheduler side when the policy vLLM applies is ``fail``."""


def applied_policy(own: str, group: Any = None) -> str:
    """The policy vLLM's scheduler applies to this connector's failed loads.

    ``own``: the policy of this connector's ``KVTransferConfig``; ``group``: vLLM's KV
    transfer group (``get_kv_transfer_group()``: the top-level connector, kvray itself or
    the MultiConnector kvray is a child of), None where vLLM has made none. The group's
    config is the top level's."""
    top = getattr(getattr(group, "_vllm_config", None), "kv_transfer_config", None)
    return str(getattr(top, "kv_load_failure_policy", own))


def worker_applied_policy(own: str) -> str:
    """:func:`applied_policy` in a vLLM worker, from vLLM's KV transfer group."""
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    group = state.get_kv_transfer_group() if state.has_kv_transfer_group() else None
    return applied_policy(own, group)
