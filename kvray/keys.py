"""Block keys: which block of which rank's KV a pool object holds.

A key names the model/namespace, the KV layout (dtype, block size, KV heads per rank,
head size), the block geometry of the rank's bytes, the TP/head-group rank, the PP rank
and the block hash::

    <namespace>@<layout>@g<geometry>@tp<r>@pp<p>@<sha256 hex>
    Qwen3-8B-m1a2b3c4d5e6@bfloat16-b128-h8x128@g0f1e2d3c4b5a@tp0@pp0@9f86d08...

The geometry (:func:`geometry_digest`) names what the layout tag does not: the order of a
block's bytes (the attention backend's planes and their shapes) and which layers the key
holds (so PP partitions, layer counts and platforms never share keys). It is in the key,
not in a record beside it: a record could be lost to a restart or evicted from a tier
while the bytes it describes stay. Engines derive it from their KV caches; keys built
without one (``KeySpace.geometries`` empty: the Pool API's and tools' own keys) have no
``@g`` part.

A hybrid model's block is one key per KV cache group of vLLM's hybrid allocator (full
attention, sliding window, ...) and rank: each group's geometry digest names the group (its
kind, window and layers, :func:`group_geometry_digest`), so one group's block never answers
for another's.

With layer-wise transfers (``use_layerwise``) each block of each rank is ``G`` keys, one
per group of its layers, ``...@pp<p>@lg<g>of<G>@<hash>``: the group count is in the key,
so engines that split layers differently (or not at all) never read each other's bytes.

Hashing is a pure function of its inputs and an explicit seed: it never depends on
``PYTHONHASHSEED`` or on the process. :func:`probe_hash` is what every rank computes at
start so that kvray can refuse to run when two ranks would derive different keys.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from kvray.errors import KeyFormatError

BlockHash = NewType("BlockHash", bytes)
"""A block hash: 32 bytes of sha256 (vLLM's ``Request.block_hashes`` or kvray's own)."""

KEY_SCHEMA_VERSION = 2
"""Bumped whenever key strings or block hashing change meaning (2: the block geometry
in engine keys, a digest of the model in default namespaces; docs/migrating.md)."""

ROOT_SEED = b"kvray-block-hash-v1"
"""Default seed of a hash chain's first block."""

_SEP = KEY_SEP = "@"
_NAMESPACE_RE = re.compile(r"^[^\s@]{1,200}$")
_LAYOUT_RE = re.compile(r"^[a-z0-9]+-b\d+-h\d+x\d+$")
_GEOMETRY_RE = re.compile(r"^[0-9a-f]{12}$")
_KEY_RE = re.compile(
    r"^(?P<ns>[^\s@]{1,200})@(?P<layout>[a-z0-9]+-b\d+-h\d+x\d+)(?:@g(?P<geo>[0-9a-f]{12}))?"
    r"@tp(?P<tp>\d+)@pp(?P<pp>\d+)(?:@lg(?P<lg>\d+)of(?P<lgs>\d+))?"
    r"@(?P<hash>[0-9a-f]{2,128})$"
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one rank stores one block: part of every key, so that engines with another
    dtype, block size or head split never read each other's bytes."""

    dtype: str
    block_size: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]+", self.dtype):
            raise KeyFormatError(
                f"KVLayout.dtype must be a lowercase name like 'bfloat16', got {self.dtype!r}"
            )
        for name in ("block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise KeyFormatError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")

    def tag(self) -> str:
        return f"{self.dtype}-b{self.block_size}-h{self.num_kv_heads}x{self.head_size}"

    @classmethod
    def from_tag(cls, tag: str) -> KVLayout:
        m = re.fullmatch(r"([a-z0-9]+)-b(\d+)-h(\d+)x(\d+)", tag)
        if m is None:
            raise KeyFormatError(f"not a layout tag: {tag!r} (expected e.g. 'float16-b128-h8x128')")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The key of one block of one rank."""

    namespace: str
    layout: str
    tp_rank: int
    pp_rank: int
    block_hash: BlockHash
    layer_group: int = 0
    layer_groups: int = 1
    """Layer-wise keys: this key holds layer group ``layer_group`` of ``layer_groups``
    (1: the key holds all of the rank's layers)."""
    geometry: str = ""
    """:func:`geometry_digest` of the rank's bytes ("": a key of no engine's KV cache)."""

    def __post_init__(self) -> None:
        if self.geometry and not _GEOMETRY_RE.match(self.geometry):
            raise KeyFormatError(
                f"BlockKey.geometry must be 12 lowercase hex digits (geometry_digest), got "
                f"{self.geometry!r}"
            )
        if not 0 <= self.layer_group < self.layer_groups:
            raise KeyFormatError(
                f"BlockKey.layer_group must be in 0..layer_groups-1, got "
                f"{self.layer_group} of {self.layer_groups}"
            )
        if not _NAMESPACE_RE.match(self.namespace):
            raise KeyFormatError(
                f"BlockKey.namespace must be 1-200 characters without '@' or whitespace, "
                f"got {self.namespace!r}"
            )
        if not _LAYOUT_RE.match(self.layout):
            raise KeyFormatError(f"BlockKey.layout must be a KVLayout tag, got {self.layout!r}")
        if self.tp_rank < 0 or self.pp_rank < 0:
            raise KeyFormatError(
                f"BlockKey ranks must be >= 0, got tp={self.tp_rank} pp={self.pp_rank}"
            )
        if not isinstance(self.block_hash, bytes) or not 1 <= len(self.block_hash) <= 64:
            raise KeyFormatError("BlockKey.block_hash must be 1-64 bytes")

    def to_str(self) -> str:
        return (
            f"{self.namespace}{_SEP}{self.layout}{_SEP}{_geometry_part(self.geometry)}"
            f"tp{self.tp_rank}{_SEP}pp{self.pp_rank}{_SEP}"
            f"{_group_part(self.layer_group, self.layer_groups)}{self.block_hash.hex()}"
        )

    @classmethod
    def from_str(cls, s: str) -> BlockKey:
        m = _KEY_RE.match(s)
        if m is None or len(m.group("hash")) % 2:
            raise KeyFormatError(f"not a kvray block key: {s!r}")
        return cls(
            m.group("ns"),
            m.group("layout"),
            int(m.group("tp")),
            int(m.group("pp")),
            BlockHash(bytes.fromhex(m.group("hash"))),
            int(m.group("lg") or 0),
            int(m.group("lgs") or 1),
            m.group("geo") or "",
        )

    def __str__(self) -> str:
        return self.to_str()


@dataclass(frozen=True, slots=True)
class KeySpace:
    """All keys of one engine instance: namespace, layout and parallel shape.

    An instance's rank ``r`` is ``pp_rank * tp_size + tp_rank`` (vLLM's order). A block
    counts as present for the instance only if every rank stored it.
    """

    namespace: str
    layout: str
    tp_size: int = 1
    pp_size: int = 1
    layer_groups: int = 1
    """Keys per block and rank (layer-wise transfers: one per group of the rank's layers)."""
    geometries: tuple[str, ...] = ()
    """Per instance rank and KV cache group (entry ``rank * kv_groups + group``), the
    :func:`geometry_digest` of its keys' bytes ("" for one this process does not know: a
    worker knows its own rank's). Empty: keys without a geometry (the Pool API's and tools'
    own keys, never an engine's)."""
    kv_groups: int = 1
    """KV cache groups of the engine (vLLM's hybrid allocator): keys per block and rank,
    each group's own (its geometry names it)."""
    state_groups: tuple[int, ...] = ()
    """The KV cache groups whose key of a block holds the recurrent state at its end
    (Mamba, linear attention): a hit of ``h`` blocks needs their key of block ``h - 1``
    only, the other groups' keys of every block before ``h``."""
    tp_replicated: bool = False
    """Every TP rank holds the same bytes (MLA's latent): one copy per block and PP
    stage, under TP rank 0's key, which every TP rank loads."""
    generation: int = 0
    """How many times the pool's blocks of this model were reset (vLLM's
    ``/reset_prefix_cache?reset_external=true``, after a weight update): mixed into every
    geometry, so that no block stored before a reset answers a key after it."""

    def __post_init__(self) -> None:
        slots = self.tp_size * self.pp_size * self.kv_groups
        if self.geometries and len(self.geometries) != slots:
            raise KeyFormatError(
                f"KeySpace.geometries has {len(self.geometries)} entries for "
                f"{self.tp_size * self.pp_size} ranks x {self.kv_groups} KV cache groups (one "
                "per rank and group, or none)"
            )
        if not set(self.state_groups) <= set(range(self.kv_groups)):
            raise KeyFormatError(
                f"KeySpace.state_groups {self.state_groups} are not all among the "
                f"{self.kv_groups} KV cache groups"
            )
        k = self.kv_groups
        for r in range(self.tp_size * self.pp_size if self.geometries and k > 1 else 0):
            known = [g for g in self.geometries[r * k : (r + 1) * k] if g]
            if len(set(known)) < len(known):
                raise KeyFormatError(
                    f"KeySpace.geometries: two KV cache groups of rank {r} share a geometry "
                    "digest; each group's keys must be its own"
                )
        for g in self.geometries:
            if g and not _GEOMETRY_RE.match(g):
                raise KeyFormatError(f"KeySpace.geometries: {g!r} is not a geometry_digest")
        if self.generation < 0 or (self.generation and not self.geometries):
            raise KeyFormatError(
                f"KeySpace.generation {self.generation}: 0 or more, and only for keys with "
                "block geometries (an engine's)"
            )
        if self.tp_size < 1 or self.pp_size < 1 or self.layer_groups < 1 or self.kv_groups < 1:
            raise KeyFormatError(
                f"KeySpace sizes must be >= 1, got tp={self.tp_size} pp={self.pp_size} "
                f"layer_groups={self.layer_groups} kv_groups={self.kv_groups}"
            )
        # Validate namespace and layout once, through a probe key.
        BlockKey(self.namespace, self.layout, 0, 0, BlockHash(b"\0"))

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def key_ranks(self) -> int:
        """Ranks with keys of their own: every rank, or one per PP stage when
        :attr:`tp_replicated`."""
        return self.pp_size if self.tp_replicated else self.world_size

    @property
    def columns(self) -> int:
        """Keys per block of the instance: every keyed rank's, KV cache group's and layer
        group's."""
        return self.key_ranks * self.kv_groups * self.layer_groups

    def column(self, c: int) -> tuple[int, int, int]:
        """Column ``c``'s (rank, layer group, KV cache group): rank-major, then KV cache
        group, then layer group (the order of :meth:`lookup_key_strs`)."""
        rank, rest = divmod(c, self.kv_groups * self.layer_groups)
        kv_group, group = divmod(rest, self.layer_groups)
        if self.tp_replicated:
            rank *= self.tp_size  # PP stage -> its TP rank 0
        return rank, group, kv_group

    def key_rank(self, rank: int) -> int:
        """The rank whose keys ``rank`` stores and loads: itself, or its PP stage's TP
        rank 0 when :attr:`tp_replicated`."""
        return rank - rank % self.tp_size if self.tp_replicated else rank

    def state_columns(self) -> list[bool]:
        """Per column, whether it is a state group's (:attr:`state_groups`)."""
        states = set(self.state_groups)
        return [self.column(c)[2] in states for c in range(self.columns)]

    def column_prefixes(self) -> list[str]:
        """:meth:`column_prefix` of every column, in column order."""
        return [self.column_prefix(*self.column(c)) for c in range(self.columns)]

    def key(
        self,
        block_hash: bytes,
        tp_rank: int = 0,
        pp_rank: int = 0,
        layer_group: int = 0,
        kv_group: int = 0,
    ) -> BlockKey:
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise KeyFormatError(
                f"rank tp={tp_rank} pp={pp_rank} is outside "
                f"tp_size={self.tp_size} pp_size={self.pp_size}"
            )
        return BlockKey(
            self.namespace,
            self.layout,
            tp_rank,
            pp_rank,
            BlockHash(block_hash),
            layer_group,
            self.layer_groups,
            self.geometry_of(pp_rank * self.tp_size + tp_rank, kv_group),
        )

    def geometry_of(self, rank: int, kv_group: int = 0) -> str:
        """The geometry part of rank ``rank``'s keys of one KV cache group ("" when keys
        have none)."""
        if not self.geometries:
            return ""
        if not 0 <= kv_group < self.kv_groups:
            raise KeyFormatError(f"KV cache group {kv_group} is outside 0..{self.kv_groups - 1}")
        geometry = self.geometries[rank * self.kv_groups + kv_group]
        if not geometry:
            raise KeyFormatError(
                f"KeySpace has no block geometry for rank {rank} (this process knows the "
                "geometries of its own ranks only): kvray's bug"
            )
        return _of_generation(geometry, self.generation) if self.generation else geometry

    @property
    def complete(self) -> bool:
        """Every rank's geometry is known (or keys have none): lookups may be made."""
        return all(self.geometries)

    def rank_key_strs(
        self, hashes: Sequence[bytes], rank: int, group: int = 0, kv_group: int = 0
    ) -> list[str]:
        """Key strings of ``hashes`` for one instance rank (layer group, KV cache group);
        the hot path of lookups."""
        if not 0 <= group < self.layer_groups:
            raise KeyFormatError(f"layer group {group} is outside 0..{self.layer_groups - 1}")
        prefix = self.column_prefix(rank, group, kv_group)
        return [prefix + h.hex() for h in hashes]

    def column_prefix(self, rank: int, group: int = 0, kv_group: int = 0) -> str:
        """What every key string of one instance rank, layer group and KV cache group
        starts with (the block hash's hex follows)."""
        rank = self.key_rank(rank)
        pp_rank, tp_rank = divmod(rank, self.tp_size)
        geometry = _geometry_part(self.geometry_of(rank, kv_group))
        return (
            f"{self.namespace}{_SEP}{self.layout}{_SEP}{geometry}"
            f"tp{tp_rank}{_SEP}pp{pp_rank}{_SEP}{_group_part(group, self.layer_groups)}"
        )

    def lookup_key_strs(self, hashes: Sequence[bytes]) -> list[str]:
        """Every key of ``hashes`` for the whole instance, column-major (``columns`` of
        them, in :meth:`column`'s order)."""
        return [k for c in range(self.columns) for k in self.rank_key_strs(hashes, *self.column(c))]


def block_of_key(key: str) -> str:
    """``namespace@layout@hash`` of a key string: the block, whatever the rank and layer
    group it was stored for (a Pool API key that is not a block key: itself)."""
    parts = key.split(_SEP)
    if len(parts) < 5:
        return key
    return f"{parts[0]}{_SEP}{parts[1]}{_SEP}{parts[-1]}"


@functools.lru_cache(maxsize=4096)
def _of_generation(geometry: str, generation: int) -> str:
    """``geometry`` as the keys of ``generation`` name it: another digest of the same form."""
    return geometry_digest(f"{geometry}#generation={generation}", ())


def _geometry_part(geometry: str) -> str:
    return f"g{geometry}{_SEP}" if geometry else ""


def geometry_digest(byte_order: str, layer_names: Sequence[str]) -> str:
    """What a rank's key holds, as 12 hex digits: ``byte_order``, the shape of one
    block of one layer as stored (e.g. ``p4x256x64``: the attention backend's planes), and
    ``layer_names``, the layers whose blocks the key holds, in order. Equal for engines
    that store the same bytes for a block whatever their process, node or placement;
    different for another attention backend, PP partition or layer count."""
    h = hashlib.sha256(b"kvray-geometry-v1\0")
    h.update(byte_order.encode())
    for name in layer_names:
        h.update(b"\0" + name.encode())
    return h.hexdigest()[:12]


def group_geometry_digest(byte_order: str, identity: str, layer_names: Sequence[str]) -> str:
    """:func:`geometry_digest` of one KV cache group of a hybrid model: ``identity`` (the
    group's kind and parameters, e.g. ``sliding_window=512``) beside the byte order, so
    groups with the same bytes per block but another kind never share keys."""
    return geometry_digest(f"{byte_order}#{identity}", layer_names)


def _group_part(group: int, groups: int) -> str:
    return f"lg{group}of{groups}{_SEP}" if groups > 1 else ""


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"", *, seed: bytes = ROOT_SEED
) -> BlockHash:
    """sha256 of (parent hash or seed, token ids, extra keys such as LoRA or media).

    Token ids are encoded as little-endian int64: identical in every process.
    """
    h = hashlib.sha256()
    head = parent if parent is not None else seed
    h.update(struct.pack("<I", len(head)))
    h.update(head)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return BlockHash(h.digest())


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: bytes = ROOT_SEED
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, each chained on its predecessor, so a
    block's hash names the whole prefix up to it (a partial last block gets none)."""
    if block_size <= 0:
        raise KeyFormatError(f"block_size must be > 0, got {block_size}")
    out: list[BlockHash] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], seed=seed)
        out.append(parent)
    return out


def probe_hash() -> str:
    """What every rank computes at start; ranks that disagree must not share a pool."""
    hashes = chain_block_hashes(list(range(64)), 16)
    return f"v{KEY_SCHEMA_VERSION}:{hashes[-1].hex()}"
