"""What the pool manager remembers (kvray.pool_state), without Ray: node actors and
forgetting dead nodes, hash fingerprints, the ledger's updates and their long poll."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvray.index.ledger import Changes, Ledger, Seen
from kvray.index.long_poll import LongPoll
from kvray.pool_state import PoolState
from kvray.remote import LookupHandle, NodeActors, StoreHandle


def _state() -> PoolState:
    state = PoolState("p")
    for node in ("a", "b"):
        for slot in (1, 0):
            ssd = StoreHandle(f"ssd-{node}{slot}", "ssd") if node == "a" else None
            state.nodes[(node, slot)] = NodeActors(
                node, slot, StoreHandle(f"{node}{slot}", "c"), ssd
            )
        state.lookups[node] = LookupHandle(f"lookup-{node}", "l")
    return state


def test_node_actors_are_listed_by_node_then_slot_and_all_are_closed():
    state = _state()
    assert [(a.node_id, a.slot) for a in state.sorted_nodes()] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1),
    ]  # fmt: skip
    names = sorted(str(h.actor) for h in state.all_actors())
    assert names == ["a0", "a1", "b0", "b1", "lookup-a", "lookup-b", "ssd-a0", "ssd-a1"]


def test_a_dead_node_is_forgotten_only_after_the_grace_period():
    state = _state()
    assert state.forget_gone({"a", "b"}, after_s=300, now=0) == []
    assert state.forget_gone({"a"}, after_s=300, now=10) == []  # b gone since 10
    assert state.forget_gone({"a"}, after_s=300, now=309) == []
    assert state.forget_gone({"a", "b"}, after_s=300, now=350) == []  # b is back: reset
    assert state.forget_gone({"a"}, after_s=300, now=400) == []
    assert state.forget_gone({"a"}, after_s=300, now=700) == ["b"]
    assert {k[0] for k in state.nodes} == {"a"} and set(state.lookups) == {"a"}


def test_fingerprints_answer_the_other_hash_domains_and_mark_mixed_keys():
    state = PoolState("p")
    fp = {"hash_domain": "sha256:seed1", "algorithm": "sha256"}
    assert state.register_fingerprint("m@l", fp) == []
    assert state.register_fingerprint("m@l", fp) == []
    other = {"hash_domain": "builtin:seed2", "algorithm": "builtin"}
    answer = state.register_fingerprint("m@l", other)
    assert [(a["hash_domain"], a["instances"]) for a in answer] == [("sha256:seed1", 2)]
    state.register_fingerprint("m@alone", fp)
    state.ledger.record(Changes.rows_of([(1, int(Seen.STORED), 0.0), (2, int(Seen.REMOVED), 0.0)]))
    seq, entries, full, mixed = state.ledger_since(0)
    assert (len(entries), mixed) == (2, ["m@l"]) and seq > 0
    assert len(state.ledger_since(seq)[1]) == 0


def test_a_reset_joins_the_newest_generation_of_its_keys_or_starts_one():
    """Engines of one model reset after a weight update: the first starts generation 1,
    the others join it (they share again); a reset from the newest starts the next one;
    other keys are untouched."""
    state = PoolState("p")
    assert state.reset_generation("m@lay", 0) == 1
    assert state.reset_generation("m@lay", 0) == 1  # another engine of the model joins
    assert state.reset_generation("m@lay", 1) == 2  # the next update
    assert state.reset_generation("m@lay", 0) == 2
    assert state.reset_generation("other@lay", 0) == 1
    assert state.reset_generation("m@lay", 5) == 6  # (a manager restarted forgot them)


def test_the_ledger_long_poll_answers_at_once_on_a_change_and_after_its_wait_without():
    """A Lookup actor's ask for ledger updates: answered at once when the ledger has
    changes after its sequence number (or the number is one the ledger never had: a
    manager restarted), as soon as a record comes while it waits, and after the wait
    when none comes. (The long waits are far above the bounds they are checked against.)"""

    async def scenario() -> bool:
        ledger, poll = Ledger(), LongPoll()

        def after(seq: int, wait_s: float) -> Coroutine[Any, Any, None]:
            """The manager's hold of an ask for what came after ``seq``."""
            return poll.wait(lambda: seq != ledger.seq, wait_s)

        ledger.record(Changes.rows_of([(1, int(Seen.STORED), 0.0)]))
        await asyncio.wait_for(after(0, 60.0), 5.0)
        await asyncio.wait_for(after(ledger.seq + 7, 60.0), 5.0)
        waiting = asyncio.ensure_future(after(ledger.seq, 60.0))
        await asyncio.sleep(0.1)
        held = not waiting.done()
        ledger.record(Changes.rows_of([(2, int(Seen.STORED), 0.0)]))
        poll.changed()
        await asyncio.wait_for(waiting, 5.0)
        await asyncio.wait_for(after(ledger.seq, 0.2), 5.0)
        return held

    assert asyncio.run(scenario()), "the ask with nothing new was answered before a change"
