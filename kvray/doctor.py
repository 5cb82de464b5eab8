"""``kvray doctor``: the traps of the seeds' FAQs and of users' reports, checked against a
pool config, the environment and this host, each finding saying what, why and the fix.

The same checks run at ``kvray up`` (an error refuses to start the pool) and when an
engine attaches (findings are logged once): :func:`check_pool` reads nothing but its
arguments, so it is cheap and testable; :func:`check_reachable` and
:func:`check_fingerprints` talk to servers and to a running pool.
"""

from __future__ import annotations

import glob
import resource
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvray.backends.registry import spec_of
from kvray.config import GiB, MooncakePoolConfig, PoolConfig, YuanrongPoolConfig, as_backend
from kvray.sizes import format_size

Level = Literal["error", "warning", "ok"]

SEED_CLIENT_TTL_S = 120
"""The seeds' advice for ``client_ttl`` with SSD offload: a client busy flushing to SSD
can be silent longer than a short TTL, and the master then drops its whole segment."""
MOONCAKE_OFFLOAD_BUFFER_DEFAULT = 1342177280
"""Mooncake's default ``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES`` (1.25 GB)."""


@dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    what: str
    why: str = ""
    fix: str = ""

    def line(self) -> str:
        parts = [f"[{self.level.upper():7}] {self.check}: {self.what}"]
        if self.why:
            parts.append(f"          why: {self.why}")
        if self.fix:
            parts.append(f"          fix: {self.fix}")
        return "\n".join(parts)


@dataclass(frozen=True)
class Host:
    """What the checks read of this machine (tests pass their own)."""

    mem_available: int | None
    dev_shm_free: int | None
    memlock_limit: int | None
    """RLIMIT_MEMLOCK soft limit in bytes; None: unlimited."""
    npu: bool
    rdma: bool

    @classmethod
    def probe(cls) -> Host:
        mem = None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        mem = int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            shm: int | None = shutil.disk_usage("/dev/shm").free
        except OSError:
            shm = None
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return cls(
            mem_available=mem,
            dev_shm_free=shm,
            memlock_limit=None if soft == resource.RLIM_INFINITY else soft,
            npu=bool(glob.glob("/dev/davinci[0-9]*")),
            rdma=bool(glob.glob("/sys/class/infiniband/*")),
        )


def _ms(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var, "").strip()
    return int(raw) if raw.isdigit() else None


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
    return [Finding("ok", "checksums", "every load is verified (xxh3-64 trailer per block)")]


def mooncake_checks(pool: PoolConfig, env: Mapping[str, str], host: Host) -> list[Finding]:
    """The ``mooncake`` backend's traps."""
    cfg = as_backend(pool, MooncakePoolConfig)
    return [
        *_fabric(cfg, env),
        *_ssd_offload_ttl(cfg),
        *_ascend_timeouts(cfg, env),
        *_protocol(cfg, host),
        *_memlock(cfg, host),
        *_segments_vs_memory(cfg, host),
    ]


def yuanrong_checks(pool: PoolConfig, env: Mapping[str, str], host: Host) -> list[Finding]:
    """The ``yuanrong`` backend's traps."""
    return _worker_vs_shm(as_backend(pool, YuanrongPoolConfig), host)


def _fabric(cfg: MooncakePoolConfig, env: Mapping[str, str]) -> list[Finding]:
    mc = cfg.mooncake
    if not (mc.fabric_mem or env.get("ASCEND_ENABLE_USE_FABRIC_MEM") == "1"):
        return []
    why = (
        "with ASCEND_ENABLE_USE_FABRIC_MEM=1 Mooncake maps these buffers with aclrtMapMem, "
        "which takes whole GiB only"
    )
    out = []
    sizes = {
        "mooncake.global_segment_size": mc.global_segment_size,
        "mooncake.local_buffer_size": mc.local_buffer_size,
    }
    if mc.enable_ssd_offload:
        buf = mc.offload.local_buffer_size_bytes
        name = "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"
        sizes[name + ("" if buf is not None else " (unset: Mooncake's 1.25 GB)")] = (
            buf if buf is not None else MOONCAKE_OFFLOAD_BUFFER_DEFAULT
        )
    for name, size in sizes.items():
        if size % GiB:
            out.append(
                Finding(
                    "error",
                    "fabric memory",
                    f"{name} is {size} bytes, not a multiple of 1 GiB",
                    why,
                    f"set it to a whole number of GiB (e.g. {max(1, size // GiB)} GiB = "
                    f"{max(1, size // GiB) * GiB} bytes)",
                )
            )
    if not out:
        out.append(Finding("ok", "fabric memory", "segment and buffers are whole GiB"))
    return out


def _ssd_offload_ttl(cfg: MooncakePoolConfig) -> list[Finding]:
    if not cfg.mooncake.enable_ssd_offload:
        return []
    if cfg.mooncake.master_server_address is not None:
        return [
            Finding(
                "warning",
                "client_ttl with SSD offload",
                "an external mooncake_master: its --client_ttl is not known here",
                "a client flushing to SSD can be silent longer than a short TTL; the master "
                "then drops its whole segment and its blocks become misses",
                f"start that master with --client_ttl={SEED_CLIENT_TTL_S} or more",
            )
        ]
    ttl = cfg.master.client_ttl_s
    if ttl < SEED_CLIENT_TTL_S:
        return [
            Finding(
                "warning",
                "client_ttl with SSD offload",
                f"master.client_ttl_s is {ttl} s with mooncake.enable_ssd_offload",
                "a client flushing to SSD can be silent longer than that; the master then "
                "drops its whole segment and its blocks become misses (the seeds recommend "
                f">= {SEED_CLIENT_TTL_S} s)",
                f"set master.client_ttl_s: {SEED_CLIENT_TTL_S}",
            )
        ]
    return [Finding("ok", "client_ttl with SSD offload", f"master.client_ttl_s is {ttl} s")]


def _ascend_timeouts(cfg: MooncakePoolConfig, env: Mapping[str, str]) -> list[Finding]:
    connect = _ms(env, "ASCEND_CONNECT_TIMEOUT")
    transfer = _ms(env, "ASCEND_TRANSFER_TIMEOUT")
    out = []
    if connect is not None or transfer is not None:
        longest = max(t for t in (connect, transfer) if t is not None)
        lease = cfg.master.default_kv_lease_ttl_ms
        if cfg.mooncake.master_server_address is None and lease <= longest:
            out.append(
                Finding(
                    "error",
                    "read lease vs Ascend timeouts",
                    f"master.default_kv_lease_ttl_ms is {lease} ms but a transfer may take up to "
                    f"{longest} ms (ASCEND_CONNECT_TIMEOUT / ASCEND_TRANSFER_TIMEOUT)",
                    "the lease is what keeps a looked-up block from being evicted until it is "
                    "read; one shorter than a transfer lets the master evict it mid-load",
                    f"set master.default_kv_lease_ttl_ms above {longest}",
                )
            )
        elif cfg.mooncake.master_server_address is None:
            out.append(
                Finding("ok", "read lease vs Ascend timeouts", f"lease {lease} ms > {longest} ms")
            )
    hccl = _ms(env, "HCCL_RDMA_TIMEOUT")
    if hccl is not None and transfer is not None:
        retry_ms = 4.096e-3 * (2**hccl) * 7  # 4.096 us x 2^v per try, 7 tries
        if transfer <= retry_ms:
            out.append(
                Finding(
                    "warning",
                    "Ascend transfer vs RDMA retransmit timeouts",
                    f"ASCEND_TRANSFER_TIMEOUT is {transfer} ms but HCCL_RDMA_TIMEOUT={hccl} "
                    f"retries for up to {retry_ms:.0f} ms",
                    "a transfer can give up while the RDMA layer is still retransmitting",
                    f"raise ASCEND_TRANSFER_TIMEOUT above {retry_ms:.0f} or lower "
                    "HCCL_RDMA_TIMEOUT",
                )
            )
    return out


def _protocol(cfg: MooncakePoolConfig, host: Host) -> list[Finding]:
    proto = cfg.mooncake.protocol
    if proto == "ascend" and not host.npu:
        return [
            Finding(
                "error",
                "protocol vs hardware",
                "mooncake.protocol is 'ascend' but this host has no /dev/davinci* device",
                "the ascend transport moves data through the NPUs' links",
                "use protocol 'tcp' (or 'rdma' with an RDMA NIC) on this host, or run where "
                "the Ascend driver is installed",
            )
        ]
    if proto == "rdma" and not host.rdma:
        return [
            Finding(
                "error",
                "protocol vs hardware",
                "mooncake.protocol is 'rdma' but this host has no RDMA device "
                "(/sys/class/infiniband is empty)",
                "the rdma transport needs an RDMA NIC and its driver",
                "use protocol 'tcp', or install the NIC's driver (rdma-core)",
            )
        ]
    if proto == "tcp" and (host.rdma or host.npu):
        better = "ascend" if host.npu else "rdma"
        return [
            Finding(
                "warning",
                "protocol vs hardware",
                f"mooncake.protocol is 'tcp' on a host with {better} hardware",
                "tcp copies through the kernel and is several times slower across nodes",
                f"set mooncake.protocol: {better} (or leave it unset to choose by hardware)",
            )
        ]
    return [Finding("ok", "protocol vs hardware", f"{proto} fits this host")]


def _memlock(cfg: MooncakePoolConfig, host: Host) -> list[Finding]:
    if cfg.mooncake.protocol not in ("rdma", "ascend") or host.memlock_limit is None:
        return []
    need = cfg.mooncake.global_segment_size + cfg.mooncake.local_buffer_size
    if host.memlock_limit >= need:
        return []
    return [
        Finding(
            "error",
            "memlock",
            f"locked-memory limit is {format_size(host.memlock_limit)}, a client registers "
            f"{format_size(need)} (segment + local buffer)",
            f"{cfg.mooncake.protocol} registers its memory with the NIC/NPU, which pins it",
            "raise it: `ulimit -l unlimited` in the shell that starts Ray, LimitMEMLOCK="
            "infinity for systemd, `--ulimit memlock=-1` for docker",
        )
    ]


def _segments_vs_memory(cfg: MooncakePoolConfig, host: Host) -> list[Finding]:
    if host.mem_available is None:
        return []
    per_client = cfg.mooncake.global_segment_size + cfg.mooncake.local_buffer_size
    need = cfg.world_size * per_client
    if need > host.mem_available:
        return [
            Finding(
                "error",
                "memory",
                f"{cfg.world_size} client(s) x {format_size(per_client)} (segment + local "
                f"buffer) = {format_size(need)} per node, but {format_size(host.mem_available)}"
                " is available here",
                "each client allocates its segment when it starts; the kernel's OOM killer "
                "then picks a process, often the engine",
                "lower mooncake.global_segment_size or world_size, or free memory",
            )
        ]
    return [
        Finding(
            "ok",
            "memory",
            f"{format_size(need)} of segments per node, {format_size(host.mem_available)} "
            "available",
        )
    ]


def _worker_vs_shm(cfg: YuanrongPoolConfig, host: Host) -> list[Finding]:
    if cfg.yuanrong.worker_address is not None or host.dev_shm_free is None:
        return []
    need = cfg.datasystem.shared_memory_size
    if need <= host.dev_shm_free:
        return []
    return [
        Finding(
            "error",
            "/dev/shm",
            f"datasystem.shared_memory_size is {format_size(need)} but /dev/shm has "
            f"{format_size(host.dev_shm_free)} free",
            "the embedded datasystem worker keeps the pool's blocks in shared memory",
            "lower datasystem.shared_memory_size, or enlarge /dev/shm (docker: "
            "--shm-size; Kubernetes: an emptyDir with medium Memory)",
        )
    ]


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


def report(findings: list[Finding]) -> str:
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    lines = [f.line() for f in findings]
    lines.append(f"{errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)
