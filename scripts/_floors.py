"""The floors a pool hit is compared with in ``bench_ttft``: what moving its bytes must
cost at least, timed in the benchmark's own process in the same rep as the hit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

STAGED_COPIES = 2
"""The copies of a hit's bytes the staged placement needs at least: the backend's into
the staging region, then the scatter into the KV cache (the local prefix cache: none)."""


class CopyVerifyFloor:
    """What a hit must cost at least over the ideal: one memcpy of the bytes it loaded and
    their xxh3-64 (the checksum kvray verifies), timed in this process (one thread) on
    memory faulted in once."""

    def __init__(self) -> None:
        self._src: Any = None
        self._dst: Any = None

    def time(self, nbytes: int) -> float:
        import numpy as np
        import xxhash

        if self._src is None or len(self._src) < nbytes:
            self._src = np.ones(nbytes, dtype=np.uint8)
            self._dst = np.ones_like(self._src)
        src, dst = self._src[:nbytes], self._dst[:nbytes]
        t0 = time.perf_counter()
        np.copyto(dst, src)
        xxhash.xxh3_64_intdigest(src)
        return time.perf_counter() - t0


class StagedFloor:
    """The staged placement's floor: :data:`STAGED_COPIES` memcpys of a hit's bytes, timed
    in this process (one thread, as the connector's scatter is) on memory faulted in once."""

    def __init__(self, model: str, max_tokens: int) -> None:
        import numpy as np

        cfg = json.loads((Path(model) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        itemsize = 4 if cfg.get("dtype", cfg.get("torch_dtype")) == "float32" else 2
        self.token_bytes = (
            cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize
        )
        self._src = np.ones(max_tokens * self.token_bytes, dtype=np.uint8)
        self._dst = np.ones_like(self._src)

    def time(self, tokens: int) -> float:
        import numpy as np

        n = tokens * self.token_bytes
        t0 = time.perf_counter()
        np.copyto(self._dst[:n], self._src[:n])
        return STAGED_COPIES * (time.perf_counter() - t0)
