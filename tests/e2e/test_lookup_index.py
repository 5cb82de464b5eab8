"""A real vLLM engine on a pool with ``lookup_index: true``: the blocks it saved are in the
node's block index by the time its saves are done; its scheduler answers lookups from the
index, mapped in its own process, and makes no lookup call to the Lookup actor (the
actor's lookup counter does not move); the step that loads the hits pins them with one
call; the loads reproduce the engine's own output; the node's keeper gets its own
node's changes back from the pool's stream as markers, each finding its change."""

from __future__ import annotations

import time

import pytest

from kvray.index.block_index import BlockIndex

from .conftest import BLOCK, own_prompts, pool_hit, start_pool
from .conftest import connector as _connector

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def index_pool(ray_cluster, engines):  # type: ignore[no-untyped-def]
    p = start_pool("e2e-ix", 1, "128MB", lookup_index=True)
    yield p
    engines.close(connected_only=True)
    p.shutdown()


def lookup_stats(pool) -> dict[str, int]:  # type: ignore[no-untyped-def]
    stats: dict[str, int] = pool._h.lookup().snapshot().result(30)["stats"]
    return stats


def keeper_state(pool) -> dict[str, int]:  # type: ignore[no-untyped-def]
    state: dict[str, int] = pool._h.lookup().snapshot().result(30)["index"]
    return state


def test_hits_and_misses_come_from_the_index_with_no_lookup_call(
    index_pool, engines, reference, tiny_model, request
):
    eng = engines.get(
        {
            "model": tiny_model,
            "connector": {
                **_connector("e2e-ix", model_namespace="tiny-ix", load_async=False),
                "policy": "recompute",
            },
        }
    )
    index = BlockIndex.attach(index_pool._h.lookup().index_spec().result(30))
    try:
        p1 = own_prompts(request, 4 * BLOCK + 40, salt="p1")
        held = len(index)
        before = lookup_stats(index_pool)
        first = eng.generate([p1])  # a miss: the index has none of it; 4 blocks saved
        assert first["lines"][0]["saved"] == 4 and first["lines"][0]["hit_pool"] == 0
        # Read your writes: the node's keeper applied the blocks before each put returned.
        assert len(index) == held + 4
        second = eng.generate([p1])
        assert [first["outputs"][0], second["outputs"][0]] == reference([p1, p1])
        pool_hit(second["lines"][0], 4)
        after = lookup_stats(index_pool)
        # Every lookup since was answered by the index (counted as the actor's through
        # the schedulers' reports, as index_lookups too): none was a call to the actor.
        called = [s["lookups"] - s["index_lookups"] for s in (before, after)]
        assert called[0] == called[1], "a lookup went to the Lookup actor"
        assert after["pins"] - before["pins"] == 1, "one pin call for the step that loaded"
        assert after["pin_failures"] == before["pin_failures"]
        # The hub sent this node's own changes back as markers, each of which found its
        # change here: the keeper took no snapshot but its first, and none is left unmarked
        # once the stream caught up (its poll's limit brings the markers).
        deadline = time.monotonic() + 10
        while (state := keeper_state(index_pool))["unmarked"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state["unmarked"] == 0 and state["lost"] == 0 and state["snapshots"] == 1, state
    finally:
        index.close()
