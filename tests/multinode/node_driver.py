"""A Ray driver on one node of the multi-node harness (tests/multinode/conftest.py): it
joins the cluster as the node ``KVRAY_NODE_IP_ADDRESS`` names and prints one JSON line.

    node_driver.py nodes                       the cluster's alive nodes
    node_driver.py start POOL [REPLICAS] [HOST] start a detached pool (clients on this node;
                                               HOST: its server_host, default auto)
    node_driver.py attach POOL                 attach for data: refused, with why, or not
    node_driver.py start-ssd POOL PATH         the same with kvray's SSD tier (mooncake|ssd)
                                               under PATH (a node-local path: each node's)
    node_driver.py start-yuanrong POOL WORKERS a yuanrong pool; WORKERS: JSON, node IP to
                                               that node's datasystem worker (this node's
                                               is the pool's worker_address)
    node_driver.py drop-dram POOL              remove every block from Mooncake's DRAM
                                               (the SSD tier keeps its copies)
    node_driver.py put POOL KEY SEED [N]       put N random bytes (seeded) under KEY
    node_driver.py get POOL KEY SEED [N]       get KEY; compare with the seeded bytes
    node_driver.py start-events POOL           start a detached pool with kv_events
    node_driver.py put-blocks POOL SEED N      describe N chained blocks (seeded tokens) as a
                                               scheduler does, and put them from this node
    node_driver.py events POOL SEED...         the blocks a subscriber (vLLM's types) holds
                                               after a replay from the start, and those of
                                               the seeds' blocks exists() shows
    node_driver.py status POOL                 the pool's status dict
    node_driver.py down POOL                   stop the pool
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np


def _value(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


EVENTS_TOPIC = "kv@mn@events"
EVENTS_LAYOUT = "float16-b16-h2x64"


def _described(seed: int, n: int) -> tuple[object, list[object]]:
    """The key space and the ``BlockInfo`` of ``n`` chained blocks of seeded tokens."""
    from kvray.index.kv_events import BlockInfo
    from kvray.keys import KeySpace, chain_block_hashes

    tokens = [int(t) for t in np.random.default_rng(seed).integers(3, 30000, 16 * n)]
    hashes = chain_block_hashes(tokens, 16)
    infos = [BlockInfo(h, hashes[i - 1] if i else None, tuple(tokens[16 * i : 16 * (i + 1)]))
             for i, h in enumerate(hashes)]  # fmt: skip
    return KeySpace("mnev", EVENTS_LAYOUT, tp_size=1), infos


def main() -> int:
    import ray

    from kvray.ray_env import ray_init
    from kvray.testing.multinode import print_result

    cmd, args = sys.argv[1], sys.argv[2:]
    ray_init(os.environ["RAY_ADDRESS"], namespace="kvray")
    me = ray.get_runtime_context().get_node_id()
    if cmd == "nodes":
        print_result([n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]])
        return 0
    from kvray import Pool

    if cmd in ("start", "start-ssd"):
        config: dict[str, object] = {
            "name": args[0],
            "world_size": 1,
            "detached": True,
            "replica_num": int(args[1]) if cmd == "start" and len(args) > 1 else 1,
            "server_host": args[2] if cmd == "start" and len(args) > 2 else "auto",
            "mooncake": {"global_segment_size": "64MB", "local_buffer_size": "16MB"},
            # the master drops a dead node's segment (and the copies in it) after 2 s
            "master": {"client_ttl_s": 2},
        }
        if cmd == "start-ssd":
            config["pipeline"] = "mooncake|ssd"
            config["ssd"] = {"path": args[1], "quota": "256MB", "io_threads": 2}
            # Lookups by the Lookup actor, which asks each rank's SSD tier where its
            # worker runs (what the SSD tests check); "drop-dram" goes behind kvray's back,
            # so the node index would still show those blocks in DRAM (a hit either way).
            config["lookup_index"] = False
        pool = Pool.start(config)
        out = {"node": me, "server": pool.server_address}
        pool.close()
    elif cmd == "start-events":
        config = {
            "name": args[0], "world_size": 1, "detached": True,
            "mooncake": {"global_segment_size": "64MB", "local_buffer_size": "16MB"},
            # 10 s (the default): with 2 s, a node's blocks were once gone before its loss
            # on a loaded machine (its client's heartbeat can lapse that long)
            "master": {"client_ttl_s": 10},
            "kv_events": {"port": 0, "replay_port": 0},  # host: the node's (2 nodes)
        }  # fmt: skip
        pool = Pool.start(config)
        out = {"node": me, "server": pool.server_address, "events": pool.kv_events()}
        pool.close()
    elif cmd == "put-blocks":
        from kvray.index.kv_events import Described

        pool = Pool.attach(args[0])
        space, infos = _described(int(args[1]), int(args[2]))
        hashes = [i.block_hash for i in infos]  # type: ignore[attr-defined]
        pool._h.manager.describe_blocks(
            [Described(space, EVENTS_TOPIC, 16, tuple(infos))]  # type: ignore[arg-type]
        ).result(60)
        keys = space.rank_key_strs(hashes, 0)  # type: ignore[attr-defined]
        pool.put(keys, [_value(int(args[1]) + j, 4096) for j in range(len(keys))])
        out = {"node": me, "client_node": pool._h.client(0).probe().result(60)["node_id"],
               "hashes": [h.hex() for h in hashes]}  # fmt: skip
        pool.close()
    elif cmd == "events":
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.kv_subscriber
        from tests.kv_subscriber import Subscriber, ext

        pool = Pool.attach(args[0])
        ends = pool.kv_events()
        assert ends is not None, "the pool has no kv_events"
        described = {}
        whole = []
        for seed in args[1:]:
            space, infos = _described(int(seed), 4)
            hashes = [i.block_hash for i in infos]  # type: ignore[attr-defined]
            present = pool.exists(space.rank_key_strs(hashes, 0))  # type: ignore[attr-defined]
            described.update({ext(h): h.hex() for h in hashes})
            whole += [h.hex() for h, p in zip(hashes, present, strict=True) if p]
        sub = Subscriber(ends["endpoint"], ends["replay"], EVENTS_TOPIC)
        for _, _, batch in sub.replay(0):  # every batch since the publisher started
            sub.apply(batch)
        sub.close()
        held = sub.blocks.get(("CPU", args[0]), set())
        out = {"held": sorted(described.get(h, f"undescribed {h!r}") for h in held),
               "whole": sorted(whole)}  # fmt: skip
        pool.close()
    elif cmd == "start-yuanrong":
        import json

        workers = json.loads(args[1])
        pool = Pool.start(
            {
                "name": args[0],
                "backend": "yuanrong",
                "world_size": 1,
                "detached": True,
                "yuanrong": {
                    "worker_address": workers[os.environ["KVRAY_NODE_IP_ADDRESS"]],
                    "node_worker_addresses": workers,
                },
            }
        )
        out = {"node": me, "server": pool.server_address}
        pool.close()
    elif cmd == "drop-dram":
        # A raw Mooncake client (no memory of its own) empties the DRAM tier, as an
        # eviction of every block would: what stays is in the nodes' SSD tiers.
        from mooncake.store import MooncakeDistributedStore

        pool = Pool.attach(args[0])
        raw = MooncakeDistributedStore()
        here = os.environ["KVRAY_NODE_IP_ADDRESS"]
        rc = raw.setup(here, "P2PHANDSHAKE", 0, 0, "tcp", "", pool.server_address)
        assert rc == 0, f"mooncake setup against {pool.server_address} failed: {rc}"
        out = {"node": me, "removed": int(raw.remove_all(True))}
        raw.close()
        pool.close()
    elif cmd in ("put", "get"):
        pool = Pool.attach(args[0])
        key, seed = args[1], int(args[2])
        n = int(args[3]) if len(args) > 3 else 1 << 20
        value = _value(seed, n)
        client = pool._h.client(0)
        where = client.probe().result(60)["node_id"]
        if cmd == "put":
            pool.put(key, value)
            out = {"node": me, "client_node": where}
        else:
            from kvray.errors import TransferError

            try:
                got = pool.get(key, shape=(n,), dtype=np.uint8)
                failed = False
            except TransferError:  # reported, never returned as bytes
                got, failed = None, True
            out = {
                "node": me,
                "client_node": where,
                "failed": failed,
                "hit": got is not None,
                "equal": got is not None and bool(np.array_equal(got, value)),
                "sha": hashlib.sha256(got.tobytes()).hexdigest() if got is not None else None,
            }
        pool.close()
    elif cmd == "wrong-node":
        # A region made here, handed to the client of another node (by name): refused
        # with the fix, never read from some other memory.
        from kvray.errors import RegionError
        from kvray.naming import client_name
        from kvray.shm import SharedRegion
        from kvray.transfer import TransferBatch

        pool = Pool.attach(args[0])
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != me)
        client = ray.get_actor(client_name(args[0], other, 0), namespace="kvray")
        region = SharedRegion.create("kvray-mn-wrong", 4096)
        batch = TransferBatch.contiguous(region.spec, ["wrong-node"], [0], [4096])
        try:
            ray.get(client.put.remote(batch))
            out = {"refused": False}
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            out = {"refused": isinstance(cause, RegionError), "error": str(cause)}
        region.close()
        pool.close()
    elif cmd == "attach":
        import time

        from kvray.errors import BackendUnavailableError

        t0 = time.monotonic()
        try:
            Pool.attach(args[0]).close()
            out = {"refused": False}
        except BackendUnavailableError as exc:
            out = {"refused": True, "error": str(exc)}
        out["took_s"] = time.monotonic() - t0
    elif cmd == "status":
        pool = Pool.attach(args[0])
        status = pool.stats()
        out = {**status.to_dict(), "table": status.table()}
        pool.close()
    elif cmd == "down":
        Pool.attach(args[0]).shutdown()
        out = {"down": args[0]}
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print_result(out)  # marked: Ray may print to stdout too (e.g. node-death notices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
