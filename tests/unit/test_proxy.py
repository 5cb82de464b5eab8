"""The PD proxy (kvray/proxy/server.py) over real HTTP on loopback, against FAKE upstream OpenAI
servers (small aiohttp apps that record what they receive): the proxy's job is the
routing, which these check. The e2e PD test runs it in front of real vLLM engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvray.proxy.server import PREFILL_PARAMS, Instance, Pool, Proxy, build, instances, parse_args

STATE = web.AppKey("state", dict)


def fake_openai(name: str, log: list, *, healthy: bool = True) -> web.Application:
    """A FAKE vLLM OpenAI server: records requests, answers or streams a fixed text."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        log.append((name, request.path, body))
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for word in ("a", "b", "c"):
                await resp.write(f"data: {json.dumps({'text': word, 'by': name})}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        answer = {"by": name, "choices": [{"text": "xyz"}]}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            # as a prefill instance's connectors do: where the decode finds the KV
            answer["kv_transfer_params"] = {"kvray": {"blocks": 3, "by": name}}
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if state["healthy"] else 503)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "by": name}]})

    state = {"healthy": healthy}
    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


async def started(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def setup():
    log: list = []
    apps = {n: fake_openai(n, log) for n in ("p0", "d0", "d1")}
    servers = {n: await started(a) for n, a in apps.items()}

    def inst(n: str) -> Instance:
        return Instance("127.0.0.1", servers[n].port)

    async def proxy(policy: str = "round_robin") -> TestClient:
        p = Proxy(
            Pool("prefill", [inst("p0")], policy),
            Pool("decode", [inst("d0"), inst("d1")], policy),
            health_interval_s=0.1,
        )
        client = TestClient(TestServer(p.app(), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    clients: list[TestClient] = []
    yield proxy, log, apps
    for c in clients:
        await c.close()
    for s in servers.values():
        await s.close()


async def test_prefill_then_decode_with_round_robin(setup):
    proxy, log, _ = setup
    client = await proxy()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 16, "stream": False}
    for _ in range(2):
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
    assert [(n, b["max_tokens"]) for n, _, b in log] == [
        ("p0", 1),
        ("d0", 16),
        ("p0", 1),
        ("d1", 16),
    ]
    assert all(b["stream"] is False for n, _, b in log if n == "p0")
    assert (await r.json())["by"] == "d1"


async def test_kv_transfer_params_go_from_prefill_answer_to_decode(setup):
    proxy, log, _ = setup
    client = await proxy()
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status == 200
    (_, _, pre), (_, _, dec) = log
    assert pre["kv_transfer_params"] == PREFILL_PARAMS
    assert dec["kv_transfer_params"] == {"kvray": {"blocks": 3, "by": "p0"}}
    assert "kv_transfer_params" not in await r.json(), "the decode's own answer is passed back"


async def test_streaming_chat_is_passed_through(setup):
    proxy, log, _ = setup
    client = await proxy()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 8}  # fmt: skip
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    text = (await r.read()).decode()
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    pre = next(b for n, _, b in log if n == "p0")
    assert pre["stream"] is False and "stream_options" not in pre
    assert pre["max_completion_tokens"] == 1 and pre["max_tokens"] == 1


async def test_unhealthy_instances_are_skipped_and_reported(setup):
    proxy, log, apps = setup
    client = await proxy()
    apps["d0"][STATE]["healthy"] = False
    await asyncio.sleep(0.35)  # a few health rounds
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
    assert {n for n, _, _ in log if n.startswith("d")} == {"d1"}
    health = await (await client.get("/health")).json()
    assert [d["healthy"] for d in health["decode"]] == [False, True]
    apps["d1"][STATE]["healthy"] = False
    await asyncio.sleep(0.35)
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status == 503 and "no healthy decode instance" in await r.text()
    assert (await client.get("/health")).status == 503


async def test_least_loaded_and_models_and_bad_input(setup):
    proxy, log, _ = setup
    client = await proxy("least_loaded")
    for _ in range(4):
        await client.post("/v1/completions", json={"prompt": "x"})
    assert sorted(n for n, _, _ in log if n.startswith("d")) == ["d0", "d0", "d1", "d1"]
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny"
    assert (await client.post("/v1/completions", data=b"not json")).status == 400


def test_cli_pairs_hosts_and_ports():
    args = parse_args(["--prefiller-ports", "8100", "8101", "--decoder-hosts", "10.0.0.2",
                       "10.0.0.3", "--decoder-ports", "8200", "8201"])  # fmt: skip
    proxy = build(args)
    assert [i.url for i in proxy.prefill.instances] == [
        "http://127.0.0.1:8100",
        "http://127.0.0.1:8101",
    ]
    assert [i.url for i in proxy.decode.instances] == [
        "http://10.0.0.2:8200",
        "http://10.0.0.3:8201",
    ]
    with pytest.raises(ValueError, match="--decoder-hosts has 2 entries but --decoder-ports has 3"):
        instances(["a", "b"], [1, 2, 3], "decoder")


async def test_mixed_serving_with_the_prefix_policy_sends_a_prefix_where_it_is_cached():
    """Each request to one instance, passed through; the router (its views filled as the
    instances' events would) sends a prompt to the instance whose cache holds it, text
    prompts tokenized by an instance's /tokenize."""
    from kvray.proxy.router import CacheView

    log: list = []
    apps = {n: fake_openai(n, log) for n in ("i0", "i1")}

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        log.append(("tokenize", request.path, body))
        return web.json_response({"tokens": [ord(c) for c in body["prompt"]]})

    apps["i0"].router.add_post("/tokenize", tokenize)
    apps["i1"].router.add_post("/tokenize", tokenize)
    servers = {n: await started(a) for n, a in apps.items()}
    args = parse_args(["--instance-ports", str(servers["i0"].port), str(servers["i1"].port),
                       "--policy", "prefix", "--kv-events-bind", "tcp://127.0.0.1:1",
                       "--kv-topics", "kv@i0@m", "kv@i1@m"])  # fmt: skip
    proxy = build(args)
    assert proxy.decode is None and proxy.feeds is not None
    proxy.feeds = None  # the views are filled here, not from sockets
    router = proxy.prefill.router
    assert router is not None
    text = "abcdefgh"  # two blocks of 4
    view = proxy.prefill.instances[1].view
    assert isinstance(view, CacheView)
    view.stored([1, 2], None, [ord(c) for c in text], 4, None, ("GPU", None))
    client = TestClient(TestServer(proxy.app(), host="127.0.0.1"))
    await client.start_server()
    try:
        for prompt in ([ord(c) for c in text] + [1], text + "!"):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert r.status == 200 and (await r.json())["by"] == "i1"
        assert sum(1 for e in log if e[0] == "tokenize") == 1  # only the text prompt
        health = await (await client.get("/health")).json()
        assert health["instance_router"]["routed_to_cache"] == 2
        assert health["instance_router"]["blocks"] == [0, 2]
    finally:
        await client.close()
        for s in servers.values():
            await s.close()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--instance-ports", "1", "2", "--policy", "prefix"], "give --kv-events-bind"),
        (
            [
                "--instance-ports",
                "1",
                "2",
                "--policy",
                "prefix",
                "--kv-events-bind",
                "tcp://x:1",
                "--kv-topics",
                "a",
            ],
            "--kv-topics has 1 entries for 2 --instance-ports",
        ),  # fmt: skip
        (
            [
                "--instance-ports",
                "1",
                "2",
                "--policy",
                "prefix",
                "--kv-events-bind",
                "tcp://x:1",
                "--kv-topics",
                "a",
                "a",
            ],
            "a topic of its own",
        ),  # fmt: skip
        (["--instance-ports", "1", "--prefiller-ports", "2"], "not both"),
        (["--prefiller-ports", "2"], "give --instance-ports"),
        (
            [
                "--instance-ports",
                "1",
                "--policy",
                "prefix",
                "--pool-kv-events",
                "tcp://x:1",
                "--max-imbalance",
                "-1",
            ],
            "--max-imbalance/--load-cost: max_imbalance -1",
        ),  # fmt: skip
    ],
)
def test_bad_routing_flags_name_the_flag_and_the_fix(argv, match):
    with pytest.raises(SystemExit, match=match):
        build(parse_args(argv))
