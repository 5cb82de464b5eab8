"""The soak's load (scripts/soak.py): vLLM's OpenAI server, one streaming completion, the
prompts (shared prefixes, random endings) and the pool keys of a prompt's blocks."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from kvray.testing.server import Server, vllm_serve_cmd

if TYPE_CHECKING:
    from kvray.keys import KeySpace

BLOCK = 128  # vLLM's CPU block size for the tiny model


def serve(name: str, model: str, extra: list[str], env: dict[str, str], tmp: Path) -> Server:
    """vLLM's OpenAI server (sha256 block hashes, as the soak's oracle computes them)."""
    from kvray.servers.process import free_port

    port = free_port()
    cmd = vllm_serve_cmd(model, port, "--prefix-caching-hash-algo", "sha256", *extra)
    return Server(name, cmd, env, tmp / f"{name}.log", port=port)


def server_metrics(server: Server) -> str:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
        return str(r.read().decode())


def completion(
    port: int, model: str, prompt: list[int], max_tokens: int, timeout_s: float
) -> tuple[list[int], float | None, float, str]:
    """A streaming completion: ``(tokens, ttft_s, total_s, response id)``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    ttft: float | None = None
    tokens: list[int] = []
    rid = ""
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"the server failed the request: {event['error']}")
            rid = event.get("id", rid)
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.monotonic() - started
                tokens.extend(ids)
    return tokens, ttft, time.monotonic() - started, rid


def make_prompts(prefixes: int, suffixes: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prefixes):
        prefix = rng.integers(3, 1000, int(rng.integers(2, 6)) * BLOCK).tolist()
        for _ in range(suffixes):
            out.append(
                prefix + rng.integers(3, 1000, int(rng.integers(BLOCK // 2, 2 * BLOCK))).tolist()
            )
    return out


def block_keys(prompt: list[int], space: KeySpace) -> list[str]:
    """The pool keys of a prompt's full blocks in the connector's key ``space`` (vLLM's
    sha256 block hashes with its default seed)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256")
    if getattr(kcu, "NONE_HASH", None) is None:
        kcu.init_none_hash(fn)
    hashes, parent = [], None
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = kcu.hash_block_tokens(fn, parent, prompt[start : start + BLOCK], None)
        hashes.append(bytes(parent))
    return space.lookup_key_strs(hashes)
