"""The ``yuanrong`` backend against real openYuanrong datasystem workers: what the shared
contract suite does not cover (key rules, a second worker, a worker crash, a full
worker, embedded and multi-worker pools, the production-style cluster script)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray

from kvray import Pool
from kvray.backends.base import KeyStatus
from kvray.backends.keycodec import YUANRONG
from kvray.config import DatasystemWorkerConfig, YuanrongConfig
from kvray.errors import BackendUnavailableError, ConfigError
from kvray.naming import manager_name, region_prefix
from kvray.servers.datasystem import DatasystemWorker
from kvray.shm import mapped_regions

from .backends import addr, blocks
from .backends import yuanrong_client as client
from .conftest import pool_actor_names, small_config, stop_and_check

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


async def test_large_multi_piece_batches_are_byte_exact(ds_worker):
    # 24 x 1 MiB in 8 pieces each: above the 8 MiB split threshold (several threads) and
    # above the 500 KB size from which the worker hands out shared memory.
    b = client(ds_worker.address)
    src, dst = blocks(24, 1 << 20, seed=1), np.zeros((24, 1 << 20), np.uint8)
    keys = [f"large-{i}" for i in range(24)]
    assert await b.put(keys, *addr(src, 8)) == [KeyStatus.OK] * 24
    assert await b.get(keys, *addr(dst, 8)) == [KeyStatus.OK] * 24
    assert np.array_equal(src, dst)
    # Read back in another piece split: a key is the concatenation of its pieces.
    dst[:] = 0
    assert await b.get(keys, *addr(dst, 2)) == [KeyStatus.OK] * 24
    assert np.array_equal(src, dst)
    await b.close()


KEY_CASES = [
    "plain-key_ok:1;2=3+4*5(6)!@#%^",  # every allowed character: kept as it is
    "model.v1/layer 0",  # '.', '/' and space: rewritten
    "ünïcode-ключ",
    "a" * 255,  # longest allowed
    "a" * 256,  # one too long
    "a" * 300 + "x",
    "a" * 300 + "y",  # same cut-off prefix as the one above
    "looks-encoded%h" + "0" * 32,  # mimics the codec's suffix: rewritten too
    "looks-encoded",
    "model.v1@float16-b16-h2x64@tp0@pp0@" + "ab" * 32,  # a kvray key with a dotted namespace
]


async def test_key_encoding_edge_cases(ds_worker):
    encoded = [YUANRONG.encode(k) for k in KEY_CASES]
    assert len(set(encoded)) == len(KEY_CASES)
    ds_rule = re.compile(r"^[a-zA-Z0-9\-_!@#%\^\*\(\)\+\=\:;]{1,255}$")  # the SDK's own
    assert all(ds_rule.match(e) for e in encoded), encoded
    assert encoded[0] == KEY_CASES[0] and encoded[3] == KEY_CASES[3]
    b = client(ds_worker.address)
    src, dst = blocks(len(KEY_CASES), 4096, seed=2), np.zeros((len(KEY_CASES), 4096), np.uint8)
    keys = [f"{i}-{k}" for i, k in enumerate(KEY_CASES)]  # fresh per run of the suite
    keys = [k + str(time.monotonic_ns()) for k in keys]
    # The datasystem silently drops keys it rejects from a batch: every key must land.
    assert await b.put(keys, *addr(src)) == [KeyStatus.OK] * len(keys)
    assert await b.exists(keys) == [True] * len(keys)
    assert await b.get(keys, *addr(dst)) == [KeyStatus.OK] * len(keys)
    assert np.array_equal(src, dst)
    assert await b.remove(keys) == [KeyStatus.OK] * len(keys)
    await b.close()


async def test_second_worker_on_the_same_metastore_serves_another_rank(ds_worker, ds_worker2):
    rank0, rank1 = client(ds_worker.address), client(ds_worker2.address)
    src, dst = blocks(6, 1 << 20, seed=3), np.zeros((6, 1 << 20), np.uint8)
    keys = [f"cross-{time.monotonic_ns()}-{i}" for i in range(6)]
    assert await rank0.put(keys[:4], *addr(src[:4])) == [KeyStatus.OK] * 4
    assert await rank1.exists(keys) == [True] * 4 + [False] * 2
    assert await rank1.get(keys, *addr(dst)) == [KeyStatus.OK] * 4 + [KeyStatus.NOT_FOUND] * 2
    assert np.array_equal(src[:4], dst[:4]) and not dst[4:].any()
    assert await rank1.remove(keys[:1]) == [KeyStatus.OK]
    assert await rank0.exists(keys[:1]) == [False]
    await rank0.close()
    await rank1.close()


@pytest.mark.timeout(120)
async def test_worker_killed_mid_use_then_restarted():
    worker = DatasystemWorker(DatasystemWorkerConfig(shared_memory_size="128MB", threads=2))
    worker.start()
    try:
        b = client(worker.address, request_timeout_ms=1500)
        src, dst = blocks(4, 1 << 20, seed=4), np.zeros((4, 1 << 20), np.uint8)
        keys = [f"crash-{i}" for i in range(4)]
        assert await b.put(keys, *addr(src)) == [KeyStatus.OK] * 4
        worker.kill()
        for op in (
            lambda: b.put(["after-crash"], *addr(src[:1])),
            lambda: b.get(keys, *addr(dst)),
            lambda: b.exists(keys),
        ):
            started = time.monotonic()
            with pytest.raises(BackendUnavailableError, match="request_timeout_ms=1500"):
                await op()
            print(f"failed in {time.monotonic() - started:.2f} s")  # shown with -s
        assert not await b.health()
        assert not dst.any(), "a failed read must not have written the destination"
        worker.restart()
        # The same client reconnects by itself; the crash lost the worker's memory, so
        # the old keys are misses now, never stale bytes.
        deadline = time.monotonic() + 30
        while not await b.health():
            assert time.monotonic() < deadline, "client did not reconnect after the restart"
            time.sleep(0.5)
        assert await b.get(keys, *addr(dst)) == [KeyStatus.NOT_FOUND] * 4
        assert await b.put(keys, *addr(src)) == [KeyStatus.OK] * 4
        assert await b.get(keys, *addr(dst)) == [KeyStatus.OK] * 4
        assert np.array_equal(src, dst)
        await b.close()
    finally:
        stop_and_check(worker)


@pytest.mark.timeout(150)
async def test_full_worker_evicts_or_reports_pool_full():
    worker = DatasystemWorker(DatasystemWorkerConfig(shared_memory_size="64MB", threads=2))
    worker.start()
    try:
        src = blocks(1, 8 << 20, seed=5)
        dst = np.zeros_like(src)
        # keep: blocks stay; a put into the full worker reports POOL_FULL (after the
        # worker's own retries for request_timeout_ms), earlier blocks stay readable.
        keep = client(worker.address, write_mode="keep", request_timeout_ms=1000)
        statuses = []
        for i in range(12):  # 96 MB into 64 MB
            statuses += await keep.put([f"keep-{i}"], *addr(src))
        assert KeyStatus.POOL_FULL in statuses
        stored = statuses.index(KeyStatus.POOL_FULL)
        assert stored >= 3 and set(statuses[stored:]) == {KeyStatus.POOL_FULL}
        assert await keep.get(["keep-0"], *addr(dst)) == [KeyStatus.OK]
        assert np.array_equal(src, dst)
        assert await keep.exists([f"keep-{stored}"]) == [False]
        await keep.remove([f"keep-{i}" for i in range(stored)])
        await keep.close()
        # evict (the default): every put lands, older blocks make room.
        evict = client(worker.address)
        for i in range(12):
            assert await evict.put([f"evict-{i}"], *addr(src)) == [KeyStatus.OK]
        present = await evict.exists([f"evict-{i}" for i in range(12)])
        assert present[-1] and not all(present)
        many = np.zeros((12, 8 << 20), np.uint8)  # alive while the backend writes into it
        got = await evict.get([f"evict-{i}" for i in range(12)], *addr(many))
        assert set(got) <= {KeyStatus.OK, KeyStatus.NOT_FOUND} and got[-1] is KeyStatus.OK
        ok = [i for i, g in enumerate(got) if g is KeyStatus.OK]
        assert all(np.array_equal(many[i], src[0]) for i in ok)
        assert not many[[i for i, g in enumerate(got) if g is not KeyStatus.OK]].any()
        await evict.close()
    finally:
        stop_and_check(worker)


def test_npu_device_path_needs_torch_npu_here():
    """What can run here of the NPU path: choosing it without torch_npu is a clear error
    before any device call."""
    if glob.glob("/dev/davinci[0-9]*"):
        pytest.skip("an Ascend NPU is present: the device tests below apply")
    from kvray.backends.yuanrong_npu import npu_device_id

    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        npu_device_id()


@pytest.mark.skipif(
    not glob.glob("/dev/davinci[0-9]*"),
    reason="the NPU device path (HeteroClient mset_d2h/mget_h2d) needs an Ascend NPU and "
    "its driver; this machine has none, so it has not run here",
)
async def test_npu_device_path_round_trip(ds_worker):
    import torch

    from kvray.backends.yuanrong_npu import YuanrongDeviceBackend

    b = YuanrongDeviceBackend(
        YuanrongConfig(worker_address=ds_worker.address, device="npu"), ds_worker.address
    )
    src = torch.randint(0, 255, (4, 1 << 16), dtype=torch.uint8, device="npu")
    dst = torch.zeros_like(src)
    keys = [f"npu-{time.monotonic_ns()}-{i}" for i in range(4)]
    ptrs = [[int(r.data_ptr())] for r in src]
    assert await b.put(keys, ptrs, [[1 << 16]] * 4) == [KeyStatus.OK] * 4
    assert (
        await b.get(keys, [[int(r.data_ptr())] for r in dst], [[1 << 16]] * 4) == [KeyStatus.OK] * 4
    )
    assert torch.equal(src.cpu(), dst.cpu())
    await b.close()


# ---- pools ---------------------------------------------------------------------------


def test_embedded_worker_pool_lifecycle(ray_cluster):
    cfg = small_config(None, backend="yuanrong")
    pool = Pool.start(cfg)
    manager = ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
    spec = ray.get(manager.spec.remote())
    assert spec.embedded and spec.server_alive and spec.server_kind == "datasystem worker"
    worker = psutil.Process(spec.server_pid)
    assert "datasystem_worker" in worker.name() or "datasystem_worker" in " ".join(worker.cmdline())
    home = next(a.split("=", 1)[1] for a in worker.cmdline() if a.startswith("--log_dir="))
    home = str(Path(home).parent)
    assert Path(home).is_dir()
    value = np.arange(4096, dtype=np.uint8)
    pool.put(f"{cfg.name}-v", value)
    assert np.array_equal(pool.get(f"{cfg.name}-v", shape=(4096,)), value)
    status = pool.stats()
    assert "embedded datasystem worker" in status.table()
    pool.shutdown()
    assert not psutil.pid_exists(spec.server_pid) or (
        psutil.Process(spec.server_pid).status() == psutil.STATUS_ZOMBIE
    )
    assert not Path(home).exists(), "the pool's worker directory was left behind"
    assert glob.glob(f"/dev/shm/{region_prefix(cfg.name)}-*") == []  # no file, ever
    mapped = mapped_regions(region_prefix(cfg.name) + "-")  # not pool t80's for pool t8
    others = {p: n for p, n in mapped.items() if p != os.getpid()}
    assert others == {}, "a process other than the driver still maps the pool's regions"
    assert pool_actor_names(cfg) == []


def test_clients_use_their_nodes_worker(ray_cluster, ds_worker, ds_worker2):
    """``node_worker_addresses``: this node's clients connect to the worker mapped to its
    IP (here ds_worker2, not the pool's ``worker_address``); a node with no entry is
    refused with the field and the fix named."""
    node_ip = ray.util.get_node_ip_address()
    cfg = small_config(
        None,
        backend="yuanrong",
        yuanrong={
            "worker_address": ds_worker.address,
            "node_worker_addresses": {node_ip: ds_worker2.address},
        },
    )
    with Pool.start(cfg) as pool:
        infos = [r.segment for r in pool.stats().ranks]
        assert infos == [f"worker {ds_worker2.address}"] * 2
        value = np.random.default_rng(6).integers(0, 256, 1 << 20, dtype=np.uint8)
        pool.put(f"{cfg.name}-x", value, rank=0)
        got = pool.get(f"{cfg.name}-x", shape=value.shape, rank=1)
        assert np.array_equal(got, value)
        assert "external datasystem worker" in pool.stats().table()
        pool.shutdown()
    assert ds_worker.alive() and ds_worker2.alive(), "external workers are not the pool's"
    other = small_config(
        None,
        backend="yuanrong",
        yuanrong={
            "worker_address": ds_worker.address,
            "node_worker_addresses": {"10.255.0.1": ds_worker2.address},
        },
    )
    with pytest.raises(ConfigError, match=f"no worker for node {node_ip}"):
        Pool.start(other)
    assert pool_actor_names(other) == []


def test_env_configured_pool_reads_ds_variables(ray_cluster, ds_worker, tmp_path):
    from kvray.config import PoolConfig

    env = {
        "DS_WORKER_ADDR": ds_worker.address,
        "DATASYSTEM_CLIENT_LOG_DIR": str(tmp_path / "client-logs"),
        "DS_ENABLE_EXCLUSIVE_CONNECTION": "0",
        "DS_ENABLE_REMOTE_H2D": "0",
    }
    cfg = PoolConfig.from_dict(
        {"name": "yrenv", "namespace": "kvray-test", "backend": "yuanrong", "detached": False},
        environ=env,
    )
    assert cfg.yuanrong.worker_address == ds_worker.address
    assert not cfg.yuanrong.enable_exclusive_connection
    with Pool.start(cfg) as pool:
        pool.put("yrenv-k", np.ones(64, np.uint8))
        assert pool.exists(["yrenv-k"]) == [True]
        pool.shutdown()
    assert any((tmp_path / "client-logs").iterdir()), "the SDK did not log where it was told"


@pytest.mark.timeout(170)
def test_production_style_cluster_script(tmp_path):
    """etcd + two workers through dscli, as scripts/datasystem_cluster.py runs them."""
    script = [sys.executable, str(REPO / "scripts" / "datasystem_cluster.py")]
    home = tmp_path / "cluster"
    up = subprocess.run(
        [*script, "up", "--dir", str(home), "--workers", "2", "--shared-memory-mb", "128"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        cluster = json.loads((home / "cluster.json").read_text())
        pids = [cluster["etcd"]["pid"]] + [w["pid"] for w in cluster["workers"]]
        assert all(psutil.pid_exists(p) for p in pids)
        addresses = [w["address"] for w in cluster["workers"]]
        assert up.stdout.count("export DS_WORKER_ADDR=") == 2
        probe = (
            "import asyncio, sys, numpy as np\n"
            "from tests.integration.backends import yuanrong_client as client, addr, blocks\n"
            "async def main():\n"
            "    a, b = client(sys.argv[1]), client(sys.argv[2])\n"
            "    src, dst = blocks(2, 1 << 20, 7), np.zeros((2, 1 << 20), np.uint8)\n"
            "    assert [s.value for s in await a.put(['p0', 'p1'], *addr(src))] == ['ok'] * 2\n"
            "    assert [s.value for s in await b.get(['p0', 'p1'], *addr(dst))] == ['ok'] * 2\n"
            "    assert np.array_equal(src, dst)\n"
            "asyncio.run(main())\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", probe, *addresses],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    finally:
        down = subprocess.run(
            [*script, "down", "--dir", str(home)], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )
    assert not home.exists()
