"""Each backend's traps for ``kvray doctor`` (the seeds' FAQs and users' reports), as
:class:`~kvray.findings.Finding`s; the backend registry names them per backend, and
:func:`kvray.doctor.check_pool` runs them."""

from __future__ import annotations

from collections.abc import Mapping

from kvray.config import GiB, MooncakePoolConfig, PoolConfig, YuanrongPoolConfig, as_backend
from kvray.findings import Finding, Host
from kvray.sizes import format_size

SEED_CLIENT_TTL_S = 120
"""The seeds' advice for ``client_ttl`` with SSD offload: a client busy flushing to SSD
can be silent longer than a short TTL, and the master then drops its whole segment."""
MOONCAKE_OFFLOAD_BUFFER_DEFAULT = 1342177280
"""Mooncake's default ``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES`` (1.25 GB)."""


def _ms(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var, "").strip()
    return int(raw) if raw.isdigit() else None


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
