"""The OpenAI servers of the serving benchmarks (bench_serve.py, bench_workloads.py):
one vLLM server per arm, and vLLM's own benchmark client called in this process."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _engines import PEER_TRANSFER_CONFIG, kvray_transfer_config
from _forked_server import start_server

from kvray.servers.process import free_port
from kvray.testing.server import Server, vllm_serve_cmd

EVERY_CORE = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
"""Each server's worker computes on every core. vLLM's automatic binding reserves a core
for the engine core's process, and one more when a KV connector is configured; on a
2-core machine that gave the servers without a connector one core and those with one
both (measured: kvray's and the peer's first, all-miss runs faster than no connector's),
so that every arm computes on the same cores, this is set for all of them."""


def serve_arm(
    name: str,
    model: str,
    max_len: int,
    env: dict[str, str],
    tmp: Path,
    *,
    prefix_caching: bool,
    kvray: dict[str, Any] | None = None,
    peer: bool = False,
    extra: tuple[str, ...] = (),
) -> Server:
    """One OpenAI server (its own process group, so it pauses as a whole): vLLM's prefix
    cache on or off, and KVRayConnector with ``kvray`` as its extra config, or the peer
    (vLLM's MooncakeStoreConnector, its client config in ``env``), or no connector; its
    worker on every core (:data:`EVERY_CORE`, unless ``env`` binds it)."""
    port = free_port()
    args: list[str] = list(extra)
    if kvray is not None:
        args += ["--kv-transfer-config", json.dumps(kvray_transfer_config(kvray))]
    elif peer:
        args += ["--kv-transfer-config", json.dumps(PEER_TRANSFER_CONFIG)]
    cmd = vllm_serve_cmd(model, port, *args, max_model_len=max_len, prefix_caching=prefix_caching)
    return start_server(name, cmd, {**EVERY_CORE, **env}, tmp / f"{name}.log", port=port)


def bench_client() -> Callable[[list[str]], object]:
    """vLLM's ``vllm bench serve`` as a function of its arguments (imported once: an
    import of vLLM costs 12-16 s on 2 cores, a run with short prompts less)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]  # vLLM: untyped __init__
    add_cli_args(parser)

    def run(argv: list[str]) -> object:
        with contextlib.redirect_stdout(sys.stderr):  # its report; stdout is our table
            return main(parser.parse_args(argv))

    return run
