"""How the connector waits for its calls to the pool: the one seam between it and
:mod:`kvray.remote`.

Both sides of the connector make their calls through the typed handles (a
:class:`~kvray.remote.Call` each) and wait for several at once through a :class:`Waits`;
by default :class:`RayWaits`, which is :mod:`kvray.remote`'s ``ready`` and ``results``.
Unit tests hand them fake handles and a fake :class:`Waits` and run both sides without
Ray. Nothing here raises Ray's errors: a failed or late call is a
:class:`~kvray.errors.KVRayError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvray import remote
from kvray.remote import Call

if TYPE_CHECKING:
    from kvray.backends.base import KeyStatus
    from kvray.transfer import TransferBatch

T = TypeVar("T")


class Transfers(Protocol):
    """Where a worker's loads and saves go: its BackendClient's
    :class:`~kvray.remote.StoreHandle` (Ray) or a :class:`~kvray.store.channel.ChannelStore`
    (the node channel)."""

    def get(self, batch: TransferBatch) -> Call[list[KeyStatus]]: ...

    def put(self, batch: TransferBatch, overwrite: bool = False) -> Call[list[KeyStatus]]: ...


class Waits(Protocol):
    """Waiting for calls in flight (:func:`kvray.remote.ready` and
    :func:`~kvray.remote.results`), and whether calls can be made at all."""

    def ready(
        self, calls: Sequence[Call[Any]], timeout_s: float = 0, *, every: bool = False
    ) -> list[bool]:
        """Which of ``calls`` answered, waiting up to ``timeout_s`` for the first (with
        ``every``: for all) of them."""
        ...

    def results(self, calls: Sequence[Call[T]], timeout_s: float | None) -> list[T]:
        """The answers of ``calls``, one deadline for all; a failure or a timeout raises
        a :class:`~kvray.errors.KVRayError`."""
        ...

    def connected(self) -> bool:
        """This process is still connected to the cluster (False once Ray's own atexit
        shutdown ran: a call then would start a new session)."""
        ...


class RayWaits:
    """:class:`Waits` over Ray, through :mod:`kvray.remote`."""

    def ready(
        self, calls: Sequence[Call[Any]], timeout_s: float = 0, *, every: bool = False
    ) -> list[bool]:
        return remote.ready(calls, timeout_s, every=every)

    def results(self, calls: Sequence[Call[T]], timeout_s: float | None) -> list[T]:
        return remote.results(calls, timeout_s)

    def connected(self) -> bool:
        return remote.connected()
