"""The node's index of the pool's blocks: what a scheduler reads to answer a lookup, with
no call to anyone (a lookup runs inside the scheduler's step, which a round trip to
another process would stall for every request in it).

One table per pool and node, in a shared-memory region: written by one process (the
node's index keeper, fed the blocks stored, removed and found gone), read by every
scheduler on the node through its own mapping. A lookup of 1000 blocks is a few vectorized
probes of that mapping, in the scheduler's own process.

The index is advisory, and that is what makes it safe to read without a lock. A block it
shows that is gone by load time is a failed load (recomputed, counted ``gone_at_load``);
a block stored and not yet shown is a miss. Bytes are always read by their full key, and
checksummed, so no state of the table (not even a read torn by a concurrent write) can
put another block's bytes into a KV cache. The write side still keeps reads consistent
almost always: a sequence counter, odd while a batch is written, that readers check
before and after (a seqlock).

Layout (one region, ``16 * slots + HEADER`` bytes): a header (magic, the sequence counter,
sizes, the tier places, when the keeper was last current), then per slot a 64-bit key
digest (0: empty, 1: deleted), a 32-bit tier mask (and a marker of why a key in no tier
left: removed, or found gone) and a 32-bit stamp (the writer's batch counter when the block was last
stored: the oldest are dropped first when the table holds ``capacity`` blocks). Open
addressing with linear probing, at most half full.

A key digest is a 64-bit mix of the key's column (its string up to the block hash: the
namespace, layout, geometry, rank and layer group) and every byte of the block hash, so
that a scheduler computes the digests of a request's ``blocks x columns`` keys with
numpy, without building a string per key. Tiers: bit 0 is the pool's DRAM tier (its
backend, reachable from every node); bit ``i`` > 0 is the SSD tier of one node's slot,
registered in the header (:data:`MAX_PLACES` of them).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.errors import ConfigError, RegionError
from kvray.index.lookup import servable_hits
from kvray.keys import KEY_SEP, KeySpace
from kvray.shm import RegionSpec, SharedRegion

MAGIC = int.from_bytes(b"KVRAYIX1", "little")
HEADER = 4096
SLOT_BYTES = 16
EMPTY = np.uint64(0)
DELETED = np.uint64(1)
MAX_PROBES = 64
"""Slots a digest may sit past its home slot (at most half full: ~1.5 probes on average)."""
MAX_PLACES = 29
DRAM = 1
"""The tier bit of the pool's DRAM tier."""
REMOVED = 1 << 31
"""Marker of a key in no tier that kvray removed (``Pool.remove``): why it misses."""
GONE = 1 << 30
"""Marker of a key in no tier that a load found gone (the backend evicted it)."""
MARKERS = REMOVED | GONE
TIERS = (1 << 30) - 1

# Header fields (uint64 words).
_MAGIC, _SEQ, _SLOTS, _CAPACITY, _COUNT, _DELETED, _PLACES, _STAMP, _RESETS, _FRESH = range(10)
_PLACE_AT = 256
_PLACE_BYTES = 96
_PLACE_NODE = 88
"""A place: its node id (ASCII, up to 88 bytes), then its slot (uint64)."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def _fold_equal(hashes: Sequence[bytes], length: int) -> np.ndarray:
    raw = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), length)
    return _fold_rows(raw)


def _fold_rows(raw: np.ndarray) -> np.ndarray:
    """:func:`fold_hashes` of equal-length hashes given as the rows of a uint8 array."""
    n, length = raw.shape
    words = -(-length // 8)
    if length % 8 or not raw.flags.c_contiguous:
        padded = np.zeros((n, words * 8), dtype=np.uint8)
        padded[:, :length] = raw
        raw = padded
    w = raw.view("<u8").reshape(n, words)
    h = np.full(n, length, dtype=np.uint64)
    for i in range(words):
        h = _mix(h ^ w[:, i])
    return h


def fold_hashes(hashes: Sequence[bytes]) -> np.ndarray:
    """One uint64 per block hash, from every byte of it (and its length)."""
    n = len(hashes)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    length = len(hashes[0])
    if all(len(h) == length for h in hashes):  # vLLM's hashes: one length
        return _fold_equal(hashes, length)
    out = np.empty(n, dtype=np.uint64)
    by_len: dict[int, list[int]] = {}
    for i, h in enumerate(hashes):
        by_len.setdefault(len(h), []).append(i)
    for ln, idx in by_len.items():
        out[idx] = _fold_equal([hashes[i] for i in idx], ln)
    return out


def column_salt(prefix: str) -> np.uint64:
    """The digest of a key column (a key string up to its block hash)."""
    digest = hashlib.blake2b(prefix.encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def digests(salt: np.uint64 | np.ndarray, folded: np.ndarray | np.uint64) -> np.ndarray:
    """Key digests of one column's blocks (never :data:`EMPTY` or :data:`DELETED`)."""
    d = _mix(np.asarray(folded ^ salt))
    return np.where(d <= DELETED, d + np.uint64(2), d)


def key_digests(keys: Iterable[str]) -> np.ndarray:
    """Digests of key strings, equal to :func:`digests` of their column and block hash. A
    string that is not ``<column><hex hash>`` (a Pool API key of the caller's choosing) is
    its own column with an empty hash."""
    keys = list(keys)
    out = np.empty(len(keys), dtype=np.uint64)
    groups: dict[str, tuple[list[int], list[str]]] = {}
    for i, k in enumerate(keys):
        cut = k.rfind(KEY_SEP) + 1
        idx, tails = groups.setdefault(k[:cut], ([], []))
        idx.append(i)
        tails.append(k[cut:])
    own: list[int] = []
    """Keys that are their own column: digested together below."""
    for prefix, (idx, tails) in groups.items():
        if not prefix:
            own += idx
            continue
        length = len(tails[0])
        if length and not length % 2 and all(len(t) == length for t in tails):
            try:  # one column's keys (what a put holds): one parse of all their hashes
                raw = np.frombuffer(bytes.fromhex("".join(tails)), np.uint8)
            except ValueError:
                raw = None
            if raw is not None:
                out[idx] = digests(_salt(prefix), _fold_rows(raw.reshape(len(tails), -1)))
                continue
        for i, tail in zip(idx, tails, strict=True):
            try:
                block = bytes.fromhex(tail)
            except ValueError:
                block = b""
            if block:
                out[i] = digests(_salt(prefix), fold_hashes([block]))[0]
            else:
                own.append(i)
    if own:
        salts = np.fromiter((column_salt(keys[i]) for i in own), dtype=np.uint64, count=len(own))
        out[own] = digests(salts, _EMPTY_FOLD)
    return out


_EMPTY_FOLD = fold_hashes([b""])[0]
"""The fold of an empty block hash (a key that is its own column)."""


@dataclass(frozen=True, slots=True)
class IndexSpec:
    """What a reader needs to map a node's index."""

    region: RegionSpec
    slots: int


class BlockIndex:
    """A node's block index: :meth:`create` (the one writer) or :meth:`attach` (a reader)."""

    def __init__(self, region: SharedRegion, slots: int, *, writer: bool) -> None:
        self._region = region
        buf = region.array
        self._head = buf[:HEADER].view(np.uint64)
        if int(self._head[_MAGIC]) != MAGIC or int(self._head[_SLOTS]) != slots:
            raise RegionError(
                f"region {region.spec.region_id} is not a block index of {slots} slots"
            )
        self.slots = slots
        self._mask = np.uint64(slots - 1)
        end = HEADER + 8 * slots
        self._keys = buf[HEADER:end].view(np.uint64)
        self._vals = buf[end : end + 4 * slots].view(np.uint32)
        self._stamps = buf[end + 4 * slots : end + 8 * slots].view(np.uint32)
        self._writer = writer
        self._places: dict[tuple[str, int], int] = {}
        self._resets = int(self._head[_RESETS])
        self.torn_reads = 0
        """Reads that overlapped a write on every try (answered anyway: advisory)."""
        self.dropped = 0
        """Digests not stored because their probe run was full (read as misses)."""

    # ---- making and mapping ----------------------------------------------------------

    @staticmethod
    def size_for(capacity: int) -> tuple[int, int]:
        """``(slots, region bytes)`` for ``capacity`` blocks (keys of every column)."""
        if capacity < 1:
            raise ConfigError(f"block index capacity must be >= 1, got {capacity}")
        slots = 1 << max(6, (2 * capacity - 1).bit_length())
        return slots, HEADER + SLOT_BYTES * slots

    @classmethod
    def create(cls, capacity: int, prefix: str = "kvray-index") -> BlockIndex:
        slots, size = cls.size_for(capacity)
        region = SharedRegion.create(prefix, size)
        head = region.array[:HEADER].view(np.uint64)
        head[_SLOTS], head[_CAPACITY], head[_MAGIC] = slots, capacity, MAGIC
        return cls(region, slots, writer=True)

    @classmethod
    def attach(cls, spec: IndexSpec) -> BlockIndex:
        return cls(SharedRegion.attach(spec.region, populate=True), spec.slots, writer=False)

    @property
    def spec(self) -> IndexSpec:
        return IndexSpec(self._region.spec, self.slots)

    @property
    def capacity(self) -> int:
        return int(self._head[_CAPACITY])

    def __len__(self) -> int:
        return int(self._head[_COUNT])

    def stale(self) -> bool:
        """The writer closed the index or died (a reader drops it and maps the next)."""
        return self._region.stale()

    def close(self) -> None:
        self._region.close()

    # ---- places ----------------------------------------------------------------------

    def place_bit(self, node_id: str, slot: int, *, register: bool = True) -> int:
        """The tier bit of the SSD tier at ``node_id``'s slot ``slot``; 0 when it has
        none (a reader, or ``register=False``: not registered; the writer: registers it,
        or 0 past :data:`MAX_PLACES`, whose blocks then read as misses)."""
        got = self._read_places().get((node_id, slot))
        n = int(self._head[_PLACES])
        if got is not None or not (self._writer and register) or n >= MAX_PLACES:
            return got or 0
        raw = node_id.encode()
        if len(raw) > _PLACE_NODE:
            raise RegionError(f"node id {node_id!r} is longer than {_PLACE_NODE} bytes")
        at = _PLACE_AT + n * _PLACE_BYTES
        buf = self._region.array
        buf[at : at + _PLACE_BYTES] = 0
        buf[at : at + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        buf[at + _PLACE_NODE : at + _PLACE_BYTES].view(np.uint64)[0] = slot
        self._head[_PLACES] = n + 1
        self._places[(node_id, slot)] = 1 << (n + 1)
        return 1 << (n + 1)

    def _read_places(self) -> dict[tuple[str, int], int]:
        """The places and their bits, read from the header when it changed (a reset gives
        other places other bits; a registration adds one)."""
        resets, n = int(self._head[_RESETS]), int(self._head[_PLACES])
        if resets != self._resets:
            self._resets, self._places = resets, {}
        if len(self._places) != n:
            buf = self._region.array
            self._places = {}
            for i in range(n):
                at = _PLACE_AT + i * _PLACE_BYTES
                name = bytes(buf[at : at + _PLACE_NODE]).rstrip(b"\0").decode()
                s = int(buf[at + _PLACE_NODE : at + _PLACE_BYTES].view(np.uint64)[0])
                self._places[(name, s)] = 1 << (i + 1)
        return self._places

    def places(self) -> list[tuple[str, int]]:
        """The registered SSD places, in bit order (the first has bit 2)."""
        return [p for p, _ in sorted(self._read_places().items(), key=lambda kv: kv[1])]

    # ---- reading ---------------------------------------------------------------------

    def _probe(self, d: np.ndarray) -> np.ndarray:
        """Slot of each digest, -1 where absent."""
        pos = np.full(len(d), -1, dtype=np.int64)
        if not len(d):
            return pos
        home = d & self._mask
        todo = np.arange(len(d))
        for p in range(MAX_PROBES):
            idx = ((home[todo] + np.uint64(p)) & self._mask).astype(np.int64)
            k = self._keys[idx]
            hit = k == d[todo]
            pos[todo[hit]] = idx[hit]
            todo = todo[~hit & (k != EMPTY)]
            if not len(todo):
                break
        return pos

    def tiers(self, d: np.ndarray, tries: int = 3) -> np.ndarray:
        """The tier mask of each digest (0: not in the pool, as far as the index knows)."""
        for _ in range(tries):
            seq = int(self._head[_SEQ])
            if seq & 1:  # a batch being written: it takes microseconds
                time.sleep(0)
                continue
            pos = self._probe(d)
            out = np.where(pos >= 0, self._vals[np.maximum(pos, 0)], 0).astype(np.uint32)
            if int(self._head[_SEQ]) == seq:
                return out
        self.torn_reads += 1
        pos = self._probe(d)
        return np.where(pos >= 0, self._vals[np.maximum(pos, 0)], 0).astype(np.uint32)

    def lookup(
        self, space: KeySpace, hashes: Sequence[bytes], masks: np.ndarray
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """A scheduler's lookup: ``(leading hits, tier masks, held)`` of ``hashes`` for
        every column of ``space`` (``(columns, blocks)`` arrays); a key is held where its
        mask meets its column's ``masks`` entry (the tiers its worker loads from)."""
        n = len(hashes)
        vals = self.tiers(space_digests(space, hashes).ravel()).reshape(space.columns, n)
        held = (vals & masks[:, None]) != 0
        return servable_hits(held, n, space), vals, held

    # ---- writing (the index keeper only) ---------------------------------------------

    def _begin(self) -> None:
        assert self._writer, "a reader wrote the block index: kvray's bug"
        self._head[_SEQ] += 1

    def _end(self) -> None:
        self._head[_SEQ] += 1

    def add(self, d: np.ndarray, bits: int = DRAM) -> None:
        """Mark digests ``d`` as held by the tiers ``bits``."""
        d = np.unique(d)
        if not len(d):
            return
        self._begin()
        try:
            stamp = np.uint32(int(self._head[_STAMP]) & 0xFFFFFFFF)
            self._head[_STAMP] += 1
            pos = self._probe(d)
            found = pos >= 0
            at = pos[found]
            self._vals[at] = (self._vals[at] & np.uint32(TIERS)) | np.uint32(bits)
            self._stamps[pos[found]] = stamp
            new = d[~found]
            self._insert(new, np.full(len(new), bits, np.uint32), np.full(len(new), stamp))
            self._keep_capacity()
        finally:
            self._end()

    def _insert(self, d: np.ndarray, bits: np.ndarray, stamps: np.ndarray) -> None:
        """Place digests known to be absent, with their tier masks and stamps."""
        home = d & self._mask
        todo = np.arange(len(d))
        for p in range(MAX_PROBES):
            if not len(todo):
                return
            idx = ((home[todo] + np.uint64(p)) & self._mask).astype(np.int64)
            free = self._keys[idx] <= DELETED
            # Two digests of this batch may probe the same free slot: the first takes it.
            cand = np.flatnonzero(free)
            _, first = np.unique(idx[cand], return_index=True)
            won = cand[first]
            at = idx[won]
            self._head[_DELETED] -= int(np.count_nonzero(self._keys[at] == DELETED))
            self._keys[at] = d[todo[won]]
            self._vals[at] = bits[todo[won]]
            self._stamps[at] = stamps[todo[won]]
            self._head[_COUNT] += len(won)
            todo = np.delete(todo, won)
        self.dropped += len(todo)

    def remove(self, d: np.ndarray, bits: int = DRAM, marker: int = 0) -> None:
        """Clear tiers ``bits`` of digests ``d``. A digest left in no tier is deleted, or,
        with ``marker`` (:data:`REMOVED` or :data:`GONE`), kept with only that marker:
        why its next lookup misses."""
        d = np.unique(d)
        if not len(d):
            return
        self._begin()
        try:
            pos = self._probe(d)
            pos = pos[pos >= 0]
            self._vals[pos] &= np.uint32(~bits & TIERS)
            empty = pos[(self._vals[pos] & TIERS) == 0]
            if marker:
                self._vals[empty] = marker
            else:
                self._delete(empty)
        finally:
            self._end()

    def _delete(self, pos: np.ndarray) -> None:
        self._keys[pos] = DELETED
        self._vals[pos] = 0
        self._head[_COUNT] -= len(pos)
        self._head[_DELETED] += len(pos)
        if int(self._head[_DELETED]) + int(self._head[_COUNT]) > 3 * self.slots // 4:
            self._rebuild()

    def touch(self) -> None:
        """The keeper is current with its stream as of now (readers check :meth:`age_s`)."""
        self._head[_FRESH] = time.monotonic_ns()

    def age_s(self) -> float:
        """Seconds since the keeper was last current (``inf``: never)."""
        at = int(self._head[_FRESH])
        return (time.monotonic_ns() - at) / 1e9 if at else float("inf")

    def _keep_capacity(self) -> None:
        """Over capacity: the blocks stored longest ago go first, a tenth of capacity at a
        time (read as misses from then on: the pool may still hold them)."""
        count, capacity = int(self._head[_COUNT]), self.capacity
        if count <= capacity:
            return
        live = np.flatnonzero(self._keys > DELETED)
        now = np.uint32(int(self._head[_STAMP]) & 0xFFFFFFFF)
        age = now - self._stamps[live]  # uint32: wraps, as the stamps do
        drop = min(len(live), count - capacity + max(1, capacity // 10))
        oldest = np.argpartition(-age.astype(np.int64), drop - 1)[:drop]
        self._delete(live[oldest])

    def _rebuild(self) -> None:
        """Rewrite the live entries without the deleted slots that lengthen probe runs."""
        live = np.flatnonzero(self._keys > DELETED)
        keys, vals, stamps = self._keys[live], self._vals[live], self._stamps[live]
        self._keys[:] = EMPTY
        self._vals[:] = 0
        self._head[_COUNT] = 0
        self._head[_DELETED] = 0
        self._insert(keys, vals, stamps)

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Every digest held, and its tier mask (a copy: a snapshot for another index)."""
        live = np.flatnonzero(self._keys > DELETED)
        return self._keys[live].copy(), self._vals[live].copy()

    def reset(
        self,
        places: Sequence[tuple[str, int]] = (),
        digests: np.ndarray | None = None,
        tiers: np.ndarray | None = None,
    ) -> None:
        """Replace everything: the places (in bit order) and the blocks (``digests`` with
        their tier masks, in those places' bits), as one write readers never see half of."""
        self._begin()
        try:
            self._keys[:] = EMPTY
            self._vals[:] = 0
            self._stamps[:] = 0
            self._head[_COUNT] = 0
            self._head[_DELETED] = 0
            self._head[_PLACES] = 0
            self._head[_RESETS] += 1
            self._places = {}
            for node_id, slot in places:
                self.place_bit(node_id, slot)
            if digests is not None and len(digests):
                assert tiers is not None, "reset: digests without their tiers: kvray's bug"
                stamp = np.full(len(digests), int(self._head[_STAMP]) & 0xFFFFFFFF, np.uint32)
                self._insert(np.asarray(digests, np.uint64), np.asarray(tiers, np.uint32), stamp)
                self._keep_capacity()
        finally:
            self._end()


def space_digests(space: KeySpace, hashes: Sequence[bytes]) -> np.ndarray:
    """The digests of every key of ``hashes`` for an instance, ``(columns, blocks)``:
    row ``c`` is column ``c`` of :meth:`KeySpace.lookup_key_strs`, without a string per
    key."""
    folded = fold_hashes(hashes)
    out = np.empty((space.columns, len(hashes)), dtype=np.uint64)
    for c, prefix in enumerate(space.column_prefixes()):
        out[c] = digests(_salt(prefix), folded)
    return out


@functools.lru_cache(maxsize=1024)
def _salt(prefix: str) -> np.uint64:
    return column_salt(prefix)
