"""``kvray doctor``: the traps of the seeds' FAQs and of users' reports, checked against a
pool config, the environment and this host, each finding saying what, why and the fix.

The same checks run at ``kvray up`` (an error refuses to start the pool) and when an
engine attaches (findings are logged once): :func:`check_pool` reads nothing but its
arguments, so it is cheap and testable; :func:`check_reachable` and
:func:`check_fingerprints` talk to servers and to a running pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvray.backends.registry import spec_of
from kvray.config import PoolConfig
from kvray.findings import Finding as Finding
from kvray.findings import Host as Host


def check_pool(
    cfg: PoolConfig, env: Mapping[str, str], host: Host, *, hash_seed: bool = True
) -> list[Finding]:
    """Every offline check of ``cfg`` on this host with environment ``env``.
    ``hash_seed``: also advise on ``PYTHONHASHSEED`` (``kvray doctor``; an engine checks
    its actual hash fingerprint instead, and ``kvray up``'s own seed does not matter)."""
    out = spec_of(cfg.backend).doctor_checks(cfg, env, host)
    out += checksum_findings(cfg)
    if hash_seed:
        out += _hash_seed(env)
    return out


def checksum_findings(cfg: PoolConfig) -> list[Finding]:
    """Whether loads are verified: every host-memory path by default; never on a path
    that moves device memory (no trailer there), nor with ``checksum: false``."""
    device = spec_of(cfg.backend).device_setting(cfg)
    if device is not None:
        return [
            Finding(
                "warning",
                "checksums",
                f"{device.field} is {device.value!r}: blocks move in device memory, which "
                "carries no checksum trailer, so loads are not verified",
                "a block corrupted in the backend (memory, transfer, a backend bug) would "
                "reach the engine as it is",
                f"set {device.field} {device.host_value!r} where verified loads matter "
                "(KVRayConnector's staged placement moves blocks through host memory)",
            )
        ]
    if not cfg.checksum:
        return [
            Finding(
                "warning",
                "checksums",
                "checksum is false: loads are not verified",
                "a block corrupted in the backend's memory, transfers or SSD offload, or "
                "served wrong by a backend bug, is loaded into the engine as it is",
                "remove checksum: false (the default verifies every load; its cost is in "
                "docs/reliability.md)",
            )
        ]
    what = "every load is verified (xxh3-64 trailer per block)"
    if cfg.backend == "mooncake":
        what += (
            "; with its trailer a block usually takes an eighth more of the segment (Mooncake's "
            "allocator rounds to eight sizes per power of two: docs/reliability.md)"
        )
    return [Finding("ok", "checksums", what)]


def _hash_seed(env: Mapping[str, str]) -> list[Finding]:
    if env.get("PYTHONHASHSEED") is not None:
        return [Finding("ok", "hash seed", f"PYTHONHASHSEED={env['PYTHONHASHSEED']}")]
    return [
        Finding(
            "warning",
            "hash seed",
            "PYTHONHASHSEED is not set in this environment",
            "vLLM seeds its block hashes with it; without it sha256 hashes agree across "
            "processes but xxhash ones are random per process, and instances with different "
            "values never share blocks (the pool reports that at attach and in `kvray status`)",
            "export the same PYTHONHASHSEED (e.g. 0) for every engine, as the seeds do",
        )
    ]


def check_reachable(cfg: PoolConfig, timeout_s: float = 2.0) -> list[Finding]:
    """The external servers ``cfg`` names answer (one TCP connect each)."""
    from kvray.servers.process import why_unreachable

    targets = spec_of(cfg.backend).reachability(cfg)
    out = []
    for name, address in targets:
        why = why_unreachable(address, timeout_s)
        if why is None:
            out.append(Finding("ok", "reachability", f"{name} {address} answers"))
        else:
            out.append(
                Finding(
                    "error",
                    "reachability",
                    f"{name} {address} does not answer ({why})",
                    "every client of the pool connects to it at start",
                    "start that server, or fix the address (or unset it to let kvray run one)",
                )
            )
    if not targets:
        out.append(
            Finding("ok", "reachability", "no external server configured: kvray runs its own")
        )
    return out


def check_fingerprints(status_fingerprints: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """Hash domains a running pool saw per model (``PoolStatus.fingerprints``), and the
    models' key spaces (the namespace carries the model digest)."""
    out = []
    if status_fingerprints:
        out.append(
            Finding(
                "ok",
                "model key spaces",
                ", ".join(sorted(status_fingerprints)),
                "engines share blocks only within one key space: a namespace is the model "
                "dir's name and digest (weights, config, KV cache dtype) unless "
                "model_namespace set it",
            )
        )
    for keys, domains in status_fingerprints.items():
        if len(domains) > 1:
            each = "; ".join(
                f"{d.get('hash_algo')} seeded by {d.get('seed_source')} ({d.get('instances')} "
                "instance(s))"
                for d in domains.values()
            )
            out.append(
                Finding(
                    "error",
                    "hash seed",
                    f"blocks of {keys} are hashed {len(domains)} ways by the instances using the "
                    f"pool: {each}",
                    "instances of different hash domains never hit each other's blocks",
                    "set the same PYTHONHASHSEED and --prefix-caching-hash-algo on every "
                    "instance, then restart the odd ones",
                )
            )
    return out


def check_engines(engines: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """What vLLM does with each attached engine's failed loads (its
    ``kv_load_failure_policy``): under ``fail`` a load the pool cannot serve ends a user's
    request."""
    out = []
    for e in engines:
        name = f"engine {e.get('engine')} ({e.get('keys')})"
        policy = e.get("load_failure_policy")
        if policy == "fail":
            out.append(
                Finding(
                    "warning",
                    "load failures",
                    f"{name}: kv_load_failure_policy is 'fail' (vLLM's default)",
                    "a failed load from the pool (a checksum mismatch, a block gone at load, a "
                    "lost node) ends the request with an error",
                    'set "kv_load_failure_policy": "recompute" at the top level of its '
                    "--kv-transfer-config, then restart it",
                )
            )
        elif policy == "recompute":
            out.append(Finding("ok", "load failures", f"{name}: a failed load is recomputed"))
        else:
            out.append(
                Finding("warning", "load failures", f"{name}: kv_load_failure_policy {policy!r}")
            )
    return out


def report(findings: list[Finding]) -> str:
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    lines = [f.line() for f in findings]
    lines.append(f"{errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)
