"""Latent attention (MLA) on real vLLM engines: a tiny DeepSeek-V2 (one ``MLAAttentionSpec``
group, a 576-value latent per token, bfloat16) pooled exactly.

At TP 1 its blocks are stored and a repeat loads them from the pool: the loaded blocks'
bytes equal those an engine without the connector computed, and the tokens are that
engine's. At TP 2 the latent is the same on every TP rank: one copy per block is stored (TP
rank 0's key, by rank 0 alone) and every TP rank loads it; the tokens are those of TP 2
without the connector.

"The tokens are that engine's" is vLLM's own test of a prefill over cached context
(``check_logprobs_close``): equal up to the first token where they differ, and there each
run's token is in the other's top two, a near tie. A run that loads its prefix computes
the prompt's tail over the cached context (vLLM's CPU MLA gathers it and merges the two
attention partials), a run without computes the whole prompt at once; the sums differ in
their last bits, which flips a greedy choice only where two tokens tie within them. Measured
with the tiny model on an AVX-512 host without AMX: the TP 1 prompt's ninth token has 591 at
a log-probability of -5.892 and 47 at -5.900, and the loaded run took 47, in bfloat16 and
in float32 alike, its three loaded blocks bit-identical to the computed ones.
"""

from __future__ import annotations

import pytest

from kvray.connector.log_lines import request_counts

from .conftest import connector as _connector
from .conftest import own_prompts, pool_hit, run_engine, start_pool

pytestmark = pytest.mark.e2e
NAMESPACE = "tiny-mla"
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""vLLM binds each CPU worker's threads; with one NUMA node the binding must be given."""


NEAR_TIE = 0.1
"""Log-probability apart (nats) within which two tokens tie for :func:`same_tokens`: a few
bfloat16 steps at the tiny model's logits (about 6: a step of 1/32)."""


def same_tokens(want: dict, got: dict) -> None:  # type: ignore[type-arg]
    """``got``'s tokens are ``want``'s (``generate`` answers with ``logprobs`` 2): equal,
    or equal up to a position where the two tokens are each in the other's top two and
    ``want`` has them within :data:`NEAR_TIE`; nothing after it is compared."""
    (a,), (b,) = want["outputs"], got["outputs"]
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if at is None:
        return
    top_a = dict(want["logprobs"][0][at][:2])
    top_b = dict(got["logprobs"][0][at][:2])
    assert b[at] in top_a and a[at] in top_b, f"token {at}: {a} against {b}, {top_a} {top_b}"
    assert abs(top_a[a[at]] - top_a[b[at]]) <= NEAR_TIE, f"token {at} is no tie: {top_a}"


def spec(model: str, conn: dict | None, **engine) -> dict:  # type: ignore[type-arg]
    """An engine of the tiny DeepSeek-V2 in bfloat16 (vLLM's AMX MLA kernels need it):
    KVRayConnector at ``conn`` (None: no connector)."""
    return {"model": model, "connector": conn, "dtype": "bfloat16", **engine}


@pytest.fixture(scope="module")
def mla_block(engines, tiny_mla) -> int:  # type: ignore[no-untyped-def]
    """The block size vLLM chose for the model (16 with its reference CPU MLA kernel, 128
    with AMX), and its one KV cache group is MLA's."""
    eng = engines.get(spec(tiny_mla, None))
    assert eng.call(op="kv_cache_groups")["groups"] == ["MLAAttentionSpec"]
    return int(eng.call(op="block_size")["block_size"])


def test_mla_blocks_are_pooled_exactly(pool, engines, tiny_mla, mla_block, request):
    bs = mla_block
    p1 = own_prompts(request, 3 * bs + bs // 2, salt="p1")  # 3 full blocks and a partial one
    other = own_prompts(request, 3 * bs + bs // 2, salt="other")
    plain = engines.get(spec(tiny_mla, None))
    # Each prompt alone, as the connector's engine runs it: without AMX vLLM's reference
    # MLA kernel in bfloat16 can pick other tokens for a prompt batched with another.
    (want_other,) = plain.generate([other], max_tokens=16)["outputs"]
    oracle = plain.generate([p1], max_tokens=16, logprobs=2)
    computed = plain.call(op="kv_digests")["groups"]
    (want,) = oracle["outputs"]
    assert want != want_other  # the oracle can tell contexts apart

    conn = _connector(model_namespace=NAMESPACE)
    eng = engines.get(spec(tiny_mla, {**conn, "policy": "recompute"}))
    first = eng.generate([p1], max_tokens=16)
    assert first["outputs"] == [want]
    (line,) = first["lines"]
    assert (line["hit_pool"], line["saved"]) == (0, 3), line
    eng.call(op="drain")

    before = pool.stats().total
    again = eng.generate([p1], max_tokens=16, logprobs=2)
    after = pool.stats().total
    loaded = eng.call(op="kv_digests")["groups"]
    assert [g[:3] for g in loaded] == [g[:3] for g in computed]  # the pool's bytes, exact
    same_tokens(oracle, again)
    (line,) = again["lines"]
    pool_hit(line, 3)  # vLLM's own prefix cache is off: only the pool serves it
    assert again["cached_tokens"] == [3 * bs]
    assert after.get_keys - before.get_keys == 3


@pytest.fixture(scope="module")
def pool2(ray_cluster):  # type: ignore[no-untyped-def]
    p = start_pool("e2e-mla-tp", 2, "128MB")
    yield p
    p.shutdown()


@pytest.mark.timeout(600)  # two-worker engines start in minutes on a loaded 2-core host
def test_tp2_stores_one_copy_of_the_latent_and_every_rank_loads_it(
    pool2, engines, ray_cluster, tiny_mla, mla_block, request, tmp_path
):
    """At TP 2 the keys line says one copy across TP; rank 0's BackendClient alone stores
    the blocks, both ranks load them, and the tokens equal TP 2 without a connector."""
    engines.close()  # the TP 2 engines run alone (two workers each on 2 cores)
    p1 = own_prompts(request, 3 * mla_block + mla_block // 2, salt="p1")
    runs = {"tp": 2, "env": TP_ENV, "max_tokens": 16, "runs": [[p1], [p1]], "logprobs": 2}
    base = run_engine(ray_cluster, tmp_path, "mla-tp-base", {**spec(tiny_mla, None), **runs})
    want = base["runs"][0]
    assert base["runs"][1]["outputs"] == want["outputs"]

    before = [r.stats for r in pool2.stats().ranks]
    conn = _connector("e2e-mla-tp", model_namespace=NAMESPACE)
    out = run_engine(
        ray_cluster, tmp_path, "mla-tp",
        {**spec(tiny_mla, conn), **runs, "wait_saves_for": "e2e-mla-tp"},
    )  # fmt: skip
    after = [r.stats for r in pool2.stats().ranks]
    assert ", one copy across TP" in out["log"], out["log"][-3000:]
    assert out["runs"][0]["outputs"] == want["outputs"]  # computed, as the base
    same_tokens(want, out["runs"][1])  # loaded
    first, second = request_counts(out["log"])[:2]
    assert (first["hit_pool"], first["saved"]) == (0, 3), first
    assert (second["hit_local"], second["hit_pool"], second["loaded"], second["failed"]) == (
        0, 3, 3, 0,
    ), second  # fmt: skip
    assert [a.put_keys - b.put_keys for a, b in zip(after, before, strict=True)] == [3, 0]
    assert [a.get_keys - b.get_keys for a, b in zip(after, before, strict=True)] == [3, 3]
