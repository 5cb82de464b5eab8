"""Put the engine's whole KV cache in shared memory, so the rank's BackendClient actor
moves blocks straight from and into it: no copy in the engine process at all.

vLLM enters the connector's ``get_mem_pool_context()`` around KV cache allocation, where
``allocate_kv_cache`` makes one ``torch.zeros(n, dtype=torch.int8)`` buffer and views
every layer's cache on it. The mode below serves exactly that call from a
:class:`~kvray.shm.SharedRegion`; every other call passes through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvray.shm import SharedRegion

logger = logging.getLogger(__name__)


class SharedKVAllocator(TorchFunctionMode):
    """Serves the KV cache's int8 ``torch.zeros`` buffer from a shared memory file."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.region: SharedRegion | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and self.region is None
            and kwargs.get("dtype") is torch.int8
            and len(args) == 1
            and isinstance(args[0], int)
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        ):
            # A memory file, zeroed, freed by the kernel however the engine ends.
            self.region = SharedRegion.create(self.prefix, args[0])
            logger.info(
                "KV cache (%d bytes) placed in shared memory %s",
                args[0],
                self.region.spec.region_id,
            )
            return torch.from_numpy(self.region.array).view(torch.int8)
        return func(*args, **kwargs)

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
