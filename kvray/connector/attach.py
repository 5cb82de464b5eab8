"""Attaching a connector process to its pool: joining the Ray cluster, finding the pool,
and what is checked and said once per process (the pool's settings against this node,
this engine's environment and UCM's)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvray import ucm
from kvray.backends.registry import spec_of
from kvray.config import ConnectorConfig, PoolConfig
from kvray.connector.instance import ucm_settings
from kvray.errors import ConfigError, PoolNotFoundError
from kvray.ucm import UcmSettings

if TYPE_CHECKING:
    from kvray.launcher import PoolHandles

logger = logging.getLogger(__name__)


def check_host_transfers(pool: PoolConfig) -> None:
    """The connector hands the pool's clients host shared memory in both placements (on
    a GPU or NPU the staged placement copies blocks to and from it), so a pool whose
    clients move device memory cannot serve it: refused here, naming the setting."""
    device = spec_of(pool.backend).device_setting(pool)
    if device is not None:
        raise ConfigError(
            f"kvray pool {pool.name!r} runs {device.field} {device.value!r} (its clients "
            "move NPU memory), but KVRayConnector moves KV blocks through host shared memory "
            f"(NPU engines via kv_placement 'staged'): start the pool with {device.field} "
            f"{device.host_value!r}"
        )


_logged: set[str] = set()
"""What this process has logged about a pool (the scheduler and workers of one process
attach alike): ``<check>:<pool name>``."""


def _first_time(check: str, pool: PoolConfig) -> bool:
    key = f"{check}:{pool.name}"
    if key in _logged:
        return False
    _logged.add(key)
    return True


def _doctor_once(pool: PoolConfig) -> None:
    """``kvray doctor``'s offline checks of the pool on this engine's node and environment,
    logged once per process (the scheduler and workers of one process attach alike)."""
    from kvray import doctor

    if not _first_time("doctor", pool):
        return
    for f in doctor.check_pool(pool, os.environ, doctor.Host.probe(), hash_seed=False):
        if f.level != "ok":
            logger.warning("kvray doctor: %s", f.line())


def _compare_config_once(pool: PoolConfig) -> None:
    """The pool's backend settings against what this engine's environment would make of
    them (the seeds' MOONCAKE_CONFIG_PATH, DS_WORKER_ADDR, ...), logged once per process."""
    from kvray.engine_env import config_differences

    if not _first_time("environment", pool):
        return
    diffs = config_differences(pool, os.environ)
    if diffs:
        logger.warning(
            "kvray pool %r was configured differently from this engine's environment, and "
            "its settings apply: %s. Fix: start the pool with this environment (`kvray down`, "
            "then `kvray up` with it set, or name the same settings in a --config / the "
            "connector's pool_config), or unset them here",
            pool.name,
            "; ".join(diffs),
        )


def _compare_ucm_once(pool: PoolConfig, settings: UcmSettings) -> None:
    """UCM's store settings against the pool's, and the UCM keys kvray ignores, logged
    once per process."""
    if not _first_time("ucm", pool):
        return
    diffs = ucm.differences(pool, settings.pool)
    if diffs:
        logger.warning(
            "kvray pool %r runs with other settings than UCM's (%s), and its settings apply: "
            "%s. Fix: start the pool with them (`kvray down`, then let the engine start the "
            "embedded pool, or `kvray up` with a config naming them)",
            pool.name,
            settings.source,
            "; ".join(diffs),
        )
    if settings.ignored:
        logger.info(
            "kvray: UCM settings without a kvray equivalent, ignored (%s): %s",
            settings.source,
            ", ".join(settings.ignored),
        )


def attach_pool(cfg: ConnectorConfig, local_workers: int = 1) -> PoolHandles:
    """Join the Ray cluster (:func:`kvray.embedded.connect`: the configured one, this
    node's, or the node's embedded pool) and find the pool (handles for this node)."""
    from kvray import launcher, remote
    from kvray.embedded import connect

    settings = ucm_settings(cfg)
    where = "this process's Ray cluster"
    if not remote.connected():
        where = connect(cfg.ray_address, cfg.namespace, cfg.pool_name, cfg.pool_config,
                        local_workers, settings.pool if settings else None)  # fmt: skip
    try:
        handles = launcher.attach(cfg.pool_name, cfg.namespace)
    except PoolNotFoundError as exc:
        raise PoolNotFoundError(
            f"no kvray pool {cfg.pool_name!r} (Ray namespace {cfg.namespace!r}) in {where}: "
            "start it with `kvray up` there (or unset RAY_ADDRESS and ray_address to let "
            "the engine run an embedded pool on its node)"
        ) from exc
    check_host_transfers(handles.config)
    _doctor_once(handles.config)
    _compare_config_once(handles.config)
    if settings is not None:
        _compare_ucm_once(handles.config, settings)
    if handles.config.backend != cfg.backend:
        raise ConfigError(
            f"kv_connector_extra_config.backend is {cfg.backend!r} but kvray pool "
            f"{cfg.pool_name!r} runs {handles.config.backend!r}: set backend to "
            f"{handles.config.backend!r} or attach to a {cfg.backend} pool (pool_name)"
        )
    return handles
