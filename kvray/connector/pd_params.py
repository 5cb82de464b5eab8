"""Scheduler side: PD disaggregation through the pool, as ``kv_transfer_params``.

A prefill instance answers a request marked ``do_remote_decode`` (vLLM's convention; the
proxy sets it) with ``kv_transfer_params`` ``{"kvray": {"pool", "space", "blocks",
"hash"}}``: the number of leading prompt blocks it stored or found in the pool, where,
and how it hashes them. The proxy forwards them with the decode request; the decode
instance's lookup then waits in the Lookup actor (up to ``pd_wait_ms``) until all of them
are there, since the prefill's last saves may still be in flight when its answer reaches
the proxy. To the scheduler that is just a slower lookup: other requests run meanwhile.
A prefill that stored elsewhere (another pool, key space or hash domain) is not waited
for: none of its blocks could be found here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvray.connector.fingerprint import FIX

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvray.connector.hash_registration import HashRegistration
    from kvray.connector.instance import InstanceInfo
    from kvray.connector.stats import KVRayConnectorStats
    from kvray.keys import KeySpace

PARAMS_KEY = "kvray"
"""kvray's entry in vLLM's ``kv_transfer_params`` (next to other connectors' entries)."""


class PDParams:
    """What a prefill tells its decode, and what a decode makes of it."""

    def __init__(
        self,
        info: InstanceInfo,
        hashes: HashRegistration,
        stats: KVRayConnectorStats,
        warn: Callable[..., None],
    ) -> None:
        self._info = info
        self._hashes = hashes
        self._stats = stats
        self._warn = warn
        self.wait_s = info.config.pd_wait_ms / 1e3
        self.use_space(info.space)

    def use_space(self, space: KeySpace) -> None:
        """The instance's keys (again after a reset moved them to a new generation)."""
        self.space_id = [space.namespace, space.layout, space.tp_size, space.pp_size]
        """What a prefill and a decode compare in ``kv_transfer_params`` (JSON-able)."""
        if space.generation:
            self.space_id.append(space.generation)

    def expected_blocks(self, request: Request) -> int:
        """Leading blocks the request's prefill instance reported in the pool (0: none,
        or stored where this instance cannot read them, or not waiting for them)."""
        if self.wait_s <= 0:
            return 0
        params = getattr(request, "kv_transfer_params", None)
        entry = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if entry is None:
            return 0
        if not isinstance(entry, dict) or not isinstance(entry.get("blocks"), int):
            self._warn("pd-params", "ignoring malformed kv_transfer_params.kvray %r", entry)
            return 0
        pool_name = self._info.config.pool_name
        if entry.get("pool") != pool_name or entry.get("space") != self.space_id:
            self._warn(
                "pd-space",
                "the prefill instance stored under pool %r keys %r, this decode instance reads "
                "pool %r keys %r: nothing of its prefill can be loaded here (set pool_name and "
                "model_namespace the same on both, and prefill_pp_size for a PP prefill)",
                entry.get("pool"),
                entry.get("space"),
                pool_name,
                self.space_id,
            )
            return 0
        mine = self._hashes.ensure()
        theirs = entry.get("hash")
        if mine is not None and theirs is not None and theirs != mine.hash_domain:
            # The prefill's blocks are under hashes this instance never derives: waiting
            # for them would only add pd_wait_ms to every request.
            self._stats.add("pd_hash_mismatches")
            self._warn(
                "pd-hash",
                "the prefill instance hashes blocks in hash domain %s, this decode instance "
                "with %s: none of its blocks can be found here, so decode requests do not wait "
                "for them: %s",
                theirs,
                mine.describe(),
                FIX,
            )
            return 0
        return min(int(entry["blocks"]), len(request.block_hashes))

    def blocks_missing(self, req_id: str, reported: int, found: int) -> None:
        """The PD wait ended with fewer blocks than the prefill reported stored."""
        self._stats.add("pd_wait_timeouts")
        self._warn(
            "pd-timeout",
            "request %s: its prefill reported %d blocks stored, the pool had %d after %.0f ms "
            "(pd_wait_ms): loading those, recomputing the rest",
            req_id,
            reported,
            found,
            self.wait_s * 1e3,
        )

    def for_decode(self, request: Request, stored_blocks: int) -> dict[str, Any] | None:
        """What a decode instance needs to find this prefill's blocks: only for requests
        marked ``do_remote_decode`` (the proxy's prefill requests)."""
        asked = getattr(request, "kv_transfer_params", None)
        if not self._info.can_save or not (
            isinstance(asked, dict) and asked.get("do_remote_decode")
        ):
            return None
        entry: dict[str, Any] = {
            "pool": self._info.config.pool_name,
            "space": self.space_id,
            "blocks": stored_blocks,
        }
        fp = self._hashes.ensure()
        if fp is not None:
            entry["hash"] = fp.hash_domain
        return {PARAMS_KEY: entry}
