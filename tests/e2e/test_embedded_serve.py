"""The embedded default on real vLLM OpenAI servers: with nothing running and no Ray
address configured, the first server's engine starts a node-local Ray and kvray pool (one
log line says so), a second server's engine joins it and loads what the first stored, and
the pool stops once both are gone. With an address configured, a cluster that does not
answer and a pool that is not there are clear errors that end the server quickly.

The first server runs as the plain ``vllm serve`` with the three connector keys does:
every setting at its default, vLLM's ``kv_load_failure_policy`` too (``fail``). Its
repeat is sent as soon as the first answer is back (its saves may still be in flight) and
must load every stored block. A load that fails under ``fail`` (the blocks removed from
the backend behind the node's index: "gone at load") ends the request with the HTTP
response docs/vllm.md describes; the second server, under ``recompute``, answers the same
failure with the tokens of an engine without kvray."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from kvray.testing.server import Server, vllm_serve_cmd
from tests.conftest import LOOKUP_TIMEOUT_MS

from .conftest import prompts, psm_left_behind, remove_behind_the_index

pytestmark = pytest.mark.e2e

SERVER_S = 240
"""Per server, so that both fit in the test's timeout and a server hung at startup (seen
once in CI: the second server's worker printed nothing for 7 minutes) is reported with its
processes' stacks (Server.dump_stacks) rather than cut off by pytest's timeout."""

FAIL_S = 150
"""An engine that cannot reach its pool must end well before Ray's ~2 minutes of retries
plus startup; vLLM's own startup to the connector takes ~20-40 s on 2 cores."""


FAILED_LOAD_RESPONSE = (
    500,
    {"error": {"message": "Internal server error", "type": "InternalServerError",
               "param": None, "code": 500}},
)  # fmt: skip
"""vLLM's answer to a completion whose load from the pool failed under ``fail``, verbatim
as docs/vllm.md ("Load failures") quotes it."""


def _serve(
    name: str,
    model: str,
    env: dict[str, str],
    tmp: Path,
    extra: dict,
    *,
    defaults: bool = False,
    policy: str | None = None,
) -> Server:
    """``defaults``: the connector's own settings but ``extra`` (else the suite's
    lookup timeout and synchronous loads); ``policy``: vLLM's ``kv_load_failure_policy``
    (None: the key left out, as the plain command does)."""
    from kvray.servers.process import free_port

    port = free_port()
    ours = {} if defaults else {"load_async": False, "lookup_timeout_ms": LOOKUP_TIMEOUT_MS}
    transfer = {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {**ours, **extra},
    }
    if policy is not None:
        transfer["kv_load_failure_policy"] = policy
    cmd = vllm_serve_cmd(model, port, "--kv-transfer-config", json.dumps(transfer))
    return Server(name, cmd, env, tmp / f"{name}.log", port=port)


def _post(url: str, model: str, prompt: list[int]) -> tuple[int, dict]:
    """A greedy completion of 4 tokens: the HTTP status and the JSON body."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    status, body = _post(url, model, prompt)
    assert status == 200, (status, body)
    return list(body["choices"][0]["token_ids"])


def _base_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        KVRAY_RUN_DIR=str(tmp / "run"),
        KVRAY_EMBEDDED_LINGER_S="1",
    )
    return env


@pytest.mark.timeout(600)  # two vLLM servers start one after the other (~2 min when idle)
def test_vllm_serve_with_nothing_running_uses_an_embedded_pool(tiny_model, tmp_path, reference):
    from kvray.embedded import Files, read_state

    env = _base_env(tmp_path)
    pool_config = tmp_path / "pool.json"
    pool_config.write_text(
        json.dumps({"mooncake": {"global_segment_size": "256MB", "local_buffer_size": "32MB"}})
    )
    extra = {"pool_config": str(pool_config)}
    files = Files(tmp_path / "run" / "kvray.kvray")
    psm_before = set(glob.glob("/dev/shm/psm_*"))
    # a: the connector's defaults (only the pool's sizes set) and vLLM's load-failure
    # policy, as `vllm serve` with the three connector keys runs; b: the suite's settings
    # under `recompute`.
    a = _serve("embedded-a", tiny_model, env, tmp_path, extra, defaults=True)
    b = None
    keeper = None
    try:
        a.wait_healthy(time.monotonic() + SERVER_S)
        assert "started the embedded kvray pool 'kvray'" in a.tail(10**8), a.tail()
        state = read_state(files)
        assert state is not None, a.tail()
        keeper = psutil.Process(state["pid"])
        # vLLM's CPU worker that started the pool pins itself to its cores; the pool must
        # not inherit that (its actors starved on the core the worker busy-polls, and no
        # save was stored while the engine ran).
        assert set(keeper.cpu_affinity()) == os.sched_getaffinity(0)
        # Nor its processes (Ray's, the actors', the master): vLLM's worker runs with
        # OpenMP's binding in its environment, and libgomp (preloaded) pinned each
        # program started with it to the worker's first core as it loaded.
        pinned = {}
        for proc in keeper.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if set(proc.cpu_affinity()) != os.sched_getaffinity(0):
                    pinned[proc.pid] = (proc.name(), proc.cpu_affinity())
        assert not pinned, pinned
        # vLLM's default policy is said once at startup, with the key that changes it.
        assert "kv_load_failure_policy is 'fail'" in a.tail(10**8), a.tail()
        p = prompts(7, 3 * 128 + 5)
        expected = reference([p])[0][:4]  # greedy: an engine without kvray's first 4
        first = _complete(a.url(), tiny_model, p)
        assert first == expected
        # The same prompt again at once (vLLM's own prefix cache is off; the first
        # request's saves may still be in flight, which its lookup waits for): a pool hit.
        assert _complete(a.url(), tiny_model, p) == first
        a.wait_request_counts(2)
        lines = a.request_lines()
        assert [(x.saved, x.hit_pool, x.loaded, x.miss) for x in lines] == [
            (3, 0, 0, "not_stored"),
            (0, 3, 3, ""),
        ], a.tail()
        # Gone at load under `fail`: the request ends with vLLM's error response.
        assert remove_behind_the_index(state["server"]) >= 3
        assert _post(a.url(), tiny_model, p) == FAILED_LOAD_RESPONSE, a.tail()
        # The failed load told the index they are gone: the next one computes and stores.
        assert _complete(a.url(), tiny_model, p) == first
        a.wait_request_counts(4)
        last = a.request_lines()[3]
        assert (last.hit_pool, last.saved) == (0, 3), a.tail()

        # a paused while b starts: in CI (twice) b's worker, importing torch next to a's
        # idle engine, made no progress for minutes (its stacks: in dlopen of torch._C).
        # Nothing of a takes part in b joining the pool (the keeper's).
        a.pause()
        b = _serve("embedded-b", tiny_model, env, tmp_path, extra, policy="recompute")
        try:
            b.wait_healthy(time.monotonic() + SERVER_S)
        finally:
            a.resume()
        assert f"joined (keeper pid {keeper.pid}) the embedded kvray pool" in b.tail(10**8)
        again = _complete(b.url(), tiny_model, p)  # b computes nothing of it: the pool has it
        assert again == first
        assert [(x["hit_pool"], x["loaded"], x["failed"]) for x in b.wait_request_counts(1)] == [
            (3, 3, 0)
        ]

        a.stop()
        a = None
        time.sleep(3)  # > linger: the pool stays for b
        assert keeper.is_running(), files.log.read_text()[-3000:]
        assert _complete(b.url(), tiny_model, p) == first
        assert "kv_load_failure_policy is 'fail'" not in b.tail(10**8)
        # Gone at load under `recompute`: vLLM recomputes, the tokens are an engine's
        # without kvray.
        assert remove_behind_the_index(state["server"]) >= 3
        assert _complete(b.url(), tiny_model, p) == expected
        counts = b.wait_request_counts(3)
        assert (counts[2]["hit_pool"], counts[2]["failed"]) == (3, 3), b.tail()
        b.stop()
        b = None
        deadline = time.monotonic() + 90
        while keeper.is_running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not keeper.is_running(), files.log.read_text()[-3000:]
        assert not files.state.exists()
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
        if keeper is not None and keeper.is_running():
            keeper.terminate()
            keeper.wait(60)
        # A server stopped by force (this test timed out: its finally stops them) cannot
        # unlink vLLM's psm_* queues: those no live process maps any more are removed.
        for path in psm_left_behind(psm_before):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.mark.timeout(FAIL_S + 150)  # the wait below, then the server's stop
@pytest.mark.parametrize("case", ["dead cluster", "no pool"])
def test_vllm_serve_without_its_pool_fails_fast_naming_the_fix(
    case, ray_cluster, tiny_model, tmp_path
):
    from kvray.servers.process import free_port

    env = _base_env(tmp_path)
    if case == "dead cluster":
        env["RAY_ADDRESS"] = f"127.0.0.1:{free_port()}"
        expect = ["does not answer", "RAY_ADDRESS", "kvray up"]
    else:
        env["RAY_ADDRESS"] = ray_cluster
        expect = ["no kvray pool 'absent'", "kvray up"]
    server = _serve("nopool", tiny_model, env, tmp_path, {"pool_name": "absent"})
    try:
        t0 = time.monotonic()
        while server.proc.poll() is None and time.monotonic() - t0 < FAIL_S:
            time.sleep(0.5)
        log = server.tail(10**8)
        assert server.proc.poll() not in (None, 0), f"still up or exited 0 after {FAIL_S} s"
        for text in expect:
            assert text in log, log[-4000:]
        assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*.json"))
    finally:
        server.stop()
