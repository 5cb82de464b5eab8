"""The pool's KV events with a real engine: a pool with ``kv_events`` and a
vLLM engine saving to it, with vLLM's own KV events on too. A subscriber built from
vLLM's types reads both streams: the pool's ``BlockStored`` carry the block hashes,
parents and token ids of the engine's own events for the same blocks; its set of blocks
equals ``exists()`` over the key space after quiescence plus 2 s, after a removal too;
and a subscriber that starts late rebuilds the same set from a replay."""

from __future__ import annotations

import time

import pytest

from kvray.servers.process import free_port

from .conftest import BLOCK, logged_key_space, own_prompts, start_pool
from .conftest import connector as _connector

pytestmark = pytest.mark.e2e
kv = pytest.importorskip("tests.kv_subscriber")


@pytest.fixture(scope="module")
def events_pool(ray_cluster, engines):  # type: ignore[no-untyped-def]
    p = start_pool(
        "e2e-ev",
        1,
        "128MB",
        kv_events={"host": "loopback", "port": 0, "replay_port": 0},
    )
    ends = p.kv_events()
    assert ends is not None and ends["endpoint"].startswith("tcp://127.0.0.1:")
    yield p, ends
    engines.close(connected_only=True)
    p.shutdown()


def _held(pool, space, hashes: list[bytes]) -> set:  # type: ignore[no-untyped-def]
    """The blocks of ``hashes`` whose every column ``exists()`` (vLLM's hash form)."""
    keys = space.lookup_key_strs(hashes)
    present = pool.exists(keys)
    n = len(hashes)
    return {
        kv.ext(h)
        for i, h in enumerate(hashes)
        if all(present[c * n + i] for c in range(space.columns))
    }


def _until(cond, timeout_s: float = 30.0, *subs) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the events did not arrive"
        for s in subs:
            s.drain(0.2)


def test_the_pools_events_match_the_engines_and_the_pool(events_pool, engines, tiny_model, request):
    pool, ends = events_pool
    topic_prefix = "kv@"
    pool_sub = kv.Subscriber(ends["endpoint"], ends["replay"], topic_prefix)
    engine_port = free_port()
    engine_sub = kv.Subscriber(f"tcp://127.0.0.1:{engine_port}", None, "", bind=True)
    try:
        eng = engines.get(
            {
                "model": tiny_model,
                "prefix_caching": True,  # (vLLM publishes its own events for cached blocks)
                "connector": _connector("e2e-ev", model_namespace="tiny-ev", load_async=False),
                "kv_events_config": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{engine_port}",  # connects to ours
                    "topic": "engine",
                },
            }
        )
        # vLLM's publisher connects to our subscriber; its first batch can go before our
        # subscription reached it (measured: lost, the next ones not): a warm-up first.
        eng.generate([own_prompts(request, BLOCK + 8, salt="warm-up")])
        engine_sub.drain(1.0)
        prompt = own_prompts(request, 4 * BLOCK + 40)
        out = eng.generate([prompt])
        hashes = [bytes.fromhex(h) for h in out["block_hashes"][0]][:4]
        assert out["lines"][0]["saved"] == 4
        want = {kv.ext(h) for h in hashes}

        def pool_has() -> bool:
            return want <= pool_sub.blocks.get(("CPU", "e2e-ev"), set())

        _until(pool_has, 30, pool_sub, engine_sub)
        engine_sub.drain(1.0)

        # The same blocks, described alike: hashes, parents, tokens, block size.
        def stored(sub) -> dict:  # type: ignore[no-untyped-def]
            out = {}
            for ev in sub.events:
                if isinstance(ev, kv.vk.BlockStored):
                    parent = ev.parent_block_hash
                    for i, h in enumerate(ev.block_hashes):
                        toks = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                        out[h] = (parent, tuple(toks), ev.block_size)
                        parent = h
            return out

        ours, theirs = stored(pool_sub), stored(engine_sub)
        assert want <= set(theirs), "the engine published no events for its blocks"
        for h in want:
            assert ours[h] == theirs[h]
        assert {ev.medium for ev in pool_sub.events if isinstance(ev, kv.vk.BlockStored)} == {"CPU"}

        # After quiescence plus 2 s, the subscriber's blocks are what exists() says.
        space = logged_key_space(eng.log())
        time.sleep(2)
        pool_sub.drain(0.5)
        assert _held(pool, space, hashes) == want
        assert pool_sub.blocks[("CPU", "e2e-ev")] & want == want

        # A removal: the block is published removed.
        gone = space.lookup_key_strs(hashes[3:])[0]  # one column of the last block
        pool.remove([gone], force=True)
        _until(lambda: kv.ext(hashes[3]) not in pool_sub.blocks[("CPU", "e2e-ev")], 30, pool_sub)
        time.sleep(2)
        pool_sub.drain(0.5)
        assert _held(pool, space, hashes) == want - {kv.ext(hashes[3])}
        assert pool_sub.blocks[("CPU", "e2e-ev")] & want == want - {kv.ext(hashes[3])}

        # A subscriber that starts now rebuilds the same set from a replay.
        late = kv.Subscriber(ends["endpoint"], ends["replay"], topic_prefix)
        try:
            for _, _, batch in late.replay(0):
                late.apply(batch)
            assert late.blocks == pool_sub.blocks
        finally:
            late.close()
    finally:
        pool_sub.close()
        engine_sub.close()
