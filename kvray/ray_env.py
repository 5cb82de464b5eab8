"""Joining or starting a Ray cluster the way kvray's tools and demos need it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import Any


def ray_init(
    address: str | None = None,
    *,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """``ray.init`` that stays on loopback when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``;
    returns the cluster's GCS address.

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
        return str(ray.get_runtime_context().gcs_address)
    env = os.environ if environ is None else environ
    if address == "local" and env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        kwargs.setdefault("_node_ip_address", "127.0.0.1")
        kwargs.setdefault("include_dashboard", False)
    node_ip = env.get("KVRAY_NODE_IP_ADDRESS")
    if node_ip:
        kwargs.setdefault("_node_ip_address", node_ip)
    kwargs.setdefault("log_to_driver", False)
    main_thread = threading.current_thread() is threading.main_thread()
    own = signal.getsignal(signal.SIGTERM) if main_thread else None
    ray.init(address=address, namespace=namespace, **kwargs)
    if main_thread:
        _keep_sigterm_handler(own)
    return str(ray.get_runtime_context().gcs_address)


def ray_shutdown() -> None:
    """Leave the Ray cluster (a cluster this process started ends with it)."""
    import ray

    ray.shutdown()


def _keep_sigterm_handler(own: object) -> None:
    """After ``ray.init``: SIGTERM goes to the process's own handler again, without a
    stack dump.

    ``ray.init`` replaces the SIGTERM handler with ``sys.exit`` and Ray's core worker adds
    a C-level handler that prints "*** SIGTERM received ..." and a stack before passing
    the signal on. In a vLLM engine (the connector joins Ray there) that turned vLLM's
    normal shutdown (its front end SIGTERMs the engine core, whose handler ends the busy
    loop cleanly) into a stack dump and a ``SystemExit`` in the middle of the loop.
    Setting a Python handler again (the process's own when it had one, else Ray's) drops
    the C-level one for SIGTERM only; crash signals keep Ray's dumps."""
    handler = own if callable(own) else signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)


def normal_priority(role: str) -> None:
    """Run every thread of this Ray worker process (a kvray actor) at niceness 0.

    Ray starts its worker processes at niceness 15 (its ``worker_niceness``), which is
    right for background tasks but not for actors on the engines' critical path: next to
    a busy engine at niceness 0 such a process gets a few percent of a core, and a pool
    hit's load and lookup wait for it. On Linux a niceness is a thread's, not the
    process's: the process's main thread and the threads Ray started before the actor's
    constructor (an async actor's event loop among them) stay at 15 unless each is
    reniced, and a starved event loop answers nothing while the engine's empty steps
    spin waiting for it (seen: a ``vllm serve`` whose saves stayed unanswered for
    seconds). Raising the priority back needs root or an ``RLIMIT_NICE`` that allows it;
    otherwise this warns once with Ray's own setting.
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, tid)
            if niceness > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            logging.getLogger(__name__).warning(
                "kvray %s runs at Ray's worker niceness %d and may not lower it (%s): loads "
                "and lookups then wait whenever an engine keeps the CPU busy; start Ray with "
                "RAY_worker_niceness=0 in its environment (e.g. `RAY_worker_niceness=0 ray "
                "start ...`)",
                role,
                niceness,
                exc,
            )
            return


OPENMP_BINDING = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")
"""The OpenMP settings that bind a process's threads to CPUs. vLLM's CPU backend sets one
of them for its workers (and preloads libgomp with ``LD_PRELOAD``); every program started
with them binds its first thread to the first CPU listed as OpenMP initializes, before
any of its code runs: Ray's gcs_server and raylet, each actor's process, mooncake_master."""


def without_cpu_binding(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without vLLM's OpenMP CPU binding (:data:`OPENMP_BINDING`), for the
    processes of a pool started from an engine's worker: with it, an embedded pool's whole
    Ray node ran on the one core where the worker busy-polls between steps, and its saves
    waited seconds for the node channel to be read on a loaded host."""
    return {k: v for k, v in env.items() if k not in OPENMP_BINDING}


def unpin_cpus() -> set[int] | None:
    """Let this process (and what it starts) run on every CPU of the machine; the CPUs it
    was pinned to before, or None when it was not pinned.

    vLLM's CPU worker pins itself to its cores (``VLLM_CPU_OMP_THREADS_BIND``), and a
    process forked from it inherits that: an embedded pool started from such a worker ran
    its whole Ray node (raylet, BackendClient, Lookup actor) on the one core where the
    worker busy-polls between steps, and its saves waited seconds for that core. The
    kernel keeps the result inside the process's cpuset."""
    before = os.sched_getaffinity(0)
    every = set(range(os.cpu_count() or 1))
    if before >= every:
        return None
    try:
        os.sched_setaffinity(0, every)
    except OSError:  # a cpuset that allows none of them beyond ours: keep what we have
        return None
    return before
