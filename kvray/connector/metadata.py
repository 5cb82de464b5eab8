"""What the scheduler side tells the worker side each step, and what each worker tells
the scheduler side once at start (vLLM's handshake metadata): typed, small, picklable.

Block hashes travel as raw bytes; each worker turns them into its own rank's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvray.index.lookup import Place


@dataclass(frozen=True)
class KVRayHandshake(KVConnectorHandshakeMetadata):
    """One worker's block geometries, sent to the scheduler side after the KV caches are
    registered (vLLM collects every worker's once the scheduler is built and hands them to
    ``set_xfer_handshake_metadata_pp_aware``): its lookups build the same keys."""

    geometries: dict[int, str]
    """Instance rank -> :func:`~kvray.keys.geometry_digest` of the keys the worker stores
    for it (its own rank; each prefill stage's, when split by a prefill's PP stages)."""
    places: dict[int, Place] = field(default_factory=dict)
    """Instance rank -> the node and slot the worker loads it through: the SSD tier a
    lookup asks for that rank's keys."""
    load_failure_policy: str = ""
    """The ``kv_load_failure_policy`` vLLM applies to this connector's failed loads (the
    top-level config's, read where the worker can reach it:
    :mod:`kvray.connector.load_policy`)."""


@dataclass(frozen=True, slots=True)
class BlockOp:
    """Move whole blocks of one request between the pool and the engine's KV cache."""

    req_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group: int = 0
    """The KV cache group whose blocks these are (:mod:`kvray.connector.kv_groups`)."""

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.block_ids), "BlockOp: one block id per hash"


@dataclass
class KVRayMetadata(KVConnectorMetadata):
    """One engine step's work for every worker of the instance."""

    loads: list[BlockOp] = field(default_factory=list)
    """Loads to finish before this step's forward (synchronous)."""
    async_loads: list[BlockOp] = field(default_factory=list)
    """Loads reported through ``get_finished`` (requests wait in WAITING_FOR_REMOTE_KVS)."""
    saves: list[BlockOp] = field(default_factory=list)
    """Blocks this step completes; stored after the forward."""
    delayed_frees: list[str] = field(default_factory=list)
    """Finished requests whose blocks stay allocated until their saves completed."""
    preempted: list[str] = field(default_factory=list)
    """Requests whose blocks were freed: their in-flight saves must drain first."""
    step: int = 0
    """The scheduler's step number, echoed back in the worker's step times."""
    generation: int = 0
    """The generation of the instance's keys (:attr:`kvray.keys.KeySpace.generation`):
    every op of the step is keyed in it."""
    idle: bool = False
    """No request computes in this step (vLLM runs it for transfers only): the worker waits
    here, briefly, for the async loads in flight, rather than the engine polling for them
    with empty steps (:data:`kvray.connector.loads.IDLE_WAIT_S`)."""
    awaits_saves: bool = False
    """No request computes and a lookup waits for this instance's own saves in flight (a
    prompt sent again while its blocks are still being saved): the worker waits, as
    briefly, for its saves to end, rather than the engine spinning empty steps beside the
    BackendClient that stores them."""

    def is_empty(self) -> bool:
        return not (
            self.loads or self.async_loads or self.saves or self.delayed_frees or self.preempted
        )
