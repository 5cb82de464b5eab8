"""Store benchmark: kvray's data plane against the backend's raw client API and memcpy.

One run measures, on the same machine and bytes, for ``--backend mooncake`` (default)
or ``--backend yuanrong``:

- ``memcpy``: numpy copy of the whole payload (the ceiling of any host-memory path);
- ``raw``: the backend's own zero-copy batch calls from an in-process client against its
  own server (the baseline): Mooncake ``batch_put_from`` / ``batch_get_into`` against a
  ``mooncake_master``; datasystem ``mcreate`` + copy + ``mset_buffer`` / ``get_buffers``
  + copy against a ``datasystem_worker``;
- ``kvray``: ``Pool.put`` / ``Pool.get`` of blocks living in a kvray shared region
  (what the vLLM connector does: one Ray call per batch, bytes moved by the rank's
  BackendClient actor, nothing through Ray's object store);
- ``kvray staged``: the same for ordinary arrays, copied through the staging window;
- prefix lookup latency of ``blocks`` hashes through the Lookup actor.

Each figure is the median of ``--reps`` repetitions after one warm-up (the first pass
over fresh shared memory faults its pages in and is several times slower).

``--cross-node`` measures gets whose blocks live on another node instead: on two Ray
nodes of this machine that share no /dev/shm (``kvray.testing.multinode``, needs root),
a pool started on node A stores the blocks in A's segment; on node B, kvray's
``Pool.get`` (B's BackendClient actor reads A's segment into B's shared region) and the
raw Mooncake client in the B driver process (``batch_get_into`` from A's segment, the
baseline) fetch them, reps interleaved, every rep recorded.

    .venv/bin/python scripts/bench_store.py --json bench-results/bench_store.json
    .venv/bin/python scripts/bench_store.py --cross-node --json bench-results/bench_cross_node.json
    .venv/bin/python scripts/bench_store.py --backend yuanrong \
        --json bench-results/bench_store_yuanrong.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402

from kvray.keys import KeySpace, KVLayout, chain_block_hashes  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    name: str, reps: int, setup: Callable[[], object], run: Callable[[], object]
) -> list[float]:
    """Warm-up once, then ``reps`` timed runs, each after ``setup``."""
    times = []
    for rep in range(reps + 1):
        setup()
        dt = timed(run)
        if rep:
            times.append(dt)
        log(f"   {name:<18} rep {rep}/{reps}{' (warm-up)' if rep == 0 else ''}: {dt * 1e3:8.1f} ms")
    return times


def bench_memcpy(src: np.ndarray, dst: np.ndarray, reps: int) -> float:
    times = measure("memcpy", reps, lambda: None, lambda: np.copyto(dst, src))
    return src.nbytes / statistics.median(times) / 1e9


def lookup_space() -> KeySpace:
    return KeySpace("bench", KVLayout("float16", 16, 8, 128).tag())


def lookup_hashes(blocks: int) -> list[bytes]:
    return list(chain_block_hashes(list(range(blocks * 16)), 16))


def bench_raw_yuanrong(
    src: np.ndarray,
    dst: np.ndarray,
    blocks: int,
    block: int,
    segment: int,
    reps: int,
) -> tuple[float, float]:
    import ctypes

    from kvray.backends.yuanrong import import_datasystem
    from kvray.config import DatasystemWorkerConfig
    from kvray.datasystem import DatasystemWorker

    ds = import_datasystem()
    worker = DatasystemWorker(DatasystemWorkerConfig(shared_memory_size=segment), name="bench")
    worker.start()
    try:
        host, port = worker.address.rsplit(":", 1)
        client = ds.KVClient(
            host, int(port), connect_timeout_ms=5000, enable_exclusive_connection=True
        )
        client.init()
        mode = ds.WriteMode.NONE_L2_CACHE_EVICT  # as kvray writes by default
        keys = [f"raw-{i}" for i in range(blocks)]

        def put() -> None:
            for lo in range(0, blocks, 1000):
                part = keys[lo : lo + 1000]
                bufs = client.mcreate(part, [block] * len(part), mode, 0)
                for i, buf in enumerate(bufs, lo):
                    view = np.frombuffer(buf.MutableData(), dtype=np.uint8)
                    ctypes.memmove(view.ctypes.data, src.ctypes.data + i * block, block)
                client.mset_buffer(bufs)

        def get() -> None:
            for lo in range(0, blocks, 1000):
                bufs = client.get_buffers(keys[lo : lo + 1000], 0)
                for i, buf in enumerate(bufs, lo):
                    view = np.frombuffer(buf, dtype=np.uint8)
                    ctypes.memmove(dst.ctypes.data + i * block, view.ctypes.data, block)

        def clear() -> None:
            client.delete(keys)

        put_t = measure("raw put", reps, clear, put)
        get_t = measure("raw get", reps, lambda: None, get)
        assert np.array_equal(src, dst), "raw round trip is not byte-exact"
    finally:
        worker.stop()
    n = blocks * block
    return n / statistics.median(put_t) / 1e9, n / statistics.median(get_t) / 1e9


def bench_raw(
    src: np.ndarray,
    dst: np.ndarray,
    blocks: int,
    block: int,
    segment: int,
    reps: int,
) -> tuple[float, float]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    from kvray.config import MooncakeMasterConfig
    from kvray.master import MooncakeMaster

    with tempfile.TemporaryDirectory() as logs:
        master = MooncakeMaster(MooncakeMasterConfig(), logs)
        master.start()
        try:
            store = MooncakeDistributedStore()
            rc = store.setup(
                "127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", master.address
            )
            assert rc == 0, f"raw mooncake setup failed: {rc}"
            store.register_buffer(src.ctypes.data, src.nbytes)
            store.register_buffer(dst.ctypes.data, dst.nbytes)
            cfg = ReplicateConfig()
            cfg.preferred_segments = [store.get_hostname()]  # as kvray does: local segment
            keys = [f"raw-{i}" for i in range(blocks)]
            sptr = [src.ctypes.data + i * block for i in range(blocks)]
            dptr = [dst.ctypes.data + i * block for i in range(blocks)]
            sizes = [block] * blocks

            def put() -> None:
                rcs = store.batch_put_from(keys, sptr, sizes, cfg)
                assert all(r == 0 for r in rcs), f"raw put failed: {set(rcs)}"

            def get() -> None:
                got = store.batch_get_into(keys, dptr, sizes)
                assert all(g == block for g in got), f"raw get failed: {set(got)}"

            def clear() -> None:
                store.batch_remove(keys, True)

            put_t = measure("raw put", reps, clear, put)
            get_t = measure("raw get", reps, lambda: None, get)
            assert np.array_equal(src, dst), "raw round trip is not byte-exact"
            store.close()
        finally:
            master.stop()
    n = blocks * block
    return n / statistics.median(put_t) / 1e9, n / statistics.median(get_t) / 1e9


def raw_exists_ms(backend: str, server: str, keys: list[str], reps: int) -> float:
    """The lookup baseline: the same exists query from an in-process client of the SDK,
    no Ray call, against the pool's own server in the same state."""
    if backend == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", server) == 0

        def query() -> None:
            assert all(r == 1 for r in store.batch_is_exist(keys))
    else:
        from kvray.backends.yuanrong import import_datasystem

        host, port = server.rsplit(":", 1)
        client = import_datasystem().KVClient(
            host, int(port), connect_timeout_ms=5000, enable_exclusive_connection=True
        )
        client.init()

        def query() -> None:
            assert all(client.exist(keys))

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        query()
        times.append((time.perf_counter() - t0) * 1e3)
    if backend == "mooncake":
        store.close()
    return statistics.median(times)


XN_POOL = "xbench"


def _xn_payload(blocks: int, block: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, blocks * block, dtype=np.uint8)


def xn_role(args: argparse.Namespace) -> int:
    """One side of ``--cross-node``, run by the harness as a driver on its node."""
    import ray

    from kvray import Pool
    from kvray.ray_env import ray_init
    from kvray.testing.multinode import print_result

    blocks, block = args.blocks, args.block_kib << 10
    keys = [f"xn-{i}" for i in range(blocks)]
    ray_init(os.environ["RAY_ADDRESS"], namespace="kvray")
    if args.xn_role == "down":
        Pool.attach(XN_POOL).shutdown()
        return 0
    if args.xn_role == "store":
        segment = max(64 << 20, int(blocks * block * 1.5) // (1 << 20) << 20)
        pool = Pool.start(
            {
                "name": XN_POOL,
                "world_size": 1,
                "detached": True,
                "io_threads": args.io_threads,
                "mooncake": {"global_segment_size": segment, "local_buffer_size": "64MB"},
            }
        )
        src = pool.empty((blocks, block), np.uint8)
        src.reshape(-1)[:] = _xn_payload(blocks, block)
        pool.put(keys, list(src))
        node = ray.get_runtime_context().get_node_id()
        print_result({"server": pool.server_address, "node": node})
        pool.close()
        return 0
    # fetch: kvray and the raw client on this node, reps interleaved
    from mooncake.store import MooncakeDistributedStore

    pool = Pool.attach(XN_POOL)
    out = pool.empty((blocks, block), np.uint8)
    rows = list(out)
    raw_dst = np.zeros(blocks * block, np.uint8)
    store = MooncakeDistributedStore()
    me = os.environ["KVRAY_NODE_IP_ADDRESS"]
    rc = store.setup(me, "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", pool.server_address)
    assert rc == 0, f"raw mooncake setup failed: {rc}"
    store.register_buffer(raw_dst.ctypes.data, raw_dst.nbytes)
    dptr = [raw_dst.ctypes.data + i * block for i in range(blocks)]
    sizes = [block] * blocks

    def kvray_get() -> None:
        got = pool.get(keys, out=rows)
        assert all(g is not None for g in got), "kvray get missed blocks"

    def raw_get() -> None:
        got = store.batch_get_into(keys, dptr, sizes)
        assert all(g == block for g in got), f"raw get failed: {set(got)}"

    reps: dict[str, list[float]] = {"kvray": [], "raw": []}
    for rep in range(args.reps + 1):
        order = [("kvray", kvray_get), ("raw", raw_get)]
        for name, fn in order if rep % 2 else order[::-1]:
            dt = timed(fn)
            log(f"   {name:<6} rep {rep}/{args.reps}{' (warm-up)' if rep == 0 else ''}: "
                f"{dt * 1e3:8.1f} ms")  # fmt: skip
            if rep:
                reps[name].append(dt)
    payload = _xn_payload(blocks, block)
    assert np.array_equal(out.reshape(-1), payload), "kvray cross-node get is not byte-exact"
    assert np.array_equal(raw_dst, payload), "raw cross-node get is not byte-exact"
    store.close()
    node = ray.get_runtime_context().get_node_id()
    print_result({"reps_s": reps, "node": node})
    pool.close()
    return 0


def cross_node(args: argparse.Namespace) -> int:
    from kvray.testing.multinode import TwoNodeCluster, result_of, unavailable_reason

    why = unavailable_reason()
    if why:
        log(f"!! --cross-node {why}")
        return 2
    blocks, block = args.blocks, args.block_kib << 10
    nbytes = blocks * block
    common = ["--blocks", str(blocks), "--block-kib", str(args.block_kib), "--reps",
              str(args.reps), "--io-threads", str(args.io_threads)]  # fmt: skip
    log(f"== cross-node gets: {blocks} blocks x {args.block_kib} KiB = {nbytes >> 20} MiB, "
        f"{args.reps} reps (+1 warm-up), interleaved")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvray-xn-") as tmp:
        log("== starting two Ray nodes (private network, separate /dev/shm)")
        with TwoNodeCluster(Path(tmp)) as cluster:
            log("== node A: pool + blocks into A's segment")
            stored = result_of(
                cluster.run_script("A", __file__, "--xn-role", "store", *common, timeout=600).stdout
            )
            log("== node B: kvray Pool.get vs raw Mooncake batch_get_into")
            res = cluster.run_script("B", __file__, "--xn-role", "fetch", *common, timeout=600)
            sys.stderr.write(res.stderr[-4000:])
            fetched = result_of(res.stdout)
            cluster.run_script("A", __file__, "--xn-role", "down", *common, timeout=120)
    assert stored["node"] != fetched["node"], "store and fetch ran on the same node"
    reps = fetched["reps_s"]
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in reps.items()}
    results = {
        "gbps": {"kvray_get_cross_node": gbps["kvray"], "raw_get_cross_node": gbps["raw"]},
        "reps_s": reps,
        "params": {"blocks": blocks, "block_bytes": block, "reps": args.reps,
                   "io_threads": args.io_threads,
                   "cpus": os.cpu_count(), "transport": "tcp (loopback between namespaces)"},
    }  # fmt: skip
    print()
    print(f"{'cross-node get':<26}{'GB/s':>8}{'vs raw':>8}   reps (ms)")
    for name, key in (("raw mooncake (in driver)", "raw"), ("kvray Pool.get", "kvray")):
        ms = " ".join(f"{t * 1e3:.0f}" for t in reps[key])
        print(f"{name:<26}{gbps[key]:>8.2f}{gbps[key] / gbps['raw']:>8.2f}   {ms}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=None, help="default 1000 (256 cross-node)")
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lookup-reps", type=int, default=200)
    parser.add_argument("--backend", choices=["mooncake", "yuanrong"], default="mooncake")
    parser.add_argument("--cross-node", action="store_true", help="gets from another node")
    parser.add_argument(
        "--io-threads", type=int, default=4, help="kvray's io_threads (--cross-node pool)"
    )
    parser.add_argument("--xn-role", choices=["store", "fetch", "down"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args()
    if args.reps < 3:
        parser.error("--reps must be >= 3 (medians of fewer are noise)")
    if args.blocks is None:
        args.blocks = 256 if (args.cross_node or args.xn_role) else 1000
    if args.xn_role:
        return xn_role(args)
    if args.cross_node:
        if args.backend != "mooncake":
            parser.error("--cross-node measures the mooncake backend")
        return cross_node(args)

    import ray

    from kvray import Pool, PoolConfig
    from kvray.ray_env import ray_init

    blocks, block = args.blocks, args.block_kib << 10
    nbytes = blocks * block
    segment = max(64 << 20, int(nbytes * 1.5) // (1 << 20) << 20)
    log(
        f"== {blocks} blocks x {args.block_kib} KiB = {nbytes / (1 << 20):.0f} MiB, "
        f"median of {args.reps} reps (+1 warm-up)"
    )
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, nbytes, dtype=np.uint8)

    log("== memcpy")
    dst = np.empty_like(payload)
    dst[:] = 0
    memcpy = bench_memcpy(payload, dst, args.reps)

    backend = args.backend
    server = "master" if backend == "mooncake" else "datasystem worker"
    log(f"== raw {backend} (in-process client, own {server})")
    raw_dst = np.zeros_like(payload)
    raw = bench_raw if backend == "mooncake" else bench_raw_yuanrong
    raw_put, raw_get = raw(payload, raw_dst, blocks, block, segment, args.reps)
    del raw_dst

    log(f"== kvray (local Ray on loopback, 1-rank pool, embedded {server})")
    ray_init("local", num_cpus=2)
    pool_cfg: dict[str, object] = {
        "name": "bench",
        "backend": backend,
        "world_size": 1,
        "detached": False,
        "transfer_window_size": "64MB",
    }
    if backend == "mooncake":
        pool_cfg["mooncake"] = {"global_segment_size": segment, "local_buffer_size": "64MB"}
    else:
        pool_cfg["datasystem"] = {"shared_memory_size": segment}
    pool = Pool.start(PoolConfig.from_dict(pool_cfg, environ={}))
    results: dict[str, dict[str, float]] = {}
    try:
        keys = [f"kv-{i}" for i in range(blocks)]
        src = pool.empty((blocks, block), np.uint8)
        src.reshape(-1)[:] = payload
        out = pool.empty((blocks, block), np.uint8)
        src_rows, out_rows = list(src), list(out)

        def clear() -> None:
            pool.remove(keys, force=True)

        put_t = measure("kvray put", args.reps, clear, lambda: pool.put(keys, src_rows))
        get_t = measure("kvray get", args.reps, lambda: None, lambda: pool.get(keys, out=out_rows))
        assert np.array_equal(src, out), "kvray round trip is not byte-exact"

        plain_src = [payload[i * block : (i + 1) * block] for i in range(blocks)]
        plain_out = [np.empty(block, np.uint8) for _ in range(blocks)]
        sput_t = measure("kvray staged put", args.reps, clear, lambda: pool.put(keys, plain_src))
        sget_t = measure(
            "kvray staged get", args.reps, lambda: None, lambda: pool.get(keys, out=plain_out)
        )
        assert all(np.array_equal(a, b) for a, b in zip(plain_src, plain_out, strict=True))

        log(f"== prefix lookup of {blocks} blocks through the Lookup actor")
        clear()
        space, hashes = lookup_space(), lookup_hashes(blocks)
        tiny = np.zeros(64, np.uint8)
        pool.put([space.key(h) for h in hashes], [tiny] * blocks)
        assert pool.lookup(space, hashes) == blocks, "lookup does not see all blocks"
        lat = []
        for i in range(args.lookup_reps):
            t0 = time.perf_counter()
            pool.lookup(space, hashes)
            lat.append((time.perf_counter() - t0) * 1e3)
            if (i + 1) % 50 == 0:
                log(f"   lookup {i + 1}/{args.lookup_reps}")
        lat.sort()
        floor = []
        for _ in range(args.lookup_reps):
            t0 = time.perf_counter()
            pool.lookup(space, [])
            floor.append((time.perf_counter() - t0) * 1e3)
        log("   raw exists query against the pool's server (in-process, no Ray)")
        raw_exists = raw_exists_ms(
            backend, pool.server_address, space.rank_key_strs(hashes, 0), args.lookup_reps
        )
        results = {
            "gbps": {
                "kvray_put": nbytes / statistics.median(put_t) / 1e9,
                "kvray_get": nbytes / statistics.median(get_t) / 1e9,
                "raw_put": raw_put,
                "raw_get": raw_get,
                "memcpy": memcpy,
                "kvray_staged_put": nbytes / statistics.median(sput_t) / 1e9,
                "kvray_staged_get": nbytes / statistics.median(sget_t) / 1e9,
            },
            "lookup_ms": {
                "p50": statistics.median(lat),
                "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                # Baselines from the same run: the Ray call alone (an empty lookup) and
                # the same exists query in-process without Ray.
                "ray_call_floor_p50": statistics.median(floor),
                "raw_exists_p50": raw_exists,
            },
            "params": {
                "backend": backend,
                "blocks": blocks,
                "block_bytes": block,
                "reps": args.reps,
                "lookup_reps": args.lookup_reps,
                "cpus": os.cpu_count(),
            },
        }
    finally:
        pool.shutdown()
        ray.shutdown()

    g = results["gbps"]
    print()
    print(f"{'path':<22}{'put GB/s':>10}{'get GB/s':>10}{'put/raw':>9}{'get/raw':>9}")
    rows = [
        ("memcpy (ceiling)", memcpy, memcpy),
        (f"raw {backend}", raw_put, raw_get),
        ("kvray (shared region)", g["kvray_put"], g["kvray_get"]),
        ("kvray (staged copy)", g["kvray_staged_put"], g["kvray_staged_get"]),
    ]
    for name, p, q in rows:
        print(f"{name:<22}{p:>10.2f}{q:>10.2f}{p / raw_put:>9.2f}{q / raw_get:>9.2f}")
    lk = results["lookup_ms"]
    print(f"\nprefix lookup of {blocks} blocks (ms){'p50':>8}{'p99':>8}")
    print(f"{'kvray Pool.lookup (Ray call)':<29}{lk['p50']:>8.2f}{lk['p99']:>8.2f}")
    print(f"{'  of which Ray call floor':<29}{lk['ray_call_floor_p50']:>8.2f}")
    print(f"{'raw exists query in-process':<29}{lk['raw_exists_p50']:>8.2f}")
    put_x, get_x = g["kvray_put"] / raw_put, g["kvray_get"] / raw_get
    print(
        f"\ntargets: kvray >= 0.8x raw: put {put_x:.2f}x, get {get_x:.2f}x; "
        f"lookup p50 <= 2 ms: {lk['p50']:.2f} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
