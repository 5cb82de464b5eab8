"""The Pool API for notebooks, jobs and tools.

::

    pool = Pool.start()                        # or Pool.attach("kvray")
    pool.put(["a", "b"], [t1, t2])             # numpy arrays or CPU torch tensors
    a, b = pool.get(["a", "b"], out=[o1, o2])  # None for a miss
    n = pool.lookup(space, block_hashes)       # leading blocks present on all ranks
    print(pool.stats().table())
    pool.shutdown()

Every method has an async twin (``aput``, ``aget``, ...). Both run the same coroutine on
the pool's own event-loop thread, so the sync methods work inside Jupyter's running loop.

Bytes move through shared memory, never through Ray's object store: tensors allocated
with :meth:`Pool.empty` live in a region the rank's BackendClient actor maps, and move
with no copy in this process; other tensors are copied through a staging window. One
Ray call carries a whole batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import threading
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvray import launcher, remote
from kvray.backends.base import KeyStatus
from kvray.config import PoolConfig
from kvray.errors import (
    KeyFormatError,
    KVRayError,
    PoolFullError,
    RegionError,
    TransferError,
)
from kvray.index.lookup import Why
from kvray.index.prefix_match import PrefixMatch
from kvray.keys import BlockKey, KeySpace
from kvray.naming import region_prefix
from kvray.ray_env import ray_init
from kvray.remote import Call, CallTimeoutError, StoreHandle
from kvray.shm import SharedRegion
from kvray.stats import RankStats
from kvray.status import PoolStatus, RankStatus
from kvray.store.channel import ChannelStore
from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Key = str | BlockKey
_PAGE = 4096
_LOOKUP_MARGIN_S = 2.0


class _LoopThread:
    """A private event loop on a daemon thread: the home of the Pool's coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvray-pool", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def arun(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


def _key_str(key: Key) -> str:
    if isinstance(key, BlockKey):
        return key.to_str()
    if (
        not isinstance(key, str)
        or not key
        or len(key) > 4096
        or not key.isprintable()
        or " " in key  # (the one whitespace character str.isprintable() lets through)
    ):
        raise KeyFormatError(
            "a key must be a BlockKey or a printable string of 1-4096 characters "
            f"without whitespace, got {key!r}"
        )
    return key


def _byte_view(t: Any, what: str) -> np.ndarray:
    """A writable uint8 view sharing ``t``'s memory (numpy array or CPU torch tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise RegionError(f"{what}: tensor is on {t.device}; the Pool API moves host tensors")
        if not t.is_contiguous():
            raise RegionError(f"{what}: tensor is not contiguous; call .contiguous() first")
        view: np.ndarray = t.detach().reshape(-1).view(torch.uint8).numpy()
        return view
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise RegionError(f"{what}: array is not C-contiguous; use np.ascontiguousarray")
        return t.reshape(-1).view(np.uint8)
    raise RegionError(f"{what}: expected a numpy array or torch tensor, got {type(t).__name__}")


def _empty_like(shape: Sequence[int], dtype: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return torch.empty(tuple(shape), dtype=dtype)
    return np.empty(tuple(shape), dtype=dtype)


def _say_if_unverified(config: PoolConfig) -> None:
    """Loads this client makes are verified unless the pool moves device memory or opted
    out (``checksum: false``): said once per process and pool when they are not."""
    from kvray.doctor import checksum_findings

    for f in checksum_findings(config):
        if f.level != "ok" and config.name not in _unverified_said:
            _unverified_said.add(config.name)
            logger.warning("kvray pool %r: %s (%s)", config.name, f.what, f.why)


_unverified_said: set[str] = set()


class Pool:
    """A client of one running kvray pool."""

    def __init__(self, handles: launcher.PoolHandles, *, owner: bool) -> None:
        self._h = handles
        self._owner = owner
        self._loop = _LoopThread()
        self._regions: list[SharedRegion] = []
        self._window: SharedRegion | None = None
        self._window_lock = asyncio.Lock()
        self._channels: dict[int, ChannelStore] = {}
        """Per rank: its client's node channel, the data plane's path (see :meth:`_store`)."""
        self._closed = False
        self._stopped = False
        _say_if_unverified(handles.config)
        # A process that exits without close() leaves nothing: its regions are memory
        # files the kernel frees, and the actors drop their mappings once it is gone.

    # ---- lifecycle -------------------------------------------------------------------

    @classmethod
    def start(cls, config: PoolConfig | dict[str, Any] | None = None) -> Pool:
        """Start a pool in the connected Ray cluster (or return the running one of the same
        name and config). Without a master address, kvray runs ``mooncake_master`` itself."""
        cfg = config if isinstance(config, PoolConfig) else PoolConfig.from_dict(config)
        ray_init(namespace=cfg.namespace)
        return cls(launcher.launch(cfg), owner=True)

    @classmethod
    async def astart(cls, config: PoolConfig | dict[str, Any] | None = None) -> Pool:
        return await asyncio.to_thread(cls.start, config)

    @classmethod
    def attach(cls, name: str = "kvray", namespace: str = "kvray") -> Pool:
        """Connect to the running pool ``name``; :meth:`close` leaves it running."""
        ray_init(namespace=namespace)
        return cls(launcher.attach(name, namespace), owner=False)

    @classmethod
    async def aattach(cls, name: str = "kvray", namespace: str = "kvray") -> Pool:
        return await asyncio.to_thread(cls.attach, name, namespace)

    @property
    def config(self) -> PoolConfig:
        return self._h.config

    @property
    def server_address(self) -> str:
        return self._h.server_address

    def close(self) -> None:
        """Release this client's shared memory; the pool keeps running."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._release_regions())
        finally:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._loop.stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def shutdown(self) -> None:
        """Stop the pool: actors, embedded master, placement group. Data is gone. Once: a
        second call (leaving a ``with`` block after it) does nothing."""
        self.close()
        if not self._stopped:
            launcher.shutdown(self._h)
            self._stopped = True

    async def ashutdown(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown() if self._owner else self.close()

    # ---- memory ----------------------------------------------------------------------

    def empty(self, shape: Sequence[int] | int, dtype: Any = np.uint8) -> Any:
        """An uninitialised array in shared memory the pool's actors map: put/get of it
        (or of contiguous slices of it) copy nothing in this process. A torch dtype gives
        a torch tensor."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        torch = sys.modules.get("torch")
        is_torch = torch is not None and isinstance(dtype, torch.dtype)
        itemsize = dtype.itemsize if is_torch else np.dtype(dtype).itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        region = SharedRegion.create(
            region_prefix(self.config.name), max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        )
        self._regions.append(region)
        raw = region.array[:nbytes]
        if is_torch:
            assert torch is not None, "Pool.empty: torch dtype without torch"
            return torch.from_numpy(raw).view(dtype).reshape(shape)
        return raw.view(np.dtype(dtype)).reshape(shape)

    def _region_of(self, view: np.ndarray) -> tuple[SharedRegion, int] | None:
        ptr: int = view.__array_interface__["data"][0]  # (view.ctypes builds an object per call)
        for region in self._regions:
            start = region.base_ptr
            if start <= ptr and ptr + view.nbytes <= start + region.spec.size:
                return region, ptr - start
        return None

    async def _release_regions(self) -> None:
        regions = self._regions + ([self._window] if self._window else [])
        for region in regions:
            for client in self._h.known_clients():
                # On failure the actor drops its mapping itself once we closed the region.
                with contextlib.suppress(KVRayError):
                    await client.release_region(region.spec.region_id).aresult(5)
            region.close()
        self._regions.clear()
        self._window = None

    def _window_for(self, nbytes: int) -> SharedRegion:
        if self._window is None or self._window.spec.size < nbytes:
            old = self._window
            size = max(self.config.transfer_window_size, -(-nbytes // _PAGE) * _PAGE)
            self._window = SharedRegion.create(region_prefix(self.config.name), size)
            if old is not None:
                old.close()
        return self._window

    # ---- data plane ------------------------------------------------------------------

    async def _actor(self, rank: int) -> StoreHandle:
        """This node's client of slot ``rank`` (made on first use)."""
        return await self._h.aclient(rank)

    async def _store(self, rank: int) -> ChannelStore:
        """The data plane's path to this node's client of slot ``rank``: its node channel,
        as the connector's workers reach it (measured on 2 cores: a batch of 1000 values
        spent 10-20 ms longer going to the actor and back as a Ray call); Ray's calls
        while the channel is down (another network namespace, an actor restarted: it
        re-attaches by itself)."""
        actor = await self._actor(rank)
        store = self._channels.get(rank)
        if store is None or store.handle is not actor:
            if store is not None:
                store.close()
            store = self._channels[rank] = ChannelStore(actor, self.config.call_timeout_s)
            await asyncio.to_thread(store.attach)  # (meanwhile this rank's calls take Ray)
        return store

    async def _call(self, call: Call[_T]) -> _T:
        return await call.aresult(self.config.call_timeout_s, "call_timeout_s")

    async def _transfer(
        self, op: str, keys: list[str], views: list[np.ndarray], rank: int, overwrite: bool = False
    ) -> list[KeyStatus]:
        """Move ``views`` (put: from, get: into) in as few actor calls as possible."""
        store = await self._store(rank)
        statuses: list[KeyStatus | None] = [None] * len(keys)
        direct: dict[str, list[tuple[int, int]]] = {}
        staged: list[int] = []
        for i, v in enumerate(views):
            found = self._region_of(v)
            if found is None:
                staged.append(i)
            else:
                direct.setdefault(found[0].spec.region_id, []).append((i, found[1]))

        async def run(batch: TransferBatch) -> list[KeyStatus]:
            return await self._call(
                store.put(batch, overwrite) if op == "put" else store.get(batch)
            )

        async def run_direct(region_id: str, items: list[tuple[int, int]]) -> None:
            region = next(r for r in self._regions if r.spec.region_id == region_id)
            idx = [i for i, _ in items]
            batch = TransferBatch.contiguous(
                region.spec,
                [keys[i] for i in idx],
                [o for _, o in items],
                [views[i].nbytes for i in idx],
            )
            for i, s in zip(idx, await run(batch), strict=True):
                statuses[i] = s

        async def run_staged() -> None:
            async with self._window_lock:
                window = self._window_for(max(views[i].nbytes for i in staged))
                buf = window.array
                try:
                    pending = collections.deque(staged)
                    while pending:
                        chunk, offsets, used = [], [], 0
                        while pending and used + views[pending[0]].nbytes <= window.spec.size:
                            i = pending.popleft()
                            chunk.append(i)
                            offsets.append(used)
                            used += -(-views[i].nbytes // 64) * 64
                        if op == "put":
                            for i, off in zip(chunk, offsets, strict=True):
                                buf[off : off + views[i].nbytes] = views[i]
                        batch = TransferBatch.contiguous(
                            window.spec,
                            [keys[i] for i in chunk],
                            offsets,
                            [views[i].nbytes for i in chunk],
                        )
                        for i, off, s in zip(chunk, offsets, await run(batch), strict=True):
                            statuses[i] = s
                            if op == "get" and s is KeyStatus.OK:
                                views[i][:] = buf[off : off + views[i].nbytes]
                finally:
                    # A failed call's traceback keeps this frame alive: without the view in
                    # it, close() releases the window's mapping (and its descriptor) at
                    # once, not at the next garbage collection.
                    del buf

        jobs = [run_direct(rid, items) for rid, items in direct.items()]
        if staged:
            jobs.append(run_staged())
        await asyncio.gather(*jobs)
        assert all(s is not None for s in statuses), "Pool._transfer left a key without status"
        return [s for s in statuses if s is not None]

    async def _put(self, keys: list[str], values: list[Any], rank: int, overwrite: bool) -> None:
        if len(keys) != len(values):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        if len(set(keys)) != len(keys):
            raise KeyFormatError("put: duplicate keys in one batch")
        views = [_byte_view(v, f"value for {k!r}") for k, v in zip(keys, values, strict=True)]
        statuses = await self._transfer("put", keys, views, rank, overwrite)
        failed = {k: s.value for k, s in zip(keys, statuses, strict=True) if s is not KeyStatus.OK}
        if failed:
            stored = [k for k in keys if k not in failed]
            err = PoolFullError if KeyStatus.POOL_FULL.value in failed.values() else TransferError
            raise err(
                f"put: {len(failed)} of {len(keys)} keys not stored ({_summary(failed)}); "
                "they are absent, the others were stored whole",
                failed,
                stored,
            )

    async def _get(self, keys: list[str], outs: list[Any], rank: int) -> list[Any]:
        views = [_byte_view(o, f"out for {k!r}") for k, o in zip(keys, outs, strict=True)]
        statuses = await self._transfer("get", keys, views, rank)
        failed = {
            k: s.value
            for k, s in zip(keys, statuses, strict=True)
            if s not in (KeyStatus.OK, KeyStatus.NOT_FOUND)
        }
        if failed:
            raise TransferError(
                f"get: {len(failed)} of {len(keys)} keys failed ({_summary(failed)}); their "
                "destinations hold no valid data",
                failed,
            )
        return [o if s is KeyStatus.OK else None for o, s in zip(outs, statuses, strict=True)]

    # ---- public data methods -----------------------------------------------------------

    def put(
        self, keys: Key | Sequence[Key], values: Any, *, rank: int = 0, overwrite: bool = False
    ) -> None:
        """Store values under keys (first write wins unless ``overwrite``). Raises
        :class:`PoolFullError` / :class:`TransferError` naming keys that were not stored."""
        return self._loop.run(self._put(*_norm_put(keys, values), rank, overwrite))

    async def aput(
        self, keys: Key | Sequence[Key], values: Any, *, rank: int = 0, overwrite: bool = False
    ) -> None:
        return await self._loop.arun(self._put(*_norm_put(keys, values), rank, overwrite))

    def get(
        self,
        keys: Key | Sequence[Key],
        out: Any = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
        rank: int = 0,
    ) -> Any:
        """Read keys into ``out`` (arrays/tensors of the stored size), or into new arrays of
        ``shape``/``dtype``. Returns the filled outputs, ``None`` for a miss; a single key
        gives a single result."""
        single, ks, outs = _norm_get(keys, out, shape, dtype)
        res = self._loop.run(self._get(ks, outs, rank))
        return res[0] if single else res

    async def aget(
        self,
        keys: Key | Sequence[Key],
        out: Any = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
        rank: int = 0,
    ) -> Any:
        single, ks, outs = _norm_get(keys, out, shape, dtype)
        res = await self._loop.arun(self._get(ks, outs, rank))
        return res[0] if single else res

    async def _exists(self, keys: list[str], rank: int) -> list[bool]:
        return await self._call((await self._actor(rank)).exists(keys))

    def exists(self, keys: Sequence[Key], *, rank: int = 0) -> list[bool]:
        return self._loop.run(self._exists([_key_str(k) for k in keys], rank))

    async def aexists(self, keys: Sequence[Key], *, rank: int = 0) -> list[bool]:
        return await self._loop.arun(self._exists([_key_str(k) for k in keys], rank))

    async def _remove(self, keys: list[str], rank: int, force: bool) -> list[KeyStatus]:
        return await self._call((await self._actor(rank)).remove(keys, force))

    def remove(self, keys: Sequence[Key], *, rank: int = 0, force: bool = False) -> list[KeyStatus]:
        """Remove keys; per key ``OK``, ``NOT_FOUND`` or ``BUSY`` (leased by a reader)."""
        return self._loop.run(self._remove([_key_str(k) for k in keys], rank, force))

    async def aremove(
        self, keys: Sequence[Key], *, rank: int = 0, force: bool = False
    ) -> list[KeyStatus]:
        return await self._loop.arun(self._remove([_key_str(k) for k in keys], rank, force))

    # Lookups are latency-critical and make exactly one Ray call: they run in the
    # caller's thread or loop, skipping the hop to the Pool's loop thread (~0.5 ms).
    # The actor answers a miss after timeout_s; the margin covers the Ray call itself.

    def lookup(
        self, space: KeySpace, block_hashes: Iterable[bytes], *, timeout_s: float | None = None
    ) -> int:
        """Leading blocks of ``block_hashes`` present for every rank of ``space`` (asked of
        this node's Lookup actor); a lookup that fails or times out is a miss (0), logged."""
        return self.lookup_why(space, block_hashes, timeout_s=timeout_s).hits

    def lookup_why(
        self, space: KeySpace, block_hashes: Iterable[bytes], *, timeout_s: float | None = None
    ) -> Why:
        """:meth:`lookup`, with the reason the block after the leading hits missed (one of
        :data:`kvray.misses.REASONS`; empty when all hit)."""
        t = self.config.lookup_timeout_s if timeout_s is None else timeout_s
        call = self._h.lookup().lookup(space, list(block_hashes), t)
        try:
            answer = call.result(t + _LOOKUP_MARGIN_S)
            return Why(answer.hits, answer.miss)
        except KVRayError as exc:
            logger.warning("lookup failed (%s): counted as a miss", exc)
            return Why(0, "lookup_timeout" if isinstance(exc, CallTimeoutError) else "lookup_error")

    async def alookup(
        self, space: KeySpace, block_hashes: Iterable[bytes], *, timeout_s: float | None = None
    ) -> int:
        t = self.config.lookup_timeout_s if timeout_s is None else timeout_s
        call = (await self._h.alookup()).lookup(space, list(block_hashes), t)
        try:
            return (await call.aresult(t + _LOOKUP_MARGIN_S)).hits
        except KVRayError as exc:
            logger.warning("lookup failed (%s): counted as a miss", exc)
            return 0

    def prefix_match(self, space: KeySpace, block_hashes: Iterable[bytes]) -> PrefixMatch:
        """Leading blocks of ``block_hashes`` the pool holds for every rank of ``space``,
        in its DRAM tier and per node (DRAM or that node's SSD tier), from the manager's
        block index (``lookup_index``); advisory, as a lookup's answer is."""
        call = self._h.manager.prefix_match(space, list(block_hashes))
        return call.result(self.config.call_timeout_s)

    async def aprefix_match(self, space: KeySpace, block_hashes: Iterable[bytes]) -> PrefixMatch:
        call = self._h.manager.prefix_match(space, list(block_hashes))
        return await call.aresult(self.config.call_timeout_s)

    def kv_events(self, timeout_s: float = 300.0) -> dict[str, str | None] | None:
        """The pool's KV-events sockets, ``{"endpoint": ..., "replay": ...}``, once its
        publisher runs (its first start imports vLLM: seconds); None without
        ``kv_events``. Raises :class:`ConfigError` when vLLM does not import where the
        manager runs."""
        return self._h.manager.kv_events().result(timeout_s)

    # ---- observability -------------------------------------------------------------------

    async def _stats(self) -> PoolStatus:
        return await collect_status(self._h)

    def stats(self) -> PoolStatus:
        """Per-rank counters and totals; ``print(pool.stats().table())``."""
        return self._loop.run(self._stats())

    async def astats(self) -> PoolStatus:
        return await self._loop.arun(self._stats())


async def collect_status(h: launcher.PoolHandles, timeout_s: float = 10.0) -> PoolStatus:
    """Snapshot every node client of the pool; a dead one (or one whose node is gone)
    shows as DOWN instead of failing."""
    cfg = h.config
    status = PoolStatus(
        cfg.name, cfg.namespace, cfg.backend, h.server_address, h.embedded, cfg.world_size
    )
    status.ssd = cfg.ssd_tier
    nodes = await h.manager.nodes().aresult(timeout_s)
    lookups = await h.manager.lookups().aresult(timeout_s)
    alive = await asyncio.to_thread(remote.nodes)
    first_of_node: dict[str, remote.NodeActors] = {}
    for a in nodes:
        first_of_node.setdefault(a.node_id, a)

    def where(node_id: str) -> str:
        return f"{alive.get(node_id, ('?', False))[0]}/{node_id[:8]}"

    async def one(a: remote.NodeActors) -> RankStatus:
        down = RankStatus(a.slot, "", 0, False, RankStats(), node=where(a.node_id))
        if not alive.get(a.node_id, ("", False))[1]:
            down.error = "node gone"
            return down
        calls = [a.client.snapshot()]
        if a.ssd is not None:
            calls.append(a.ssd.snapshot())
        look = lookups.get(a.node_id) if first_of_node[a.node_id] is a else None
        if look is not None:
            calls.append(look.snapshot())
        try:
            snaps = await asyncio.gather(*(c.aresult(timeout_s) for c in calls))
        except KVRayError as exc:
            down.error = type(exc).__name__
            return down
        stats = RankStats.from_dict(snaps[0]["stats"])
        if a.ssd is not None:
            stats.merge(RankStats.from_dict(snaps[1]["tier"]))
        if look is not None:
            stats.merge(RankStats.from_dict(snaps[-1]["stats"]))
        info = snaps[0]["info"]
        return RankStatus(
            a.slot, info["segment"], info["segment_bytes"], True, stats, node=where(a.node_id)
        )

    status.ranks = list(await asyncio.gather(*(one(a) for a in nodes)))
    status.fingerprints = await h.manager.fingerprints().aresult(timeout_s)
    status.engines = await h.manager.engines().aresult(timeout_s)
    status.server = await h.manager.server_metrics().aresult(timeout_s)
    return status


def _summary(failed: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for reason in failed.values():
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))


def _norm_put(keys: Key | Sequence[Key], values: Any) -> tuple[list[str], list[Any]]:
    if isinstance(keys, str | BlockKey):
        return [_key_str(keys)], [values]
    return [_key_str(k) for k in keys], list(values)


def _norm_get(
    keys: Key | Sequence[Key], out: Any, shape: Sequence[int] | None, dtype: Any
) -> tuple[bool, list[str], list[Any]]:
    single = isinstance(keys, str | BlockKey)
    ks = [_key_str(keys)] if isinstance(keys, str | BlockKey) else [_key_str(k) for k in keys]
    if out is not None:
        outs = [out] if single else list(out)
        if len(outs) != len(ks):
            raise ValueError(f"get: {len(ks)} keys but {len(outs)} outputs")
    elif shape is not None:
        outs = [_empty_like(shape, dtype if dtype is not None else np.uint8) for _ in ks]
    else:
        raise ValueError("get: pass out= (arrays to fill) or shape= and dtype= (to allocate)")
    return single, ks, outs
