"""The yuanrong backend's pieces that need no server: config from the DS_* environment,
the SDK error mapping (messages as the real SDK words them), the embedded worker's
command line."""

from __future__ import annotations

import pytest

from kvray.backends.base import KeyStatus
from kvray.backends.yuanrong import classify, code_of
from kvray.config import ConnectorConfig, DatasystemWorkerConfig, PoolConfig, YuanrongConfig
from kvray.errors import ConfigError
from kvray.servers.datasystem import UDS_DIR_MAX, DatasystemWorker


def test_env_is_read_once_into_the_typed_config(tmp_path):
    cfg = YuanrongConfig.from_env(
        {
            "DS_WORKER_ADDR": "10.0.0.5:31501",
            "DATASYSTEM_CLIENT_LOG_DIR": str(tmp_path),
            "DS_ENABLE_EXCLUSIVE_CONNECTION": "0",
            "DS_ENABLE_REMOTE_H2D": "1",
        }
    )
    assert cfg.worker_address == "10.0.0.5:31501"
    assert cfg.client_log_dir == str(tmp_path)
    assert cfg.enable_exclusive_connection is False and cfg.enable_remote_h2d is True
    assert cfg.connect_timeout_ms == 5000 and cfg.request_timeout_ms == 5000


def test_no_worker_address_means_embedded():
    cfg = PoolConfig.from_dict({"backend": "yuanrong"}, environ={})
    assert cfg.yuanrong.worker_address is None and cfg.embedded_server
    assert cfg.yuanrong.write_mode == "evict" and cfg.yuanrong.device == "host"
    assert cfg.yuanrong.enable_exclusive_connection


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"DS_WORKER_ADDR": "localhost"}, r"worker_address: .*host:port"),
        ({"DS_WORKER_ADDR": "h:99999"}, r"worker_address: .*1\.\.65535"),
        ({"DS_WORKER_ADDR": "  "}, "DS_WORKER_ADDR is set but empty"),
        ({"DS_ENABLE_REMOTE_H2D": "maybe"}, "DS_ENABLE_REMOTE_H2D must be 1 or 0"),
    ],
)
def test_bad_environment_names_the_variable_or_field(env, match):
    with pytest.raises(ConfigError, match=match):
        YuanrongConfig.from_env(env)


def test_pool_config_reads_ds_variables_only_for_yuanrong():
    env = {"DS_WORKER_ADDR": "127.0.0.1:31501", "MOONCAKE_MASTER": "127.0.0.1:50051"}
    yr = PoolConfig.from_dict({"backend": "yuanrong"}, environ=env)
    assert yr.yuanrong.worker_address == "127.0.0.1:31501" and not yr.embedded_server
    mc = PoolConfig.from_dict({}, environ=env)
    assert not hasattr(mc, "yuanrong")  # a mooncake pool has no yuanrong section
    assert mc.mooncake.master_server_address == "127.0.0.1:50051"


def test_node_worker_addresses():
    data = {
        "backend": "yuanrong",
        "yuanrong": {
            "worker_address": "10.0.0.1:31501",
            "node_worker_addresses": {"10.0.0.1": "10.0.0.1:31501", "10.0.0.2": "10.0.0.2:31501"},
        },
    }
    cfg = PoolConfig.from_dict(data, environ={})
    assert [cfg.yuanrong.address_on(ip) for ip in ("10.0.0.1", "10.0.0.2")] == [
        "10.0.0.1:31501",
        "10.0.0.2:31501",
    ]
    with pytest.raises(ConfigError, match=r"no worker for node 10\.0\.0\.3 .*add \"10\.0\.0\.3\""):
        cfg.yuanrong.address_on("10.0.0.3")
    plain = PoolConfig.from_dict(
        {**data, "yuanrong": {"worker_address": "10.0.0.1:31501"}}, environ={}
    )
    assert plain.yuanrong.address_on("10.0.0.9") == "10.0.0.1:31501"  # one worker for all
    without = {"node_worker_addresses": {"10.0.0.1": "10.0.0.1:31501"}}
    with pytest.raises(ConfigError, match="set worker_address too"):
        PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": without}, environ={})
    bad = {"worker_address": "10.0.0.1:31501", "node_worker_addresses": {"10.0.0.2": "nope"}}
    with pytest.raises(ConfigError, match=r"yuanrong\.node_worker_addresses\.10\.0\.0\.2"):
        PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": bad}, environ={})


def test_typos_and_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"yuanrong\.write_mod: unknown field"):
        PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": {"write_mod": "keep"}})
    with pytest.raises(ConfigError, match=r"datasystem\.shared_memory_size: .*at least 64MB"):
        PoolConfig.from_dict({"backend": "yuanrong", "datasystem": {"shared_memory_size": "1MB"}})
    with pytest.raises(ConfigError, match=r"backend: .*'mooncake', 'yuanrong' or 'memcache'"):
        PoolConfig.from_dict({"backend": "redis"}, environ={})
    assert ConnectorConfig(backend="yuanrong").backend == "yuanrong"


# Messages exactly as openyuanrong-datasystem 0.8.1 raised them against a real worker.
SDK_ERRORS = [
    (
        "code: [Key not found], msg: [Cannot get objects from worker, traceId: d804e0ca]",
        KeyStatus.NOT_FOUND,
    ),
    (
        "code: [Out of memory], msg: [Shared memory no space in arena: 2, traceId: b95. RPC "
        "Retry detail: [ Out of memory * 4 ] with 3 times in 2000 ms.]",
        KeyStatus.POOL_FULL,
    ),
    (
        "code: [Invalid parameter], msg: [Thread ID 1 Invalid parameter. The key contains "
        "illegal char(s)]",
        KeyStatus.INVALID,
    ),
    (
        "code: [RPC unavailable], msg: [[UDS_CONNECT_FAILED] Socket (20) can not connect to "
        "/tmp/x/uds/7822e87f/exclusiveConn with unix domain socket: errno = 111]",
        None,
    ),
    ("code: [RPC deadline exceeded], msg: [timeout]", None),
    (  # the last of the SDK's retries of a put into a full worker ran out of time
        "code: [RPC unavailable], msg: [[RPC_RECV_TIMEOUT] Rpc service for client 6c159223 "
        "has not responded within the allowed time. Detail: code: [Try again], msg: [Try "
        "again. The queue is empty within allowed time: 3 ms | traceId : 178b7a35]. RPC "
        "Retry detail: [ RPC unavailable * 1 Out of memory * 3 ] with 3 times in 1000 ms.]",
        KeyStatus.POOL_FULL,
    ),
    (
        "code: [RPC unavailable], msg: [timeout. RPC Retry detail: [ RPC unavailable * 3 ] "
        "with 3 times in 1000 ms.]",
        None,
    ),
    ("code: [Something new], msg: [?]", KeyStatus.ERROR),
]


@pytest.mark.parametrize(("message", "status"), SDK_ERRORS)
def test_sdk_errors_map_to_key_status_or_unavailable(message, status):
    assert classify(RuntimeError(message)) is status
    assert code_of(RuntimeError(message)) == message.split("]", 1)[0].removeprefix("code: [")


def test_worker_command_is_loopback_lean_and_self_contained(tmp_path):
    w = DatasystemWorker(
        DatasystemWorkerConfig(shared_memory_size="512MB", data_dir=str(tmp_path)), name="p"
    )
    w.port, w.metastore_port = 31501, 31511
    flags = dict(a.removeprefix("--").split("=", 1) for a in w.command()[1:])
    assert flags["worker_address"] == "127.0.0.1:31501"
    assert flags["metastore_address"] == "127.0.0.1:31511"
    assert flags["start_metastore_service"] == "true"
    assert flags["shared_memory_size_mb"] == "512" and flags["log_monitor"] == "false"
    for key in ("rocksdb_store_dir", "log_dir", "ready_check_path"):
        assert flags[key].startswith(str(tmp_path)), key
    # sockets under the data dir too, unless its path is too long for a socket's (then a
    # directory of its own in /tmp; an xdist worker's tmp_path can be)
    uds = flags["unix_domain_socket_dir"]
    if len(str(w.home / "uds")) <= UDS_DIR_MAX:
        assert uds == str(w.home / "uds")
    else:
        assert uds.startswith("/tmp/kvray-uds-") and uds == str(w.uds_dir)
    joiner = DatasystemWorker(
        DatasystemWorkerConfig(data_dir=str(tmp_path)), metastore_address="127.0.0.1:31511"
    )
    joiner.port = 31502
    jflags = dict(a.removeprefix("--").split("=", 1) for a in joiner.command()[1:])
    assert jflags["start_metastore_service"] == "false"
    assert jflags["metastore_address"] == "127.0.0.1:31511"
    w.stop()
    joiner.stop()
    assert not w.home.exists() and not joiner.home.exists()


def test_long_data_dir_keeps_sockets_under_the_path_limit(tmp_path):
    deep = tmp_path / ("d" * 90)
    w = DatasystemWorker(DatasystemWorkerConfig(data_dir=str(deep)))
    assert len(str(w.uds_dir)) <= UDS_DIR_MAX and w.uds_dir.is_dir()
    assert len(str(w.uds_dir)) + len("/0123abcd/exclusiveConn") < 108
    w.stop()
    assert not w.uds_dir.exists() and not w.home.exists()
