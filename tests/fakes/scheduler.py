"""The scheduler side of KVRayConnector on a fake pool (:mod:`tests.fakes.pool_handles`),
driven by vLLM's own objects: real requests (block hashes by vLLM's hasher), scheduler
outputs and connector outputs. Import it after ``pytest.importorskip("vllm")``; a test
module that uses :class:`Sched` also imports the ``none_hash`` fixture."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvray.config import ConnectorConfig, PoolConfig, validate
from kvray.connector.instance import InstanceInfo
from kvray.connector.scheduler import KVRayScheduler
from kvray.index.lookup import Answer
from kvray.keys import KeySpace, KVLayout
from tests.fakes.pool_handles import FakeCall, FakePool, FakeWaits

BS = 16
LAYOUT = KVLayout("float32", BS, 4, 64).tag()


@pytest.fixture(autouse=True)
def none_hash(monkeypatch):  # type: ignore[no-untyped-def]
    """vLLM's hash seed, as its EngineCore sets it before the first request."""
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", None, raising=False)
    kv_cache_utils.init_none_hash(sha256)


class Sched:
    """A scheduler side on a fake pool, and the vLLM calls a step makes."""

    def __init__(
        self,
        tp_size: int = 1,
        index: Any = None,
        pool: dict[str, Any] | None = None,
        role: str = "kv_both",
        **extra: Any,
    ) -> None:
        """``index``: the node's block index the Lookup actor offers (a BlockIndex);
        ``pool``: the pool's config; ``role``: vLLM's ``kv_role``."""
        cfg = validate(ConnectorConfig, {"model_namespace": "unit", **extra}, source="test")
        self.info = InstanceInfo(
            cfg, KeySpace("unit", LAYOUT, tp_size), BS, role, model_name="tiny"
        )
        self.pool = FakePool(PoolConfig.from_dict(pool, environ={}) if pool else None)
        self.lookup = self.pool.lookup()
        self.lookup.index = index.spec if index is not None else None
        self.waits = FakeWaits()
        self.sched = KVRayScheduler(self.info, self.pool, self.waits)  # type: ignore[arg-type]

    def request(
        self, rid: str, tokens: int, params: dict[str, Any] | None = None, first: int = 1000
    ) -> Request:
        """A request of ``tokens`` prompt tokens from token id ``first`` on (``params``: its
        kv_transfer_params, as an API request's ``kv_transfer_params`` reaches vLLM)."""
        extra = {"kv_transfer_params": params} if params is not None else None
        sampling = SamplingParams(max_tokens=4, extra_args=extra)
        hasher = get_request_block_hasher(BS, sha256)
        req = Request(rid, list(range(first, first + tokens)), sampling, None, block_hasher=hasher)
        self.sched.on_new_request(req)
        return req

    def step(self, scheduled: dict[str, int] | None = None,
             new: list[tuple[Request, list[int]]] = ()) -> Any:  # type: ignore[assignment]  # fmt: skip
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = dict(scheduled or {})
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.scheduled_new_reqs = [NewRequestData.from_request(r, (ids,)) for r, ids in new]
        return self.sched.build_connector_meta(out)

    def alloc(self, req: Request, block_ids: list[int], external: int) -> None:
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
        self.sched.update_state_after_alloc(req, blocks, external)

    def stat(self, name: str) -> int:
        return int(self.sched.stats.data[name])


def answered(hits: int, miss: str = "", ssd: int = 0) -> Any:
    """A Lookup actor's answer: ``hits`` leading blocks (``ssd`` of them only on the SSD
    tier), then ``miss``."""
    return lambda hashes: FakeCall(
        "FakeLookup.lookup", Answer(min(hits, len(hashes)), miss, min(ssd, hits, len(hashes)))
    )
