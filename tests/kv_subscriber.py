"""A subscriber to KV events built from vLLM's own ``vllm.distributed.kv_events`` types,
as vLLM's examples/online_serving/kv_events_subscriber.py builds one: the tests' consumer
of the pool's events and of an engine's own."""

from __future__ import annotations

from typing import Any

import pytest

vk = pytest.importorskip("vllm.distributed.kv_events", reason="the subscriber needs vLLM")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


def ext(h: bytes) -> Any:
    """A block hash as vLLM's own events carry it (bytes, or an int: its env's choice)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)  # type: ignore[arg-type]


class Subscriber:
    """vLLM's example subscriber, reduced: a SUB socket on the topic, a REQ-like DEALER
    for replay, batches decoded into vLLM's KVEventBatch."""

    def __init__(
        self, endpoint: str, replay: str | None, topic: str, *, bind: bool = False
    ) -> None:
        """``bind``: listen at ``endpoint`` for a publisher that connects (vLLM's own,
        given a ``tcp://<host>:<port>`` endpoint, connects)."""
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)  # (before a publisher attaches)
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decode = msgspec.msgpack.Decoder(type=vk.KVEventBatch).decode
        self.blocks: dict[tuple[str | None, str | None], set[Any]] = {}
        self.events: list[Any] = []
        """Every event received live, in order."""

    def recv(self, timeout_s: float = 10.0) -> tuple[str, int, vk.KVEventBatch]:
        if not self.sub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no batch")
        topic, seq, payload = self.sub.recv_multipart()
        return topic.decode(), int.from_bytes(seq, "big"), self.decode(payload)

    def replay(self, start: int) -> list[tuple[str, int, vk.KVEventBatch]]:
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert req.poll(10_000), "no replay answer"
            _, topic, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            out.append((topic.decode(), int.from_bytes(seq, "big"), self.decode(payload)))
        req.close(linger=0)
        return out

    def drain(self, timeout_s: float = 0.5) -> int:
        """Apply every batch that arrives until none came for ``timeout_s``; how many."""
        n = 0
        while True:
            try:
                _, _, batch = self.recv(timeout_s)
            except TimeoutError:
                return n
            self.events += batch.events
            self.apply(batch)
            n += 1

    def apply(self, batch: vk.KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, vk.AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(ev, vk.BlockStored):
                self.blocks.setdefault((ev.medium, ev.ownership), set()).update(ev.block_hashes)
            elif isinstance(ev, vk.BlockRemoved):
                self.blocks.setdefault((ev.medium, ev.ownership), set()).difference_update(
                    ev.block_hashes
                )

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
