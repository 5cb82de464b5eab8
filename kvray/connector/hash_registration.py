"""Scheduler side: this engine's hash fingerprint, registered with the pool.

vLLM's block hashes depend on its hash algorithm and its seed, so two engines of one
model can disagree silently (0 % hits, never wrong bytes). The scheduler learns its
engine's fingerprint from the first request on (:mod:`kvray.connector.fingerprint`) and
registers it with the pool's manager, with what vLLM does with the engine's failed
loads (its ``kv_load_failure_policy``, listed by ``kvray status`` and ``kvray doctor``),
which answers with the other fingerprints it saw
for the same ``namespace@layout``: checked in a later step, never waited for, and a
mismatch is logged once, naming the fix.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvray.connector.fingerprint import Fingerprint, mismatch_message, random_seed_message
from kvray.connector.fingerprint import current as current_fingerprint
from kvray.errors import KVRayError

if TYPE_CHECKING:
    from kvray.connector.instance import InstanceInfo
    from kvray.remote import Call, ManagerHandle

logger = logging.getLogger(__name__)


class HashRegistration:
    """Registers the engine's fingerprint once, and reports what the pool answered."""

    def __init__(
        self, manager: ManagerHandle, info: InstanceInfo, warn: Callable[..., None]
    ) -> None:
        self._manager = manager
        self._info = info
        self._warn = warn
        self.fingerprint: Fingerprint | None = None
        """How this engine hashes blocks: known from its first request on."""
        self.load_failure_policy = ""
        """What vLLM does with this engine's failed loads (known at the workers'
        handshake, before any request), registered beside the fingerprint."""
        self._call: Call[list[dict[str, Any]]] | None = None

    def ensure(self) -> Fingerprint | None:
        """This engine's fingerprint (None while vLLM has not set its hash seed up),
        registered with the pool the first time it is known."""
        if self.fingerprint is None:
            fp = current_fingerprint(self._info.hash_algo)
            if fp is None:
                return None
            self.fingerprint = fp
            if fp.seed_source == "random per process":
                self._warn("random-seed", "%s", random_seed_message(fp))
            space = self._info.space
            self._call = self._manager.register_fingerprint(
                f"{space.namespace}@{space.layout}", fp.as_dict(), self._engine()
            )
        return self.fingerprint

    def _engine(self) -> dict[str, Any]:
        """This engine as ``kvray status`` and ``kvray doctor`` list it."""
        info = self._info
        return {
            "engine": f"{socket.gethostname()}:{os.getpid()}",
            "engine_id": info.engine_id,
            "model": info.model_name,
            "keys": f"{info.space.namespace}@{info.space.layout}",
            "kv_role": info.kv_role,
            "load_failure_policy": self.load_failure_policy or "unknown",
        }

    def check(self) -> None:
        """Once the registration answered: warn about other fingerprints of the model."""
        call = self._call
        if call is None or not call.done():
            return
        self._call = None
        try:
            others = call.result(None)
        except KVRayError as exc:
            logger.warning("kvray: registering this engine's hash fingerprint failed: %s", exc)
            return
        if others and self.fingerprint is not None:
            self._warn(
                "fingerprint",
                "%s",
                mismatch_message(self._info.space.namespace, self.fingerprint, others),
            )
