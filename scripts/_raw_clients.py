"""The store benchmark's baselines: the backends' own clients, in-process, against their
own servers, with the zero-copy batch calls (used by ``bench_store.py``)."""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np


class RawMooncake:
    """The baseline: an in-process Mooncake client on its own ``mooncake_master`` (the
    master's settings are kvray's defaults), the zero-copy batch calls, blocks preferred
    in the client's own segment as kvray places them."""

    name = "mooncake"

    def __init__(self, src: np.ndarray, dst: np.ndarray, segment: int, logs: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from kvray.config import MooncakeMasterConfig
        from kvray.servers.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster(MooncakeMasterConfig(), logs)
        self.master.start()
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", self.master.address
        )
        assert rc == 0, f"raw mooncake setup failed: {rc}"
        self.store.register_buffer(src.ctypes.data, src.nbytes)
        self.store.register_buffer(dst.ctypes.data, dst.nbytes)
        self.cfg = ReplicateConfig()
        self.cfg.preferred_segments = [self.store.get_hostname()]
        self.src, self.dst = src.ctypes.data, dst.ctypes.data

    def put(self, keys: list[str], offs: np.ndarray, lens: np.ndarray, lo: int, hi: int) -> None:
        k, o, n = keys[lo:hi], (offs[lo:hi] + self.src).tolist(), lens[lo:hi].tolist()
        if offs.shape[1] == 1:
            rcs = self.store.batch_put_from(k, [x[0] for x in o], [x[0] for x in n], self.cfg)
        else:
            rcs = self.store.batch_put_from_multi_buffers(k, o, n, self.cfg)
        assert all(r == 0 for r in rcs), f"raw put failed: {set(rcs)}"

    def get(self, keys: list[str], offs: np.ndarray, lens: np.ndarray, lo: int, hi: int) -> None:
        k, o, n = keys[lo:hi], (offs[lo:hi] + self.dst).tolist(), lens[lo:hi].tolist()
        if offs.shape[1] == 1:
            got = self.store.batch_get_into(k, [x[0] for x in o], [x[0] for x in n])
        else:
            got = self.store.batch_get_into_multi_buffers(k, o, n)
        assert all(g == sum(x) for g, x in zip(got, n, strict=True)), f"raw get: {set(got)}"

    def clear(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)

    def close(self) -> None:
        self.store.close()
        self.master.stop()


class RawYuanrong:
    """The baseline: an in-process datasystem ``KVClient`` on its own
    ``datasystem_worker``: ``mcreate`` + copy of the pieces + ``mset_buffer``,
    ``get_buffers`` + copy, 1000 keys per native call (the SDK's limit is 2000)."""

    name = "yuanrong"

    def __init__(self, src: np.ndarray, dst: np.ndarray, segment: int, logs: str) -> None:
        from kvray.backends.yuanrong import import_datasystem
        from kvray.config import DatasystemWorkerConfig
        from kvray.servers.datasystem import DatasystemWorker

        ds = import_datasystem()
        self.worker = DatasystemWorker(
            DatasystemWorkerConfig(shared_memory_size=segment), name="bench-raw"
        )
        self.worker.start()
        host, port = self.worker.address.rsplit(":", 1)
        self.client = ds.KVClient(
            host, int(port), connect_timeout_ms=5000, enable_exclusive_connection=True
        )
        self.client.init()
        self.mode = ds.WriteMode.NONE_L2_CACHE_EVICT  # as kvray writes by default
        self.src, self.dst = src.ctypes.data, dst.ctypes.data

    def put(self, keys: list[str], offs: np.ndarray, lens: np.ndarray, lo: int, hi: int) -> None:
        for a in range(lo, hi, 1000):
            b = min(hi, a + 1000)
            bufs = self.client.mcreate(keys[a:b], lens[a:b].sum(axis=1).tolist(), self.mode, 0)
            for i, buf in enumerate(bufs, a):
                base = np.frombuffer(buf.MutableData(), dtype=np.uint8).ctypes.data
                at = 0
                for off, n in zip(offs[i].tolist(), lens[i].tolist(), strict=True):
                    ctypes.memmove(base + at, self.src + off, n)
                    at += n
            self.client.mset_buffer(bufs)

    def get(self, keys: list[str], offs: np.ndarray, lens: np.ndarray, lo: int, hi: int) -> None:
        for a in range(lo, hi, 1000):
            bufs = self.client.get_buffers(keys[a : min(hi, a + 1000)], 0)
            for i, buf in enumerate(bufs, a):
                base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
                at = 0
                for off, n in zip(offs[i].tolist(), lens[i].tolist(), strict=True):
                    ctypes.memmove(self.dst + off, base + at, n)
                    at += n

    def clear(self, keys: list[str]) -> None:
        self.client.delete(keys)

    def close(self) -> None:
        self.worker.stop()


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
