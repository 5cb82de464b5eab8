"""What a running pool listens on: every socket that starting a pool
and using it opens (its embedded server, its node actors, the Ray workers that host them),
listed from the kernel's table with its process. Everything listens on loopback except
Mooncake's transfer engine inside each Mooncake client process (BackendClient and Lookup
actors), which opens its TCP data port on all interfaces with no setting to change it:
docs/security.md, "What else listens", says so and how to deploy around it."""

from __future__ import annotations

import ipaddress

import numpy as np
import psutil
import pytest
import ray

from kvray.keys import KeySpace, KVLayout, chain_block_hashes
from kvray.naming import manager_name

from .conftest import small_config, users_lease

pytestmark = pytest.mark.integration

MOONCAKE_CLIENTS = ("ray::BackendClientActor", "ray::LookupActor")
"""Process titles of the actors that hold a Mooncake client (Ray titles an actor's worker
``ray::<class>`` and ``ray::<class>.<method>`` while it runs one)."""


def _listening() -> dict[tuple[str, int], int | None]:
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}  # not another xdist worker's
    return {
        (c.laddr.ip, c.laddr.port): c.pid
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    }


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def _title(pid: int | None) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:80] if pid else "?"
    except psutil.Error:
        return "(gone)"


@pytest.mark.parametrize("backend", ["mooncake", "yuanrong"])
def test_a_running_pool_listens_on_loopback_but_mooncakes_data_port(ray_cluster, backend):
    from kvray import Pool

    before = _listening()
    # No address: kvray runs the server itself. Rank 1 reads what rank 0's segment holds,
    # under the users' read lease.
    lease = {"master": users_lease()} if backend == "mooncake" else {}
    cfg = small_config(None, backend=backend, **lease)
    pool = Pool.start(cfg)
    try:
        keys = [f"exposure-{i}" for i in range(4)]
        for rank in range(cfg.world_size):  # every rank's client made and used
            pool.put(keys, [np.full(4096, i, np.uint8) for i in range(4)], rank=rank)
            got = pool.get(keys, shape=(4096,), dtype=np.uint8, rank=rank)
            assert [int(x[0]) for x in got] == [0, 1, 2, 3]
        space = KeySpace("exposure", KVLayout("float16", 16, 8, 128).tag())
        assert pool.lookup(space, list(chain_block_hashes(list(range(64)), 16))) == 0
        manager = ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
        server = psutil.Process(ray.get(manager.spec.remote()).server_pid)
        server_pids = {server.pid, *(c.pid for c in server.children(recursive=True))}
        new = {addr: pid for addr, pid in _listening().items() if addr not in before}
        titles = {pid: _title(pid) for pid in new.values()}
    finally:
        pool.shutdown()

    table = "\n".join(f"  {ip}:{port}  pid {pid}  {titles[pid]}" for (ip, port), pid in new.items())
    print(f"listening sockets the {backend} pool opened:\n{table}")
    assert any(pid in server_pids for pid in new.values()), f"no server socket seen:\n{table}"
    wide = {addr: pid for addr, pid in new.items() if not _loopback(addr[0])}
    if backend != "mooncake":
        assert not wide, f"not on loopback:\n{table}"
        return
    # Mooncake: only its clients' transfer-engine data port, never the master's ports.
    assert wide, "Mooncake's data port was expected on all interfaces (docs/security.md says so)"
    for (ip, port), pid in wide.items():
        assert pid not in server_pids, f"the master listens on {ip}:{port}:\n{table}"
        assert titles[pid].startswith(MOONCAKE_CLIENTS), f"{ip}:{port} by {titles[pid]}"
