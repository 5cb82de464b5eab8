"""The pool as a router's source of truth: its blocks as vLLM KV events.

Routers that send a request to where its prefix is cached (llm-d's precise prefix-cache
scorer, Dynamo's KV router, Ray Serve's prefix-aware router) learn what is cached from
vLLM's KV events. One publisher per pool, in the pool's manager, speaks the same wire
format for what the *pool* holds:

- **What is stored** comes from the pool's own block index (the manager's
  :class:`~kvray.index.stream.IndexHub`: every store and remove of every BackendClient,
  per tier, and what loads found gone), not from the workers' word. A block counts as
  stored in a medium only when every column of its key space (every rank, every layer
  group) is there: ``CPU`` for the pool's DRAM tier, ``STORAGE`` for kvray's SSD tier.
- **What a block is** (its vLLM block hash, parent hash, token ids, block size, extra
  keys) comes from the scheduler that saved it (:class:`Described`, sent with the step's
  saves): the index knows 8-byte digests only. A block the pool holds that no scheduler
  described (stored through the Pool API, or before the manager last started) is not
  published.
- **KV cache groups** (a hybrid model's full-attention, sliding-window and state groups):
  each group's block is announced on its own, with vLLM's ``group_idx``, spec kind and
  window, once every column of that group is stored (a state group's only at the block
  boundaries whose state was saved), so a router finds where every group can serve a
  prefix, as vLLM's own per-group events let it.
- **Topics**: one key space per topic, the topic the describing engine's
  ``kv_events.topic`` template names (default ``kv@{host}@{model}``, llm-d's per-engine
  convention), so a router attributes the pool's blocks to each engine attached to it.
  Each topic has its own sequence numbers; its first batch (and every batch after a
  restart, or for a subscriber further behind than the replay buffer) is
  ``AllBlocksCleared`` then a snapshot of every block announced on it.

Wire format: vLLM's own (``vllm.distributed.kv_events``): ZMQ PUB frames ``(topic, 8-byte
big-endian sequence number, msgpack KVEventBatch)``, and a ROUTER socket for replay
(``(identity, b"", start sequence)`` in; ``(identity, b"", topic, seq, payload)`` per
batch out, then ``(identity, b"", b"", -1, b"")``). vLLM's event types are imported by the
publisher's thread when it starts (4-8 s and ~600 MB in the manager's process, paid only
by pools with ``kv_events`` set).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvray.index.block_index import DRAM, TIERS, BlockIndex, space_digests
from kvray.keys import KeySpace

logger = logging.getLogger(__name__)

CPU, STORAGE = "CPU", "STORAGE"
"""vLLM's medium names: the pool's DRAM tier, kvray's SSD tier."""
SSD_TIERS = TIERS & ~DRAM
"""The index's tier bits of the SSD places."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""A replay's last frame's sequence number."""
SNAPSHOT_BATCH = 1024
"""Blocks per BlockStored event of a snapshot."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block as vLLM's ``BlockStored`` describes it, as its scheduler knew it."""

    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None
    """vLLM's per-block extra keys as its events publish them (LoRA name, media, the
    cache salt), or None."""
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One KV cache group as vLLM's ``BlockStored`` names it."""

    kind: str | None = None
    """vLLM's ``KVCacheSpecKind`` value (``full_attention``, ``sliding_window``,
    ``mamba``, ...); None: not known."""
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class Described:
    """A scheduler's saved blocks of one key space, for the pool's events on ``topic``."""

    space: KeySpace
    topic: str
    block_size: int
    blocks: tuple[BlockInfo, ...]
    groups: tuple[GroupInfo, ...] = ()
    """The key space's KV cache groups, one per ``space.kv_groups`` (empty: unknown
    kinds)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One event before it is vLLM's: ``stored`` or ``removed`` blocks in ``medium``, or
    ``cleared`` (vLLM's ``AllBlocksCleared``)."""

    kind: str
    medium: str = CPU
    ownership: str | None = None
    block_size: int = 0
    blocks: tuple[BlockInfo, ...] = ()
    group: int = 0
    """The KV cache group of ``blocks`` (vLLM's ``group_idx``)."""
    group_info: GroupInfo = GroupInfo()


@dataclass(slots=True, eq=False)
class _Block:
    """One KV cache group's block."""

    info: BlockInfo
    space: _Space
    group: int
    digests: np.ndarray
    """The block's key digests, one per column of its key space's group."""
    media: dict[str, str | None] = field(default_factory=dict)
    """Media announced stored -> the ownership they were announced with."""


@dataclass(slots=True, eq=False)
class _Space:
    space: KeySpace
    block_size: int
    groups: tuple[GroupInfo, ...]
    topics: set[str] = field(default_factory=set)
    blocks: dict[tuple[bytes, int], _Block] = field(default_factory=dict)
    """By block hash and group, in the order they were described (parents before
    children, each block's groups in order)."""
    columns: list[np.ndarray] = field(default_factory=list)
    """Per group, the columns of the key space that are that group's."""

    def __post_init__(self) -> None:
        of = np.array([self.space.column(c)[2] for c in range(self.space.columns)])
        self.columns = [np.nonzero(of == g)[0] for g in range(self.space.kv_groups)]
        if len(self.groups) != self.space.kv_groups:
            self.groups = (GroupInfo(),) * self.space.kv_groups


class BlockCatalog:
    """The blocks the pool's events speak of: their descriptions, by key space, and the
    media each was last announced in. Fed the hub's index (its tier masks are the truth)
    and the schedulers' descriptions; answers the events each change makes, per topic.
    Not thread-safe: one lock around it (:class:`KVEventsHub`)."""

    def __init__(
        self,
        index: BlockIndex,
        pool: str,
        node_of_place: Callable[[int], str],
        max_blocks: int,
    ) -> None:
        self._index = index
        self._pool = pool
        self._node_of_place = node_of_place
        """The node name (for ``ownership``) of the SSD place with that tier bit."""
        self._max_blocks = max_blocks
        self._spaces: dict[KeySpace, _Space] = {}
        self._topics: dict[str, _Space] = {}
        self._by_digest: dict[int, _Block] = {}
        self._order: dict[tuple[int, bytes, int], _Block] = {}
        """Every block, oldest described first."""
        self.refused_topics: set[str] = set()
        """Topics a second key space asked for: its blocks were not published."""

    @property
    def blocks(self) -> int:
        return len(self._order)

    def topics(self) -> list[str]:
        return list(self._topics)

    def describe(self, d: Described) -> tuple[list[str], list[tuple[str, Event]]]:
        """Take a scheduler's descriptions: ``(topics new to the catalog, events)``, the
        events those of blocks already complete in a medium."""
        sp = self._spaces.get(d.space)
        if sp is None:
            sp = self._spaces[d.space] = _Space(d.space, d.block_size, d.groups)
        new_topics: list[str] = []
        events: list[tuple[str, Event]] = []
        owner = self._topics.get(d.topic)
        if owner is None:
            self._topics[d.topic] = sp
            sp.topics.add(d.topic)
            new_topics.append(d.topic)
        elif owner is not sp and _reset_of(owner.space, d.space):
            # The engine reset its pool blocks (a new generation of its keys): its topic
            # starts over, as vLLM's own after a prefix-cache reset.
            owner.topics.discard(d.topic)
            self._topics[d.topic] = sp
            sp.topics.add(d.topic)
            events.append((d.topic, Event("cleared")))
        elif owner is not sp and d.topic not in self.refused_topics:
            self.refused_topics.add(d.topic)
            logger.warning(
                "kv events: topic %r already carries the key space %s@%s; an engine of "
                "%s@%s (tp %d, pp %d) asked for it too and its blocks are not published "
                "there: make the kv_events.topic template tell them apart (add {instance})",
                d.topic,
                owner.space.namespace,
                owner.space.layout,
                d.space.namespace,
                d.space.layout,
                d.space.tp_size,
                d.space.pp_size,
            )
        n = len(sp.columns)
        fresh = [b for b in d.blocks if any((b.block_hash, g) not in sp.blocks for g in range(n))]
        if not fresh or not sp.topics:  # (a key space no topic carries: nothing to say)
            return new_topics, events
        digs = space_digests(d.space, [b.block_hash for b in fresh])
        made = []
        for i, info in enumerate(fresh):
            for g, cols in enumerate(sp.columns):
                if (info.block_hash, g) in sp.blocks:
                    continue
                block = _Block(info, sp, g, digs[cols, i].copy())
                sp.blocks[(info.block_hash, g)] = block
                self._order[(id(sp), info.block_hash, g)] = block
                for dg in block.digests.tolist():
                    self._by_digest[dg] = block
                made.append(block)
        events += self._evaluate(made)
        events += self._trim()
        return new_topics, events

    def changed(self, digests: Iterable[np.ndarray]) -> list[tuple[str, Event]]:
        """The events of the hub's index changes of ``digests`` (already applied)."""
        touched: dict[int, _Block] = {}
        for d in digests:
            for dg in d.tolist():
                block = self._by_digest.get(dg)
                if block is not None:
                    touched[id(block)] = block
        return self._evaluate(list(touched.values())) if touched else []

    def snapshot(self, topic: str) -> list[Event]:
        """``cleared``, then every block announced on ``topic``, by medium and owner."""
        return snapshot_events(*self.announced(topic))

    def announced(self, topic: str) -> tuple[int, list[Announced]]:
        """``(block size, [(block, its group, its media)])`` of ``topic``'s blocks, oldest
        first: what a snapshot is made of, taken under the lock (the media dicts are
        replaced, never changed, so they may be read after it)."""
        sp = self._topics.get(topic)
        if sp is None:
            return 0, []
        rows = [(b.info, b.group, sp.groups[b.group], b.media) for b in sp.blocks.values()]
        return sp.block_size, [r for r in rows if r[3]]

    def keys_in(self, medium: str) -> tuple[np.ndarray, list[str]]:
        """Every column key of the blocks announced in ``medium``, and its digest: what
        to ask the backend about when the index may be wrong (a node lost, and the DRAM
        tier's copies in it)."""
        digests: list[np.ndarray] = []
        keys: list[str] = []
        for sp in self._spaces.values():
            prefixes = sp.space.column_prefixes()
            of_group = [[prefixes[c] for c in cols.tolist()] for cols in sp.columns]
            for block in sp.blocks.values():
                if medium in block.media:
                    tail = block.info.block_hash.hex()
                    keys += [p + tail for p in of_group[block.group]]
                    digests.append(block.digests)
        return (np.concatenate(digests) if digests else np.empty(0, np.uint64)), keys

    def _evaluate(self, blocks: Sequence[_Block]) -> list[tuple[str, Event]]:
        """Compare each block's media in the index with what was announced."""
        if not blocks:
            return []
        tiers = self._index.tiers(np.concatenate([b.digests for b in blocks]))
        at = 0
        stored: dict[tuple[int, int, str, str | None], list[_Block]] = {}
        removed: dict[tuple[int, int, str, str | None], list[_Block]] = {}
        for block in blocks:
            t = tiers[at : at + len(block.digests)]
            at += len(block.digests)
            now: dict[str, str | None] = {}
            if bool((t & DRAM).all()):
                now[CPU] = self._pool
            if bool((t & SSD_TIERS).all()):
                now[STORAGE] = self._ssd_owner(int(t[0] & SSD_TIERS))
            at_key = (id(block.space), block.group)
            for medium, owner in block.media.items():
                if now.get(medium, "\0") != owner:
                    removed.setdefault((*at_key, medium, owner), []).append(block)
            for medium, owner in now.items():
                if block.media.get(medium, "\0") != owner:
                    stored.setdefault((*at_key, medium, owner), []).append(block)
            block.media = now
        out: list[tuple[str, Event]] = []
        for kind, changes in (("removed", removed), ("stored", stored)):
            # (by group: a group's parents are announced before a later group names them)
            for (_, g, medium, owner), members in sorted(changes.items(), key=lambda kv: kv[0][1]):
                sp = members[0].space
                infos = tuple(b.info for b in members)
                ev = Event(kind, medium, owner, sp.block_size, infos, g, sp.groups[g])
                out += [(topic, ev) for topic in sp.topics]
        return out

    def _ssd_owner(self, bits: int) -> str:
        """``<pool>@<node>`` of the lowest SSD place among ``bits``."""
        low = bits & -bits
        return f"{self._pool}@{self._node_of_place(low)}"

    def _trim(self) -> list[tuple[str, Event]]:
        """Past ``max_blocks``, the oldest described blocks are forgotten; those announced
        are published removed (the pool no longer vouches for them)."""
        out: list[tuple[str, Event]] = []
        while len(self._order) > self._max_blocks:
            key = next(iter(self._order))
            block = self._order.pop(key)
            sp = block.space
            del sp.blocks[key[1:]]
            for dg in block.digests.tolist():
                if self._by_digest.get(dg) is block:
                    del self._by_digest[dg]
            for medium, owner in block.media.items():
                g = block.group
                ev = Event("removed", medium, owner, sp.block_size, (block.info,), g, sp.groups[g])
                out += [(topic, ev) for topic in sp.topics]
        return out


Announced = tuple[BlockInfo, int, GroupInfo, dict[str, str | None]]
"""A block as a snapshot lists it: its description, KV cache group, and media."""


def _reset_of(old: KeySpace, new: KeySpace) -> bool:
    """``new`` is ``old``'s keys after a reset (a newer generation)."""
    return new.generation > old.generation and replace(old, generation=new.generation) == new


def snapshot_events(block_size: int, rows: Sequence[Announced]) -> list[Event]:
    """``cleared``, then ``rows``' blocks as ``stored`` events by group, medium and
    owner (groups in order)."""
    out = [Event("cleared")]
    runs: dict[tuple[int, str, str | None], tuple[GroupInfo, list[BlockInfo]]] = {}
    for info, g, group, media in rows:
        for medium, owner in media.items():
            runs.setdefault((g, medium, owner), (group, []))[1].append(info)
    for (g, medium, owner), (group, infos) in sorted(runs.items(), key=lambda kv: kv[0][0]):
        for lo in range(0, len(infos), SNAPSHOT_BATCH):
            chunk = tuple(infos[lo : lo + SNAPSHOT_BATCH])
            out.append(Event("stored", medium, owner, block_size, chunk, g, group))
    return out


class KVEventsHub:
    """The manager's side: the catalog, the publisher, and the lock between the manager's
    loop (descriptions, index changes) and the publisher's thread (snapshots)."""

    def __init__(
        self,
        index: BlockIndex,
        pool: str,
        pub_endpoint: str,
        replay_endpoint: str | None,
        *,
        buffer: int,
        hwm: int,
        max_blocks: int,
        node_name: Callable[[str], str] = lambda node_id: node_id[:12],
    ) -> None:
        self._lock = threading.Lock()

        def place_node(bit: int) -> str:
            return node_name(index.places()[bit.bit_length() - 2][0])

        self.catalog = BlockCatalog(index, pool, place_node, max_blocks)
        self.publisher = KVEventsPublisher(
            pub_endpoint, replay_endpoint, self._snapshot, buffer=buffer, hwm=hwm
        )

    def _snapshot(self, topic: str) -> list[Event]:
        with self._lock:  # (the manager's loop waits while this holds it: keep it short)
            announced = self.catalog.announced(topic)
        return snapshot_events(*announced)

    def describe(self, reports: Sequence[Described]) -> None:
        """A scheduler's step of saved blocks (announced once the index has them whole)."""
        with self._lock:
            results = [self.catalog.describe(d) for d in reports]
        for new_topics, events in results:
            for topic in new_topics:
                self.publisher.add_topic(topic)
            # A new topic's first batch is its snapshot, taken after these were announced.
            self._publish([(t, ev) for t, ev in events if t not in new_topics])

    def changed(self, digests: Iterable[np.ndarray]) -> None:
        """The hub's index applied changes of ``digests``."""
        if not self.catalog.blocks:
            return
        with self._lock:
            events = self.catalog.changed(digests)
        self._publish(events)

    def keys_in(self, medium: str) -> tuple[np.ndarray, list[str]]:
        """:meth:`BlockCatalog.keys_in`, under the lock."""
        with self._lock:
            return self.catalog.keys_in(medium)

    def _publish(self, events: list[tuple[str, Event]]) -> None:
        by_topic: dict[str, list[Event]] = {}
        for topic, ev in events:
            by_topic.setdefault(topic, []).append(ev)
        for topic, evs in by_topic.items():
            self.publisher.publish(topic, evs)

    def endpoints(self) -> dict[str, str | None]:
        return {"endpoint": self.publisher.endpoint, "replay": self.publisher.replay_endpoint}

    def close(self) -> None:
        self.publisher.close()


class _Topic:
    __slots__ = ("seq", "buffer")

    def __init__(self, buffer: int) -> None:
        self.seq = itertools.count()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)


class KVEventsPublisher:
    """ZMQ PUB and replay ROUTER sockets in a thread of their own, vLLM's wire format.

    ``snapshot(topic)`` (called on the thread, under the caller's lock) gives the events
    a topic starts with: its first batch, and the answer to a replay request that starts
    before the oldest batch kept (``buffer`` batches per topic) or after the newest."""

    def __init__(
        self,
        pub_endpoint: str,
        replay_endpoint: str | None,
        snapshot: Callable[[str], list[Event]],
        *,
        buffer: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self.endpoint = _bind(self._pub, pub_endpoint)
            self.replay_endpoint = (
                _bind(self._replay, replay_endpoint) if self._replay and replay_endpoint else None
            )
        except Exception:
            self._close_sockets()
            raise
        self._snapshot = snapshot
        self._buffer = buffer
        self._queue: queue.Queue[tuple[str, list[Event]] | None] = queue.Queue()
        self._topics: dict[str, _Topic] = {}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.published = 0
        """Batches sent (replays not counted)."""
        self._thread = threading.Thread(target=self._run, name="kvray-kv-events", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        """Until vLLM's event types are imported (raises what the import raised)."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the KV-events publisher did not start within {timeout:.0f} s")
        if self._error is not None:
            raise self._error

    def publish(self, topic: str, events: list[Event]) -> None:
        """One batch on ``topic`` (the topic's snapshot first if it is new); dropped
        when the publisher could not start (:meth:`wait_ready` says why)."""
        if events and self._error is None:
            self._queue.put((topic, events))

    def add_topic(self, topic: str) -> None:
        """Start ``topic``: its first batch is its snapshot."""
        if self._error is None:
            self._queue.put((topic, []))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ---- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            import msgspec
            from vllm.distributed import kv_events as vk
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            self._vk = vk
            self._external: Callable[[Any], Any] = maybe_convert_block_hash
            self._encode = msgspec.msgpack.Encoder().encode
        except BaseException as exc:  # reported by wait_ready
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = self._zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self._zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("kv events: a replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            topic, events = item
            try:
                self._send(topic, events)
            except Exception:
                logger.exception("kv events: publishing a batch on %r failed", topic)

    def _topic(self, name: str) -> tuple[_Topic, bool]:
        t = self._topics.get(name)
        if t is None:
            t = self._topics[name] = _Topic(self._buffer)
            return t, True
        return t, False

    def _send(self, topic: str, events: list[Event]) -> None:
        t, new = self._topic(topic)
        if new:  # its first batch: cleared, then what it has (which covers ``events``)
            events = self._snapshot(topic)
        elif not events:
            return
        seq = next(t.seq)
        payload = self._payload(events)
        self._pub.send_multipart((topic.encode(), seq.to_bytes(8, "big"), payload))
        t.buffer.append((seq, payload))
        self.published += 1

    def _payload(self, events: list[Event]) -> bytes:
        vk = self._vk
        out: list[Any] = []
        for ev in events:
            if ev.kind == "cleared":
                out.append(vk.AllBlocksCleared())
            elif ev.kind == "removed":
                out.append(
                    vk.BlockRemoved(
                        block_hashes=[self._external(b.block_hash) for b in ev.blocks],
                        medium=ev.medium,
                        group_idx=ev.group,
                        ownership=ev.ownership,
                    )
                )
            else:
                out += _stored(vk, self._external, ev)
        return self._encode(vk.KVEventBatch(ts=time.time(), events=out))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or len(frames[-1]) != 8:
            logger.warning("kv events: a replay request of %d frame(s) ignored", len(frames))
            return
        ident = frames[0]
        start = int.from_bytes(frames[-1], "big")
        names = [frames[2].decode()] if len(frames) == 4 else list(self._topics)
        for name in names:
            t = self._topics.get(name)
            if t is None:
                continue
            first = t.buffer[0][0] if t.buffer else None
            last = t.buffer[-1][0] if t.buffer else None
            if first is not None and last is not None and first <= start <= last:
                for seq, payload in t.buffer:
                    if seq >= start:
                        self._replay.send_multipart(
                            (ident, b"", name.encode(), seq.to_bytes(8, "big"), payload)
                        )
            elif last is not None and start != last + 1:
                # Further behind than the buffer (or from another publisher's numbering):
                # what the topic holds now, as of its newest batch.
                payload = self._payload(self._snapshot(name))
                self._replay.send_multipart(
                    (ident, b"", name.encode(), last.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))


def _stored(vk: Any, external: Callable[[bytes], Any], ev: Event) -> list[Any]:
    """``BlockStored`` events of ``ev``'s blocks: one per run of blocks that chain (each
    the parent of the next) and share a LoRA, as vLLM batches its own (a state group's
    blocks, saved at boundaries only, mostly one per event)."""
    out: list[Any] = []
    run: list[BlockInfo] = []

    def flush() -> None:
        if run:
            extra = [b.extra_keys for b in run]
            out.append(
                vk.BlockStored(
                    block_hashes=[external(b.block_hash) for b in run],
                    parent_block_hash=external(run[0].parent) if run[0].parent else None,
                    token_ids=[t for b in run for t in b.token_ids],
                    block_size=ev.block_size,
                    lora_id=None,
                    medium=ev.medium,
                    lora_name=run[0].lora_name,
                    extra_keys=extra if any(e is not None for e in extra) else None,
                    group_idx=ev.group,
                    kv_cache_spec_kind=ev.group_info.kind,
                    kv_cache_spec_sliding_window=ev.group_info.sliding_window,
                    ownership=ev.ownership,
                )
            )

    for b in ev.blocks:
        if run and (b.parent != run[-1].block_hash or b.lora_name != run[-1].lora_name):
            flush()
            run = []
        run.append(b)
    flush()
    return out


def _bind(sock: Any, endpoint: str) -> str:
    """Bind ``endpoint`` (``tcp://<address>:<port>``, port 0: any free one); the endpoint
    bound."""
    import zmq

    sock.bind(endpoint)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
