"""Settings of the pool's KV-events publisher (``kv_events``; the publisher is
:mod:`kvray.index.kv_events`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvray.config._common import _Strict

TOPIC_FIELDS = ("host", "model", "instance", "pool", "namespace")
"""What a topic template may name: the describing engine's node address, its served
model name, its engine id, the pool's name, its key space's namespace."""


class KVEventsConfig(_Strict):
    """Publish the pool's blocks as vLLM KV events (ZMQ PUB, and a replay ROUTER), for
    routers that score engines by cached prefixes (llm-d, Dynamo, Ray Serve)."""

    host: str = "auto"
    """Where the sockets listen, by ``server_host``'s rule: ``auto`` (default: ``node`` in
    a pool started on a multi-node cluster, else ``loopback``), ``node`` (the manager's
    node address), ``loopback`` (127.0.0.1), or an IP address of the manager's node."""
    port: int = Field(5577, ge=0, le=65535)
    """The PUB socket's port (0: any free one; ``Pool.kv_events()`` names it)."""
    replay_port: int | None = Field(5578, ge=0, le=65535)
    """The replay ROUTER socket's port (0: any free one; null: no replay)."""
    topic: str = "kv@{host}@{model}"
    """Each engine's topic: a template of ``{host}``, ``{model}``, ``{instance}``,
    ``{pool}`` and ``{namespace}``. The default is llm-d's per-engine convention
    (``kv@<pod address>@<model>``); one key space per topic (engines of another key space
    that would share a topic are refused it, with a warning: add ``{instance}``)."""
    buffer_batches: int = Field(10_000, ge=1, le=10_000_000)
    """Batches per topic kept for replay; a subscriber further behind gets a snapshot."""
    hwm: int = Field(100_000, ge=1)
    """The PUB socket's high-water mark (messages queued per subscriber)."""
    max_blocks: int = Field(1_000_000, ge=1, le=1 << 28)
    """Blocks the publisher keeps descriptions of (block hash, parent, token ids: ~0.2 KiB
    each plus 4 bytes per token); past it the oldest are published removed."""

    @field_validator("topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        try:
            v.format(**dict.fromkeys(TOPIC_FIELDS, "x"))
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"topic {v!r}: a template of {', '.join('{' + f + '}' for f in TOPIC_FIELDS)} "
                f"only ({exc!r})"
            ) from None
        return v
