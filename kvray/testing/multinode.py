"""Two Ray nodes on one machine that share no network and no /dev/shm, as two real hosts.

Each node lives in its own network namespace, joined to the other by a veth pair (node A
is 10.77.0.1, node B 10.77.0.2; each also has its own loopback, which the other cannot
reach), and in its own mount namespace with its own tmpfs on /dev/shm and its own
/tmp/ray. So a server that listens on 127.0.0.1 on one node is out of the other's reach,
as on real hosts; a cross-node shared-memory assumption fails as on real hardware
(kvray's regions are refused on another node, Ray's object stores are separate);
Mooncake traffic between the nodes goes over TCP on the veth link. The addresses exist
only inside namespaces the harness creates: no traffic leaves them. Processes are put
on a node with ``nsenter`` into its namespaces; a driver joins Ray as that node through
``KVRAY_NODE_IP_ADDRESS``.
Needs root (namespaces), util-linux and iproute2. Used by ``tests/multinode`` and
``scripts/bench_store.py --cross-node``.

    with TwoNodeCluster(Path(tmp)) as cluster:
        cluster.run_script("B", "my_driver.py", "arg")
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

RAY = str(Path(sys.executable).with_name("ray"))
NODE_IPS = {"A": "10.77.0.1", "B": "10.77.0.2"}
RAY_TMP = "/tmp/ray"
"""Ray's default temp dir; each node gets its own (a bind mount in its mount namespace)."""
"""Each node's address on the link between them (inside the harness's namespaces only)."""
RESULT = "KVRAY-RESULT "
"""Marks a helper's answer on stdout (Ray may print other lines there)."""
_NODES_PROBE = (
    "import json, ray; ray.init(); "
    f"print({RESULT!r} + json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
)


def print_result(answer: object) -> None:
    """A helper process's JSON answer, marked so that :func:`result_of` finds it."""
    print(RESULT + json.dumps(answer), flush=True)


def result_of(stdout: str) -> Any:
    """The answer a helper printed with :func:`print_result` (its last one)."""
    answers = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if not answers:
        raise HarnessError(f"the helper printed no answer:\n{stdout[-3000:]}")
    return json.loads(answers[-1][len(RESULT) :])


class HarnessError(RuntimeError):
    """The harness could not start or run something; the message says what and why."""


def unavailable_reason() -> str | None:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for network and mount namespaces (CI runs as root)"
    if not (shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")):
        return "needs unshare, nsenter and ip (util-linux, iproute2)"
    # A network and mount namespace, with a veth pair inside (gone with the namespace).
    veth = "ip link add kvray-p0 type veth peer name kvray-p1"
    probe = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", veth], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create namespaces and a veth pair here: {probe.stderr.decode().strip()}"
    return None


@dataclass
class Node:
    name: str
    ip: str
    pid: int
    """The process that keeps the node's namespaces alive."""
    dev: str
    """Its end of the link between the nodes (a network device in its namespace)."""
    raylet: subprocess.Popen[bytes] | None = None
    """``ray start --block`` of the node."""

    def argv(self, *cmd: str) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", "-m", "--", *cmd]


class TwoNodeCluster:
    """Nodes ``A`` (the head) and ``B``, and the Ray cluster on them."""

    def __init__(
        self,
        tmp: Path,
        *,
        port: int = 6379,
        cpus: int = 4,
        gpus: int = 0,
        raylet_env: dict[str, str] | None = None,
    ) -> None:
        """``gpus``: the ``--num-gpus`` each node advertises (Ray resources only, slots
        for vLLM's Ray executor under ``kvray.testing.vllm_ray_cpu``); ``raylet_env``:
        extra environment of each node's Ray processes (their workers inherit it)."""
        self.tmp = tmp
        self.port = port
        self.cpus = cpus
        self.gpus = gpus
        self.raylet_env = dict(raylet_env or {})
        self.address = f"{NODE_IPS['A']}:{port}"
        self.nodes: dict[str, Node] = {}
        self._holders: list[subprocess.Popen[bytes]] = []

    def describe(self) -> dict[str, Any]:
        """What :meth:`attached` needs to run processes on this running harness."""
        return {
            "port": self.port,
            "raylet_env": self.raylet_env,
            "nodes": {n.name: [n.ip, n.pid, n.dev] for n in self.nodes.values()},
        }

    @classmethod
    def attached(cls, described: dict[str, Any], tmp: Path) -> TwoNodeCluster:
        """A handle to a harness that runs already (its :meth:`describe`), to run
        processes on its nodes; it starts and stops nothing."""
        cluster = cls(tmp, port=described["port"], raylet_env=described["raylet_env"])
        for name, (ip, pid, dev) in described["nodes"].items():
            cluster.nodes[name] = Node(name, ip, pid, dev)
        return cluster

    def __enter__(self) -> TwoNodeCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def env(self, node: Node, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # else Ray refuses a second node
            "RAY_AUTH_MODE": "disabled",
            "RAY_ADDRESS": self.address,
            "KVRAY_NODE_IP_ADDRESS": node.ip,
            "VLLM_HOST_IP": node.ip,  # vLLM's "this node's address" (else: the default route)
            # torch's gloo (vLLM's CPU process groups) binds where the host name resolves,
            # here a loopback address the other node cannot reach: the link instead.
            "GLOO_SOCKET_IFNAME": node.dev,
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def start(self) -> None:
        holder = ["unshare", "--net", "--mount", "--propagation", "private", "sleep", "infinity"]
        for name, ip in NODE_IPS.items():
            proc = subprocess.Popen(holder)
            self._holders.append(proc)
            node = Node(name, ip, proc.pid, f"kvray-{name.lower()}")
            self.nodes[name] = node
            _wait_ns(node.pid)
        a, b = self.nodes["A"], self.nodes["B"]
        # The link between the nodes: one veth pair, each end made inside its node.
        _ip("link", "add", a.dev, "netns", str(a.pid), "type", "veth",
            "peer", "name", b.dev, "netns", str(b.pid))  # fmt: skip
        os.makedirs(RAY_TMP, exist_ok=True)
        for node in (a, b):
            # Each node's own Ray temp dir, as on separate hosts: a `ray start --head`
            # here would otherwise record its address in this machine's
            # /tmp/ray/ray_current_cluster, where engines outside the harness that start
            # Ray without an address would find it (and fail to reach it).
            ray_tmp = self.tmp / f"ray-tmp-{node.name}"
            ray_tmp.mkdir(exist_ok=True)
            for cmd in (
                ("ip", "link", "set", "lo", "up"),
                ("ip", "addr", "add", f"{node.ip}/24", "dev", node.dev),
                ("ip", "link", "set", node.dev, "up"),
                ("mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", "/dev/shm"),
                ("mount", "--bind", str(ray_tmp), RAY_TMP),
            ):
                subprocess.run(node.argv(*cmd), check=True, capture_output=True)
        head = self.nodes["A"]
        head.raylet = self._ray_start(
            head, "--head", "--port", str(self.port), "--include-dashboard", "false"
        )
        self.wait_nodes(1)
        self.restart_node("B")

    def _ray_start(self, node: Node, *args: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"ray-{node.name}.log", "w") as log:
            return subprocess.Popen(
                node.argv(RAY, "start", "--block", "--node-ip-address", node.ip,
                          "--num-cpus", str(self.cpus), "--num-gpus", str(self.gpus),
                          "--disable-usage-stats", *args),
                env=self.env(node, **self.raylet_env), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def alive_nodes(self) -> list[str]:
        res = self.run_python("A", _NODES_PROBE, check=False, timeout=60)
        if res.returncode != 0 or RESULT not in res.stdout:
            return []
        return list(result_of(res.stdout))

    def wait_nodes(self, n: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                if node.raylet is not None and node.raylet.poll() is not None:
                    raise HarnessError(f"ray on node {node.name} exited:\n{self.log(node.name)}")
            if len(self.alive_nodes()) >= n:
                return
            time.sleep(2)
        raise HarnessError(f"{n} Ray node(s) not up in {timeout_s:.0f} s:\n{self.log('A')}")

    def kill_node(self, name: str) -> int:
        """Node loss: SIGKILL every process of node ``name`` (its raylet, object store,
        workers and kvray's actors there: all share its mount namespace); returns how
        many died."""
        node = self.nodes[name]
        ns = os.readlink(f"/proc/{node.pid}/ns/mnt")
        victims = 0
        for proc in Path("/proc").glob("[0-9]*"):
            if int(proc.name) == node.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(proc / "ns" / "mnt") == ns:
                    os.kill(int(proc.name), signal.SIGKILL)
                    victims += 1
        if node.raylet is not None:
            node.raylet.wait(30)
            node.raylet = None
        return victims

    def restart_node(self, name: str) -> None:
        """(Re)start node ``name``'s Ray node: a node that comes back after a loss."""
        node = self.nodes[name]
        node.raylet = self._ray_start(node, "--address", self.address)
        self.wait_nodes(len(self.nodes))

    def log(self, name: str) -> str:
        return (self.tmp / f"ray-{name}.log").read_text(errors="replace")[-4000:]

    def run_script(
        self,
        node: str,
        script: str,
        *args: str,
        check: bool = True,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``python SCRIPT ARGS`` as a process (a Ray driver) on ``node``."""
        return self._run(node, [script, *args], check, timeout, env)

    def run_python(
        self, node: str, code: str, *, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run(node, ["-c", code], check, timeout, None)

    def _run(
        self,
        node: str,
        args: list[str],
        check: bool,
        timeout: float,
        env: dict[str, str] | None,
    ) -> subprocess.CompletedProcess[str]:
        n = self.nodes[node]
        res = subprocess.run(
            n.argv(sys.executable, *args),
            env=self.env(n, **(env or {})), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and res.returncode != 0:
            raise HarnessError(f"{args[0]} on node {node} failed:\n{res.stderr[-6000:]}")
        return res

    def stop(self) -> None:
        for node in reversed(list(self.nodes.values())):
            if node.raylet is not None and node.raylet.poll() is None:
                node.raylet.send_signal(signal.SIGTERM)  # `ray start --block` stops its node
                try:
                    node.raylet.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(node.raylet.pid, signal.SIGKILL)
                    node.raylet.wait(10)
        for node in self.nodes.values():
            # Whatever a test left on the node (a killed node's leftovers) goes with it.
            self.kill_node(node.name)
        for holder in self._holders:
            holder.kill()
            holder.wait(10)


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


def _wait_ns(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` runs in its own network or mount namespace (unshare has run)."""
    mine = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "mnt")}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/ns/{ns}") != mine[ns] for ns in mine):
                return
        time.sleep(0.05)
    raise HarnessError(f"namespace holder {pid} did not start")
