"""``kv_connector_extra_config``: the settings of the KVRayConnector in each engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, field_validator, model_validator

from kvray.config._common import BackendName, ByteSize, _Strict
from kvray.errors import ConfigError


def _partition(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return value


class ConnectorConfig(_Strict):
    """``kv_connector_extra_config``: AscendStoreConnector's keys plus kvray's own.

    Existing AscendStoreConnector deployments switch by changing the connector name;
    the keys below keep their meaning.
    """

    backend: BackendName = "mooncake"
    """Storage backend of the pool; must match the pool the connector attaches to."""
    lookup_rpc_port: int = Field(0, ge=0, le=65535)
    """AscendStoreConnector's lookup socket name: there it names the ZMQ IPC socket
    between an instance's scheduler and its rank-0 worker's lookup server, distinct per
    instance on a host. kvray has no such socket (its schedulers reach their node's
    Lookup actor through Ray, which serves every instance), so the value is accepted,
    so that existing configs work, and ignored."""
    mooncake_rpc_port: int = Field(0, ge=0, le=65535)
    """AscendStoreConnector's deprecated name of ``lookup_rpc_port``: ignored alike."""
    load_async: bool | Literal["auto"] = "auto"
    """``"auto"`` (the default): a step's first pool hit loads synchronously (its request
    computes in that step, with no step of its own), the same step's further hits
    asynchronously (they load while that step computes); with ``use_layerwise``, every
    hit synchronously. ``true``: every hit asynchronously (reported through
    ``get_finished``; its request computes in a later step). ``false``: every hit
    synchronously, waited for before the forward of the step that computes its request.
    Hybrid models load asynchronously whatever is set (``false`` is refused)."""
    recompute_slow_hits: bool = True
    """Compute a pool hit rather than load it when this engine measured its load to be
    slower than computing its tokens (short hits, a slow SSD tier); counted as the miss
    ``not_worth_loading``. Until both rates are measured every hit is loaded. False:
    every hit is loaded."""
    consumer_is_to_put: bool = False
    """A ``kv_consumer`` also stores its blocks to the pool."""
    consumer_is_to_load: bool = False
    """A ``kv_consumer`` also loads prefix hits from the pool."""
    prefill_pp_size: int = Field(1, ge=1)
    """Pipeline-parallel size of the prefill instance a decode node stores for; given
    only ``prefill_pp_layer_partition``, its number of stages."""
    prefill_pp_layer_partition: Annotated[str | None, BeforeValidator(_partition)] = None
    """Layers per prefill PP stage, e.g. ``"30,31"``; must sum to the model's layers."""
    pool_name: str = "kvray"
    """Name of the kvray pool (its Ray actors) to use."""
    namespace: str = "kvray"
    """Ray namespace of the pool's actors."""
    ray_address: str | None = None
    """Ray cluster to join from multiprocessing-executor workers (default: ``RAY_ADDRESS``;
    neither set: a cluster ``ray start`` made on this node, else the node's embedded pool,
    started by the first engine and stopped with the last)."""
    pool_config: str | None = None
    """Pool config file (YAML or JSON, as for ``kvray up --config``) the embedded pool is
    started with, when an engine starts it (no Ray cluster configured)."""
    ucm_connectors: list[dict[str, Any]] | None = None
    """UCM's store settings (``ucm_connectors[0]``, a ``UcmPipelineStore``), read by
    :mod:`kvray.ucm` into pool and connector settings."""
    UCM_CONFIG_FILE: str | None = None
    """UCM's YAML config file (also read from the ``UCM_CONFIG_FILE`` environment
    variable) when ``ucm_connectors`` is not given here."""
    lookup_timeout_ms: float = Field(200.0, gt=0)
    """A lookup slower than this is a miss, never a stall."""
    pd_wait_ms: float = Field(5000.0, ge=0)
    """PD disaggregation, decode side: how long a request whose prefill instance reported
    N stored blocks (``kv_transfer_params``, forwarded by the proxy) waits for all N to
    be in the pool, since the prefill's last saves may still be in flight when its
    answer arrives. Other requests keep running meanwhile; after the wait, what the pool
    has is loaded and the rest recomputed. 0: never wait."""
    model_namespace: str | None = Field(None, pattern=r"^[^\s@]{1,200}$")
    """First part of every block key. Default: the model directory's or id's last part and
    a digest of the model (sampled weight content, effective config, KV cache dtype:
    ``tiny-llama-m0f1e2d3c4b5a``), so different checkpoints never share keys. Engines share
    blocks only under the same namespace (and KV layout and block geometry): set it to
    share keys across checkpoints on purpose, at the risk of loading one model's KV into
    another."""
    kv_placement: Literal["auto", "shared", "staged"] = "auto"
    """Where the KV bytes move from and to. ``shared``: the engine's KV cache itself lives
    in shared memory (CPU engines; no copy at all). ``staged``: the KV cache lives
    anywhere (GPU, NPU, CPU); blocks are gathered into a pinned shared staging region and
    scattered back. ``auto``: shared when vLLM allocated the KV cache through the
    connector's memory pool context (CPU), else staged."""
    kv_staging_size: ByteSize | None = None
    """Staging region per worker (``staged``): bytes or ``"256MB"``. Default: room for
    two of the engine's largest steps (``max_num_batched_tokens`` worth of blocks each).
    A transfer larger than staging is split, never refused."""
    transfer_channel: Literal["node", "ray"] = "node"
    """How a worker sends its transfers (descriptors only: the bytes move through
    registered memory) to its node's BackendClient. ``node``: a Unix socket on the node,
    set up through Ray at registration, a step's calls in one message (tens of
    microseconds); Ray while it is down, re-attached in the background. ``ray``: every
    transfer is a Ray actor call (1-2 ms each)."""
    use_layerwise: bool = False
    """Layer-wise transfers (AscendStoreConnector's and UCM's key): a step's pool hits
    load group by group of layers, each group waited for only before its first layer
    runs (``wait_for_layer_load``), and a step's blocks are saved group by group as soon
    as the group's last layer has run (``save_kv_layer``). Each block is then stored as
    ``layerwise_groups`` keys per rank: engines share blocks only with engines using the
    same setting."""
    layerwise_groups: int = Field(4, ge=1, le=1024)
    """With ``use_layerwise``: layer groups per rank (at most the layers each rank holds;
    set it to the layer count for one group per layer); a hybrid model's: per KV cache
    group (at most its layers; 1: each group's blocks sent as its layers completed, the
    same keys as without layer-wise transfers). 1 is refused for a model of one group
    (nothing to split). More groups overlap more of a
    load with compute but multiply the keys a lookup asks for and the Ray calls per
    step."""

    _stages: tuple[int, ...] | None = PrivateAttr(None)

    @field_validator("prefill_pp_layer_partition")
    @classmethod
    def _partition_format(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = [p.strip() for p in v.split(",")]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"expected comma-separated positive layer counts like '30,31', got {v!r}"
            )
        return ",".join(parts)

    @model_validator(mode="before")
    @classmethod
    def _size_from_partition(cls, data: Any) -> Any:
        """The seeds set ``prefill_pp_size`` *or* ``prefill_pp_layer_partition``."""
        if isinstance(data, dict) and "prefill_pp_size" not in data:
            raw = _partition(data.get("prefill_pp_layer_partition"))
            if isinstance(raw, str) and raw.strip():
                data = {**data, "prefill_pp_size": len(raw.split(","))}
        return data

    @model_validator(mode="after")
    def _partition_size(self) -> ConnectorConfig:
        if self.prefill_pp_layer_partition is not None:
            # Parsed once, here; the field keeps its string (the JSON form engines share).
            self._stages = tuple(int(p) for p in self.prefill_pp_layer_partition.split(","))
            n = len(self._stages)
            if n != self.prefill_pp_size:
                raise ValueError(
                    f"prefill_pp_layer_partition has {n} stages but prefill_pp_size is "
                    f"{self.prefill_pp_size}: give one layer count per prefill PP stage"
                )
        if self.use_layerwise and self.prefill_pp_size > 1:
            raise ValueError(
                "use_layerwise cannot be combined with prefill_pp_size > 1 (blocks split by a "
                "PP prefill's stages are already one key per stage): set use_layerwise to "
                "false on this instance and its prefill"
            )
        return self

    @property
    def prefill_partition(self) -> tuple[int, ...] | None:
        """``prefill_pp_layer_partition`` as numbers: layers per prefill PP stage (None:
        not given)."""
        return self._stages

    def layer_partition(self, num_layers: int) -> list[int]:
        """Layers per prefill PP stage; default split as even as possible."""
        if self._stages is None:
            base, rest = divmod(num_layers, self.prefill_pp_size)
            return [base + (1 if i < rest else 0) for i in range(self.prefill_pp_size)]
        parts = list(self._stages)
        if sum(parts) != num_layers:
            raise ConfigError(
                f"prefill_pp_layer_partition {self.prefill_pp_layer_partition!r} sums to "
                f"{sum(parts)} layers but the model has {num_layers}"
            )
        return parts
