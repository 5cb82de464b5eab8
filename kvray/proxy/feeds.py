"""The router's KV-event subscriptions (kvray/proxy/router.py): one thread that reads the
engines' and the pool's ZMQ streams (vLLM's wire format) into the router's views.

- **Engines** publish to the router: vLLM's publisher connects to a ``tcp://host:port``
  endpoint (it binds only wildcard ones), so the router binds one SUB socket that every
  engine connects to, each on its own topic (its ``kv_events_config.topic``), which says
  whose cache a batch describes.
- **The pool** listens (kvray's publisher, on loopback unless configured otherwise): the
  router connects to it, subscribed to ``pool_topic`` (a prefix: the topics of the
  model the proxy serves, where the pool holds several).

Each topic's sequence numbers are followed: a batch after a gap, or the first one heard
from a stream that began earlier, asks the stream's replay socket for what was missed
(vLLM's replay protocol: a DEALER sends the first sequence wanted; a pool whose buffer
no longer reaches it answers ``AllBlocksCleared`` and a snapshot). The pool is asked at
once on connect, so a router started after the pool knows what it holds before any new
block. Without a replay endpoint a gap is counted and logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvray.proxy.router import CacheView, apply_batch
from kvray.warn_once import WarnOnce

logger = logging.getLogger(__name__)

POLL_MS = 100
"""How often the thread looks at its stop flag while nothing arrives."""
REPLAY_WAIT_MS = 5000
"""How long a replay answer is waited for (the stream goes on without it after)."""
END_SEQ = -1


@dataclass
class Stream:
    """One publisher's topics as the router follows them."""

    name: str
    views: Callable[[str], CacheView | None]
    """The view a topic's batches go to (None: a topic nobody asked for)."""
    replay: str | None = None
    """Its replay endpoint, or None."""
    last: dict[str, int] = field(default_factory=dict)
    """Topic -> the last sequence number applied."""


@dataclass
class FeedStats:
    batches: int = 0
    gaps: int = 0
    """Gaps in a topic's sequence numbers (a replay was asked for, where one is known)."""
    replayed: int = 0
    """Batches applied from replays."""
    unknown_topics: int = 0
    decode_errors: int = 0


class EventFeeds:
    """The router's subscriptions, on a thread of their own (:meth:`start`, :meth:`stop`);
    every batch is applied under ``lock``."""

    def __init__(
        self,
        lock: threading.Lock,
        *,
        bind: str | None = None,
        engines: dict[str, CacheView] | None = None,
        engine_replays: dict[str, str] | None = None,
        pool: CacheView | None = None,
        pool_endpoint: str | None = None,
        pool_replay: str | None = None,
        pool_topic: str = "",
    ) -> None:
        if engines and bind is None:
            raise ValueError("engines' topics given without an endpoint to bind for them")
        if pool is not None and pool_endpoint is None:
            raise ValueError("a pool view without the pool's kv_events endpoint")
        self._lock = lock
        self._bind = bind
        self._engines = dict(engines or {})
        self._engine_replays = dict(engine_replays or {})
        self._pool = pool
        self._pool_endpoint = pool_endpoint
        self._pool_replay = pool_replay
        self._pool_topic = pool_topic
        self.stats = FeedStats()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._warn = WarnOnce(logger)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread; returns once its sockets are bound and connected, raising
        what failed there. vLLM's event types are imported here first, outside
        ``timeout_s``: that import alone takes from seconds to tens of seconds on a
        busy host."""
        from vllm.distributed.kv_events import KVEventBatch  # noqa: F401

        self._thread = threading.Thread(target=self._run, name="kvray-router-feeds", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the router's KV-event sockets not ready in {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            import msgspec
            import zmq
            from vllm.distributed.kv_events import KVEventBatch

            ctx = zmq.Context()
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            sockets: dict[Any, Stream] = {}
            if self._bind is not None:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt_string(zmq.SUBSCRIBE, "")
                sub.bind(self._bind)
                sockets[sub] = Stream("engines", self._engines.get)
            if self._pool is not None and self._pool_endpoint is not None:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt_string(zmq.SUBSCRIBE, self._pool_topic)
                sub.connect(self._pool_endpoint)
                sockets[sub] = Stream("pool", self._pool_view, self._pool_replay)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            for stream in sockets.values():
                if stream.name == "pool" and stream.replay is not None:
                    try:
                        self._replay(ctx, decoder, stream, 0)
                    except Exception as exc:  # the live stream still comes
                        self._warn("pool-replay", "the pool's KV-event replay failed (%r)", exc)
            poller = zmq.Poller()
            for sock in sockets:
                poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    frames = sock.recv_multipart()
                    try:
                        topic, seq, payload = frames
                        self._take(ctx, decoder, sockets[sock], topic.decode(), seq, payload)
                    except Exception as exc:  # one bad batch, never the thread
                        self.stats.decode_errors += 1
                        self._warn("batch", "a KV-event batch (%d frames) was not applied "
                                   "(%r): skipped", len(frames), exc)  # fmt: skip
        finally:
            for sock in sockets:
                sock.close(linger=0)
            ctx.term()

    def _pool_view(self, topic: str) -> CacheView | None:
        return self._pool if topic.startswith(self._pool_topic) else None

    def _take(
        self, ctx: Any, decoder: Any, stream: Stream, topic: str, seq_b: bytes, payload: bytes
    ) -> None:
        seq = int.from_bytes(seq_b, "big", signed=True)
        view = stream.views(topic)
        if view is None:
            self.stats.unknown_topics += 1
            self._warn("topic-" + stream.name, "KV events on topic %r (%s): no instance of "
                       "the router has it; check each instance's kv_events_config.topic",
                       topic, stream.name)  # fmt: skip
            return
        last = stream.last.get(topic)
        if last is not None and seq <= last:
            return  # replayed already
        if (last is None and seq > 0) or (last is not None and seq > last + 1):
            self.stats.gaps += 1
            replay = stream.replay or self._engine_replays.get(topic)
            if replay is not None:
                self._replay(ctx, decoder, stream, 0 if last is None else last + 1, replay, topic)
            elif last is not None:
                self._warn("gap-" + topic, "KV events on %r skipped %d batches and the stream "
                           "has no replay endpoint: its view misses them until they change "
                           "again", topic, seq - last - 1)  # fmt: skip
            if stream.last.get(topic, -1) >= seq:
                return
        self._apply(decoder, view, payload)
        stream.last[topic] = seq
        self.stats.batches += 1

    def _apply(self, decoder: Any, view: CacheView, payload: bytes) -> bool:
        try:
            batch = decoder.decode(payload)
        except Exception as exc:  # a publisher of another version: log, skip
            self.stats.decode_errors += 1
            self._warn("decode", "a KV-event batch did not decode as vLLM's KVEventBatch "
                       "(%s): skipped", exc)  # fmt: skip
            return False
        with self._lock:
            apply_batch(view, batch)
        return True

    def _replay(
        self,
        ctx: Any,
        decoder: Any,
        stream: Stream,
        start: int,
        endpoint: str | None = None,
        only: str | None = None,
    ) -> None:
        """Ask ``endpoint`` (the stream's replay socket) for its batches from ``start``
        and apply the ones not applied yet (``only``: of that topic)."""
        import zmq

        endpoint = endpoint or stream.replay
        assert endpoint is not None, "a replay without an endpoint (caller's bug)"
        req = ctx.socket(zmq.DEALER)
        try:
            req.connect(endpoint)
            req.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not req.poll(REPLAY_WAIT_MS):
                    self._warn("replay-" + endpoint, "the KV-event replay at %s did not answer "
                               "in %.0f s", endpoint, REPLAY_WAIT_MS / 1e3)  # fmt: skip
                    return
                frames = req.recv_multipart()
                _, topic_b, seq_b, payload = frames[-4:]
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return
                topic = topic_b.decode()
                view = stream.views(topic)
                if view is None or (only is not None and topic != only):
                    continue
                if seq <= stream.last.get(topic, -1):
                    continue
                if self._apply(decoder, view, payload):
                    stream.last[topic] = seq
                    self.stats.replayed += 1
        finally:
            req.close(linger=0)
