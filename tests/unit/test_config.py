import json

import pytest

from kvray.config import ConnectorConfig, MooncakeConfig, PoolConfig, detect_protocol
from kvray.errors import ConfigError

GIB = 1 << 30


def write(tmp_path, data, name="mooncake.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


def test_mooncake_json_as_deployments_write_it(tmp_path):
    path = write(
        tmp_path,
        {
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": "10.0.0.5:50088",
            "global_segment_size": "1GB",
            "local_buffer_size": "1048576KB",
            "preferred_segment": True,
            "prefer_alloc_in_same_node": False,
        },
    )
    cfg = MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": path})
    assert cfg.master_server_address == "10.0.0.5:50088"
    assert cfg.global_segment_size == GIB
    assert cfg.local_buffer_size == GIB
    assert cfg.preferred_segment is True and cfg.prefer_alloc_in_same_node is False


def test_env_overrides_json(tmp_path):
    path = write(
        tmp_path, {"master_server_address": "10.0.0.5:50088", "global_segment_size": "1GB"}
    )
    env = {
        "MOONCAKE_CONFIG_PATH": path,
        "MOONCAKE_MASTER": "127.0.0.1:6000",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2048MB",
    }
    cfg = MooncakeConfig.from_env(env)
    assert cfg.master_server_address == "127.0.0.1:6000"
    assert cfg.global_segment_size == 2 * GIB


def test_no_file_no_env_means_embedded_defaults():
    cfg = MooncakeConfig.from_env({})
    assert cfg.master_server_address is None
    assert cfg.global_segment_size == GIB
    assert cfg.metadata_server == "P2PHANDSHAKE"


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"global_segment_size": "10G"}, "global_segment_size", "cannot parse size"),
        ({"global_segment_size": 100}, "global_segment_size", "at least 16MB"),
        ({"global_segment_size": "8MB"}, "global_segment_size", "at least 16MB"),
        ({"local_buffer_size": "x"}, "local_buffer_size", "cannot parse size"),
        ({"master_server_address": "localhost"}, "master_server_address", "host:port"),
        ({"master_server_address": "h:70000"}, "master_server_address", "host:port"),
        ({"protocol": "udp"}, "protocol", "tcp"),
        ({"preferred_segment": "maybe"}, "preferred_segment", "bool"),
        ({"global_segement_size": "1GB"}, "global_segement_size", "unknown field"),
    ],
)
def test_bad_values_name_the_field(tmp_path, data, field, fragment):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": path})
    msg = str(info.value)
    assert f"  {field}:" in msg and fragment in msg and path in msg


def test_empty_env_var_is_an_error():
    with pytest.raises(ConfigError, match="MOONCAKE_MASTER is set but empty"):
        MooncakeConfig.from_env({"MOONCAKE_MASTER": " "})


def test_bad_env_size_names_field():
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeConfig.from_env({"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(tmp_path / "nope.json")})
    with pytest.raises(ConfigError, match="not valid JSON"):
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": write(tmp_path, "{oops")})
    with pytest.raises(ConfigError, match="JSON object"):
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": write(tmp_path, "[1]")})


def test_fabric_mem_requires_whole_gib(tmp_path):
    env = {"ASCEND_ENABLE_USE_FABRIC_MEM": "1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1280MB"}
    with pytest.raises(ConfigError, match="multiple of 1GB"):
        MooncakeConfig.from_env(env)
    env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = "2GB"
    assert MooncakeConfig.from_env(env).global_segment_size == 2 * GIB
    # Without fabric memory any size is fine.
    plain = MooncakeConfig.from_env({"MOONCAKE_GLOBAL_SEGMENT_SIZE": "1280MB"})
    assert plain.global_segment_size == 1280 << 20


def test_protocol_detected_from_devices(tmp_path):
    dev, ib = tmp_path / "dev", tmp_path / "ib"
    dev.mkdir()
    assert detect_protocol(dev, ib) == "tcp"
    ib.mkdir()
    (ib / "mlx5_0").mkdir()
    assert detect_protocol(dev, ib) == "rdma"
    (dev / "davinci0").touch()
    assert detect_protocol(dev, ib) == "ascend"


def test_connector_extra_config_keys():
    cfg = ConnectorConfig.model_validate(
        {
            "backend": "mooncake",
            "lookup_rpc_port": 100,
            "load_async": True,
            "consumer_is_to_put": True,
            "consumer_is_to_load": True,
            "prefill_pp_size": 2,
            "prefill_pp_layer_partition": "30,31",
        }
    )
    assert cfg.layer_partition(61) == [30, 31]
    assert ConnectorConfig(prefill_pp_size=2).layer_partition(61) == [31, 30]
    assert ConnectorConfig().backend == "mooncake"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"backend": "redis"}, "backend"),
        ({"prefill_pp_layer_partition": "30,x", "prefill_pp_size": 2}, "comma-separated"),
        (
            {"prefill_pp_layer_partition": "30,31", "prefill_pp_size": 3},
            "one layer count per prefill PP stage",
        ),
        ({"lookup_rpc_port": -1}, "lookup_rpc_port"),
        ({"load_asynch": True}, "unknown field"),
        ({"load_async": "sometimes"}, "load_async"),
    ],
)
def test_connector_config_errors(data, fragment):
    from kvray.config import validate

    with pytest.raises(ConfigError, match=fragment):
        validate(ConnectorConfig, data, source="kv_connector_extra_config")


def test_seed_spellings():
    """As the seeds write them: the partition alone gives the PP size (size *or*
    partition), the protocol in any case, AscendStore's lookup_rpc_port accepted."""
    cfg = ConnectorConfig.model_validate({"prefill_pp_layer_partition": [30, 31]})
    assert cfg.prefill_pp_size == 2 and cfg.layer_partition(61) == [30, 31]
    assert ConnectorConfig.model_validate({"lookup_rpc_port": 50051}).lookup_rpc_port == 50051
    assert ConnectorConfig.model_validate({"mooncake_rpc_port": 1}).mooncake_rpc_port == 1
    assert MooncakeConfig.model_validate({"protocol": "Ascend"}).protocol == "ascend"
    assert MooncakeConfig.model_validate({"protocol": "TCP"}).protocol == "tcp"
    with pytest.raises(ValueError, match="protocol"):
        MooncakeConfig.model_validate({"protocol": "hccs"})


def test_partition_must_match_model():
    with pytest.raises(ConfigError, match="sums to 61 layers but the model has 60"):
        ConnectorConfig(prefill_pp_size=2, prefill_pp_layer_partition="30,31").layer_partition(60)


def test_pool_config_from_yaml(tmp_path):
    p = tmp_path / "pool.yaml"
    p.write_text(
        "name: prod\nworld_size: 4\nmooncake:\n  master_server_address: 127.0.0.1:50051\n"
        "  global_segment_size: 4GB\nmaster:\n  eviction_ratio: 0.1\n"
    )
    cfg = PoolConfig.from_file(p, environ={})
    assert cfg.name == "prod" and cfg.world_size == 4
    assert cfg.mooncake.global_segment_size == 4 * GIB
    assert cfg.master.eviction_ratio == 0.1


def test_pool_config_takes_mooncake_from_env_when_absent(tmp_path):
    cfg = PoolConfig.from_dict({"name": "a"}, environ={"MOONCAKE_MASTER": "127.0.0.1:7"})
    assert cfg.mooncake.master_server_address == "127.0.0.1:7"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"name": "bad name"}, "name"),
        ({"world_size": 0}, "world_size"),
        ({"master": {"eviction_ratio": 2}}, "master.eviction_ratio"),
        ({"master": {"extra_args": ["oops"]}}, "--flag=value"),
        ({"transfer_window_size": "big"}, "transfer_window_size"),
    ],
)
def test_pool_config_errors(data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PoolConfig.from_dict(data, environ={})


def test_config_round_trips_through_json():
    cfg = PoolConfig.from_dict({"world_size": 2}, environ={})
    assert PoolConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_example_configs_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    assert (
        PoolConfig.from_file(root / "pool.yaml", environ={}).mooncake.master_server_address is None
    )
    ext = PoolConfig.from_file(root / "pool-external-master.yaml", environ={})
    assert ext.mooncake.protocol == "rdma" and ext.world_size == 8
    mc = MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(root / "mooncake.json")})
    assert mc.global_segment_size == GIB


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"placement_strategy": "SPREAD"}, "placement_strategy was removed"),
        ({"backend": "yuanrong", "replica_num": 2}, "replica_num 2 needs backend mooncake"),
        ({"replica_num": 0}, "greater than or equal to 1"),
        ({"server_host": "0.0.0.0"}, "server_host '0.0.0.0' would listen on every interface"),
        ({"server_host": "::"}, "server_host '::' would listen on every interface"),
        ({"server_host": "my-host"}, "server_host 'my-host': write auto, node, loopback or an IP"),
    ],
)
def test_pool_config_multinode_errors(data, fragment):
    from kvray.config import PoolConfig

    with pytest.raises(ConfigError, match=fragment):
        PoolConfig.from_dict(data, environ={})


def test_replicas_and_node_address_defaults():
    from kvray.config import PoolConfig

    cfg = PoolConfig.from_dict({"replica_num": 2}, environ={})
    assert cfg.replica_num == 2
    # unset: each node's clients advertise their own node's address (filled in there)
    assert cfg.mooncake.local_hostname is None


def test_nested_typo_lists_the_sections_fields():
    from kvray.config import YuanrongConfig

    with pytest.raises(ConfigError) as err:
        PoolConfig.from_dict({"backend": "yuanrong", "yuanrong": {"write_mod": "keep"}}, environ={})
    line = next(x for x in str(err.value).splitlines() if "yuanrong.write_mod" in x)
    allowed = line.split("allowed here: ")[1].split(", ")
    assert allowed == sorted(YuanrongConfig.model_fields)
    assert "world_size" not in allowed and "write_mode" in allowed
    with pytest.raises(ConfigError, match=r"mooncake\.offload\.bucket_keys: .* bucket_keys_limit"):
        PoolConfig.from_dict({"mooncake": {"offload": {"bucket_keys": 1}}}, environ={})


def test_pipeline_and_partition_are_parsed_once_into_typed_values(tmp_path):
    from kvray.config import Pipeline

    cfg = PoolConfig.from_dict(
        {"pipeline": "mooncake | ssd", "ssd": {"path": str(tmp_path)}}, environ={}
    )
    assert cfg.tiers == Pipeline("mooncake", ssd=True) and cfg.ssd_tier
    assert str(cfg.tiers) == "mooncake|ssd" and cfg.pipeline == "mooncake | ssd"
    again = PoolConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg and again.tiers == cfg.tiers
    assert PoolConfig.from_dict({}, environ={}).tiers == Pipeline("mooncake")
    assert Pipeline.parse("yuanrong|ssd") == Pipeline("yuanrong", ssd=True)
    assert Pipeline.parse("mooncake|posix") is None
    conn = ConnectorConfig.model_validate({"prefill_pp_layer_partition": [10, 10, 12]})
    assert conn.prefill_partition == (10, 10, 12) and conn.prefill_pp_size == 3
    assert conn.model_dump()["prefill_pp_layer_partition"] == "10,10,12"
    assert ConnectorConfig.model_validate_json(conn.model_dump_json()) == conn
    assert ConnectorConfig().prefill_partition is None


SECTIONS = {
    "mooncake": {"mooncake", "master"},
    "yuanrong": {"yuanrong", "datasystem"},
    "memcache": {"memcache", "memcache_meta"},
}


@pytest.mark.parametrize("backend", sorted(SECTIONS))
def test_each_backends_config_holds_only_its_sections(backend):
    from kvray.config import POOL_CONFIGS

    cfg = PoolConfig.from_dict({"backend": backend}, environ={})
    assert type(cfg) is POOL_CONFIGS[backend] and isinstance(cfg, PoolConfig)
    assert set(type(cfg).model_fields) - set(PoolConfig.model_fields) == SECTIONS[backend]
    for other in set().union(*SECTIONS.values()) - SECTIONS[backend]:
        assert not hasattr(cfg, other)
    # The JSON the pool's actors get gives back an equal config of the same class.
    again = PoolConfig.model_validate_json(cfg.model_dump_json())
    assert type(again) is type(cfg) and again == cfg
    assert type(PoolConfig.model_validate(cfg.model_dump())) is type(cfg)
    assert type(cfg.model_copy(update={"io_threads": 2})) is type(cfg)


def test_default_backend_is_mooncake():
    from kvray.config import MooncakePoolConfig

    cfg = PoolConfig.from_dict({}, environ={})
    assert isinstance(cfg, MooncakePoolConfig) and cfg.backend == "mooncake"
    assert isinstance(PoolConfig.model_validate_json("{}"), MooncakePoolConfig)


@pytest.mark.parametrize(
    ("data", "field", "owner"),
    [
        ({"backend": "yuanrong", "mooncake": {}}, "mooncake", "mooncake"),
        ({"backend": "yuanrong", "memcache_meta": {}}, "memcache_meta", "memcache"),
        ({"backend": "memcache", "master": {"eviction_ratio": 0.1}}, "master", "mooncake"),
        ({"backend": "mooncake", "datasystem": {}}, "datasystem", "yuanrong"),
        ({"backend": "memcache", "yuanrong": {}}, "yuanrong", "yuanrong"),
    ],
)
def test_another_backends_section_is_refused_naming_the_fix(data, field, owner):
    data = {"backend": "mooncake", **data}
    data[data["backend"]] = {}  # its own section given too: only the foreign one is wrong
    with pytest.raises(ConfigError) as err:
        PoolConfig.from_dict(data, environ={})
    assert str(err.value).splitlines()[1:] == [
        f"  {field}: only for backend '{owner}' (this pool's backend is '{data['backend']}'): "
        f"remove the section or set backend: {owner}"
    ]


def test_a_bad_backend_is_named_before_the_sections():
    with pytest.raises(ConfigError) as err:
        PoolConfig.from_dict({"backend": "redis", "mooncake": {}, "world_size": 0}, environ={})
    lines = str(err.value).splitlines()[1:]
    assert [x.split(":")[0].strip() for x in lines] == ["backend", "world_size"]
    with pytest.raises(TypeError, match="abstract"):
        PoolConfig()  # the common part alone is no pool: parse one


@pytest.mark.parametrize(
    ("setting", "alive", "host"),
    [
        ("auto", 1, "127.0.0.1"),  # a one-node cluster: loopback, reachable from it only
        ("auto", 2, "10.0.0.7"),  # more nodes: the address Ray knows the node by
        ("node", 1, "10.0.0.7"),
        ("loopback", 3, "127.0.0.1"),
        ("192.168.5.1", 3, "192.168.5.1"),
    ],
)
def test_the_embedded_server_listens_where_server_host_says(setting, alive, host):
    cfg = PoolConfig.from_dict({"server_host": setting}, environ={})
    assert cfg.listen_host("10.0.0.7", alive) == host


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:5000", True),
        ("127.0.0.2:5000", True),
        ("localhost:5000", True),
        ("tcp://127.0.0.1:5000", True),
        ("[::1]:5000", True),
        ("10.77.0.1:5000", False),
        ("tcp://10.77.0.1:5000", False),
        ("master.example:5000", False),
    ],
)
def test_a_loopback_server_address_is_told_apart(address, loopback):
    from kvray.servers.process import is_loopback

    assert is_loopback(address) is loopback
