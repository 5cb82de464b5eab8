"""Joining or starting a Ray cluster the way kvray's tools and demos need it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any


def ray_init(
    address: str | None = None,
    *,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """``ray.init`` that stays on loopback when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``.

    With that variable set Ray binds 127.0.0.1, but a new local cluster must also be
    told its node address, or it advertises the machine's external one. ``address=
    "local"`` always starts a new cluster; ``None`` joins ``RAY_ADDRESS`` or the cluster
    ``ray start`` made on this node, else starts one (Ray's own rule).

    ``KVRAY_NODE_IP_ADDRESS`` picks the Ray node a process joins as when several Ray nodes
    share its host (Ray's ``--node-ip-address`` of that node): kvray's clients are the
    ones of the node a process joins as, and its shared memory must be theirs.
    """
    import ray

    if ray.is_initialized():
        return
    env = os.environ if environ is None else environ
    if address == "local" and env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        kwargs.setdefault("_node_ip_address", "127.0.0.1")
        kwargs.setdefault("include_dashboard", False)
    node_ip = env.get("KVRAY_NODE_IP_ADDRESS")
    if node_ip:
        kwargs.setdefault("_node_ip_address", node_ip)
    kwargs.setdefault("log_to_driver", False)
    ray.init(address=address, namespace=namespace, **kwargs)


def normal_priority(role: str) -> None:
    """Run this Ray worker process (a kvray actor) at niceness 0.

    Ray starts its worker processes at niceness 15 (its ``worker_niceness``), which is
    right for background tasks but not for actors on the engines' critical path: next to
    a busy engine at niceness 0 such a process gets a few percent of a core, and a pool
    hit's load and lookup wait for it. Raising the priority back needs root or an
    ``RLIMIT_NICE`` that allows it; otherwise this warns once with Ray's own setting.
    """
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "kvray %s runs at Ray's worker niceness %d and may not lower it (%s): loads and "
            "lookups then wait whenever an engine keeps the CPU busy; start Ray with "
            "RAY_worker_niceness=0 in its environment (e.g. `RAY_worker_niceness=0 ray start "
            "...`)",
            role,
            os.getpriority(os.PRIO_PROCESS, 0),
            exc,
        )
