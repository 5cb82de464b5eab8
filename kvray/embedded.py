"""The embedded default: a node-local Ray cluster and kvray pool for engines started with
nothing else running (``vllm serve ... --kv-transfer-config '{"kv_connector":
"KVRayConnector", ...}'``), shared by every engine of the node, stopped with the last.

One *keeper* process per pool and node (``python -m kvray.embedded``) owns both: it
starts Ray on loopback (``ray.init`` of a new local cluster, so the cluster ends with the
keeper), starts the pool in it, writes its address to a state file and waits. Engine
processes find it through that file, under a start lock, and each holds a *shared* lock
on the pool's users file for its whole life (the kernel drops it when the process ends,
crashes included). The keeper checks every second, under the start lock, whether it can
take that lock *exclusively*: when it can, no engine is left, and after
``KVRAY_EMBEDDED_LINGER_S`` (5 s) without users it stops the pool and Ray and exits.
Holding the start lock for both the join and the check leaves no window in which a
joining engine could find a keeper on its way out.

Files live in ``KVRAY_RUN_DIR`` (default ``<tmp>/kvray-<uid>``), per Ray namespace and
pool name: ``<ns>.<pool>.json`` (state), ``.start.lock``, ``.users.lock``, ``.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvray.errors import ConfigError, EmbeddedPoolError
from kvray.ray_env import unpin_cpus, without_cpu_binding
from kvray.servers.process import why_unreachable
from kvray.shm import process_gone

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
"""How long an engine waits for a keeper to bring Ray and the pool up (a cold local Ray
takes 6-12 s and a pool a few more on a 2-core machine)."""

_held: list[IO[str]] = []  # users-lock files this process holds until it exits


def run_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    default = Path(tempfile.gettempdir()) / f"kvray-{os.getuid()}"
    return Path(env.get("KVRAY_RUN_DIR") or default)


@dataclass(frozen=True)
class Files:
    """The files of one embedded pool."""

    base: Path

    @classmethod
    def of(cls, namespace: str, name: str, environ: Mapping[str, str] | None = None) -> Files:
        d = run_dir(environ)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(d / f"{namespace}.{name}")

    @property
    def state(self) -> Path:
        return self.base.with_suffix(self.base.suffix + ".json")

    @property
    def start_lock(self) -> Path:
        return self.base.with_suffix(self.base.suffix + ".start.lock")

    @property
    def users_lock(self) -> Path:
        return self.base.with_suffix(self.base.suffix + ".users.lock")

    @property
    def log(self) -> Path:
        return self.base.with_suffix(self.base.suffix + ".log")


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float | None) -> Iterator[bool]:
    """Hold ``path`` exclusively; ``timeout_s`` None: try once. Yields whether it is held."""
    f = path.open("a+")
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is None or time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        f.close()  # releases the lock


def _alive(pid: int) -> bool:
    return not process_gone(pid)


def read_state(files: Files) -> dict[str, Any] | None:
    """The running keeper's state, or None (no file, unreadable, or its keeper is gone)."""
    try:
        state: dict[str, Any] = json.loads(files.state.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(state.get("pid", -1))):
        return None
    return state


def join(
    namespace: str,
    name: str,
    pool_config: str | None,
    world_size: int,
    *,
    timeout_s: float = START_TIMEOUT_S,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Join this node's embedded pool ``name``, starting its keeper if none runs; returns
    the keeper's state (``address``: the Ray cluster to join, ``auth_mode``). This process
    counts as a user of the pool until it exits."""
    files = Files.of(namespace, name)
    with _locked(files.start_lock, timeout_s) as held:
        if not held:
            raise EmbeddedPoolError(
                f"could not take {files.start_lock} in {timeout_s:.0f} s (another engine is "
                "starting the embedded kvray pool and did not finish): see "
                f"{files.log}, or start a pool yourself with `kvray up` and set RAY_ADDRESS"
            )
        state = read_state(files)
        started = state is None
        if state is None:
            state = _start_keeper(
                files, namespace, name, pool_config, world_size, timeout_s, overrides
            )
        users = files.users_lock.open("a+")
        fcntl.flock(users, fcntl.LOCK_SH)  # held until this process exits
        _held.append(users)
    how = "started" if started else f"joined (keeper pid {state['pid']})"
    logger.warning(
        "kvray: no Ray cluster configured (RAY_ADDRESS, ray_address): %s the embedded kvray "
        "pool %r (%s) on a local Ray at %s; it stops with the last engine using it. Log: %s",
        how,
        name,
        state.get("backend", "?"),
        state["address"],
        files.log,
    )
    return state


def _start_keeper(
    files: Files,
    namespace: str,
    name: str,
    pool_config: str | None,
    world_size: int,
    timeout_s: float,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    files.state.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvray.embedded", "--namespace", namespace, "--name", name]
    cmd += ["--world-size", str(world_size), "--daemonize"]
    if pool_config:
        cmd += ["--config", pool_config]
    if overrides:
        cmd += ["--overrides", json.dumps(overrides)]
    # Not vLLM's OpenMP binding of the worker this runs in: the pool's processes would
    # each pin themselves to the worker's first core (unpin_cpus cannot undo that).
    env = without_cpu_binding(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    with files.log.open("w") as log:
        # --daemonize: the keeper forks away from this process (vLLM kills its engines'
        # process trees at shutdown; the pool must outlive the engine that started it)
        # and prints its pid.
        out = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            close_fds=True,
            text=True,
            timeout=60,
        )
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        raise EmbeddedPoolError(
            f"the embedded kvray pool {name!r} did not start (exit {out.returncode}); its log "
            f"{files.log} ends:\n{_tail(files.log)}"
        )
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(files)
        if state is not None and state.get("pid") == pid:
            return state
        if not _alive(pid):
            raise EmbeddedPoolError(
                f"the embedded kvray pool {name!r} did not start (its keeper, pid {pid}, "
                f"exited); its log {files.log} ends:\n{_tail(files.log)}"
            )
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    raise EmbeddedPoolError(
        f"the embedded kvray pool {name!r} was not up after {timeout_s:.0f} s; its log "
        f"{files.log} ends:\n{_tail(files.log)}"
    )


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return "(no log)"


def _local_cluster(any_gcs: bool = False) -> str | None:
    """The Ray cluster ``ray start`` made on this node (the address Ray recorded for it),
    if it answers; a stale record is ignored. ``any_gcs`` (``RAY_ADDRESS=auto``): else any
    Ray GCS running on this node, as Ray's own ``auto`` does."""
    from kvray import remote  # (imports Ray: only where an engine looks for a cluster)

    for address in remote.local_clusters(any_gcs):
        if _on_this_node(address) and why_unreachable(address, 1.0) is None:
            return address
    return None


def _on_this_node(address: str) -> bool:
    """Whether ``host:port``'s host is an address of this machine (one it can bind). A
    record of another host's cluster (a copied /tmp, a network namespace's cluster) is
    not this node's, even where something answers there (a proxy that accepts any TCP
    connection, as on some sandboxes)."""
    host = address.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def connect(
    ray_address: str | None,
    namespace: str,
    name: str,
    pool_config: str | None,
    world_size: int,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Join the Ray cluster an engine process should use; returns how it was chosen.
    ``overrides``: pool settings (UCM's) an embedded pool this starts is made with.

    - an address configured (``ray_address``, else ``RAY_ADDRESS``): that cluster, after
      checking within seconds that it answers (a dead address is an error naming it,
      never Ray's minutes of retries);
    - else a cluster ``ray start`` made on this node, if it answers: it is joined;
    - else this node's embedded pool: joined, or started (:func:`join`).
    """
    from kvray.ray_env import ray_init

    address = ray_address or os.environ.get("RAY_ADDRESS")
    source = "ray_address" if ray_address else "RAY_ADDRESS"
    if address == "auto":
        local = _local_cluster(any_gcs=True)
        if local is None:
            raise ConfigError(
                f"{source} is 'auto' but no Ray cluster answers on this node: start one "
                f"(`ray start --head`, then `kvray up`), or unset {source} to let kvray run "
                "an embedded pool on this node"
            )
        ray_init(local, namespace=namespace)
        return f"this node's Ray cluster at {local} ({source}=auto)"
    if address:
        why = why_unreachable(address)
        if why is not None:
            raise ConfigError(
                f"the Ray cluster at {address} ({source}) does not answer ({why}): start it "
                f"(`ray start --head`, then `kvray up`), fix {source}, or unset it to let "
                "kvray run an embedded pool on this node"
            )
        ray_init(address, namespace=namespace)
        return f"cluster {address} ({source})"
    local = _local_cluster()
    if local is not None:
        ray_init(local, namespace=namespace)
        return f"this node's Ray cluster at {local}"
    state = join(namespace, name, pool_config, world_size, overrides=overrides)
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode != state["auth_mode"]:
        raise ConfigError(
            f"RAY_AUTH_MODE is {mode!r} in this engine but the embedded pool's Ray runs with "
            f"{state['auth_mode']!r}: use the same mode in every engine of the node"
        )
    os.environ["RAY_AUTH_MODE"] = state["auth_mode"]
    ray_init(state["address"], namespace=namespace)
    return f"embedded pool (local Ray at {state['address']})"


# ---- the keeper -------------------------------------------------------------------------


def keep(
    namespace: str,
    name: str,
    pool_config: str | None,
    world_size: int,
    linger_s: float,
    overrides: dict[str, Any] | None = None,
) -> int:
    from kvray import Pool
    from kvray.config import PoolConfig
    from kvray.ray_env import ray_init, ray_shutdown

    files = Files.of(namespace, name)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # A loopback-only cluster of this node's engines: no token unless the engine's
    # environment asked for one (then engines and keeper share it).
    auth = os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if pool_config:
        base = PoolConfig.from_file(pool_config)
        spec = {**base.model_dump(), "name": name, "namespace": namespace}
        if (overrides or {}).get("backend", base.backend) != base.backend:
            # UCM's store_pipeline names another backend than the file: the file's
            # backend sections are not that backend's; its common fields still apply.
            spec = {k: v for k, v in spec.items() if k in PoolConfig.model_fields}
        source = pool_config
    else:
        spec = {"name": name, "namespace": namespace, "world_size": world_size}
        source = "embedded default"
    for key, value in (overrides or {}).items():  # UCM's settings (kvray.ucm)
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    if overrides:
        source += " with UCM's settings"
    config = PoolConfig.from_dict(spec, source=source)
    if config.world_size < world_size:
        raise ConfigError(
            f"{pool_config}: world_size {config.world_size} but the engine runs {world_size} "
            "workers on this node: raise world_size"
        )
    print(f"starting a local Ray (loopback) for kvray pool {name!r} ...", flush=True)
    address = ray_init("local", namespace=namespace, num_cpus=max(2, os.cpu_count() or 2))
    pool = Pool.start(config)
    state = {
        "pid": os.getpid(),
        "address": address,
        "auth_mode": auth,
        "backend": config.backend,
        "server": pool.server_address,
        "world_size": config.world_size,
    }
    tmp = files.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(files.state)
    print(f"kvray pool {name!r} is up: {json.dumps(state)}", flush=True)
    idle_since: float | None = None
    try:
        while not stop:
            time.sleep(1.0)
            with _locked(files.start_lock, None) as held:
                if not held:
                    continue  # an engine is joining
                with _locked(files.users_lock, None) as unused:
                    if not unused:
                        idle_since = None
                        continue
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= linger_s:
                        print("no engine uses the pool any more: stopping", flush=True)
                        files.state.unlink(missing_ok=True)
                        break
    finally:
        files.state.unlink(missing_ok=True)
        pool.shutdown()
        ray_shutdown()
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvray.embedded", description="keeper of a node's embedded kvray pool"
    )
    parser.add_argument("--namespace", default="kvray")
    parser.add_argument("--name", default="kvray")
    parser.add_argument("--config", help="pool config file (YAML or JSON)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--overrides", help="pool settings (JSON) over the config's")
    parser.add_argument(
        "--daemonize", action="store_true", help="fork away, print the keeper's pid, return"
    )
    args = parser.parse_args(argv)
    if args.daemonize:
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            os._exit(0)
        os.setsid()  # its own session, and (its parent gone) no engine's descendant
        os.dup2(2, 1)  # the log
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    logging.basicConfig(level=logging.INFO)
    pinned = unpin_cpus()  # before Ray starts: its processes inherit this
    if pinned is not None:
        logging.getLogger(__name__).info(
            "the engine process that started this pool ran on CPUs %s only: the pool runs on "
            "all of them",
            sorted(pinned),
        )
    linger = float(os.environ.get("KVRAY_EMBEDDED_LINGER_S", "5"))
    overrides = json.loads(args.overrides) if args.overrides else None
    return keep(args.namespace, args.name, args.config, args.world_size, linger, overrides)


if __name__ == "__main__":
    sys.exit(main())
