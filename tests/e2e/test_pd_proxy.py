"""PD disaggregation end to end, as deployed: two real vLLM OpenAI servers (tiny model, CPU)
started by ``scripts/pd_prefill.sh`` and ``scripts/pd_decode.sh`` with the shipped
MultiConnector configs (KVRayConnector first, vLLM's ExampleConnector as the P->D connector
that runs on CPU), behind ``scripts/pd_proxy.sh`` (``python -m kvray.proxy``), over a
real kvray pool on the session's Ray cluster.

A request through the proxy is prefilled (one token) on the prefill server, which stores
its blocks; the decode server loads them from the pool and generates. Outputs equal the
single-engine run without any connector (the ``baseline`` fixture)."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvray.misses import LOOKUP_REASONS, REASONS
from kvray.testing.server import Server
from tests.conftest import LOOKUP_TIMEOUT_MS

from .conftest import (
    P1,
    P2,
    P3,
    STARTUP_S,
    assert_no_region_left,
    logged_key_space,
    psm_left_behind,
    start_pool,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # the module's setup starts 2 servers

ROOT = Path(__file__).parents[2]


def _json_post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    with urllib.request.urlopen(_json_post(url, body), timeout=timeout) as r:
        return dict(json.loads(r.read()))


def post_stream(url: str, body: dict, timeout: float = 120.0) -> list[dict]:
    events = []
    with urllib.request.urlopen(_json_post(url, body), timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                events.append({"done": True})
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


def config_copy(name: str, tmp: Path) -> Path:
    """A shipped config with the ExampleConnector's directory moved under ``tmp``, and a
    longer ``pd_wait_ms`` and ``lookup_timeout_ms``: on a shared 2-core machine vLLM's
    busy-polling workers can slow the prefill a decode waits for by seconds, and a pool
    lookup past 200 ms is a miss that hands the blocks to vLLM's ExampleConnector, which
    then reads files another server is still writing (seen: its worker died of a shape
    mismatch). The test is about what is loaded from the pool."""
    cfg = json.loads((ROOT / "configs" / name).read_text())
    for child in cfg["kv_connector_extra_config"]["connectors"]:
        extra = child["kv_connector_extra_config"]
        if child["kv_connector"] == "ExampleConnector":
            extra["shared_storage_path"] = str(tmp / "p2d-kv")
        elif child["kv_connector"] == "KVRayConnector":
            extra["lookup_timeout_ms"] = LOOKUP_TIMEOUT_MS
            if "pd_wait_ms" in extra:
                extra["pd_wait_ms"] = 30000
    out = tmp / name
    out.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def pd(ray_cluster, tiny_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    from kvray.servers.process import free_port

    pool = start_pool("kvray", 1, "256MB")  # the configs' pool_name
    tmp = tmp_path_factory.mktemp("pd")
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster,
        "PYTHON": sys.executable,
        "HOST": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    vllm_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                 "--no-enable-prefix-caching", "--seed", "0"]  # fmt: skip
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    psm_before = set(glob.glob("/dev/shm/psm_*"))  # vLLM's own shared memory
    servers: list[Server] = []
    try:
        for role in ("prefill", "decode"):
            cfg = config_copy(f"pd-{role}-multi.json", tmp)
            servers.append(
                Server(
                    role,
                    [str(ROOT / "scripts" / f"pd_{role}.sh"), tiny_model, str(ports[role]),
                     *vllm_args],
                    {**env, "KV_CONFIG": str(cfg)},
                    tmp / f"{role}.log",
                    port=ports[role],
                )
            )  # fmt: skip
        deadline = time.monotonic() + STARTUP_S
        for s in servers:
            s.wait_healthy(deadline)
        proxy = Server(
            "proxy",
            [str(ROOT / "scripts" / "pd_proxy.sh"), str(ports["proxy"]), "--health-interval", "1"],
            {**env, "PREFILL": f"127.0.0.1:{ports['prefill']}",
             "DECODE": f"127.0.0.1:{ports['decode']}"},
            tmp / "proxy.log",
            port=ports["proxy"],
        )  # fmt: skip
        servers.append(proxy)
        proxy.wait_healthy(time.monotonic() + 60)
        yield SimpleNamespace(
            url={k: f"http://127.0.0.1:{p}" for k, p in ports.items()},
            prefill=servers[0],
            decode=servers[1],
            proxy=proxy,
            model=tiny_model,
            p2d_dir=tmp / "p2d-kv",
        )
    finally:
        for s in reversed(servers):
            s.stop()
        pool.shutdown()
    assert_no_region_left("stopped servers")
    psm_left = psm_left_behind(psm_before)
    assert not psm_left, f"stopped servers left vLLM shared memory behind: {sorted(psm_left)}"


def completion(pd, prompt: list[int], **extra) -> dict:  # type: ignore[no-untyped-def]
    return {"model": pd.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "return_token_ids": True, **extra}  # fmt: skip


def test_request_through_proxy_is_prefilled_stored_and_loaded_by_decode(pd, baseline):
    n_pre, n_dec = len(pd.prefill.request_counts()), len(pd.decode.request_counts())
    out = post(f"{pd.url['proxy']}/v1/completions", completion(pd, P1))
    assert out["choices"][0]["token_ids"] == baseline["P1"]
    (pre,) = pd.prefill.wait_request_counts(n_pre + 1)[n_pre:]
    (dec,) = pd.decode.wait_request_counts(n_dec + 1)[n_dec:]
    # P1: 4 full blocks + a partial one. The prefill stores the 4; the decode loads all 4
    # from the pool (KVRayConnector is MultiConnector's first child) and stores nothing.
    assert (pre["hit_pool"], pre["saved"]) == (0, 4), pre
    assert (dec["hit_pool"], dec["loaded"], dec["failed"], dec["saved"]) == (4, 4, 0, 0), dec
    assert pd.p2d_dir.is_dir(), "the P->D connector next to KVRayConnector ran too"

    # The same prompt again: now the prefill itself is served by the pool.
    out = post(f"{pd.url['proxy']}/v1/completions", completion(pd, P1))
    assert out["choices"][0]["token_ids"] == baseline["P1"]
    (pre,) = pd.prefill.wait_request_counts(n_pre + 2)[n_pre + 1 :]
    assert (pre["hit_pool"], pre["loaded"], pre["saved"]) == (4, 4, 0), pre


def test_streaming_through_proxy(pd, baseline):
    n_dec = len(pd.decode.request_counts())
    events = post_stream(f"{pd.url['proxy']}/v1/completions", completion(pd, P2, stream=True))
    assert events[-1] == {"done": True}
    tokens = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert tokens == baseline["P2"]
    (dec,) = pd.decode.wait_request_counts(n_dec + 1)[n_dec:]
    # P2 shares P1's first 2 blocks; its prefill stored the third: all 3 come from the pool.
    assert (dec["hit_pool"], dec["loaded"]) == (3, 3), dec


def test_chat_completion_through_proxy(pd):
    n_pre, n_dec = len(pd.prefill.request_counts()), len(pd.decode.request_counts())
    words = " ".join(f"w{i % 97} item{i}" for i in range(300))  # several blocks of tokens
    body = {"model": pd.model, "messages": [{"role": "user", "content": words}],
            "max_completion_tokens": 6, "temperature": 0.0}  # fmt: skip
    out = post(f"{pd.url['proxy']}/v1/chat/completions", body)
    assert out["object"] == "chat.completion"
    assert out["usage"]["completion_tokens"] == 6
    (pre,) = pd.prefill.wait_request_counts(n_pre + 1)[n_pre:]
    (dec,) = pd.decode.wait_request_counts(n_dec + 1)[n_dec:]
    assert pre["saved"] >= 2 and dec["hit_pool"] == dec["loaded"] == pre["saved"], (pre, dec)
    direct = post(f"{pd.url['decode']}/v1/chat/completions", body)
    assert direct["choices"][0]["message"] == out["choices"][0]["message"]


def test_decode_waits_for_the_prefill_blocks_it_was_told_about(pd, baseline):
    """The decode request arrives first, carrying the kv_transfer_params a prefill answer
    would give; it waits (pd_wait_ms) until the prefill has stored them, then loads them."""
    logged = logged_key_space(pd.decode.log.read_text(errors="replace"))
    assert logged.namespace.startswith(f"{Path(pd.model).name}-m")  # the model digest
    space = [logged.namespace, "float32-b128-h4x64", 1, 1]
    told = {"kvray": {"pool": "kvray", "space": space, "blocks": 3}}
    n_dec = len(pd.decode.request_counts())
    answer: dict = {}

    def decode() -> None:
        answer.update(
            post(f"{pd.url['decode']}/v1/completions", completion(pd, P3, kv_transfer_params=told))
        )

    t = threading.Thread(target=decode)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "the decode request did not wait for its prefill's blocks"
    pre = post(
        f"{pd.url['prefill']}/v1/completions",
        completion(pd, P3, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    params = pre["kv_transfer_params"]["kvray"]
    # What a prefill answer tells the decode: the same, plus its hash domain (a decode of
    # another domain would not wait: this one did, and loads below).
    assert {k: v for k, v in params.items() if k != "hash"} == told["kvray"], params
    assert re.fullmatch(r"[0-9a-f]{16}", params["hash"]), params
    t.join(60)
    assert answer["choices"][0]["token_ids"] == baseline["P3"]
    (dec,) = pd.decode.wait_request_counts(n_dec + 1)[n_dec:]
    assert (dec["hit_pool"], dec["loaded"]) == (3, 3), dec


def test_proxy_health_reports_both_instances(pd):
    with urllib.request.urlopen(f"{pd.url['proxy']}/health", timeout=5) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok"
    (pre,), (dec,) = health["prefill"], health["decode"]
    assert pre["healthy"] and dec["healthy"]
    # every proxied request went to both; none is still in flight
    assert pre["served"] == dec["served"] and pre["in_flight"] == dec["in_flight"] == 0


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a counter over its label sets (those with ``labels``) on a vLLM server's
    /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if (line.startswith(name + "{") or line.startswith(name + " "))
              and all(w in line for w in want)]  # fmt: skip
    assert values, f"{name} {labels} not on {url}/metrics"
    return sum(values)


def test_connector_counters_on_vllm_metrics(pd, baseline):
    out = post(f"{pd.url['proxy']}/v1/completions", completion(pd, P1))
    assert out["choices"][0]["token_ids"] == baseline["P1"]
    deadline = time.monotonic() + 30  # stats reach the API server with the next steps
    while metric(pd.url["decode"], "vllm:kvray_loaded_blocks_total") < 4:
        assert time.monotonic() < deadline, "decode's loaded blocks never reached /metrics"
        time.sleep(0.5)
    stored = metric(pd.url["prefill"], "vllm:kvray_saved_blocks_total")
    served = metric(pd.url["prefill"], "vllm:kvray_loaded_blocks_total")
    assert stored + served >= 4
    assert metric(pd.url["decode"], "vllm:kvray_saved_blocks_total") == 0
    # Every block a lookup missed is counted under exactly one reason.
    for url in pd.url["prefill"], pd.url["decode"]:
        missed = metric(url, "vllm:kvray_lookup_blocks_total") - metric(
            url, "vllm:kvray_lookup_hit_blocks_total"
        )
        by_reason = {r: metric(url, "vllm:kvray_missed_blocks_total", reason=r) for r in REASONS}
        assert sum(v for r, v in by_reason.items() if r in LOOKUP_REASONS) == missed, by_reason
    assert metric(pd.url["prefill"], "vllm:kvray_missed_blocks_total", reason="not_stored") >= 4
