"""``kvray up | status | down`` against the current Ray cluster.

The cluster is the one ``RAY_ADDRESS`` names, or ``--address``, or ``auto`` (the
cluster this node belongs to).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from kvray import launcher
from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.errors import ConfigError, KVRayError
from kvray.keys import KeySpace


def _connect(args: argparse.Namespace) -> None:
    from kvray.ray_env import ray_init

    ray_init(args.address or "auto", namespace=args.namespace or "kvray")


def _pool_ref(args: argparse.Namespace) -> tuple[str, str]:
    return args.name or "kvray", args.namespace or "kvray"


def _load_config(args: argparse.Namespace) -> PoolConfig:
    # Flags given on the command line override the config file.
    flags = {"name": args.name, "namespace": args.namespace, "world_size": args.world_size}
    overrides = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        base = PoolConfig.from_file(args.config)
        return PoolConfig.from_dict({**base.model_dump(), **overrides}, source=args.config)
    return PoolConfig.from_dict(overrides, source="command line")


def cmd_up(args: argparse.Namespace) -> int:
    from kvray import doctor

    config = _load_config(args)
    findings = doctor.check_pool(config, os.environ, doctor.Host.probe(), hash_seed=False)
    for f in findings:
        if f.level == "warning":
            print(f.line(), file=sys.stderr)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise ConfigError(
            "refusing to start the pool (`kvray doctor` checks):\n" + doctor.report(errors)
        )
    args.namespace = config.namespace
    _connect(args)
    print(
        f"starting kvray pool {config.name!r} ({config.world_size} client(s) per node) ...",
        flush=True,
    )
    handles = launcher.launch(config)
    server = spec_of(config.backend).server_name
    mode = f"embedded {server}" if handles.embedded else f"external {server}"
    where = f"{config.backend} at {handles.server_address} ({mode})"
    print(f"kvray pool {config.name!r} is up: {where}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from kvray import doctor
    from kvray.pool import collect_status
    from kvray.servers.process import why_unreachable

    findings: list[doctor.Finding] = []
    try:
        config: PoolConfig | None = _load_config(args)
    except KVRayError as exc:
        findings.append(doctor.Finding("error", "config", str(exc)))
        config = None
    if config is not None:
        findings += doctor.check_pool(config, os.environ, doctor.Host.probe())
        findings += doctor.check_reachable(config)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address and address != "auto":
        why = why_unreachable(address)
        if why is not None:
            findings.append(
                doctor.Finding(
                    "error",
                    "Ray cluster",
                    f"{address} (--address / RAY_ADDRESS) does not answer ({why})",
                    "engines and kvray's CLI join the pool's Ray cluster there",
                    "start it (`ray start --head`), fix the address, or unset RAY_ADDRESS to "
                    "let engines run an embedded pool",
                )
            )
        else:
            _connect(args)
            try:
                handles = launcher.attach(*_pool_ref(args), clients=False)
                status = asyncio.run(collect_status(handles))
                refusal = handles.manager.refusal(handles.node_id).result(60)
            except KVRayError as exc:
                findings.append(doctor.Finding("warning", "running pool", str(exc)))
            else:
                if refusal is not None:
                    findings.append(doctor.Finding("error", "pool from this node", refusal))
                down = [r for r in status.ranks if not r.alive]
                findings.append(
                    doctor.Finding(
                        "error" if down else "ok",
                        "running pool",
                        f"pool {status.name!r}: {len(status.ranks) - len(down)} of "
                        f"{len(status.ranks)} client(s) up"
                        + "".join(f"; {r.node} slot {r.rank}: {r.error}" for r in down),
                        fix="see `kvray status`" if down else "",
                    )
                )
                findings += doctor.check_fingerprints(status.fingerprints)
                findings += doctor.check_engines(status.engines)
    print(doctor.report(findings))
    return 1 if any(f.level == "error" for f in findings) else 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvray.pool import collect_status

    _connect(args)
    handles = launcher.attach(*_pool_ref(args), clients=False)
    if args.watch is None:
        status = asyncio.run(collect_status(handles))
        print(json.dumps(status.to_dict(), indent=2) if args.json else status.table())
        return 0 if all(r.alive for r in status.ranks) else 1
    return asyncio.run(_watch(handles, args.watch, args.count, args.json))


async def _watch(
    handles: launcher.PoolHandles, every_s: float, count: int | None, as_json: bool
) -> int:
    """``status --watch``: the table again every ``every_s`` with the rates since the last
    one (until Ctrl-C, or ``count`` refreshes); on a terminal the screen is redrawn."""
    import time

    from kvray.pool import collect_status
    from kvray.status import rates

    if every_s <= 0:
        raise ConfigError(f"--watch takes seconds > 0, got {every_s}")
    tty = sys.stdout.isatty() and not as_json
    prev, shown, rc = None, 0, 0
    try:
        while count is None or shown < count:
            status = await collect_status(handles)
            now = time.monotonic()
            rate = rates(prev[1], status, now - prev[0]) if prev else None
            if as_json:
                print(json.dumps({"status": status.to_dict(), "rates": rate}), flush=True)
            else:
                head = "\x1b[H\x1b[2J" if tty else ("" if shown == 0 else "\n")
                line = (
                    "  ".join(f"{k} {v}" for k, v in rate.items())
                    if rate
                    else "rates from the next refresh on"
                )
                clock = time.strftime("%H:%M:%S")
                print(f"{head}{status.table()}\n{clock}  {line}", flush=True)
            rc = 0 if all(r.alive for r in status.ranks) else 1
            prev, shown = (now, status), shown + 1
            if count is None or shown < count:
                await asyncio.sleep(every_s)
    except KeyboardInterrupt:
        pass
    return rc


def _key_space(text: str, tp_size: int, pp_size: int, layer_groups: int) -> KeySpace:
    """``NAMESPACE@LAYOUT[, block geometries G1,G2[, kv_groups K]]``: the key space as the
    connector's scheduler logs it after ``keys`` (with geometries, their count is TP x PP
    x K)."""
    head, _, listed = text.partition(", block geometries ")
    replicated = listed.endswith(", one copy across TP")
    listed = listed.removesuffix(", one copy across TP")
    listed, _, groups = listed.partition(", kv_groups ")
    groups, _, states = groups.partition(" (state ")
    kv_groups = int(groups) if groups.strip().isdigit() else 1
    state = tuple(int(s) for s in states.rstrip(")").split(",") if s.strip().isdigit())
    namespace, at, layout = head.strip().partition("@")
    if not (namespace and at and layout) or " " in layout:
        raise ConfigError(
            f"--keys {text!r} is not a key space: give what the connector's scheduler logs "
            "after 'keys ', e.g. 'NAMESPACE@LAYOUT, block geometries G1,G2'"
        )
    geometries = tuple(g for g in listed.split(",") if g)
    tp = len(geometries) // (pp_size * kv_groups) if geometries else tp_size
    return KeySpace(
        namespace, layout, tp, pp_size, layer_groups, geometries, kv_groups, state, replicated
    )


def cmd_prefix_match(args: argparse.Namespace) -> int:
    from kvray.pool import Pool

    space = _key_space(args.keys, args.tp_size, args.pp_size, args.layer_groups)
    hashes = [*args.hashes, *(args.hashes_file.read().split() if args.hashes_file else [])]
    try:
        blocks = [bytes.fromhex(h) for h in hashes]
    except ValueError as exc:
        raise ConfigError(f"block hashes are hex strings (vLLM's block hashes): {exc}") from exc
    _connect(args)
    found = Pool.attach(*_pool_ref(args)).prefix_match(space, blocks)
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.table())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _connect(args)
    name, namespace = _pool_ref(args)
    launcher.shutdown(launcher.attach(name, namespace, clients=False))
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
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) with rates (GB/s, hits/s) until Ctrl-C",
    )
    st.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")
    st.set_defaults(fn=cmd_status)
    doc = sub.add_parser(
        "doctor",
        help="check a pool config, this host and the environment (and the running pool, "
        "with --address / RAY_ADDRESS) for known traps; exit 1 on an error",
    )
    doc.add_argument("--config", help="pool config file (YAML or JSON, see configs/)")
    doc.add_argument("--world-size", type=int, help="ranks to serve (default 1)")
    doc.set_defaults(fn=cmd_doctor)
    pm = sub.add_parser(
        "prefix-match",
        help="how many leading blocks of a prefix the pool holds, in DRAM and per node",
    )
    pm.add_argument(
        "--keys",
        required=True,
        help="the key space, as the connector's scheduler logs it after 'keys ': "
        "'NAMESPACE@LAYOUT, block geometries G1,G2'",
    )
    pm.add_argument("--tp-size", type=int, default=1, help="the engine's TP size (no geometries)")
    pm.add_argument("--pp-size", type=int, default=1, help="the engine's PP size")
    pm.add_argument("--layer-groups", type=int, default=1, help="the connector's layer groups")
    pm.add_argument("hashes", nargs="*", help="the prefix's block hashes, hex, in order")
    pm.add_argument("--hashes-file", type=argparse.FileType(), help="more of them, one a line")
    pm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pm.set_defaults(fn=cmd_prefix_match)
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
