"""`kvray doctor`: each trap set up, caught with what, why and the fix; a clean config on a
fitting host has no error; the CLI's exit code follows."""

from __future__ import annotations

import socket

import pytest

from kvray import cli, doctor
from kvray.backends import checks
from kvray.config import GiB, MiB, PoolConfig
from kvray.doctor import Finding, Host

HOST = Host(
    mem_available=64 * GiB, dev_shm_free=32 * GiB, memlock_limit=None, npu=False, rdma=False
)


def pool(**data) -> PoolConfig:  # type: ignore[no-untyped-def]
    return PoolConfig.from_dict(data, environ={})


def errors(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.level == "error" and f.check == check]


def warnings(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.level == "warning" and f.check == check]


def test_clean_default_config_has_no_error():
    found = doctor.check_pool(pool(mooncake={"protocol": "tcp"}), {"PYTHONHASHSEED": "0"}, HOST)
    assert not [f for f in found if f.level != "ok"], doctor.report(found)
    assert {f.check for f in found} >= {"protocol vs hardware", "memory", "hash seed"}


def test_fabric_memory_needs_whole_gib_buffers_including_the_offload_default(tmp_path):
    cfg = pool(
        mooncake={
            "protocol": "tcp",
            "global_segment_size": "2GB",
            "local_buffer_size": "256MB",
            "enable_ssd_offload": True,
            "ssd_offload_path": str(tmp_path),
        }
    )
    found = errors(
        doctor.check_pool(cfg, {"ASCEND_ENABLE_USE_FABRIC_MEM": "1"}, HOST), "fabric memory"
    )
    what = " ".join(f.what for f in found)
    assert "mooncake.local_buffer_size is 268435456 bytes" in what
    assert "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES (unset: Mooncake's 1.25 GB)" in what
    assert "global_segment_size" not in what  # 2GB is whole
    assert all("aclrtMapMem" in f.why and "GiB" in f.fix for f in found)
    # Set to whole GiB: clean.
    ok = pool(mooncake={"protocol": "tcp", "local_buffer_size": "1GB"})
    assert not errors(
        doctor.check_pool(ok, {"ASCEND_ENABLE_USE_FABRIC_MEM": "1"}, HOST), "fabric memory"
    )
    # Without fabric memory nothing is asked of the sizes.
    assert not checks._fabric(cfg, {})


def test_client_ttl_with_ssd_offload(tmp_path):
    mc = {"protocol": "tcp", "enable_ssd_offload": True, "ssd_offload_path": str(tmp_path)}
    (w,) = warnings(doctor.check_pool(pool(mooncake=mc), {}, HOST), "client_ttl with SSD offload")
    assert "client_ttl_s is 10 s" in w.what and "master.client_ttl_s: 120" in w.fix
    fine = pool(mooncake=mc, master={"client_ttl_s": 120})
    assert not warnings(doctor.check_pool(fine, {}, HOST), "client_ttl with SSD offload")
    external = pool(mooncake={**mc, "master_server_address": "10.0.0.1:50051"})
    (w,) = warnings(doctor.check_pool(external, {}, HOST), "client_ttl with SSD offload")
    assert "--client_ttl=120" in w.fix


def test_read_lease_shorter_than_ascend_timeouts():
    env = {"ASCEND_CONNECT_TIMEOUT": "10000", "ASCEND_TRANSFER_TIMEOUT": "10000"}
    (e,) = errors(
        doctor.check_pool(pool(mooncake={"protocol": "tcp"}), env, HOST),
        "read lease vs Ascend timeouts",
    )
    assert "5000 ms" in e.what and "10000 ms" in e.what and "above 10000" in e.fix
    longer = pool(mooncake={"protocol": "tcp"}, master={"default_kv_lease_ttl_ms": 12000})
    assert not errors(doctor.check_pool(longer, env, HOST), "read lease vs Ascend timeouts")
    env2 = {"ASCEND_TRANSFER_TIMEOUT": "1000", "HCCL_RDMA_TIMEOUT": "17"}
    (w,) = warnings(
        doctor.check_pool(longer, env2, HOST), "Ascend transfer vs RDMA retransmit timeouts"
    )
    assert "HCCL_RDMA_TIMEOUT=17" in w.what and "3758 ms" in w.what


@pytest.mark.parametrize(
    ("protocol", "host", "level", "fragment"),
    [
        ("ascend", HOST, "error", "no /dev/davinci"),
        ("rdma", HOST, "error", "no RDMA device"),
        ("tcp", Host(64 * GiB, 32 * GiB, None, npu=False, rdma=True), "warning", "rdma hardware"),
        ("rdma", Host(64 * GiB, 32 * GiB, None, npu=False, rdma=True), "ok", "fits"),
    ],
)
def test_protocol_vs_hardware(protocol, host, level, fragment):
    (f,) = [f for f in doctor.check_pool(pool(mooncake={"protocol": protocol}), {}, host)
            if f.check == "protocol vs hardware"]  # fmt: skip
    assert f.level == level and fragment in f.what


def test_memlock_for_registered_memory():
    host = Host(64 * GiB, 32 * GiB, memlock_limit=64 * MiB, npu=False, rdma=True)
    (e,) = errors(doctor.check_pool(pool(mooncake={"protocol": "rdma"}), {}, host), "memlock")
    assert "limit is 64.0 MiB" in e.what and "registers 1.2 GiB" in e.what
    assert "ulimit -l unlimited" in e.fix and "memlock=-1" in e.fix
    assert not errors(doctor.check_pool(pool(mooncake={"protocol": "tcp"}), {}, host), "memlock")


def test_segments_larger_than_memory_and_shm():
    small = Host(
        mem_available=2 * GiB, dev_shm_free=512 * MiB, memlock_limit=None, npu=False, rdma=False
    )
    cfg = pool(world_size=2, mooncake={"protocol": "tcp", "global_segment_size": "1GB"})
    (e,) = errors(doctor.check_pool(cfg, {}, small), "memory")
    assert "2 client(s)" in e.what and "global_segment_size" in e.fix
    ds = pool(backend="yuanrong", datasystem={"shared_memory_size": "1GB"})
    (e,) = errors(doctor.check_pool(ds, {}, small), "/dev/shm")
    assert "--shm-size" in e.fix


def test_hash_seed_advice_and_a_running_pool_mismatch():
    (w,) = warnings(doctor.check_pool(pool(mooncake={"protocol": "tcp"}), {}, HOST), "hash seed")
    assert "PYTHONHASHSEED" in w.fix
    assert not [
        f for f in doctor.check_pool(pool(), {}, HOST, hash_seed=False) if f.check == "hash seed"
    ]
    one = {"hash_algo": "sha256", "seed_source": "PYTHONHASHSEED"}
    fps = {"m@l": {"a": {**one, "instances": 2}, "b": {**one, "instances": 1}}}
    (e,) = errors(doctor.check_fingerprints(fps), "hash seed")
    assert "hashed 2 ways" in e.what
    (ok,) = doctor.check_fingerprints({"tiny-m0123456789ab@l": {"a": {}}})
    assert (ok.level, ok.check) == ("ok", "model key spaces")
    assert "tiny-m0123456789ab@l" in ok.what


def test_unreachable_external_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = pool(mooncake={"protocol": "tcp", "master_server_address": f"127.0.0.1:{port}"})
    (e,) = errors(doctor.check_reachable(cfg, 1.0), "reachability")
    assert "mooncake.master_server_address" in e.what and "does not answer" in e.what


def test_cli_exit_code_and_up_refuses_on_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(doctor.Host, "probe", classmethod(lambda cls: HOST))
    good = tmp_path / "good.json"
    good.write_text('{"mooncake": {"protocol": "tcp"}}')
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert cli.main(["doctor", "--config", str(good)]) == 0
    assert "0 error(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"mooncake": {"protocol": "ascend"}}')
    assert cli.main(["doctor", "--config", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "[ERROR  ] protocol vs hardware" in out and "fix:" in out
    broken = tmp_path / "broken.json"
    broken.write_text('{"mooncake": {"global_segment_size": "lots"}}')
    assert cli.main(["doctor", "--config", str(broken)]) == 1
    assert "global_segment_size" in capsys.readouterr().out
    # kvray up refuses before it connects to anything.
    monkeypatch.setattr(cli, "_connect", lambda args: pytest.fail("up connected despite errors"))
    assert cli.main(["up", "--config", str(bad)]) == 2
    assert "refusing to start the pool" in capsys.readouterr().err


def test_checksums_are_on_by_default_and_their_absence_is_said():
    default = pool(mooncake={"protocol": "tcp"})
    assert default.checksum is True
    found = doctor.check_pool(default, {}, HOST)
    (ok,) = [f for f in found if f.check == "checksums"]
    assert ok.level == "ok" and "an eighth more of the segment" in ok.what
    yuanrong = doctor.check_pool(pool(backend="yuanrong"), {}, HOST)
    (ok,) = [f for f in yuanrong if f.check == "checksums"]
    assert ok.level == "ok" and "segment" not in ok.what
    off = doctor.check_pool(pool(mooncake={"protocol": "tcp"}, checksum=False), {}, HOST)
    (w,) = warnings(off, "checksums")
    assert "checksum is false" in w.what and "remove checksum: false" in w.fix
    for data in (
        {"backend": "yuanrong", "yuanrong": {"device": "npu"}},
        {"backend": "memcache", "memcache": {"region": "device"}},
    ):
        (w,) = warnings(doctor.check_pool(pool(**data), {}, HOST), "checksums")
        assert "no checksum trailer" in w.what, w.line()


def test_each_attached_engines_load_failure_policy_is_listed():
    """``kvray doctor`` and ``kvray status`` say, per engine, what a failed load does: under
    vLLM's default ``fail`` it ends the request, which doctor warns about, naming the key."""
    from kvray.pool_state import PoolState
    from kvray.status import PoolStatus

    state = PoolState("p")
    fp = {"hash_algo": "sha256", "seed_source": "vLLM default", "hash_domain": "d1"}
    for name, policy in (("h:1", "fail"), ("h:2", "recompute")):
        engine = {"engine": name, "keys": "m@l", "kv_role": "kv_both",
                  "load_failure_policy": policy}  # fmt: skip
        state.register_fingerprint("m@l", fp, engine)
    engines = state.engine_list()
    found = doctor.check_engines(engines)
    assert [(f.level, f.check) for f in found] == [
        ("warning", "load failures"),
        ("ok", "load failures"),
    ]
    assert "h:1" in found[0].what and '"kv_load_failure_policy": "recompute"' in found[0].fix
    assert "ends the request" in found[0].why
    status = PoolStatus("p", "kvray", "mooncake", "127.0.0.1:1", True, 1, engines=engines)
    table = status.table()
    assert "engine h:1 (kv_both, m@l): a failed load ENDS THE REQUEST" in table, table
    assert "engine h:2 (kv_both, m@l): a failed load is recomputed" in table, table
    assert [e["load_failure_policy"] for e in status.to_dict()["engines"]] == ["fail", "recompute"]
