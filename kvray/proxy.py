"""A load-balancing proxy for PD-disaggregated vLLM serving over a kvray pool.

Each OpenAI request (``/v1/completions``, ``/v1/chat/completions``) is first sent to a
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

Instances are chosen round-robin or least-loaded (fewest requests in flight) among the
healthy ones; every instance's ``/health`` is polled, and one that fails is skipped until
it answers again. ``GET /health`` reports the proxy's view; ``GET /v1/models`` is passed
to a decode instance.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger("kvray.proxy")

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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Pool:
    """Instances of one role, and how one is chosen."""

    role: str
    instances: list[Instance]
    policy: str = "round_robin"
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self) -> Instance:
        live = [i for i in self.instances if i.healthy]
        if not live:
            raise web.HTTPServiceUnavailable(
                text=f"no healthy {self.role} instance (of {len(self.instances)})"
            )
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
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        *,
        health_interval_s: float = 5.0,
        timeout_s: float = 600.0,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.health_interval_s = health_interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

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
        await asyncio.gather(
            *(self._probe(i) for i in self.prefill.instances + self.decode.instances)
        )

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

        live = any(i.healthy for i in self.prefill.instances) and any(
            i.healthy for i in self.decode.instances
        )
        body = {"status": "ok" if live else "degraded", "prefill": view(self.prefill),
                "decode": view(self.decode)}  # fmt: skip
        return web.json_response(body, status=200 if live else 503)

    async def handle_models(self, request: web.Request) -> web.Response:
        inst = self.decode.choose()
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
        params = await self._prefill(request.path, body, headers)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        return await self._decode(request, body, headers)

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | None:
        """One token, not streamed: enough for the prefill instance to compute and store
        the prompt's KV. Returns the answer's ``kv_transfer_params`` for the decode."""
        pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        inst = self.prefill.choose()
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

    async def _decode(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        inst = self.decode.choose()
        with _upstream(inst, "decode"):
            async with self.session.post(
                f"{inst.url}{request.path}", json=body, headers=headers
            ) as r:
                if r.status != 200:
                    logger.warning("decode instance %s answered %d", inst.url, r.status)
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
        description="PD-disaggregation proxy: prefill on one instance, decode on another",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    p.add_argument("--prefiller-ports", nargs="+", type=int, required=True)
    p.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    p.add_argument("--decoder-ports", nargs="+", type=int, required=True)
    p.add_argument("--policy", choices=["round_robin", "least_loaded"], default="round_robin")
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> Proxy:
    try:
        pre = instances(args.prefiller_hosts, args.prefiller_ports, "prefiller")
        dec = instances(args.decoder_hosts, args.decoder_ports, "decoder")
    except ValueError as exc:
        raise SystemExit(f"kvray.proxy: {exc}") from None
    return Proxy(
        Pool("prefill", pre, args.policy),
        Pool("decode", dec, args.policy),
        health_interval_s=args.health_interval,
        timeout_s=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    proxy = build(args)
    logger.info(
        "proxy on %s:%d: prefill %s, decode %s (%s)",
        args.host,
        args.port,
        [i.url for i in proxy.prefill.instances],
        [i.url for i in proxy.decode.instances],
        args.policy,
    )
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
