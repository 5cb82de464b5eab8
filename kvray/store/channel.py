"""The node channel: a worker's transfer calls to its node's BackendClient with no Ray
round trip.

Ray sets it up and stays the fallback. At attach the worker asks the BackendClient (a
Ray call) for its channel's address, and from then on a step's transfer descriptors
(``get``/``put`` of :class:`~kvray.transfer.TransferBatch`) go over a Unix stream socket
in the node's abstract namespace: the step's calls in one frame, their answers back as
they end, each with the time the actor spent serving it (the timeline's share of a load
that is the BackendClient's own). The bytes never cross it; they stay in the registered regions.

Why a Unix socket, measured here (``scripts/bench_channel.py``, docs/benchmarks.md): a
round trip costs tens of microseconds against 1.1-1.8 ms for a Ray actor call; waiting
blocks in the kernel (no spin: idle costs nothing); a BackendClient that dies closes it,
so its calls in flight fail at once rather than at their timeout; and the server runs on
the actor's own event loop (no thread, no sync method: Ray Compiled Graphs cannot
compile async actors and are in maintenance mode). vLLM's own executor uses a
shared-memory ring (``shm_broadcast.MessageQueue``) for one writer and many readers
polling every step; here each worker has its own peer, and the socket is the same
speed for messages this small.

Only processes of the actor's user may connect (``SO_PEERCRED``): such a process can
already read the actor's memory, so the channel opens nothing new (docs/security.md).

A call is a :class:`ChannelCall`, a :class:`~kvray.remote.Call`: the connector waits for
it like for a Ray call (:func:`kvray.remote.ready` / :func:`~kvray.remote.results`). A
channel that broke (its actor restarted or died) fails every call in flight with a
:class:`~kvray.errors.BackendUnavailableError`; :class:`ChannelStore` then sends through
Ray while it asks the restarted actor for its new channel, without blocking a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvray.errors import BackendUnavailableError, KVRayError
from kvray.remote import Call, CallTimeoutError

if TYPE_CHECKING:
    from kvray.backends.base import KeyStatus
    from kvray.remote import StoreHandle
    from kvray.transfer import TransferBatch

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HEAD = struct.Struct("<I")
MAX_FRAME = 1 << 30
"""A frame this large is a broken peer, not a step's descriptors."""
REATTACH_S = 1.0
"""How often a worker whose channel broke asks its BackendClient for the new one."""

CLOSED = "closed by the actor (it restarted or died)"
"""Why a channel broke when the actor's end of it closed."""
LOCK_POLL_S = 0.001
"""How often a thread waiting for another's read of the channel looks whether that read
settled its calls."""

Method = Callable[..., Awaitable[Any]]


def _frame(payload: object) -> bytes:
    body = pickle.dumps(payload, protocol=5)
    return _HEAD.pack(len(body)) + body


def _answerable(exc: BaseException, what: str) -> KVRayError:
    """What the caller sees of a failure: kvray's own errors as they are, anything else
    (kvray's bug) named in one line."""
    if isinstance(exc, KVRayError):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:  # noqa: BLE001 - an error that does not pickle is sent as text
            pass
    return BackendUnavailableError(f"{what}: {type(exc).__name__}: {exc}")


class ChannelServer:
    """The actor's end: serves ``methods`` (coroutines) to same-user processes of the
    node, on the actor's event loop. Each connection's calls run concurrently, and each
    answers as it ends."""

    def __init__(self, name: str, methods: Mapping[str, Method]) -> None:
        self.name = name
        self._methods = dict(methods)
        self._server: asyncio.Server | None = None
        self.address = ""
        self._uid = os.getuid()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        """Accepted so far (a worker that re-attached counts again)."""

    async def start(self) -> str:
        """Listen (once); the address to hand to workers."""
        if self._server is None:
            # Abstract namespace: no file to leave behind, scoped to the node's network
            # namespace (a node of the multi-node harness has its own).
            address = f"\0kvray-{self.name}-{os.getpid()}-{secrets.token_hex(6)}"
            self._server = await asyncio.start_unix_server(self._serve, path=address)
            self.address = address
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    def _peer_allowed(self, writer: asyncio.StreamWriter) -> bool:
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        if uid in (self._uid, 0):
            return True
        logger.warning(
            "%s: refused a node-channel connection from pid %d (uid %d; this actor runs as uid %d)",
            self.name,
            pid,
            uid,
            self._uid,
        )
        return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._peer_allowed(writer):
            writer.close()
            return
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                (n,) = _HEAD.unpack(await reader.readexactly(_HEAD.size))
                if n > MAX_FRAME:
                    logger.warning("%s: a node-channel frame of %d bytes; closing it", self.name, n)
                    return
                calls = pickle.loads(await reader.readexactly(n))
                for cid, method, args in calls:
                    task = asyncio.ensure_future(self._answer(writer, cid, method, args))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away; calls running still end (their stores count)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(
        self, writer: asyncio.StreamWriter, cid: int, method: str, args: tuple[Any, ...]
    ) -> None:
        what = f"{self.name}.{method}"
        fn = self._methods.get(method)
        ok, value = True, None
        t0 = time.perf_counter()
        try:
            if fn is None:
                raise BackendUnavailableError(f"{what}: the node channel serves no such call")
            value = await fn(*args)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, never dropped
            ok, value = False, _answerable(exc, what)
        served = time.perf_counter() - t0
        if writer.is_closing():
            return
        try:
            data = _frame([(cid, ok, value, served)])
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle
            data = _frame([(cid, False, _answerable(exc, what), served)])
        writer.write(data)


class ChannelCall(Call[T]):
    """One call in flight over a node channel."""

    __slots__ = ("channel", "cid", "settled", "ok", "value", "served")

    def __init__(self, channel: ChannelClient, cid: int, what: str) -> None:
        super().__init__(None, what)
        self.channel = channel
        self.cid = cid
        self.settled = False
        self.ok = False
        self.value: Any = None
        self.served: float | None = None

    def _settle(self, ok: bool, value: Any, served: float | None = None) -> None:
        self.ok, self.value, self.served, self.settled = ok, value, served, True

    @property
    def served_s(self) -> float | None:
        return self.served

    def done(self) -> bool:
        if not self.settled:
            self.channel.pump(0)
        return self.settled

    @property
    def carrier(self) -> object:
        return self.channel

    def block(self, timeout_s: float | None) -> None:
        self.channel.pump(timeout_s)

    def result(self, timeout_s: float | None, setting: str | None = None) -> T:
        if not self.settled:
            self.channel.wait([self], timeout_s, every=True)
        if not self.settled:
            limit = "its timeout" if timeout_s is None else f"{timeout_s:g} s"
            fix = f" ({setting}={timeout_s:g})" if setting and timeout_s is not None else ""
            raise CallTimeoutError(f"{self.what}: no answer in {limit}{fix}")
        if not self.ok:
            raise self.value
        value: T = self.value
        return value

    async def aresult(self, timeout_s: float | None, setting: str | None = None) -> T:
        return await asyncio.to_thread(self.result, timeout_s, setting)

    def cancel(self) -> None:
        """Drop the answer (the call itself runs to its end in the actor)."""
        self.channel.forget(self)


class ChannelClient:
    """A worker's end of one node channel. Thread-safe; calls queue until
    :meth:`flush` (or a wait) sends them, all in one frame."""

    def __init__(self, address: str, name: str, timeout_s: float = 5.0) -> None:
        self.name = name
        self.address = address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            raise BackendUnavailableError(
                f"{name}: cannot connect to its node channel ({exc.strerror or exc}): the "
                "actor is not on this node, or not running"
            ) from exc
        sock.settimeout(None)
        self._sock = sock
        self._send_lock = threading.RLock()
        self._recv_lock = threading.Lock()
        self._queued: list[tuple[int, str, tuple[Any, ...]]] = []
        self._calls: dict[int, ChannelCall[Any]] = {}
        self._ids = itertools.count()
        self._buf = bytearray()
        self.broken: KVRayError | None = None
        self.frames = 0
        """Frames sent: a step's calls go in one."""

    def call(self, method: str, args: tuple[Any, ...], what: str) -> ChannelCall[Any]:
        call: ChannelCall[Any] = ChannelCall(self, next(self._ids), what)
        with self._send_lock:
            if self.broken is not None:
                call._settle(False, type(self.broken)(f"{what}: {self.broken}"))
                return call
            self._calls[call.cid] = call
            self._queued.append((call.cid, method, args))
        return call

    def flush(self) -> None:
        """Send the calls queued so far, in one frame."""
        with self._send_lock:
            if not self._queued or self.broken is not None:
                return
            queued, self._queued = self._queued, []
            try:
                self._sock.sendall(_frame(queued))
                self.frames += 1
            except OSError as exc:
                self._break(f"send failed ({exc.strerror or exc})")

    def peer_closed(self) -> bool:
        """Whether the channel is down. With no call in flight, one non-blocking peek
        finds an actor that restarted or died while this worker was idle (its end
        closed), and the channel breaks then, so that the next call takes Ray's path
        instead of failing on the dead socket. Calls in flight learn it from their
        answers (:meth:`pump`)."""
        if self.broken is not None:
            return True
        if self._calls or not self._recv_lock.acquire(blocking=False):
            return False
        try:
            try:
                data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False  # open, nothing to read
            except OSError:
                data = b""  # reset: the actor died
        finally:
            self._recv_lock.release()
        if data:
            return False  # an answer of a call given up on: pump reads it
        self._break(CLOSED)
        return True

    def forget(self, call: ChannelCall[Any]) -> None:
        with self._send_lock:
            self._calls.pop(call.cid, None)

    def pump(self, timeout_s: float | None, done: Callable[[], bool] | None = None) -> None:
        """Send what is queued, then settle the calls whose answers arrived, waiting up
        to ``timeout_s`` (None: no limit) for some to arrive; or, once ``done`` is true,
        not at all. Several threads may wait on one channel (a Pool's calls): one reads
        while the others wait for its lock, and a waiter whose calls that reader settled
        returns without reading, since nothing more may come for it."""
        self.flush()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._recv_lock.acquire(timeout=LOCK_POLL_S):
            if (done is not None and done()) or (
                deadline is not None and time.monotonic() >= deadline
            ):
                return
        try:
            if self.broken is not None or (done is not None and done()):
                return
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            while True:
                try:
                    readable, _, _ = select.select([self._sock], [], [], wait)
                except (OSError, ValueError) as exc:
                    self._break(f"wait failed ({exc})")
                    return
                if not readable:
                    return
                try:
                    data = self._sock.recv(1 << 20)
                except ConnectionResetError:
                    data = b""  # closed with our calls unread: the actor died
                except OSError as exc:
                    self._break(f"receive failed ({exc.strerror or exc})")
                    return
                if not data:
                    self._break(CLOSED)
                    return
                self._buf += data
                self._dispatch()
                wait = 0  # read on only while more is there already
        finally:
            self._recv_lock.release()

    def _dispatch(self) -> None:
        buf = self._buf
        at = 0
        while len(buf) - at >= _HEAD.size:
            (n,) = _HEAD.unpack_from(buf, at)
            if len(buf) - at - _HEAD.size < n:
                break
            answers = pickle.loads(buf[at + _HEAD.size : at + _HEAD.size + n])
            at += _HEAD.size + n
            with self._send_lock:
                settled = [(self._calls.pop(cid, None), ok, v, t) for cid, ok, v, t in answers]
            for call, ok, value, served in settled:
                if call is not None:
                    call._settle(ok, value, served)
        del buf[:at]

    def wait(
        self, calls: Sequence[ChannelCall[Any]], timeout_s: float | None, *, every: bool
    ) -> None:
        """Until the first (``every``: all) of ``calls`` settled, or ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            settled = [c.settled for c in calls]
            if (all(settled) if every else any(settled)) or not calls:
                return
            if self.broken is not None:
                return  # every call in flight was failed when it broke
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.pump(left, lambda: (all if every else any)(c.settled for c in calls))

    def _break(self, why: str) -> None:
        """Fail every call in flight; the channel is closed for good."""
        with self._send_lock:
            if self.broken is not None:
                return
            self.broken = BackendUnavailableError(f"node channel of {self.name} {why}")
            failed, self._calls, self._queued = list(self._calls.values()), {}, []
        logger.warning("%s (%d calls in flight failed)", self.broken, len(failed))
        for call in failed:
            call._settle(False, BackendUnavailableError(f"{call.what}: {self.broken}"))
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        with self._send_lock:
            if self.broken is None:
                self.broken = BackendUnavailableError(f"node channel of {self.name} closed")
        self._sock.close()


class ChannelLink:
    """A node channel to one actor that may restart: its :class:`ChannelClient` while it
    is up, None while it is not (the caller goes through Ray meanwhile).

    A channel whose actor went (closed, or broken by a failed call) is asked for again
    through ``ask`` (a Ray call for the actor's new address), at most every ``retry_s``:
    without waiting from a worker's step (:meth:`live`: the first step after the answer
    connects), or awaited on an actor's event loop (:meth:`alive`). What it could not
    connect is warned once; a connect after one is logged."""

    def __init__(self, ask: Callable[[], Call[str]], name: str, retry_s: float) -> None:
        self._ask = ask
        self.name = name
        self._retry_s = retry_s
        self._channel: ChannelClient | None = None
        self._asking: Call[str] | None = None
        self._asked_at = float("-inf")
        self._failed = False

    @property
    def up(self) -> ChannelClient | None:
        """The channel, while its actor's end is open and no call broke it."""
        channel = self._channel
        return None if channel is None or channel.peer_closed() else channel

    @property
    def current(self) -> ChannelClient | None:
        """The channel connected last, up or not (None: none yet, or closed)."""
        return self._channel

    @property
    def frames(self) -> int:
        return self._channel.frames if self._channel is not None else 0

    def connect(self, address: str) -> ChannelClient:
        """Connect to ``address`` now (blocking), replacing the channel there was."""
        self.close()
        self._channel = ChannelClient(address, self.name)
        if self._failed:
            self._failed = False
            logger.info("%s: node channel re-attached", self.name)
        return self._channel

    def ask_now(self) -> None:
        """The next :meth:`live` or :meth:`alive` asks at once (no pause)."""
        self._asked_at = float("-inf")

    def live(self) -> ChannelClient | None:
        """The channel, or None while it is down; never blocks: an ask due is sent, an
        answer in connects."""
        channel = self.up
        if channel is not None:
            return channel
        if self._asking is None:
            if self._due():
                self._asking = self._ask()
            return None
        if not self._asking.done():
            return None
        asking, self._asking = self._asking, None
        try:
            return self.connect(asking.result(0))
        except KVRayError as exc:
            self.lost(exc)
            return None

    async def alive(self, timeout_s: float) -> ChannelClient | None:
        """The channel, or None while it is down; an ask due is awaited (at most
        ``timeout_s``), and its answer connected."""
        channel = self.up
        if channel is not None or not self._due():
            return channel
        try:
            address = await self._ask().aresult(timeout_s)
            return await asyncio.to_thread(self.connect, address)
        except KVRayError as exc:
            self.lost(exc)
            return None

    def _due(self) -> bool:
        if time.monotonic() - self._asked_at < self._retry_s:
            return False
        self._asked_at = time.monotonic()
        return True

    def lost(self, exc: KVRayError) -> None:
        """Connecting failed (``exc``): warned the first time since the last connect."""
        if not self._failed:
            self._failed = True
            logger.warning("%s: no node channel (%s); its calls go through Ray", self.name, exc)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class ChannelStore:
    """A worker's transfers to its node's BackendClient: over the node channel when it
    is up, through Ray (:class:`~kvray.remote.StoreHandle`) while it is not.

    A broken channel is re-attached in the background (:class:`ChannelLink`): every
    :data:`REATTACH_S`, a Ray call asks the (restarted) actor for its new address, and the
    first step after the answer connects, so no step waits for the actor to come back. An
    actor that restarted while the worker was idle is found before a call is sent on its
    old channel (:meth:`ChannelClient.peer_closed`): that call goes through Ray, it does
    not fail.
    """

    def __init__(self, handle: StoreHandle, timeout_s: float) -> None:
        self.handle = handle
        self._timeout_s = timeout_s
        self._link = ChannelLink(handle.channel, handle.name, REATTACH_S)
        self.ray_calls = 0
        """Transfers sent through Ray (the channel down)."""

    def attach(self) -> None:
        """Connect now (at registration; blocking); a failure leaves Ray's path on."""
        try:
            self._link.connect(self.handle.channel().result(self._timeout_s))
        except KVRayError as exc:
            self._link.lost(exc)

    @property
    def attached(self) -> bool:
        return self._link.up is not None

    @property
    def frames(self) -> int:
        return self._link.frames

    def _live(self) -> ChannelClient | None:
        return self._link.live()

    def get(self, batch: TransferBatch) -> Call[list[KeyStatus]]:
        channel = self._live()
        if channel is None:
            self.ray_calls += 1
            return self.handle.get(batch)
        return channel.call("get", (batch,), f"{self.handle.name}.get of {len(batch)}")

    def put(self, batch: TransferBatch, overwrite: bool = False) -> Call[list[KeyStatus]]:
        channel = self._live()
        if channel is None:
            self.ray_calls += 1
            return self.handle.put(batch, overwrite)
        return channel.call("put", (batch, overwrite), f"{self.handle.name}.put of {len(batch)}")

    def flush(self) -> None:
        """Send the step's calls (one frame)."""
        channel = self._link.current
        if channel is not None:  # (a channel that broke since fails its calls at once)
            channel.flush()

    def close(self) -> None:
        self._link.close()
