"""Starting, attaching, failing and stopping pools: real Ray, real mooncake_master."""

from __future__ import annotations

import glob
import os

import numpy as np
import psutil
import pytest
import ray

from kvray import Pool
from kvray.errors import (
    BackendUnavailableError,
    PoolConflictError,
    PoolFullError,
    PoolNotFoundError,
    TransferError,
)
from kvray.naming import manager_name, region_prefix
from kvray.servers.process import free_port
from kvray.shm import mapped_regions

from .conftest import pool_actor_names, small_config, users_lease

pytestmark = pytest.mark.integration


def assert_nothing_left(cfg, master_pid=None):
    with pytest.raises(ValueError):
        ray.get_actor(manager_name(cfg.name), namespace=cfg.namespace)
    assert pool_actor_names(cfg) == []
    assert glob.glob(f"/dev/shm/{region_prefix(cfg.name)}-*") == []  # no file, ever
    mapped = mapped_regions(region_prefix(cfg.name) + "-")  # not pool t80's for pool t8
    others = {p: n for p, n in mapped.items() if p != os.getpid()}
    assert others == {}, "a process other than the driver still maps the pool's regions"
    if master_pid is not None:
        gone = not psutil.pid_exists(master_pid)
        assert gone or psutil.Process(master_pid).status() == psutil.STATUS_ZOMBIE


def test_embedded_master_lifecycle(ray_cluster):
    cfg = small_config(None, world_size=1)
    pool = Pool.start(cfg)
    spec = pool._h.manager.spec().result(30)
    assert spec.embedded and spec.server_alive
    master = psutil.Process(spec.server_pid)
    assert "mooncake_master" in " ".join(master.cmdline())
    assert pool.server_address.startswith("127.0.0.1:")
    pool.put("k", np.arange(100, dtype=np.int64))
    assert np.array_equal(pool.get("k", shape=(100,), dtype=np.int64), np.arange(100))
    pool.shutdown()
    master.wait(timeout=10)
    assert_nothing_left(cfg, spec.server_pid)


def test_start_is_idempotent_and_attach_finds_data(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, world_size=1)
    pool = Pool.start(cfg)
    try:
        again = Pool.start(cfg)
        assert again._h.client(0).actor._actor_id == pool._h.client(0).actor._actor_id
        again.close()
        pool.put(f"{cfg.name}-a", np.full(10, 7, np.uint8))
        attached = Pool.attach(cfg.name, cfg.namespace)
        assert attached.get(f"{cfg.name}-a", shape=(10,))[3] == 7
        attached.close()
        with pytest.raises(PoolConflictError, match="different config"):
            Pool.start(cfg.model_copy(update={"io_threads": 2}))
    finally:
        pool.shutdown()
    assert_nothing_left(cfg)
    with pytest.raises(PoolNotFoundError, match="kvray up"):
        Pool.attach(cfg.name, cfg.namespace)


@pytest.mark.timeout(60)  # Mooncake's own retries would take ~90 s
def test_unreachable_master_fails_fast_and_clearly(ray_cluster):
    address = f"127.0.0.1:{free_port()}"
    cfg = small_config(address, world_size=1)
    with pytest.raises(BackendUnavailableError) as info:
        Pool.start(cfg)
    assert "cannot reach mooncake_master" in str(info.value) and address in str(info.value)
    assert_nothing_left(cfg)


def test_full_pool_stores_whole_blocks_or_nothing(ray_cluster):
    """A put into a full pool: each key is stored whole or fails ``pool_full`` and is absent.
    Its own embedded master: the pool's capacity is exactly one 16 MB segment; the users'
    read lease (a failed read is neither outcome this test is about). The adapter puts a
    full batch's keys again while the master evicts, so the first 24 MiB can all land on a
    slow host: batches of 24 MiB go in until the pool reports full."""
    cfg = small_config(
        None, world_size=1, mooncake={"global_segment_size": "16MB"}, master=users_lease()
    )
    pool = Pool.start(cfg)
    try:
        rng = np.random.default_rng(0)
        values = [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(24)]
        err = None
        for batch in range(8):
            keys = [f"b{batch}-{i}" for i in range(24)]
            try:
                pool.put(keys, values)
            except PoolFullError as full:
                err = full
                break
        assert err is not None, "192 MiB went into a 16 MB pool without one key failing"
        assert "pool_full" in str(err)
        assert err.failed and set(err.failed) | set(err.stored) == set(keys)
        assert all(reason == "pool_full" for reason in err.failed.values())
        # Failed keys are absent; stored keys read back whole (or are evicted: a miss).
        assert not any(pool.exists(list(err.failed)))
        assert all(r is None for r in pool.get(list(err.failed), shape=(1 << 20,)))
        for key in err.stored:
            got = pool.get(key, shape=(1 << 20,))
            assert got is None or np.array_equal(got, values[keys.index(key)])
        # The batches before it stored every key: the only failures are this batch's.
        assert pool.stats().total.put_pool_full == len(err.failed)
    finally:
        pool.shutdown()


def test_node_channel_of_a_killed_client_fails_its_calls_then_reattaches(
    ray_cluster, mooncake_master
):
    """A worker's node channel (kvray.store.channel): the BackendClient SIGKILLed with a get in
    flight (the actor stopped first, so the call cannot have answered) fails that get at
    once, not at its timeout; transfers go through Ray meanwhile, and the channel
    re-attaches to the restarted actor and moves bytes again."""
    import contextlib
    import time

    from kvray.backends.base import KeyStatus
    from kvray.remote import CallTimeoutError
    from kvray.store.channel import ChannelStore
    from kvray.transfer import TransferBatch

    cfg = small_config(mooncake_master.address, world_size=1)
    pool = Pool.start(cfg)
    store = None
    try:
        handle = pool._h.client(0)
        n, size = 4, 4096
        src = pool.empty(n * size, np.uint8)
        src[:] = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
        out = pool.empty(n * size, np.uint8)
        keys = [f"{cfg.name}-ch{i}" for i in range(n)]

        def batch(view: np.ndarray) -> TransferBatch:
            region, base = pool._region_of(view)
            spec = region.spec
            return TransferBatch.contiguous(spec, keys, [base + i * size for i in range(n)],
                                            [size] * n)  # fmt: skip

        store = ChannelStore(handle, cfg.call_timeout_s)
        store.attach()
        assert store.attached
        assert store.put(batch(src), True).result(30) == [KeyStatus.OK] * n
        proc = psutil.Process(handle.probe().result(30)["pid"])
        proc.suspend()
        in_flight = store.get(batch(out))
        store.flush()
        proc.kill()
        proc.wait(timeout=30)
        with pytest.raises(BackendUnavailableError, match="closed by the actor") as err:
            in_flight.result(cfg.call_timeout_s)
        assert not isinstance(err.value, CallTimeoutError)

        deadline = time.monotonic() + 60
        while not store.attached and time.monotonic() < deadline:
            with contextlib.suppress(BackendUnavailableError):  # Ray's path meanwhile
                store.put(batch(src), True).result(cfg.call_timeout_s)
            time.sleep(0.1)
        assert store.attached and store.ray_calls >= 1
        frames = store.frames
        assert store.put(batch(src), True).result(30) == [KeyStatus.OK] * n
        assert store.get(batch(out)).result(30) == [KeyStatus.OK] * n
        assert np.array_equal(out, src) and store.frames == frames + 2
        assert handle.probe().result(30)["pid"] != proc.pid
    finally:
        if store is not None:
            store.close()
        pool.shutdown()
    assert_nothing_left(cfg)


def test_killed_backend_client_restarts_and_serves(ray_cluster, mooncake_master):
    cfg = small_config(mooncake_master.address, world_size=1)
    pool = Pool.start(cfg)
    try:
        actor = pool._h.client(0)
        pool.put(f"{cfg.name}-before", np.ones(64, np.uint8))
        old = psutil.Process(actor.probe().result(30)["pid"])
        ray.kill(actor.actor, no_restart=False)
        old.wait(timeout=30)
        value = np.arange(4096, dtype=np.uint8)
        pool.put(f"{cfg.name}-after", value)  # waits for the restarted actor
        assert np.array_equal(pool.get(f"{cfg.name}-after", shape=(4096,)), value)
        assert actor.probe().result(30)["pid"] != old.pid
        assert pool.stats().ranks[0].alive
        # The old block lived in the dead client's segment: a failed read or a miss,
        # never other bytes.
        try:
            got = pool.get(f"{cfg.name}-before", shape=(64,))
            assert got is None or np.array_equal(got, np.ones(64, np.uint8))
        except TransferError as exc:
            assert set(exc.failed) == {f"{cfg.name}-before"}
    finally:
        pool.shutdown()
    assert_nothing_left(cfg)
