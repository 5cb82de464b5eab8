"""Prefix-aware routing for kvray's proxy: the instance a request goes to, from
what each instance's own prefix cache holds (its engine's KV events) and what the kvray
pool holds (the pool's KV events, kvray/index/kv_events.py), within a bound on load imbalance.

What is cached is learned as vLLM's KV-events consumers learn it: ZMQ PUB batches of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (vLLM's own types). The engines'
publishers connect to the router's SUB socket, each on a topic of its own (llm-d's
``kv@<instance>@<model>``), so one socket hears every instance; the pool's publisher
listens, and the router connects to it.

Blocks are matched by their tokens, not by vLLM's block hashes: a :data:`BlockKey` chains
a block's token ids and extra keys onto its parent's key, computed the same way from an
event's ``token_ids`` and from a request's prompt, so the router needs neither the
engines' hash function nor their seed. Extra keys: a request's ``cache_salt`` is the first
block's, as vLLM's events publish it; LoRA and multimodal requests carry keys the router
cannot know from the request, and are routed as misses (by load alone).

How an instance is scored, for a prompt of ``n`` full blocks:

- ``local``: leading blocks in the instance's own prefix cache (free to reuse);
- ``cached``: leading blocks in its cache or the pool (DRAM for every instance, an SSD
  tier for the instances on its node): what it loads rather than computes;
- cost = ``(n - cached) + load_cost * (cached - local)``: blocks to compute, plus blocks
  to load at ``load_cost`` of a computed one.

A hybrid model's KV cache groups (events with ``group_idx``) are held apart, and a prefix
counts only as far as every group can serve it, by vLLM's rules: a full-attention group
needs every block before the hit's end, a sliding-window group the blocks of the window
ending there, a state group (Mamba, linear attention) the block that ends there. A group's
kind comes from the events that name it (the pool's do; vLLM's own engine events may not,
and then the pool's word for the same group index is taken; unknown: full attention).

Among the healthy instances with at most ``max_imbalance`` requests in flight more than
the least busy one, the cheapest wins; ties go to the less busy, then in turn.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

logger = logging.getLogger(__name__)

BlockKey = NewType("BlockKey", int)
"""A block's identity to the router: its tokens and extra keys, chained onto its
parent's key (the first block's parent is :data:`ROOT`)."""
ROOT = BlockKey(0)

POOL_CPU, POOL_STORAGE = "CPU", "STORAGE"
"""The media of the pool's events: its DRAM tier, and the SSD tier of one node."""

KEYS_KEPT = 1 << 20
"""Block hashes a view remembers the key of (about 150 bytes each): removed blocks' too,
since a child stored later names its parent by hash."""


def chain(parent: int, tokens: Sequence[int], extra: Hashable | None) -> BlockKey:
    """The key of a block of ``tokens`` (with ``extra`` keys) after ``parent``."""
    return BlockKey(hash((parent, tuple(tokens), extra)))


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[BlockKey]:
    """The keys of a prompt's full blocks; ``salt``: its ``cache_salt`` (vLLM puts it in
    the first block's extra keys)."""
    keys: list[BlockKey] = []
    prev = ROOT
    for j in range(len(tokens) // block_size):
        extra = (salt,) if j == 0 and salt else None
        prev = chain(prev, tokens[j * block_size : (j + 1) * block_size], extra)
        keys.append(prev)
    return keys


def _extra(keys: Any) -> Hashable | None:
    """An event's extra keys of one block, as :func:`chain` takes them."""
    if not keys:
        return None
    return tuple(tuple(k) if isinstance(k, list) else k for k in keys)


Where = tuple[str | None, str | None]
"""(medium, ownership) of a stored block."""


FULL, WINDOW, STATE = "full", "window", "state"
"""How a group serves a hit of ``h`` blocks: every block before ``h``, the window's blocks
ending at ``h``, or block ``h - 1`` alone."""
_STATE_KINDS = frozenset({"mamba"})
_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(frozen=True)
class GroupKind:
    """A KV cache group's kind as events name it (vLLM's ``kv_cache_spec_kind``)."""

    kind: str | None = None
    sliding_window: int | None = None

    def rule(self) -> str:
        if self.kind in _STATE_KINDS:
            return STATE
        if self.kind in _WINDOW_KINDS and self.sliding_window:
            return WINDOW
        return FULL


class CacheView:
    """What one stream of KV events says is held: each block's key, and where, per KV
    cache group."""

    def __init__(self, name: str, keys_kept: int = KEYS_KEPT) -> None:
        self.name = name
        self.block_size = 0
        """The block size of its latest ``BlockStored`` (0: none yet)."""
        self.groups: dict[int, GroupKind] = {}
        """The KV cache groups its events named, with the kind they gave."""
        self._key_of: OrderedDict[Any, BlockKey] = OrderedDict()
        self._where: dict[tuple[BlockKey, int], set[Where]] = {}
        self._kept = keys_kept
        self.unresolved = 0
        """Stored blocks skipped: their parent's key was never seen (a batch was lost)."""

    def __len__(self) -> int:
        return len(self._where)

    def stored(
        self,
        hashes: Sequence[Any],
        parent: Any,
        tokens: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Any] | None,
        where: Where,
        group: int | None = None,
        kind: GroupKind | None = None,
    ) -> None:
        g = group or 0
        if (kind is not None and kind.kind is not None) or g not in self.groups:
            self.groups[g] = kind or GroupKind()
        prev: BlockKey | None = ROOT if parent is None else self._key_of.get(parent)
        if prev is None:
            self.unresolved += len(hashes)
            return
        self.block_size = block_size
        for i, h in enumerate(hashes):
            extra = _extra(extra_keys[i]) if extra_keys and i < len(extra_keys) else None
            prev = chain(prev, tokens[i * block_size : (i + 1) * block_size], extra)
            self._key_of[h] = prev
            self._key_of.move_to_end(h)
            self._where.setdefault((prev, g), set()).add(where)
        while len(self._key_of) > self._kept:
            self._key_of.popitem(last=False)

    def removed(self, hashes: Sequence[Any], where: Where, group: int | None = None) -> None:
        g = group or 0
        for h in hashes:
            key = self._key_of.get(h)
            held = self._where.get((key, g)) if key is not None else None
            if held is None:
                continue
            held.discard(where)
            if not held:
                del self._where[(key, g)]  # type: ignore[arg-type]  # key is set when held is

    def cleared(self) -> None:
        self._where.clear()

    def leading(self, keys: Sequence[BlockKey], accept: Callable[[Where], bool]) -> int:
        """How many of ``keys``, from the first, every group can serve from somewhere
        ``accept`` takes (:func:`servable`)."""
        return servable(keys, self.groups, lambda k, g: self.holds(k, accept, g), self.block_size)

    def holds(self, key: BlockKey, accept: Callable[[Where], bool], group: int = 0) -> bool:
        held = self._where.get((key, group))
        return bool(held) and any(accept(w) for w in held)  # type: ignore[union-attr]


def servable(
    keys: Sequence[BlockKey],
    groups: Mapping[int, GroupKind],
    held: Callable[[BlockKey, int], bool],
    block_size: int,
) -> int:
    """The deepest ``h <= len(keys)`` at which every group of ``groups`` (none known: one
    full-attention group 0) holds what a hit of ``h`` blocks needs: vLLM's fixed point
    for hybrid models, not each group's longest hit."""
    rules = {g: k.rule() for g, k in groups.items()} or {0: FULL}
    h = len(keys)
    for g, rule in rules.items():
        if rule == FULL:
            n = 0
            while n < h and held(keys[n], g):
                n += 1
            h = n
    others = {g: r for g, r in rules.items() if r != FULL}
    while h > 0:
        ok = True
        for g, rule in others.items():
            if rule == STATE:
                ok = held(keys[h - 1], g)
            else:
                window = groups[g].sliding_window  # (set: rule() said WINDOW)
                assert window is not None
                span = -(-(window - 1) // block_size) if block_size else h
                ok = all(held(keys[j], g) for j in range(max(0, h - span), h))
            if not ok:
                break
        if ok:
            return h
        h -= 1
    return 0


class Target(Protocol):
    """One instance as the router sees it (the proxy's ``Instance``)."""

    host: str
    view: CacheView | None
    """What its engine's KV events say it holds (None: no events: nothing known)."""
    in_flight: int
    healthy: bool


@dataclass(frozen=True)
class Choice:
    """A routing decision, with what it was based on (logged, and counted)."""

    index: int
    blocks: int
    local: int
    cached: int
    cost: float
    scores: tuple[tuple[int, int, int], ...] = field(default=())
    """Per instance: (local, cached, in flight) at the decision."""


class PrefixRouter:
    """Chooses among ``targets`` by their caches and the pool's, within ``max_imbalance``
    requests in flight of the least busy; thread-safe (event feeds apply from their own
    threads)."""

    def __init__(
        self,
        targets: Sequence[Target],
        pool: CacheView | None = None,
        *,
        max_imbalance: int = 4,
        load_cost: float = 0.2,
    ) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance {max_imbalance}: give 0 or more requests")
        if not 0.0 <= load_cost <= 1.0:
            raise ValueError(
                f"load_cost {load_cost}: a loaded block's cost as a fraction of a computed "
                "one, between 0 and 1"
            )
        self.targets = targets
        self.pool = pool
        self.max_imbalance = max_imbalance
        self.load_cost = load_cost
        self.lock = threading.Lock()
        self._turn = itertools.count()
        self.routed_to_cache = 0
        """Requests sent where some of their prefix was held (local or pool)."""
        self.bounded = 0
        """Requests whose cheapest instance was passed over for the imbalance bound."""

    def block_size(self) -> int:
        sizes = [t.view.block_size for t in self.targets if t.view and t.view.block_size]
        if not sizes and self.pool is not None:
            sizes = [self.pool.block_size] if self.pool.block_size else []
        return sizes[0] if sizes else 0

    def choose(self, tokens: Sequence[int] | None, salt: str | None = None) -> Choice:
        """The instance for a prompt of ``tokens`` (None: not known, by load alone)."""
        with self.lock:
            live = [i for i, t in enumerate(self.targets) if t.healthy]
            if not live:
                raise LookupError("no healthy instance")
            size = self.block_size()
            keys = block_keys(tokens, size, salt) if tokens and size else []
            scores = {i: self._score(self.targets[i], keys) for i in live}
            least = min(self.targets[i].in_flight for i in live)
            eligible = [i for i in live if self.targets[i].in_flight <= least + self.max_imbalance]
            turn = next(self._turn)

            def order(i: int) -> tuple[float, int, int]:
                local, cached = scores[i]
                cost = (len(keys) - cached) + self.load_cost * (cached - local)
                return (cost, self.targets[i].in_flight, (i - turn) % len(self.targets))

            best = min(eligible, key=order)
            if min(live, key=order) != best:
                self.bounded += 1
            local, cached = scores[best]
            if cached:
                self.routed_to_cache += 1
            return Choice(
                best,
                len(keys),
                local,
                cached,
                order(best)[0],
                tuple((*scores.get(i, (0, 0)), t.in_flight) for i, t in enumerate(self.targets)),
            )

    def _score(self, target: Target, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """(local, cached) leading blocks of ``keys`` for ``target``: what every KV cache
        group serves from its own cache, and from its cache and the pool together."""
        view, pool = target.view, self.pool
        groups = dict(pool.groups) if pool is not None else {}
        if view is not None:  # (its engine's events may not name kinds: the pool's do)
            groups.update({g: k for g, k in view.groups.items() if k.kind or g not in groups})
        size = (view.block_size if view is not None else 0) or (pool.block_size if pool else 0)

        def anywhere(w: Where) -> bool:
            return True

        def own(key: BlockKey, g: int) -> bool:
            return view is not None and view.holds(key, anywhere, g)

        local = servable(keys, groups, own, size) if view is not None else 0
        if pool is None:
            return local, local

        def in_pool(w: Where) -> bool:
            medium, owner = w
            if medium == POOL_STORAGE:  # ``<pool>@<node address>``: that node's tier only
                return owner is not None and owner.rsplit("@", 1)[-1] == target.host
            return True

        def either(key: BlockKey, g: int) -> bool:
            return own(key, g) or pool.holds(key, in_pool, g)

        return local, max(local, servable(keys, groups, either, size))


def apply_batch(view: CacheView, batch: Any) -> None:
    """One ``KVEventBatch`` (vLLM's types) onto ``view``."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for ev in batch.events:
        if isinstance(ev, BlockStored):
            view.stored(
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.block_size,
                ev.extra_keys,
                (ev.medium, ev.ownership),
                ev.group_idx,
                GroupKind(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window),
            )
        elif isinstance(ev, BlockRemoved):
            view.removed(ev.block_hashes, (ev.medium, ev.ownership), ev.group_idx)
        elif isinstance(ev, AllBlocksCleared):
            view.cleared()
