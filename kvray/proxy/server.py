"""A routing proxy for vLLM instances over a kvray pool: PD-disaggregated (prefill, then
decode) or mixed (each request to one ``kv_both`` instance).

**PD.** Each OpenAI request (``/v1/completions``, ``/v1/chat/completions``) is first sent to a
prefill instance (``kv_producer``) as a one-token, non-streaming request marked
``kv_transfer_params: {"do_remote_decode": true, ...}`` (vLLM's PD convention): the
prefill computes the prompt's KV and its connectors store it (KVRayConnector to the pool;
a P->D connector such as NIXL holds it for the decode instance). The ``kv_transfer_params``
of the prefill's answer (where to find the KV: kvray's stored block count, NIXL's remote
blocks) go with the original request to a decode instance (``kv_consumer``), whose
answer, streamed or not, is passed back unchanged.

    python -m kvray.proxy --port 8000 \\
        --prefiller-hosts 127.0.0.1 --prefiller-ports 8100 \\
        --decoder-hosts 127.0.0.1 --decoder-ports 8200

**Mixed.** ``--instance-ports`` (no prefill or decode instances): each request goes to one
instance, passed through unchanged, its answer streamed back.

    python -m kvray.proxy --port 8000 --instance-ports 8100 8101 --policy prefix \
        --kv-events-bind tcp://127.0.0.1:5557 --kv-topics kv@a@m kv@b@m \
        --pool-kv-events tcp://127.0.0.1:5577 --pool-kv-replay tcp://127.0.0.1:5578

Instances (the prefill ones in PD) are chosen round-robin, least-loaded (fewest requests
in flight), or ``prefix``: by what each one's own prefix cache holds (its engine's KV
events, each engine publishing to ``--kv-events-bind`` on its ``--kv-topics`` entry) and
what the kvray pool holds (the pool's KV events), within ``--max-imbalance`` requests in
flight of the least busy instance (kvray/proxy/router.py). Every instance's ``/health`` is
polled, and one that fails is skipped until it answers again. ``GET /health`` reports the
proxy's view (and the router's counters); ``GET /v1/models`` is passed to an instance.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvray.proxy.feeds import EventFeeds
from kvray.proxy.router import CacheView, PrefixRouter

logger = logging.getLogger("kvray.proxy.server")

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""``kv_transfer_params`` of a prefill request, as vLLM's own PD proxies send them."""


@dataclass
class Instance:
    """One vLLM server behind the proxy."""

    host: str
    port: int
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    view: CacheView | None = None
    """Its prefix cache, from its engine's KV events (the ``prefix`` policy)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Pool:
    """Instances of one role, and how one is chosen."""

    role: str
    instances: list[Instance]
    policy: str = "round_robin"
    router: PrefixRouter | None = None
    """The ``prefix`` policy's router over ``instances``."""
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, tokens: Sequence[int] | None = None, salt: str | None = None) -> Instance:
        """An instance for a prompt of ``tokens`` (used by the ``prefix`` policy)."""
        live = [i for i in self.instances if i.healthy]
        if not live:
            raise web.HTTPServiceUnavailable(
                text=f"no healthy {self.role} instance (of {len(self.instances)})"
            )
        if self.router is not None:
            choice = self.router.choose(tokens, salt)
            inst = self.instances[choice.index]
            logger.debug(
                "%s: %d blocks, %d local, %d cached (local or pool) at %s",
                self.role, choice.blocks, choice.local, choice.cached, inst.url,
            )  # fmt: skip
            return inst
        if self.policy == "least_loaded":
            return min(live, key=lambda i: (i.in_flight, i.served))
        return live[next(self._rr) % len(live)]


def instances(hosts: Sequence[str], ports: Sequence[int], role: str) -> list[Instance]:
    """Pair hosts with ports; one host may serve several ports."""
    if not ports:
        raise ValueError(f"--{role}-ports: give at least one port")
    if len(hosts) == 1 and len(ports) > 1:
        hosts = list(hosts) * len(ports)
    if len(hosts) != len(ports):
        raise ValueError(
            f"--{role}-hosts has {len(hosts)} entries but --{role}-ports has {len(ports)}: "
            "give one host per port (or a single host for all ports)"
        )
    return [Instance(h, p) for h, p in zip(hosts, ports, strict=True)]


class Proxy:
    """PD (``prefill`` then ``decode``) or, with ``decode`` None, mixed: each request to one
    of ``prefill``'s instances, passed through."""

    def __init__(
        self,
        prefill: Pool,
        decode: Pool | None,
        *,
        health_interval_s: float = 5.0,
        timeout_s: float = 600.0,
        feeds: EventFeeds | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.health_interval_s = health_interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.feeds = feeds
        """The ``prefix`` policy's KV-event subscriptions (started with the app)."""
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

    @property
    def pools(self) -> list[Pool]:
        return [self.prefill] if self.decode is None else [self.prefill, self.decode]

    # ---- lifecycle ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        if self.feeds is not None:
            await asyncio.to_thread(self.feeds.start)
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        await self.check_health()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()
        if self.feeds is not None:
            await asyncio.to_thread(self.feeds.stop)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Proxy used outside its aiohttp app"
        return self._session

    # ---- health ------------------------------------------------------------------------

    async def _probe(self, inst: Instance) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=2)
            async with self.session.get(f"{inst.url}/health", timeout=timeout) as r:
                ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok != inst.healthy:
            logger.warning("%s is now %s", inst.url, "healthy" if ok else "UNHEALTHY")
        inst.healthy = ok

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(i) for p in self.pools for i in p.instances))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    # ---- handlers ----------------------------------------------------------------------

    async def handle_health(self, request: web.Request) -> web.Response:
        def view(pool: Pool) -> list[dict[str, Any]]:
            return [
                {"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight, "served": i.served}
                for i in pool.instances
            ]

        live = all(any(i.healthy for i in p.instances) for p in self.pools)
        body: dict[str, Any] = {"status": "ok" if live else "degraded"}
        for pool in self.pools:
            body[pool.role] = view(pool)
            if pool.router is not None:
                body[f"{pool.role}_router"] = self._router_view(pool.router)
        return web.json_response(body, status=200 if live else 503)

    def _router_view(self, router: PrefixRouter) -> dict[str, Any]:
        out: dict[str, Any] = {
            "routed_to_cache": router.routed_to_cache,
            "bounded": router.bounded,
            "max_imbalance": router.max_imbalance,
            "blocks": [len(t.view) if t.view is not None else None for t in router.targets],
            "pool_blocks": len(router.pool) if router.pool is not None else None,
        }
        if self.feeds is not None:
            out["events"] = vars(self.feeds.stats)
        return out

    async def handle_models(self, request: web.Request) -> web.Response:
        inst = (self.decode or self.prefill).choose()
        async with self.session.get(f"{inst.url}/v1/models") as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="request body must be JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tokens = None
        if self.prefill.router is not None:
            tokens = await self._prompt_tokens(request.path, body, headers)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if self.decode is None:
            return await self._forward(request, self.prefill.choose(tokens, salt), body, headers)
        params = await self._prefill(request.path, body, headers, tokens, salt)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        return await self._forward(request, self.decode.choose(), body, headers)

    async def _prompt_tokens(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids, for the ``prefix`` policy: a completion's own ids, or
        what an instance's ``/tokenize`` makes of its text or chat messages (the engine's
        own tokenizer and chat template). None: not known (routed by load)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
            ask: dict[str, Any] = {"model": body.get("model"), "messages": body["messages"]}
        elif isinstance(prompt, str):
            ask = {"model": body.get("model"), "prompt": prompt}
        else:
            return None
        live = [i for i in self.prefill.instances if i.healthy]
        if not live:
            return None
        inst = live[next(self.prefill._rr) % len(live)]
        try:
            async with self.session.post(f"{inst.url}/tokenize", json=ask, headers=headers) as r:
                answer = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, ValueError) as exc:
            logger.warning("%s/tokenize failed (%s): routed by load", inst.url, exc)
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def _prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        tokens: list[int] | None = None,
        salt: str | None = None,
    ) -> dict[str, Any] | None:
        """One token, not streamed: enough for the prefill instance to compute and store
        the prompt's KV. Returns the answer's ``kv_transfer_params`` for the decode."""
        pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        inst = self.prefill.choose(tokens, salt)
        with _upstream(inst, "prefill"):
            async with self.session.post(f"{inst.url}{path}", json=pre, headers=headers) as r:
                text = await r.text()
        if r.status != 200:
            raise web.HTTPBadGateway(
                text=f"prefill instance {inst.url} answered {r.status}: {text[:500]}"
            )
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise web.HTTPBadGateway(
                text=f"prefill instance {inst.url} answered with no JSON object: {text[:200]}"
            ) from None
        return params if isinstance(params, dict) else None

    async def _forward(
        self, request: web.Request, inst: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """``body`` to ``inst`` (a decode instance, or a mixed one), its answer streamed
        back unchanged."""
        role = "decode" if self.decode is not None else "instance"
        with _upstream(inst, role):
            async with self.session.post(
                f"{inst.url}{request.path}", json=body, headers=headers
            ) as r:
                if r.status != 200:
                    logger.warning("%s %s answered %d", role, inst.url, r.status)
                response = web.StreamResponse(status=r.status)
                ctype = r.headers.get("Content-Type")
                if ctype:
                    response.headers["Content-Type"] = ctype
                await response.prepare(request)
                async for chunk in r.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response


@contextlib.contextmanager
def _upstream(inst: Instance, role: str) -> Iterator[None]:
    """One request to ``inst``: counted while in flight; a connection failure marks it
    unhealthy (until its next health check) and is a 502 to the client."""
    inst.in_flight += 1
    try:
        yield
    except aiohttp.ClientError as exc:
        inst.healthy = False
        raise web.HTTPBadGateway(text=f"{role} instance {inst.url} failed: {exc}") from exc
    finally:
        inst.in_flight -= 1
        inst.served += 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvray.proxy",
        description="Routing proxy for vLLM instances over a kvray pool: PD (prefill on one "
        "instance, decode on another) or mixed (--instance-ports)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    p.add_argument("--prefiller-ports", nargs="+", type=int)
    p.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    p.add_argument("--decoder-ports", nargs="+", type=int)
    p.add_argument("--instance-hosts", nargs="+", default=["127.0.0.1"])
    p.add_argument("--instance-ports", nargs="+", type=int, help="mixed serving: kv_both instances")
    p.add_argument(
        "--policy", choices=["round_robin", "least_loaded", "prefix"], default="round_robin"
    )
    g = p.add_argument_group("the prefix policy (instances, or prefill instances in PD)")
    g.add_argument(
        "--kv-events-bind",
        help="where the router listens for the engines' KV events (vLLM's publisher, given "
        "this as kv_events_config.endpoint, connects), e.g. tcp://127.0.0.1:5557",
    )
    g.add_argument(
        "--kv-topics", nargs="+", default=[],
        help="each instance's kv_events_config.topic, in --*-ports order",
    )  # fmt: skip
    g.add_argument(
        "--kv-replays", nargs="+", default=[],
        help="each instance's kv_events_config.replay_endpoint (optional), in order",
    )  # fmt: skip
    g.add_argument("--pool-kv-events", help="the kvray pool's kv_events endpoint")
    g.add_argument("--pool-kv-replay", help="the kvray pool's kv_events replay endpoint")
    g.add_argument(
        "--pool-topic", default="",
        help="only the pool's topics starting with this (a pool holding several models)",
    )  # fmt: skip
    g.add_argument(
        "--max-imbalance", type=int, default=4,
        help="requests in flight an instance may have over the least busy one and still be "
        "chosen for its cache",
    )  # fmt: skip
    g.add_argument(
        "--load-cost", type=float, default=0.2,
        help="a block loaded from the pool, as a fraction of a computed one",
    )  # fmt: skip
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    return p.parse_args(argv)


def _router(
    args: argparse.Namespace, routed: list[Instance], flag: str
) -> tuple[PrefixRouter, EventFeeds]:
    """The ``prefix`` policy over ``routed`` (whose ports came with ``flag``)."""
    if args.kv_events_bind is None and args.pool_kv_events is None:
        raise ValueError(
            "--policy prefix: give --kv-events-bind (the instances' own caches), "
            "--pool-kv-events (the pool's), or both"
        )
    if args.kv_events_bind is not None and len(args.kv_topics) != len(routed):
        raise ValueError(
            f"--kv-topics has {len(args.kv_topics)} entries for {len(routed)} {flag}: give "
            "each instance's kv_events_config.topic, in the same order (distinct topics: "
            "they say whose cache a batch describes)"
        )
    if len(set(args.kv_topics)) != len(args.kv_topics):
        raise ValueError("--kv-topics: each instance needs a topic of its own")
    if args.kv_replays and len(args.kv_replays) != len(routed):
        raise ValueError(
            f"--kv-replays has {len(args.kv_replays)} entries for {len(routed)} {flag}"
        )
    for inst, topic in zip(routed, args.kv_topics, strict=False):
        inst.view = CacheView(topic)
    pool = CacheView("pool") if args.pool_kv_events else None
    try:
        router = PrefixRouter(
            routed, pool, max_imbalance=args.max_imbalance, load_cost=args.load_cost
        )
    except ValueError as exc:
        raise ValueError(f"--max-imbalance/--load-cost: {exc}") from None
    feeds = EventFeeds(
        router.lock,
        bind=args.kv_events_bind,
        engines={i.view.name: i.view for i in routed if i.view is not None},
        engine_replays=dict(zip(args.kv_topics, args.kv_replays, strict=False)),
        pool=pool,
        pool_endpoint=args.pool_kv_events,
        pool_replay=args.pool_kv_replay,
        pool_topic=args.pool_topic,
    )
    return router, feeds


def build(args: argparse.Namespace) -> Proxy:
    try:
        if args.instance_ports:
            if args.prefiller_ports or args.decoder_ports:
                raise ValueError(
                    "--instance-ports (mixed serving) or --prefiller-ports with "
                    "--decoder-ports (PD), not both"
                )
            routed = instances(args.instance_hosts, args.instance_ports, "instance")
            pools = [Pool("instance", routed, args.policy)]
            flag = "--instance-ports"
        else:
            if not args.prefiller_ports or not args.decoder_ports:
                raise ValueError(
                    "give --instance-ports (mixed serving), or --prefiller-ports and "
                    "--decoder-ports (PD)"
                )
            routed = instances(args.prefiller_hosts, args.prefiller_ports, "prefiller")
            dec = instances(args.decoder_hosts, args.decoder_ports, "decoder")
            decode_policy = "least_loaded" if args.policy == "prefix" else args.policy
            pools = [Pool("prefill", routed, args.policy), Pool("decode", dec, decode_policy)]
            flag = "--prefiller-ports"
        feeds = None
        if args.policy == "prefix":
            pools[0].router, feeds = _router(args, routed, flag)
    except ValueError as exc:
        raise SystemExit(f"kvray.proxy.server: {exc}") from None
    return Proxy(
        pools[0],
        pools[1] if len(pools) > 1 else None,
        health_interval_s=args.health_interval,
        timeout_s=args.timeout,
        feeds=feeds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    proxy = build(args)
    logger.info(
        "proxy on %s:%d: %s (%s)",
        args.host,
        args.port,
        ", ".join(f"{p.role} {[i.url for i in p.instances]}" for p in proxy.pools),
        args.policy,
    )
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0
