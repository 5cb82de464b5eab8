"""The scripts that run vLLM engines, each in its smoke mode (``--smoke``: the full run
with small arguments) as a user runs it: it exits 0, prints its table, and writes JSON
with the keys of the full run (``tests/script_smoke.py``). Each starts and stops its own
local Ray cluster, pool and engines; most of their time is starting those (the engines
and servers forked from a fork server that imported vLLM once, ``KVRAY_ENGINE_FORK=1``,
and started together).

The demo's run must also end quietly: no traceback, no stack dump of a SIGTERMed process
(Ray's handler in a vLLM engine process, before kvray.ray_env kept the engine's own), no
resource-tracker warning about leaked shared memory, no process force-killed by vLLM.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import LOOKUP_TIMEOUT_MS
from tests.script_smoke import committed_keys, json_keys, run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def prefill_model(tmp_path_factory) -> str:
    """The model of the demo and of the TTFT benchmarks, built once for the session."""
    from kvray.testing.tiny_model import build_prefill_bound_llama

    return str(build_prefill_bound_llama(tmp_path_factory.mktemp("prefill-model") / "llama"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("script", "result", "table", "extra"),
    [
        ("bench_ttft.py", "bench_ttft.json", "kvray ms", ()),
        (
            "bench_ttft.py",
            "bench_ttft_gemma3.json",
            "kvray-hma-off loaded",
            ("--family", "gemma3", "--configs", "full,local,kvray,hmaoff"),
        ),
        ("bench_layerwise.py", "bench_layerwise.json", "lw shared", ()),
        ("ttft_breakdown.py", "ttft_breakdown.json", "excess", ()),
    ],
)
def test_engine_benchmark_smoke(tmp_path, prefill_model, script, result, table, extra):
    """A TTFT benchmark's smoke run (every configuration's engine, short inputs, 3 reps;
    the script itself fails a run whose requests did not load what they should): its
    JSON has the keys of the committed full run."""
    out = tmp_path / result
    args = ("--model-dir", prefill_model, "--json", str(out), *extra)
    res = run_script(script, *args, timeout_s=580)
    assert table in res.stdout
    assert json_keys(out) == committed_keys(result)


@pytest.mark.timeout(600)
def test_bench_serve_smoke(tmp_path):
    """The peer's and kvray's OpenAI servers, ``vllm bench serve`` twice each on 2
    prompts; run 2 hits every block. The lookup timeout is the engine tests' (the default
    200 ms is a miss beside the other test worker: CI saw 2 of 4 blocks)."""
    out = tmp_path / "bench_serve.json"
    res = run_script(
        "bench_serve.py", "--model-dir", str(tmp_path / "model"), "--json", str(out),
        "--connector", json.dumps({"lookup_timeout_ms": LOOKUP_TIMEOUT_MS}), timeout_s=580,
    )  # fmt: skip
    assert "run 2 mean" in res.stdout
    assert json_keys(out) == committed_keys("bench_serve.json")
    result = json.loads(out.read_text())
    kvray = next(row for row in result["table"] if row["mode"] == "kvray")
    assert kvray["run2_blocks"] > 0 and kvray["run2_hits"] == kvray["run2_blocks"]
    # Every request's TTFT is recorded, not only the run's percentiles.
    assert all(len(run["ttfts_ms"]) == 2 for run in result["runs"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workload", ["chat", "ucm", "prefix_repetition"])
def test_bench_workloads_smoke(tmp_path, workload):
    """Each field workload against vLLM's prefix cache and kvray below it (one rep, a few
    short prompts): every request streamed its tokens (the script fails a short one), and
    the JSON has the keys of the committed full run."""
    out = tmp_path / f"bench_workloads_{workload}.json"
    res = run_script(
        "bench_workloads.py", "--workload", workload, "--model-dir", str(tmp_path / "model"),
        "--json", str(out), "--connector", json.dumps({"lookup_timeout_ms": LOOKUP_TIMEOUT_MS}),
        timeout_s=580,
    )  # fmt: skip
    assert "p50/local" in res.stdout
    assert json_keys(out) == committed_keys(out.name)
    runs = json.loads(out.read_text())["runs"]
    assert {r["arm"] for r in runs} == {"local", "kvray-pc"}
    assert all(req["ttft_ms"] > 0 and req["e2e_ms"] >= req["ttft_ms"] for r in runs
               for req in r["requests"])  # fmt: skip


@pytest.mark.timeout(600)
def test_bench_route_smoke(tmp_path, prefill_model):
    """Two instances per arm behind kvray's proxy: round-robin on their own caches, on the
    pool, and the prefix router on the engines' and the pool's KV events. Every request
    answered; the router sent the repeats of a prefix where it was cached."""
    out = tmp_path / "bench_route.json"
    res = run_script("bench_route.py", "--model-dir", prefill_model, "--json", str(out),
                     timeout_s=580)  # fmt: skip
    assert "p50 / local-rr" in res.stdout
    assert json_keys(out) == committed_keys("bench_route.json")
    runs = json.loads(out.read_text())["runs"]
    router = next(r for r in runs if r["arm"] == "pool-router")
    assert sum(router["served"]) == len(router["ttfts_ms"]) == 8
    # 4 prefixes asked twice: the second askings go where the first left the prefix (at
    # least half of them: beside the other test worker an engine's events can trail
    # the next request; CI saw 3 of 4)
    assert router["router"]["routed_to_cache"] >= 2, router["router"]
    assert router["router"]["events"]["batches"] + router["router"]["events"]["replayed"] > 0


DEMO_KEYS = {
    "meta", "passes",
    *(f"meta.{k}" for k in ("commit", "machine", "requests", "prefix_tokens", "groups",
                            "suffix_tokens")),
    *(f"passes[].{k}" for k in ("pass", "ttft_p50_s", "ttft_mean_s", "ttfts_s",
                                "pool_hit_rate", "blocks_loaded", "blocks_stored")),
}  # fmt: skip
"""What scripts/demo_vllm.py writes (the full run's keys: its arguments only size the
workload)."""

NOISE = {
    "Traceback": "a traceback",
    "SIGTERM received": "a SIGTERMed process's stack dump",
    "leaked shared_memory": "the resource tracker's leaked shared memory warning",
    "force killing": "vLLM force-killing a process that did not exit in time",
}


@pytest.mark.timeout(420)
def test_demo_vllm_smoke_ends_quietly(tmp_path, prefill_model):
    """``make demo``'s script, smoke-sized: pass 2 loads every prefix block from the pool,
    and the run ends without noise."""
    out = tmp_path / "demo.json"
    res = run_script("demo_vllm.py", "--model-dir", prefill_model, "--json", str(out),
                     timeout_s=400)  # fmt: skip
    assert "pool hit rate" in res.stdout
    assert json_keys(out) == DEMO_KEYS
    first, second = json.loads(out.read_text())["passes"]
    assert first["blocks_stored"] > 0 and second["blocks_stored"] == 0
    assert second["pool_hit_rate"] == 1.0 and second["blocks_loaded"] > 0
    found = [what for text, what in NOISE.items() if text in res.stdout + res.stderr]
    shutdown = "\n".join(line for line in res.stdout.splitlines() if "[shutdown]" in line)
    assert not found, (
        f"the demo's run printed {found}:\n{res.stderr[-6000:]}\n--- vLLM's shutdown\n{shutdown}"
    )
