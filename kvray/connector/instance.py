"""What both sides of the connector derive from vLLM's config: kvray's typed connector
config and the engine instance as the pool sees it (:class:`InstanceInfo`: its
:class:`~kvray.keys.KeySpace`, roles and sizes)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvray import ucm
from kvray.config import ConnectorConfig, validate
from kvray.connector.kv_groups import KVGroup, kv_groups
from kvray.errors import ConfigError
from kvray.keys import KeySpace, KVLayout
from kvray.ucm import UcmSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)
_namespaces_logged: set[str] = set()


@dataclass(frozen=True)
class InstanceInfo:
    """The engine instance as the pool sees it."""

    config: ConnectorConfig
    space: KeySpace
    block_size: int
    kv_role: str
    split_stages: bool = False
    """Blocks are split by the prefill's PP layer partition (this instance has no PP,
    ``prefill_pp_size`` > 1): one key per prefill stage."""
    num_blocks: int = 0
    """The engine's KV blocks (``kv_cache_config.num_blocks``): finds the block
    dimension of each layer's cache on the staged path."""
    max_step_blocks: int = 0
    """Blocks of the engine's largest step (``max_num_batched_tokens``): sizes the
    default staging region."""
    hash_algo: str = "sha256"
    """vLLM's ``prefix_caching_hash_algo``: with its seed, decides the block hashes."""
    local_workers: int = 1
    """Engine workers per node (TP x PP x local DP ranks): the clients an embedded pool
    started by this engine needs."""
    model_name: str = ""
    """vLLM's served model name (the pool's KV-events topics name it)."""
    engine_id: str = ""
    """vLLM's ``kv_transfer_config.engine_id`` (``{instance}`` in KV-events topics)."""
    load_failure_policy: str = "fail"
    """This connector's own ``kv_load_failure_policy``; the one vLLM applies may be a
    MultiConnector's (:mod:`kvray.connector.load_policy`)."""
    groups: tuple[KVGroup, ...] = ()
    """The engine's KV cache groups (:mod:`kvray.connector.kv_groups`): one for most
    models, several for a hybrid one under vLLM's hybrid allocator."""

    @property
    def can_load(self) -> bool:
        return self.kv_role != "kv_consumer" or self.config.consumer_is_to_load

    @property
    def can_save(self) -> bool:
        return self.kv_role != "kv_consumer" or self.config.consumer_is_to_put


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {}) if transfer else {}
    cfg = validate(ConnectorConfig, extra, source="kv_connector_extra_config")
    settings = ucm_settings(cfg)
    if settings is None:
        return cfg
    # UCM's choices of backend and layer-wise transfers are the connector's too.
    update = {**settings.connector, "backend": settings.pool["backend"]}
    return cfg.model_copy(update=update)


def ucm_settings(cfg: ConnectorConfig) -> UcmSettings | None:
    """UCM's config, where the connector config has one (inline or UCM_CONFIG_FILE)."""
    extra = {"ucm_connectors": cfg.ucm_connectors, "UCM_CONFIG_FILE": cfg.UCM_CONFIG_FILE}
    return ucm.settings({k: v for k, v in extra.items() if v is not None}, os.environ)


def instance_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> InstanceInfo:
    cfg = connector_config(vllm_config)
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ConfigError("KVRayConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
    groups = kv_groups(kv_cache_config)
    if len(groups) > 1:
        cfg = _for_groups(cfg, len(groups))
    elif cfg.use_layerwise and cfg.layerwise_groups == 1:
        raise ConfigError(
            "layerwise_groups is 1: a model of one KV cache group is then sent whole, not "
            "layer by layer; set layerwise_groups to 2 or more (or use_layerwise to false)"
        )
    attention = [g for g in groups if g.positional]
    if not attention:
        raise ConfigError(
            "KVRayConnector: this model has no attention layer (only recurrent states): "
            "kvray pools models with at least one; run it without KVRayConnector"
        )
    # (the key's layout tag: the first attention group's; each group's geometry names its own)
    spec: Any = kv_cache_config.kv_cache_groups[attention[0].index].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = KVLayout(dtype, spec.block_size, spec.num_kv_heads, spec.head_size).tag()
    namespace = cfg.model_namespace or default_namespace(vllm_config)
    parallel = vllm_config.parallel_config
    # A non-PP instance (a decode node) storing for a PP prefill keys each block's layers
    # by the prefill stage that owns them, so each prefill stage finds its part.
    split = parallel.pipeline_parallel_size == 1 and cfg.prefill_pp_size > 1
    pp_size = cfg.prefill_pp_size if split else parallel.pipeline_parallel_size
    layer_groups = cfg.layerwise_groups if cfg.use_layerwise else 1
    space = KeySpace(
        namespace,
        layout,
        parallel.tensor_parallel_size,
        pp_size,
        layer_groups,
        kv_groups=len(groups),
        state_groups=tuple(g.index for g in groups if not g.positional),
        tp_replicated=parallel.tensor_parallel_size > 1 and _latent_only(kv_cache_config),
    )
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None, "instance_info without kv_transfer_config"
    step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    return InstanceInfo(
        cfg,
        space,
        spec.block_size,
        str(transfer.kv_role),
        split,
        num_blocks=int(kv_cache_config.num_blocks),
        max_step_blocks=-(-int(step_tokens) // spec.block_size),
        hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        local_workers=parallel.tensor_parallel_size
        * parallel.pipeline_parallel_size
        * max(1, parallel.data_parallel_size_local),
        model_name=_served_name(vllm_config),
        engine_id=str(transfer.engine_id or ""),
        load_failure_policy=str(transfer.kv_load_failure_policy),
        groups=groups,
    )


def _latent_only(kv_cache_config: KVCacheConfig) -> bool:
    """Every group is MLA's latent, which is the same on every TP rank: stored once per
    block (TP rank 0's key), loaded by every rank."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    return all(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups)


def _for_groups(cfg: ConnectorConfig, n: int) -> ConnectorConfig:
    """The connector config for a model of ``n`` > 1 KV cache groups: loads are
    asynchronous (vLLM takes a failed load of such a model only per request, as a failed
    async receive), refused where set otherwise (``use_layerwise`` then applies to the
    attention groups' saves: :meth:`KVRegion.use_kv_groups`); blocks split by a PP
    prefill's stages are refused."""
    if cfg.prefill_pp_size > 1:
        raise ConfigError(
            f"prefill_pp_size: this model has {n} KV cache groups (hybrid attention); blocks "
            "split by a PP prefill's stages are for models of one group: set "
            "prefill_pp_size to 1"
        )
    if "load_async" in cfg.model_fields_set and not cfg.load_async:
        raise ConfigError(
            f"load_async is false, but this model has {n} KV cache groups (hybrid attention): "
            "vLLM can recompute a failed load of such a model only when it was asynchronous; "
            "set load_async to true (or leave it out)"
        )
    return cfg.model_copy(update={"load_async": True})


def default_namespace(vllm_config: VllmConfig) -> str:
    """``<model dir's last part>-m<digest of weights, effective config, KV cache dtype>``
    (:mod:`kvray.model_identity`): two checkpoints never share keys by default, and
    byte-identical copies do wherever they are. Logged once per process."""
    from kvray.model_identity import model_identity

    identity = model_identity(vllm_config)
    namespace = identity.namespace(vllm_config.model_config.model)
    if namespace not in _namespaces_logged:
        _namespaces_logged.add(namespace)
        logger.info(
            "kvray: key namespace %s (model digest m%s: weights %s; config and KV cache dtype "
            "%s); set model_namespace to share keys with another checkpoint on purpose",
            namespace,
            identity.digest,
            identity.weights,
            identity.config,
        )
    return namespace


def _served_name(vllm_config: VllmConfig) -> str:
    """The first name vLLM serves the model as."""
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else ""
    return str(name or vllm_config.model_config.model)
