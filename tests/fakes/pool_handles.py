"""FAKE pool handles, for running both sides of the connector without Ray.

The connector reaches the pool only through :mod:`kvray.remote`'s typed handles (each
method returns a :class:`~kvray.remote.Call`) and waits for calls through a
:class:`~kvray.connector.calls.Waits`. These fakes stand in for all of them:

- :class:`FakeCall`: answered (a value or a kvray error) or still pending; the test
  finishes a pending one when it likes. ``result`` of a pending call raises
  :class:`~kvray.remote.CallTimeoutError` at once, as the real one does after its
  timeout; with no timeout it would block forever, so it fails the test instead.
- :class:`FakeWaits`: ``ready``/``results`` over fake calls, recording each timeout.
- :class:`FakeStore`: a BackendClient that really moves bytes between the regions the
  worker maps and a dict of keys, so round trips are checked byte for byte; per-key
  statuses can be forced (``force``) and calls left pending (``hang``).
- :class:`FakeLookup`, :class:`FakeManager`, :class:`FakePool`.

The handle fakes subclass the real handle classes (with no actor), so the connector's
types hold; a method a fake does not override fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvray.backends.base import KeyStatus
from kvray.config import PoolConfig
from kvray.errors import KVRayError
from kvray.index.block_index import IndexSpec
from kvray.index.lookup import Answer, Placement
from kvray.remote import CallTimeoutError, LookupHandle, ManagerHandle, StoreHandle
from kvray.shm import RegionSpec, SharedRegion
from kvray.transfer import TransferBatch


class FakeCall:
    """One call in flight to a fake actor."""

    def __init__(self, what: str, value: Any = None, *, error: KVRayError | None = None,
                 pending: bool = False) -> None:  # fmt: skip
        self.what = what
        self.value = value
        self.error = error
        self.pending = pending
        self.cancelled = False
        self.served: float | None = None
        """What :attr:`served_s` reports: None, as Ray's calls; a test sets seconds, as
        the node channel reports them."""
        self.on_finish: Callable[[], None] | None = None
        """Runs when a pending call is finished (the fake store moves its bytes then)."""

    def finish(self, value: Any = None, *, error: KVRayError | None = None) -> None:
        """Answer a pending call now."""
        assert self.pending, f"{self.what} already answered"
        self.pending = False
        if self.on_finish is not None:
            self.on_finish()
        if value is not None:
            self.value = value
        self.error = error

    def done(self) -> bool:
        return not self.pending

    @property
    def served_s(self) -> float | None:
        return self.served

    def result(self, timeout_s: float | None) -> Any:
        if self.pending:
            assert timeout_s is not None, f"{self.what}: waited without a limit for a hung call"
            raise CallTimeoutError(f"{self.what}: no answer in {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.value

    async def aresult(self, timeout_s: float | None) -> Any:
        return self.result(timeout_s)

    def cancel(self) -> None:
        self.cancelled = True


class FakeWaits:
    """:class:`~kvray.connector.calls.Waits` over fake calls (nothing really waits)."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []
        """The timeout of every ``ready`` and ``results``, in order."""
        self.is_connected = True

    def ready(self, calls: Sequence[FakeCall], timeout_s: float = 0, *,
              every: bool = False) -> list[bool]:  # fmt: skip
        self.timeouts.append(timeout_s)
        return [c.done() for c in calls]

    def results(self, calls: Sequence[FakeCall], timeout_s: float | None) -> list[Any]:
        self.timeouts.append(timeout_s)
        return [c.result(timeout_s) for c in calls]

    def connected(self) -> bool:
        return self.is_connected


class FakeStore(StoreHandle):
    """A rank's BackendClient: keys -> bytes, moved from and into mapped regions."""

    def __init__(self, name: str = "FakeStore[0]") -> None:
        super().__init__(None, name)
        self.objects: dict[str, bytes] = {}
        self.regions: dict[str, SharedRegion] = {}
        self.force: dict[str, KeyStatus] = {}
        """Key -> the status its next puts and gets answer (nothing moves for it)."""
        self.hang = False
        """New puts and gets stay pending (their bytes move when the test finishes them)."""
        self.calls: list[tuple[str, TransferBatch, FakeCall]] = []

    def probe(self) -> FakeCall:  # type: ignore[override]
        return FakeCall(f"{self.name}.probe", {"ok": True})

    def map_region(self, spec: RegionSpec) -> FakeCall:  # type: ignore[override]
        self.regions[spec.region_id] = SharedRegion.attach(spec)
        return FakeCall(f"{self.name}.map_region")

    def release_region(self, region_id: str) -> FakeCall:  # type: ignore[override]
        self.regions.pop(region_id).close()
        return FakeCall(f"{self.name}.release_region")

    def close(self) -> FakeCall:  # type: ignore[override]
        for region in self.regions.values():
            region.close()
        self.regions.clear()
        return FakeCall(f"{self.name}.close")

    def _call(self, method: str, batch: TransferBatch, move: Callable[[], list[KeyStatus]]
              ) -> FakeCall:  # fmt: skip
        call = FakeCall(f"{self.name}.{method} of {len(batch)}", pending=self.hang)
        if self.hang:
            call.on_finish = lambda: setattr(call, "value", move())
        else:
            call.value = move()
        self.calls.append((method, batch, call))
        return call

    def put(self, batch: TransferBatch, overwrite: bool = False) -> FakeCall:  # type: ignore[override]
        return self._call("put", batch, lambda: self._put(batch))

    def get(self, batch: TransferBatch) -> FakeCall:  # type: ignore[override]
        return self._call("get", batch, lambda: self._get(batch))

    def _pieces(self, batch: TransferBatch, i: int) -> list[tuple[int, int]]:
        return list(zip(batch.offsets[i].tolist(), batch.lengths[i].tolist(), strict=True))

    def _put(self, batch: TransferBatch) -> list[KeyStatus]:
        buf = self.regions[batch.region.region_id].array
        out = []
        for i, key in enumerate(batch.keys):
            if key in self.force:
                out.append(self.force[key])
                continue
            self.objects[key] = b"".join(
                buf[o : o + n].tobytes() for o, n in self._pieces(batch, i)
            )
            out.append(KeyStatus.OK)
        return out

    def _get(self, batch: TransferBatch) -> list[KeyStatus]:
        buf = self.regions[batch.region.region_id].array
        out = []
        for i, key in enumerate(batch.keys):
            if key in self.force:
                out.append(self.force[key])
                continue
            value = self.objects.get(key)
            if value is None:
                out.append(KeyStatus.NOT_FOUND)
                continue
            at = 0
            for o, n in self._pieces(batch, i):
                buf[o : o + n] = memoryview(value)[at : at + n]
                at += n
            out.append(KeyStatus.OK)
        return out


class FakeLookup(LookupHandle):
    """A node's Lookup actor: each lookup answers what ``answer`` says (default: a
    pending call the test finishes)."""

    def __init__(self) -> None:
        super().__init__(None, "FakeLookup")
        self.answer: Callable[[list[bytes]], FakeCall] | None = None
        self.asked: list[tuple[list[bytes], float, int, float]] = []
        self.placements: list[Placement | None] = []
        """The placement each lookup in ``asked`` sent (which SSD tiers to ask)."""
        self.calls: list[FakeCall] = []
        self.index: IndexSpec | None = None
        """What ``index_spec`` answers: the node's block index (None: the pool keeps none)."""
        self.reports: list[dict[str, int]] = []
        """The counters of each ``report`` call (lookups the index answered)."""
        self.pins: list[list[bytes]] = []
        """The hashes of each ``pin`` call (one per step that loads index answers)."""

    def pin(self, space: Any, block_hashes: Sequence[bytes], timeout_s: float) -> FakeCall:  # type: ignore[override]
        self.pins.append(list(block_hashes))
        return FakeCall("FakeLookup.pin", None)

    def report(self, counts: dict[str, int]) -> FakeCall:  # type: ignore[override]
        self.reports.append(dict(counts))
        return FakeCall("FakeLookup.report", None)

    def index_spec(self) -> FakeCall:  # type: ignore[override]
        return FakeCall("FakeLookup.index_spec", self.index)

    def lookup(self, space: Any, block_hashes: Sequence[bytes], timeout_s: float,  # type: ignore[override]
               want: int = 0, wait_s: float = 0.0,
               placement: Placement | None = None) -> FakeCall:  # fmt: skip
        hashes = list(block_hashes)
        if not hashes:  # the scheduler's warm-up call
            return FakeCall("FakeLookup.lookup", Answer(0))
        self.asked.append((hashes, timeout_s, want, wait_s))
        self.placements.append(placement)
        call = self.answer(hashes) if self.answer else FakeCall("FakeLookup.lookup", pending=True)
        self.calls.append(call)
        return call


class FakeManager(ManagerHandle):
    """The pool's manager: hash fingerprints, saved blocks' descriptions (KV events)."""

    def __init__(self) -> None:
        super().__init__(None, "FakeManager")
        self.other_fingerprints: list[dict[str, Any]] = []
        """What ``register_fingerprint`` answers (the pool's other hash domains)."""
        self.registered: list[tuple[str, dict[str, Any]]] = []
        self.engines: list[dict[str, Any] | None] = []
        """What each registration said of its engine (its load-failure policy, ...)."""
        self.fingerprint_calls: list[FakeCall] = []
        self.described: list[Any] = []
        """What ``describe_blocks`` was sent, in order."""

    def describe_blocks(self, reports: list[Any]) -> FakeCall:  # type: ignore[override]
        self.described.extend(reports)
        return FakeCall("describe_blocks", None)

    def register_fingerprint(  # type: ignore[override]
        self, keys: str, fp: dict[str, Any], engine: dict[str, Any] | None = None
    ) -> FakeCall:
        self.registered.append((keys, fp))
        self.engines.append(engine)
        call = FakeCall("FakeManager.register_fingerprint", list(self.other_fingerprints))
        self.fingerprint_calls.append(call)
        return call


class FakePool:
    """:class:`~kvray.launcher.PoolHandles` of one node: its stores, its Lookup actor."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig.from_dict({"name": "fake"}, environ={})
        self.server_address = "fake:0"
        self.node_id = "fake-node"
        self.manager = FakeManager()
        self.stores: dict[int, FakeStore] = {}
        self._lookup = FakeLookup()

    def node_ip(self) -> str:
        return "127.0.0.1"

    def client(self, slot: int) -> FakeStore:
        return self.stores.setdefault(slot, FakeStore(f"FakeStore[{slot}]"))

    def lookup(self) -> FakeLookup:
        return self._lookup

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
