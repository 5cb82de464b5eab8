"""``kvray up | status | down`` against the current Ray cluster.

The cluster is the one ``RAY_ADDRESS`` names, or ``--address``, or ``auto`` (the
cluster this node belongs to).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from kvray import launcher
from kvray.config import PoolConfig
from kvray.errors import KVRayError


def _connect(args: argparse.Namespace) -> None:
    from kvray.ray_env import ray_init

    ray_init(args.address or "auto", namespace=args.namespace or "kvray")


def _pool_ref(args: argparse.Namespace) -> tuple[str, str]:
    return args.name or "kvray", args.namespace or "kvray"


def cmd_up(args: argparse.Namespace) -> int:
    # Flags given on the command line override the config file.
    flags = {"name": args.name, "namespace": args.namespace, "world_size": args.world_size}
    overrides = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        base = PoolConfig.from_file(args.config)
        config = PoolConfig.from_dict({**base.model_dump(), **overrides}, source=args.config)
    else:
        config = PoolConfig.from_dict(overrides, source="command line")
    args.namespace = config.namespace
    _connect(args)
    print(
        f"starting kvray pool {config.name!r} ({config.world_size} client(s) per node) ...",
        flush=True,
    )
    handles = launcher.launch(config)
    server = {"mooncake": "mooncake_master", "yuanrong": "datasystem worker"}.get(
        config.backend, "MemCache MetaService"
    )
    mode = f"embedded {server}" if handles.embedded else f"external {server}"
    where = f"{config.backend} at {handles.server_address} ({mode})"
    print(f"kvray pool {config.name!r} is up: {where}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvray.pool import collect_status

    _connect(args)
    status = asyncio.run(collect_status(launcher.attach(*_pool_ref(args))))
    print(json.dumps(status.to_dict(), indent=2) if args.json else status.table())
    return 0 if all(r.alive for r in status.ranks) else 1


def cmd_down(args: argparse.Namespace) -> int:
    _connect(args)
    name, namespace = _pool_ref(args)
    launcher.shutdown(launcher.attach(name, namespace))
    print(f"kvray pool {name!r} stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvray", description="kvray KV-cache pool on Ray")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    parser.add_argument("--name", help="pool name (default: kvray, or the --config file's)")
    parser.add_argument("--namespace", help="Ray namespace (default: kvray)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a pool (idempotent)")
    up.add_argument("--config", help="pool config file (YAML or JSON, see configs/)")
    up.add_argument("--world-size", type=int, help="ranks to serve (default 1)")
    up.set_defaults(fn=cmd_up)
    st = sub.add_parser("status", help="show a pool's ranks and counters")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(fn=cmd_status)
    down = sub.add_parser("down", help="stop a pool and its embedded servers")
    down.set_defaults(fn=cmd_down)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.fn(args))
    except KVRayError as exc:
        print(f"kvray {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
