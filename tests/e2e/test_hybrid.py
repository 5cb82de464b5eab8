"""Hybrid-attention models on real vLLM engines: a tiny Gemma 3 (three sliding-window
layers of a 64-token window and one full-attention layer: four KV cache groups under vLLM's
hybrid allocator) pooled per group, exact.

vLLM keeps its hybrid allocator on with KVRayConnector (the engine's KV cache groups equal
those of an engine without a connector); every group's blocks are stored under keys of
their own; a hit loads the full-attention blocks and, of each sliding-window group, only the
blocks vLLM allocates inside the window before the hit's end; greedy outputs equal an engine
without the connector. The pool keeps what the engine drops: a prompt sharing half of a
stored one hits at the half, where vLLM's own prefix cache (which keeps only a prompt's
last window) has nothing.
"""

from __future__ import annotations

import pytest

from .conftest import BLOCK, own_prompts, pool_hit
from .conftest import connector as _connector

pytestmark = pytest.mark.e2e
NAMESPACE = "tiny-hybrid"
WINDOW = 64
"""The tiny Gemma 3's sliding window (tokens)."""
GROUPS = ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]
"""What vLLM's hybrid allocator makes of it: one group per sliding layer, one full."""


@pytest.fixture(scope="module", params=["shared", "staged"])
def placement(request):  # type: ignore[no-untyped-def]
    return request.param


def spec(model: str, placement: str | None, **engine) -> dict:  # type: ignore[type-arg]
    """An engine of the tiny Gemma 3: KVRayConnector in ``placement`` (None: no connector)
    at the connector's defaults but the module's namespace and its drop hook."""
    if placement is None:
        return {"model": model, "connector": None, **engine}
    conn = _connector(kv_placement=placement, model_namespace=NAMESPACE)
    return {
        "model": model,
        "connector": {**conn, "policy": "recompute"},
        "drop_hook": True,
        **engine,
    }


@pytest.fixture(scope="module")
def gemma_reference(engines, tiny_gemma3):  # type: ignore[no-untyped-def]
    """``reference(prompts)``: greedy outputs of the tiny Gemma 3 without any connector."""

    def outputs(prompt_list: list[list[int]]) -> list[list[int]]:
        eng = engines.get(spec(tiny_gemma3, None))
        return eng.generate(prompt_list, max_tokens=16)["outputs"]

    return outputs


def window_blocks_loaded(hit_blocks: int) -> int:
    """Blocks vLLM allocates for a sliding-window group inside an external hit of
    ``hit_blocks`` blocks (the others are its null block): those covering the window
    before the hit's end."""
    end = hit_blocks * BLOCK
    skipped = max(0, end - WINDOW + 1)
    return hit_blocks - skipped // BLOCK


def test_sliding_window_model_pools_every_group_exactly(
    pool, engines, gemma_reference, tiny_gemma3, request, placement
):
    shared = own_prompts(request, 2 * BLOCK, salt="shared")
    p1 = own_prompts(request, 4 * BLOCK + 40, salt="p1", shared=shared)
    p2 = own_prompts(request, 3 * BLOCK + 10, salt="p2", shared=shared)
    p3 = own_prompts(request, 3 * BLOCK + 5, salt="p3")
    want = gemma_reference([p1, p2, p3])
    # The oracle can tell: different contexts give different continuations.
    assert len({tuple(w) for w in want}) == 3, want

    eng = engines.get(spec(tiny_gemma3, placement))
    groups = eng.call(op="kv_cache_groups")["groups"]
    plain = engines.get(spec(tiny_gemma3, None)).call(op="kv_cache_groups")["groups"]
    assert groups == plain == GROUPS  # vLLM's hybrid allocator stays on
    eng = engines.get(spec(tiny_gemma3, placement))
    assert ", kv_groups 4" in eng.log(), eng.log()[-3000:]

    first = eng.generate([p1], max_tokens=16)
    assert first["outputs"] == [want[0]]
    (line,) = first["lines"]
    assert (line["hit_pool"], line["saved"]) == (0, 4), line
    eng.call(op="drain")

    before = pool.stats().total
    again = eng.generate([p1], max_tokens=16)
    eng.call(op="drain")
    after = pool.stats().total
    assert again["outputs"] == [want[0]]
    (line,) = again["lines"]
    pool_hit(line, 4)  # vLLM's own prefix cache is off: only the pool serves it
    # Keys read: the full-attention group's 4 blocks, and of each of the 3 sliding
    # groups only the blocks inside the window before the hit's end.
    assert after.get_keys - before.get_keys == 4 + 3 * window_blocks_loaded(4)
    # The bytes the load wrote are the bytes vLLM computes: every group's blocks before
    # the hit's end that the repeat holds (the full group's 4; each sliding group's window
    # block) equal those of an engine without the connector that computed the prompt.
    loaded = [g[:4] for g in eng.call(op="kv_digests")["groups"]]
    plain_engine = engines.get(spec(tiny_gemma3, None))
    plain_engine.generate([p1], max_tokens=16)
    computed = [g[:4] for g in plain_engine.call(op="kv_digests")["groups"]]
    held = [[i for i, d in enumerate(g) if d is not None] for g in loaded]
    assert held == [[3], [3], [3], [0, 1, 2, 3]], loaded
    assert loaded == computed
    eng = engines.get(spec(tiny_gemma3, placement))

    half = eng.generate([p2], max_tokens=16)
    assert half["outputs"] == [want[1]]
    (line,) = half["lines"]
    pool_hit(line, 2)  # the shared half: its windows were stored, not just p1's last one
    assert half["cached_tokens"] == [2 * BLOCK]


def test_a_failed_load_of_a_hybrid_model_is_recomputed(
    pool, engines, gemma_reference, tiny_gemma3, request, placement
):
    """Every key of the hit removed behind kvray's back before it loads: vLLM takes the
    failed receive of the whole request and recomputes it; the tokens are the same."""
    p1 = own_prompts(request, 3 * BLOCK + 7, salt="p1")
    (want,) = gemma_reference([p1])
    eng = engines.get(spec(tiny_gemma3, placement))
    eng.generate([p1], max_tokens=16)
    eng.call(op="drain")
    out = eng.generate([p1], max_tokens=16, drop=True)
    assert out["outputs"] == [want]
    (line,) = out["lines"]
    assert line["hit_pool"] == 3 and line["failed"] == 3, line


def test_the_pool_keeps_the_windows_the_engines_own_cache_drops(
    engines, gemma_reference, tiny_gemma3, request
):
    """vLLM's own prefix cache (hybrid allocator on, no connector) on the same sequence of
    requests: a prompt sharing half of a stored one gets nothing from it (it kept only the
    stored prompt's last window), where the pool served the half (the test above)."""
    shared = own_prompts(request, 2 * BLOCK, salt="shared")
    p1 = own_prompts(request, 4 * BLOCK + 40, salt="p1", shared=shared)
    p2 = own_prompts(request, 3 * BLOCK + 10, salt="p2", shared=shared)
    eng = engines.get(spec(tiny_gemma3, None, prefix_caching=True))
    first, again, half = (
        eng.generate([p], max_tokens=16, reset_prefix_cache=False) for p in (p1, p1, p2)
    )
    assert [r["outputs"][0] for r in (first, again, half)] == gemma_reference([p1, p1, p2])
    assert again["cached_tokens"][0] > 0  # its own cache works for a whole repeat
    assert half["cached_tokens"] == [0]


STATE_GROUPS = ["MambaSpec"] * 3 + ["FullAttentionSpec"]
"""The tiny Qwen3-Next's groups: one per Gated DeltaNet layer, one full attention."""


def qwen_spec(model: str, placement: str | None) -> dict:  # type: ignore[type-arg]
    """An engine of the tiny Qwen3-Next (bfloat16: vLLM's CPU GDN kernel needs it), with
    vLLM's prefix cache on (its "align" mode keeps a state per block boundary)."""
    return {**spec(model, placement), "dtype": "bfloat16", "prefix_caching": True}


@pytest.fixture(scope="module")
def qwen_block(engines, tiny_qwen3_next) -> int:  # type: ignore[no-untyped-def]
    """The block size vLLM chose for the model (every group's: attention pages are
    grown to hold a state page)."""
    eng = engines.get(qwen_spec(tiny_qwen3_next, None))
    return int(eng.call(op="block_size")["block_size"])


def test_linear_attention_states_are_pooled_at_block_boundaries(
    pool, engines, tiny_qwen3_next, qwen_block, request, placement
):
    """A Gated DeltaNet model: the states vLLM offers at block boundaries are stored beside
    the attention blocks; after vLLM's own cache is emptied the repeat loads the attention
    blocks up to the last stored state and that state, and its tokens equal an engine
    without a connector."""
    bs = qwen_block
    p1 = own_prompts(request, 2 * bs + 40, salt="p1")
    other = own_prompts(request, 2 * bs + 40, salt="other")
    plain = engines.get(qwen_spec(tiny_qwen3_next, None))
    want, want_other = plain.generate([p1, other], max_tokens=16)["outputs"]
    want = [want]
    assert want != [want_other]  # the oracle can tell contexts apart
    groups = plain.call(op="kv_cache_groups")["groups"]
    eng = engines.get(qwen_spec(tiny_qwen3_next, placement))
    assert eng.call(op="kv_cache_groups")["groups"] == groups == STATE_GROUPS
    assert ", kv_groups 4 (state 0,1,2)" in eng.log(), eng.log()[-3000:]
    first = eng.generate([p1], max_tokens=16)
    assert first["outputs"] == want
    # vLLM's own cache emptied before each generate: only the pool can serve the repeat
    again = eng.generate([p1], max_tokens=16)
    assert again["outputs"] == want
    (line,) = again["lines"]
    pool_hit(line, 2)
    assert again["cached_tokens"] == [2 * bs]
    # the hit's keys (attention blocks and states) removed behind kvray's back: vLLM
    # takes the failed receive and recomputes the request, same tokens
    dropped = eng.generate([p1], max_tokens=16, drop=True)
    assert dropped["outputs"] == want
    (line,) = dropped["lines"]
    assert line["hit_pool"] == 2 and line["failed"] == 2, line


def test_pd_roles_with_a_hybrid_model(pool, engines, gemma_reference, tiny_gemma3, request):
    """kvray alone in both PD roles on the tiny Gemma 3: the producer stores every group's
    blocks, the consumer (``consumer_is_to_load``) loads them, same tokens."""
    p = own_prompts(request, 3 * BLOCK + 10, salt="pd")
    (want,) = gemma_reference([p])
    base = spec(tiny_gemma3, "shared")
    producer = {**base, "connector": {**base["connector"], "role": "kv_producer"}}
    out = engines.get(producer).generate([p], max_tokens=16)
    assert out["outputs"] == [want]
    (line,) = out["lines"]
    assert (line["hit_pool"], line["saved"]) == (0, 3), line
    conn = _connector(kv_placement="shared", model_namespace=NAMESPACE, consumer_is_to_load=True)
    consumer = {**base, "connector": {**conn, "policy": "recompute", "role": "kv_consumer"}}
    out = engines.get(consumer).generate([p], max_tokens=16)
    assert out["outputs"] == [want]
    (line,) = out["lines"]
    pool_hit(line, 3)
    assert line["saved"] == 0


def test_layerwise_saves_of_a_hybrid_model_load_in_an_engine_without(
    pool, engines, gemma_reference, tiny_gemma3, request
):
    """``use_layerwise`` on the tiny Gemma 3 (staged: the device path's per-layer copies):
    each KV cache group's blocks are sent as its layer's hook completes; the keys are
    those of an engine without layer-wise transfers (one layer group per KV cache group),
    which loads them: same tokens, every block from the pool."""
    p = own_prompts(request, 3 * BLOCK + 20, salt="layerwise")
    (want,) = gemma_reference([p])
    base = spec(tiny_gemma3, "staged")
    conn = _connector(
        kv_placement="staged", model_namespace=NAMESPACE, use_layerwise=True, layerwise_groups=1
    )
    layerwise = engines.get({**base, "connector": {**conn, "policy": "recompute"}})
    out = layerwise.generate([p], max_tokens=16)
    assert out["outputs"] == [want]
    (line,) = out["lines"]
    assert (line["hit_pool"], line["saved"]) == (0, 3), line
    assert "layer-wise saves of 4 KV cache groups, 1 layer groups each" in layerwise.log()
    out = engines.get(spec(tiny_gemma3, "shared")).generate([p], max_tokens=16)
    assert out["outputs"] == [want]
    pool_hit(out["lines"][0], 3)


@pytest.mark.parametrize("parts", [2, 1])
def test_layerwise_with_several_layers_per_kv_cache_group(
    pool, engines, deep_gemma3, request, parts
):
    """``use_layerwise`` on an eight-layer Gemma 3 (four KV cache groups of two layers):
    with ``layerwise_groups`` 2 each group's layers are stored one per key, each sent as
    its layer's hook completes; with 1 each group goes whole after its last layer. The
    repeat, the engine's own cache emptied, loads every block from the pool: the tokens of
    an engine without a connector."""
    p = own_prompts(request, 3 * BLOCK + 20, salt=f"deep-layerwise-{parts}")
    reference = engines.get(spec(deep_gemma3, None))
    (want,) = reference.generate([p], max_tokens=16)["outputs"]
    conn = _connector(
        kv_placement="staged",
        model_namespace=f"{NAMESPACE}-deep",
        use_layerwise=True,
        layerwise_groups=parts,
    )
    eng = engines.get({**spec(deep_gemma3, "staged"), "connector": {**conn, "policy": "recompute"}})
    assert eng.call(op="kv_cache_groups")["groups"] == GROUPS
    first = eng.generate([p], max_tokens=16)
    assert first["outputs"] == [want]
    assert (first["lines"][0]["hit_pool"], first["lines"][0]["saved"]) == (0, 3), first["lines"]
    assert f"layer-wise saves of 4 KV cache groups, {parts} layer groups each" in eng.log()
    again = eng.generate([p], max_tokens=16)
    assert again["outputs"] == [want]
    pool_hit(again["lines"][0], 3)
