"""Store benchmark: kvray's data plane against the backend's raw client API and memcpy.

One run measures, on the same machine and bytes, for ``--backend mooncake`` (default)
or ``--backend yuanrong``, every path live at once and the reps interleaved (each rep
runs every path in turn: clear, put, get, verify byte-exact; the order rotated per rep;
one warm-up rep first, since the first pass over fresh memory faults its pages in):

- ``memcpy`` / ``memcpy xN``: numpy copy of the payload, one thread / ``N`` threads;
- ``memcpy checksum``: ``memcpy`` block by block with the digest kvray's checksums
  compute (:func:`kvray.backends.checksum.digest`, the key and the bytes) right before
  each block's copy on a put (as a put is sealed) and right after it on a get (as a load
  is verified): what verified copies cost on this host, the floor under ``kvray
  checksum``'s cost, printed beside it;
- ``raw`` / ``raw xN``: the backend's own zero-copy batch calls from an in-process client
  against its own server (the baseline): Mooncake ``batch_put_from`` /
  ``batch_get_into`` against a ``mooncake_master``; datasystem ``mcreate`` + copy +
  ``mset_buffer`` / ``get_buffers`` + copy against a ``datasystem_worker``. ``xN``: the
  batch split in ``N`` native calls on ``N`` threads, the parallelism kvray itself uses
  (``--io-threads``, its ``io_threads``);
- ``kvray``: ``Pool.put`` / ``Pool.get`` of blocks living in a kvray shared region (one
  call per batch on the node channel, bytes moved by the rank's BackendClient actor,
  nothing through Ray's object store), on a pool with ``checksum: false``;
- ``kvray staged``: the same for ordinary arrays, copied through the staging window;
- ``kvray checksum`` / ``kvray multi checksum``: the same as ``kvray`` and ``kvray
  multi`` on a second pool with ``checksum: true`` (the default): the difference is what
  the block checksums cost, printed as "checksum cost" (median of the per-rep ratios);
- ``raw multi`` / ``raw multi xN`` / ``kvray multi``: the same bytes with each block in
  ``2 x --layers`` pieces laid out as vLLM's per-layer KV tensors hold them, the
  connector's real transfers (``kvray multi`` sends the very ``TransferBatch`` the
  connector's worker sends to the rank's actor, the way it sends it: over the node
  channel, ``transfer_channel: node``; raw: the multi-buffer batch calls);
- prefix lookup latency of ``blocks`` hashes through the Lookup actor, and read from the
  node's block index as a scheduler with ``lookup_index`` reads it, next to the Ray
  call floor and the same exists query in-process.

kvray is compared with the stronger raw path of the same shape. Every rep is in the JSON.

``--cross-node`` measures gets whose blocks live on another node instead: on two Ray
nodes of this machine that share no network and no /dev/shm (``kvray.testing.multinode``:
a network namespace each, joined by a veth pair; needs root),
a pool started on node A stores the blocks in A's segment; on node B, kvray's
``Pool.get`` (B's BackendClient actor reads A's segment into B's shared region) and the
raw Mooncake client in the B driver process (``batch_get_into`` from A's segment, the
baseline) fetch them, reps interleaved, every rep recorded.

    .venv/bin/python scripts/bench_store.py --json bench-results/bench_store.json
    .venv/bin/python scripts/bench_store.py --smoke --json /tmp/bench_store.json
    .venv/bin/python scripts/bench_store.py --cross-node --json bench-results/bench_cross_node.json
    .venv/bin/python scripts/bench_store.py --backend yuanrong \
        --json bench-results/bench_store_yuanrong.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402

from kvray.backends.base import KeyStatus  # noqa: E402
from kvray.backends.checksum import digest  # noqa: E402
from kvray.index.block_index import DRAM, BlockIndex  # noqa: E402
from kvray.keys import KeySpace, KVLayout, chain_block_hashes  # noqa: E402
from kvray.shm import RegionSpec  # noqa: E402
from kvray.store.channel import ChannelStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RoundTrip, log, parse, round_trips, timed, write_json  # noqa: E402
from _engines import run_meta  # noqa: E402
from _raw_clients import RawMooncake, RawYuanrong, raw_exists_ms  # noqa: E402

SMOKE = ["--blocks", "32", "--block-kib", "64", "--lookup-reps", "5"]
"""``--smoke``: 2 MiB per path instead of 500 MiB, the same paths, reps and JSON keys."""


def index_lookup_ms(
    pool_cfg: dict[str, object], space: KeySpace, hashes: list[bytes], reps: int
) -> list[float]:
    """A lookup of ``hashes`` as a scheduler makes it with ``lookup_index``: its own
    mapping of the node's block index (a second, small pool with the index on, the blocks
    stored there), digests and probes in this process, no call. Sorted ms."""
    from kvray import Pool, PoolConfig

    small = "128MB"
    cfg = {**pool_cfg, "name": "bench-ix", "lookup_index": True}
    if "mooncake" in cfg:
        cfg["mooncake"] = {"global_segment_size": small, "local_buffer_size": "16MB"}
    else:
        cfg["datasystem"] = {"shared_memory_size": small}
    ix = Pool.start(PoolConfig.from_dict(cfg, environ={}))
    try:
        ix.put([space.key(h) for h in hashes], [np.zeros(64, np.uint8)] * len(hashes))
        spec = ix._h.lookup().index_spec().result(60)
        assert spec is not None, "a pool with lookup_index offers no index"
        index = BlockIndex.attach(spec)
        try:
            masks = np.full(space.columns, DRAM, np.uint32)
            hits, _, _ = index.lookup(space, hashes, masks)
            assert hits == len(hashes), f"the index shows {hits} of {len(hashes)} blocks"
            lat = []
            for _ in range(reps):
                t0 = time.perf_counter()
                index.lookup(space, hashes, masks)
                lat.append((time.perf_counter() - t0) * 1e3)
        finally:
            index.close()
    finally:
        ix.shutdown()
    return sorted(lat)


def lookup_space() -> KeySpace:
    return KeySpace("bench", KVLayout("float16", 16, 8, 128).tag())


def lookup_hashes(blocks: int) -> list[bytes]:
    return list(chain_block_hashes(list(range(blocks * 16)), 16))


def piece_layout(blocks: int, block: int, pieces: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths, shape (blocks, pieces), of each block's pieces in a buffer of
    ``blocks * block`` bytes. One piece: blocks back to back. More: as vLLM's per-layer KV
    tensors lay a block out (the connector's multi-buffer transfers): piece j of every
    block (layer j // 2, K or V) lives in plane j, the planes one after another."""
    piece = block // pieces
    offsets = (
        np.arange(pieces, dtype=np.int64)[None, :] * (blocks * piece)
        + np.arange(blocks, dtype=np.int64)[:, None] * piece
    )
    return offsets, np.full((blocks, pieces), piece, dtype=np.int64)


def split_run(
    pool: ThreadPoolExecutor | None, parts: int, n: int, fn: Callable[[int, int], object]
) -> None:
    """``fn(lo, hi)`` over ``n`` items: one call, or ``parts`` calls on contiguous slices
    run by ``pool``'s threads, as kvray's adapters split a large batch over
    ``io_threads`` (the native calls release the GIL)."""
    if pool is None or parts <= 1:
        fn(0, n)
        return
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [pool.submit(fn, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    for f in futures:
        f.result()


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
                # as the single-node "kvray" row: the transport, without the checksum
                # trailer (which the raw client's reads would then have to make room for)
                "checksum": False,
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
    raw_dst = page_aligned(blocks * block)
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
        running: contextlib.AbstractContextManager[TwoNodeCluster]
        if args.harness is not None:
            log(f"== on the running harness of {args.harness}")
            described = json.loads(args.harness.read_text())
            running = contextlib.nullcontext(TwoNodeCluster.attached(described, Path(tmp)))
        else:
            log("== starting two Ray nodes (a network namespace and /dev/shm each, a veth link)")
            running = TwoNodeCluster(Path(tmp))
        with running as cluster:
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
        "meta": run_meta(order="per rep kvray and raw in turn, order alternated", reps=args.reps),
        "gbps": {"kvray_get_cross_node": gbps["kvray"], "raw_get_cross_node": gbps["raw"]},
        "reps_s": reps,
        "params": {"blocks": blocks, "block_bytes": block, "reps": args.reps,
                   "io_threads": args.io_threads,
                   "cpus": os.cpu_count(), "checksum": False,
                   "transport": "tcp over a veth pair between network namespaces"},
    }  # fmt: skip
    print()
    print(f"{'cross-node get':<26}{'GB/s':>8}{'vs raw':>8}   reps (ms)")
    for name, key in (("raw mooncake (in driver)", "raw"), ("kvray Pool.get", "kvray")):
        ms = " ".join(f"{t * 1e3:.0f}" for t in reps[key])
        print(f"{name:<26}{gbps[key]:>8.2f}{gbps[key] / gbps['raw']:>8.2f}   {ms}")
    write_json(args.json, results)
    return 0


def page_aligned(nbytes: int) -> np.ndarray:
    """A zeroed page-aligned buffer (an anonymous mapping), as kvray's shared regions and
    the backends' segments are: the raw paths' source and destination. On some hosts
    glibc's copy between addresses that are not a whole number of pages apart runs several
    times slower (measured on an AMD EPYC: 7x with 8 bytes past a page), which would slow
    the raw baseline alone had numpy's allocator placed it there."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def region_spec(pool: Any, view: np.ndarray) -> RegionSpec:
    """The descriptor of the pool's shared region ``view`` lies in (what the connector's
    worker sends in a ``TransferBatch``)."""
    found = pool._region_of(view)  # noqa: SLF001 - the connector's descriptors
    assert found is not None, "the array is not in one of the pool's shared regions"
    spec: RegionSpec = found[0].spec
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=None, help="default 1000 (256 cross-node)")
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lookup-reps", type=int, default=200)
    parser.add_argument("--backend", choices=["mooncake", "yuanrong"], default="mooncake")
    parser.add_argument("--cross-node", action="store_true", help="gets from another node")
    parser.add_argument(
        "--harness",
        type=Path,
        help="--cross-node on a running multi-node harness (the JSON of its describe()) "
        "instead of two nodes of its own",
    )
    parser.add_argument(
        "--io-threads", type=int, default=4, help="kvray's io_threads, and the raw client's threads"
    )
    parser.add_argument(
        "--layers", type=int, default=8, help="multi-buffer paths: a block is 2 x LAYERS pieces"
    )
    parser.add_argument("--xn-role", choices=["store", "fetch", "down"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write results here")
    args = parse(parser, SMOKE)
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
    from kvray.transfer import TransferBatch

    blocks, block, threads = args.blocks, args.block_kib << 10, args.io_threads
    nbytes = blocks * block
    pieces = 2 * args.layers
    if block % pieces:
        parser.error(f"--block-kib {args.block_kib} is not divisible into {pieces} pieces")
    segment = max(64 << 20, int(nbytes * 1.5) // (1 << 20) << 20)
    backend = args.backend
    server = "master" if backend == "mooncake" else "datasystem worker"
    log(
        f"== {blocks} blocks x {args.block_kib} KiB = {nbytes / (1 << 20):.0f} MiB; "
        f"{args.reps} reps (+1 warm-up), every path in turn per rep, order rotated"
    )
    payload = page_aligned(nbytes)
    payload[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    raw_dst = page_aligned(nbytes)
    shapes = {"": piece_layout(blocks, block, 1), "multi": piece_layout(blocks, block, pieces)}
    keys = [f"kv-{i}" for i in range(blocks)]
    io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench")
    logs = tempfile.TemporaryDirectory(prefix="kvray-bench-store-")

    log(f"== raw {backend}: in-process client, its own {server}")
    raw: RawMooncake | RawYuanrong = (RawMooncake if backend == "mooncake" else RawYuanrong)(
        payload, raw_dst, segment, logs.name
    )
    log(f"== kvray: local Ray on loopback, 1-rank pool, embedded {server}, io_threads {threads}")
    ray_init("local", num_cpus=2)
    pool_cfg: dict[str, object] = {
        "name": "bench",
        "backend": backend,
        "world_size": 1,
        "detached": False,
        "io_threads": threads,
        "transfer_window_size": "64MB",
        "checksum": False,  # the paths without checksums; "... checksum": the default
    }
    if backend == "mooncake":
        pool_cfg["mooncake"] = {"global_segment_size": segment, "local_buffer_size": "64MB"}
    else:
        pool_cfg["datasystem"] = {"shared_memory_size": segment}
    pool = Pool.start(PoolConfig.from_dict(pool_cfg, environ={}))
    log("== kvray with block checksums: a second pool, checksum: true, its own server")
    ck = Pool.start(
        PoolConfig.from_dict({**pool_cfg, "name": "bench-ck", "checksum": True}, environ={})
    )
    try:
        src = pool.empty(nbytes, np.uint8)
        src[:] = payload
        out = pool.empty(nbytes, np.uint8)
        src_rows, out_rows = list(src.reshape(blocks, block)), list(out.reshape(blocks, block))
        plain_out = [np.empty(block, np.uint8) for _ in range(blocks)]
        plain_src = [payload[i * block : (i + 1) * block] for i in range(blocks)]
        region, out_region = region_spec(pool, src), region_spec(pool, out)
        # rank 0's client on its node channel, as the connector's worker reaches it (the
        # pool's own: Pool.put and Pool.get take it too)
        store: ChannelStore = pool._loop.run(pool._store(0))  # noqa: SLF001
        ck_src = ck.empty(nbytes, np.uint8)
        ck_src[:] = payload
        ck_out = ck.empty(nbytes, np.uint8)
        ck_src_rows = list(ck_src.reshape(blocks, block))
        ck_out_rows = list(ck_out.reshape(blocks, block))
        ck_region, ck_out_region = region_spec(ck, ck_src), region_spec(ck, ck_out)
        ck_store: ChannelStore = ck._loop.run(ck._store(0))  # noqa: SLF001
        for channel in (store, ck_store):
            assert channel.attached, "the BackendClient's node channel did not attach"

        def actor_call(op: str, spec: RegionSpec, on: ChannelStore = store) -> None:
            """What the connector's worker sends per step: one TransferBatch of every
            block's per-layer pieces to the rank's BackendClient actor, on its node channel
            (as the worker sends it)."""
            offs, lens = shapes["multi"]
            batch = TransferBatch(spec, tuple(keys), offs, lens)
            call = on.put(batch, False) if op == "put" else on.get(batch)
            statuses = call.result(None)
            assert all(st is KeyStatus.OK for st in statuses), f"kvray multi {op} failed"

        def memcpy_checked(seal: bool) -> Callable[[], None]:
            """``memcpy`` block by block, each block's digest before its copy (``seal``)
            or after it, from the bytes the copy reads or wrote."""
            names = [k.encode() for k in keys]
            src0, dst0 = payload.ctypes.data, raw_dst.ctypes.data

            def run() -> None:
                for i, name in enumerate(names):
                    at = i * block
                    if seal:
                        digest(name, [src0 + at], [block])
                    np.copyto(raw_dst[at : at + block], payload[at : at + block])
                    if not seal:
                        digest(name, [dst0 + at], [block])

            return run

        def memcpy_par() -> None:
            split_run(io, threads, nbytes, lambda lo, hi: np.copyto(raw_dst[lo:hi], payload[lo:hi]))

        def raw_op(op: str, shape: str, parts: int) -> Callable[[], None]:
            offs, lens = shapes[shape]
            fn = raw.put if op == "put" else raw.get
            return lambda: split_run(io, parts, blocks, lambda lo, hi: fn(keys, offs, lens, lo, hi))

        def reset(buf: np.ndarray | list[np.ndarray]) -> Callable[[], None]:
            def run() -> None:
                for b in buf if isinstance(buf, list) else [buf]:
                    b.fill(0)

            return run

        def same(buf: np.ndarray | list[np.ndarray]) -> Callable[[], bool]:
            def run() -> bool:
                got = np.concatenate(buf) if isinstance(buf, list) else buf
                return bool(np.array_equal(got, payload))

            return run

        def kv_clear() -> None:
            pool.remove(keys, force=True)

        def ck_clear() -> None:
            ck.remove(keys, force=True)

        def raw_clear() -> None:
            raw.clear(keys)

        # name -> (clear, put, reset destination, get, destination holds the payload)
        paths: dict[str, RoundTrip] = {
            "memcpy": (
                lambda: None, lambda: np.copyto(raw_dst, payload), reset(raw_dst),
                lambda: np.copyto(raw_dst, payload), same(raw_dst),
            ),
            f"memcpy x{threads}": (
                lambda: None, memcpy_par, reset(raw_dst), memcpy_par, same(raw_dst),
            ),
            "memcpy checksum": (
                lambda: None, memcpy_checked(True), reset(raw_dst), memcpy_checked(False),
                same(raw_dst),
            ),
            "raw": (
                raw_clear, raw_op("put", "", 1), reset(raw_dst), raw_op("get", "", 1),
                same(raw_dst),
            ),
            f"raw x{threads}": (
                raw_clear, raw_op("put", "", threads), reset(raw_dst),
                raw_op("get", "", threads), same(raw_dst),
            ),
            "kvray": (
                kv_clear, lambda: pool.put(keys, src_rows), reset(out),
                lambda: pool.get(keys, out=out_rows), same(out),
            ),
            "kvray checksum": (
                ck_clear, lambda: ck.put(keys, ck_src_rows), reset(ck_out),
                lambda: ck.get(keys, out=ck_out_rows), same(ck_out),
            ),
            "kvray staged": (
                kv_clear, lambda: pool.put(keys, plain_src), reset(plain_out),
                lambda: pool.get(keys, out=plain_out), same(plain_out),
            ),
            "raw multi": (
                raw_clear, raw_op("put", "multi", 1), reset(raw_dst),
                raw_op("get", "multi", 1), same(raw_dst),
            ),
            f"raw multi x{threads}": (
                raw_clear, raw_op("put", "multi", threads), reset(raw_dst),
                raw_op("get", "multi", threads), same(raw_dst),
            ),
            "kvray multi": (
                kv_clear, lambda: actor_call("put", region), reset(out),
                lambda: actor_call("get", out_region), same(out),
            ),
            "kvray multi checksum": (
                ck_clear, lambda: actor_call("put", ck_region, ck_store), reset(ck_out),
                lambda: actor_call("get", ck_out_region, ck_store), same(ck_out),
            ),
        }  # fmt: skip
        times = round_trips(paths, args.reps, ("put", "get"))
        sent_by_ray = store.ray_calls + ck_store.ray_calls
        assert sent_by_ray == 0, f"{sent_by_ray} kvray transfers went through Ray"
        raw_clear()

        log(f"== prefix lookup of {blocks} blocks through the Lookup actor")
        kv_clear()
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
        log("   the node's block index, as a scheduler reads it (a pool with lookup_index)")
        index_lat = index_lookup_ms(pool_cfg, space, hashes, args.lookup_reps)
    finally:
        ck.shutdown()
        pool.shutdown()
        ray.shutdown()
        raw.close()
        io.shutdown()
        logs.cleanup()

    gbps: dict[str, dict[str, float]] = {
        n: {op: nbytes / statistics.median(t[op]) / 1e9 for op in ("put", "get")}
        for n, t in times.items()
    }

    def strongest_raw(name: str, op: str) -> float:
        shape = [n for n in times if n.startswith("raw") and ("multi" in n) == ("multi" in name)]
        return max(gbps[n][op] for n in shape)

    print()
    print(f"{'path':<20}{'put GB/s':>12}{'get GB/s':>12}{'put/raw':>9}{'get/raw':>9}")
    for n in times:
        cells = []
        for op in ("put", "get"):
            t = times[n][op]
            half = (max(t) - min(t)) / statistics.median(t) / 2
            cells.append(f"{gbps[n][op]:>7.2f} ±{half:3.0%}")
        vs = (
            f"{gbps[n]['put'] / strongest_raw(n, 'put'):>9.2f}"
            f"{gbps[n]['get'] / strongest_raw(n, 'get'):>9.2f}"
            if n.startswith("kvray")
            else ""
        )
        print(f"{n:<20}{cells[0]:>12}{cells[1]:>12}{vs}")
    print(
        f"\nmedians of {args.reps}, ± half the range of the reps; vs raw = against the "
        f"stronger of raw and raw x{threads} of the same shape (one piece per block, or "
        f"multi: {pieces} pieces per block as {args.layers} layers' K and V)"
    )
    # The checksums' cost: the same path with and without them, same run, reps interleaved.
    # Paired per rep (both ran in it), so drift between reps cancels: 1 - t_without / t_with.
    per_rep = {
        shape: {
            op: [
                1 - plain / with_ck
                for plain, with_ck in zip(
                    times[f"kvray{shape}"][op], times[f"kvray{shape} checksum"][op], strict=True
                )
            ]
            for op in ("put", "get")
        }
        for shape in ("", " multi")
    }
    # The floor: the same digests beside a plain copy, paired the same way.
    per_rep["memcpy"] = {
        op: [
            1 - plain / with_ck
            for plain, with_ck in zip(
                times["memcpy"][op], times["memcpy checksum"][op], strict=True
            )
        ]
        for op in ("put", "get")
    }
    cost = {
        shape: {op: statistics.median(r) for op, r in c.items()} for shape, c in per_rep.items()
    }
    print("\nchecksum cost (median over reps of 1 - GB/s with / without; loads are gets)")
    for shape, c in cost.items():
        name = shape if shape == "memcpy" else f"kvray{shape}"
        print(f"  {name:<19}put {c['put']:>+6.1%}   get {c['get']:>+6.1%}")
    lk = {
        "p50": statistics.median(lat),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        # Baselines from the same run: the Ray call alone (an empty lookup) and the
        # same exists query in-process without Ray.
        "ray_call_floor_p50": statistics.median(floor),
        "raw_exists_p50": raw_exists,
        "index_p50": statistics.median(index_lat),
        "index_p99": index_lat[min(len(index_lat) - 1, int(0.99 * len(index_lat)))],
    }
    print(f"\nprefix lookup of {blocks} blocks (ms){'p50':>8}{'p99':>8}")
    print(f"{'kvray Pool.lookup (Ray call)':<29}{lk['p50']:>8.2f}{lk['p99']:>8.2f}")
    print(f"{'  of which Ray call floor':<29}{lk['ray_call_floor_p50']:>8.2f}")
    print(f"{'raw exists query in-process':<29}{lk['raw_exists_p50']:>8.2f}")
    print(f"{'node index (lookup_index)':<29}{lk['index_p50']:>8.2f}{lk['index_p99']:>8.2f}")
    results = {
        "meta": run_meta(
            order="per rep every path in turn (clear, put, get, verify), order rotated",
            reps=args.reps,
        ),
        "gbps": gbps,
        "reps_s": times,
        "lookup_ms": lk,
        "checksum_cost": {(s.strip() or "single"): c for s, c in cost.items()},
        "checksum_cost_note": "single / multi: kvray with checksums against without; "
        "memcpy: a copy with the same digests against a plain copy (the floor)",
        "checksum_cost_per_rep": {(s.strip() or "single"): c for s, c in per_rep.items()},
        "params": {
            "backend": backend, "blocks": blocks, "block_bytes": block,
            "pieces_multi": pieces, "io_threads": threads, "reps": args.reps,
            "lookup_reps": args.lookup_reps,
        },
    }  # fmt: skip
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
