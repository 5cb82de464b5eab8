"""A node actor's config: the pool's, with what the embedded server chose, what the node
fills in, and, after Ray restarted the actor, the manager's current server."""

from __future__ import annotations

import logging
from typing import Any

from kvray import remote
from kvray.backends.registry import spec_of, with_client_settings
from kvray.config import PoolConfig
from kvray.errors import KVRayError, PoolNotFoundError
from kvray.naming import manager_name
from kvray.remote import START_TIMEOUT_S, ManagerHandle

logger = logging.getLogger(__name__)


def actor_config(config: PoolConfig, resolved: dict[str, Any]) -> str:
    """The config the rank actors get: the pool's, with what the embedded server chose
    (MemCache clients need the MetaService's config-store url as well as its url)."""
    return with_client_settings(config, resolved).model_dump_json()


def current_settings(config_json: str, server_address: str) -> tuple[str, str]:
    """A node actor's config and server address: those it was made with, or, when Ray
    restarted it, the manager's current ones (a restarted manager runs its embedded
    server anew, on another node when its own was lost, and restarts the node actors
    that talk to it)."""
    if not remote.restarted():
        return config_json, server_address
    config = PoolConfig.model_validate_json(config_json)
    try:
        actor = remote.find(manager_name(config.name), config.namespace)
        if actor is None:
            raise PoolNotFoundError(f"no manager of pool {config.name!r}")
        spec = ManagerHandle(actor, f"pool {config.name!r} manager").spec().result(START_TIMEOUT_S)
    except KVRayError as exc:
        logger.warning(
            "pool %s: a restarted actor did not get the pool's current server from the "
            "manager (%s); it keeps %s",
            config.name,
            exc,
            server_address,
        )
        return config_json, server_address
    current = PoolConfig.model_validate_json(spec.config_json)
    return actor_config(current, spec.resolved), spec.server_address


def on_this_node(config: PoolConfig) -> PoolConfig:
    """``config`` with what depends on the node filled in (called inside node actors):
    a Mooncake client advertises the address Ray knows its node by; a datasystem client
    connects to its node's worker (``yuanrong.node_worker_addresses``)."""
    return spec_of(config.backend).on_node(config, remote.node_ip())
