"""The soak's oracle (scripts/soak.py): every prompt's greedy tokens from a server without
a connector, kept in a file for another run of the same model files, prompts and length."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from _soak_load import completion, serve


def model_digest(model: str) -> str:
    """sha256 of a model directory's files (names and bytes): a cached oracle is only
    as good as the model it came from."""
    h = hashlib.sha256()
    root = Path(model)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def oracle_tokens(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    env: dict[str, str],
    tmp: Path,
    cache: Path | None,
) -> tuple[list[list[int]], str]:
    """Every prompt's greedy tokens from a server without a connector, and where they came
    from: ``cache`` holds them for the same model files, prompts and ``max_tokens`` (a
    second run, e.g. the other checksum mode, skips the baseline server), else they are
    computed (and written there)."""
    key = {
        "model": model_digest(model) if cache is not None else "",
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "max_tokens": max_tokens,
    }
    if cache is not None and cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["tokens"], f"read from {cache}"
    base = serve("baseline", model, [], env, tmp)
    try:
        base.wait_healthy(time.monotonic() + 600)
        tokens = [completion(base.port, model, p, max_tokens, 300)[0] for p in prompts]
    finally:
        base.stop(grace_s=90)
    if cache is None:
        return tokens, "computed"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "tokens": tokens}))
    return tokens, f"computed, written to {cache}"
