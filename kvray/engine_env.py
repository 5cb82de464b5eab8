"""The settings the seeds export in the vLLM launch script, brought to the pool's actors.

vLLM-Ascend and UCM deployments set their backends' native knobs in the engine's
environment (``ASCEND_CONNECT_TIMEOUT``, ``HCCL_RDMA_TIMEOUT``, ``MC_*``, ...), where the
backend's client reads them. kvray's clients run in Ray actors, which never see the
engine's environment, so:

- the native knobs (:func:`forwarded`) travel with the request that creates a node's
  actors (each actor's ``runtime_env``); a process that finds them already made with other
  values is told which, and the fix (:func:`env_differences`);
- the variables that configure the pool itself (``MOONCAKE_CONFIG_PATH``,
  ``DS_WORKER_ADDR``, ``MMC_LOCAL_CONFIG_PATH``, ...) are read where the pool is
  configured; an engine whose environment would configure it differently is told which
  fields differ, and the fix, at attach (:func:`config_differences`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvray.backends.registry import SPECS, spec_of

DEVICE_PREFIXES = ("ASCEND_", "HCCL_", "ACL_", "GLOG_")
"""Native knobs of CANN/HCCL (``ASCEND_*``, ``HCCL_*``, ``ACL_*``) and glog, whatever the
backend."""

FORWARD_PREFIXES = DEVICE_PREFIXES + tuple(p for s in SPECS.values() for p in s.forward_prefixes)
"""Those, and the backends' own (Mooncake's transfer engine and store client ``MC_*``, its
SSD offload ``MOONCAKE_OFFLOAD_*``)."""

NOT_FORWARDED = frozenset(
    {
        # Device selection is per engine rank, not per pool client.
        "ASCEND_RT_VISIBLE_DEVICES",
        "ASCEND_VISIBLE_DEVICES",
        # Configure the pool (read where it is configured; compared at attach).
        *(v for s in SPECS.values() for v in s.config_vars),
    }
)


def forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The native backend knobs of ``environ`` that a pool's actors should run with."""
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(FORWARD_PREFIXES) and k not in NOT_FORWARDED
    }


def env_differences(actors_env: Mapping[str, str], mine: Mapping[str, str]) -> list[str]:
    """``VAR: the actors' value, this process's`` for every forwarded knob that differs
    (set on one side only included)."""
    out = []
    for var in sorted(set(actors_env) | set(mine)):
        theirs, ours = actors_env.get(var), mine.get(var)
        if theirs != ours:
            out.append(f"{var}: the pool's clients {_show(theirs)}, this process {_show(ours)}")
    return out


def config_differences(pool: Any, environ: Mapping[str, str]) -> list[str]:
    """The fields of the running pool's backend section (``pool``: its ``PoolConfig``)
    that this process's environment would set otherwise, as ``field: pool X, environment
    Y (from VARS)``; empty when the environment sets none of the backend's
    :attr:`~kvray.backends.registry.BackendSpec.config_vars`."""
    from kvray.config import PoolConfig
    from kvray.errors import ConfigError

    spec = spec_of(pool.backend)
    names = [v for v in spec.config_vars if v in environ]
    if not names:
        return []
    source = ", ".join(names)
    try:
        mine = PoolConfig.from_dict({"backend": pool.backend}, environ)
    except ConfigError as exc:
        return [f"this process's {source} does not make a valid config: {exc}"]
    out = []
    for section in spec.env_sections:
        ours = getattr(mine, section).model_dump()
        theirs = getattr(pool, section).model_dump()
        for key in ours:
            if ours[key] != theirs.get(key):
                out.append(
                    f"{section}.{key}: pool {theirs.get(key)!r}, this process's environment "
                    f"{ours[key]!r} (from {source})"
                )
    return out


def _show(value: str | None) -> str:
    return "unset" if value is None else repr(value)
