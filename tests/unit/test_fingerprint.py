"""Hash fingerprints: equal exactly when two engines derive the same block hashes, named
with their cause and fix when they differ, shown by ``kvray status``."""

from __future__ import annotations

from kvray.connector.fingerprint import fingerprint, mismatch_message, random_seed_message
from kvray.status import PoolStatus


def test_domain_is_equal_exactly_when_algorithm_and_seed_hash_are():
    env = {"PYTHONHASHSEED": "1"}
    a = fingerprint("sha256", b"\x01" * 32, env)
    assert a == fingerprint("sha256", b"\x01" * 32, env)
    assert a.hash_domain != fingerprint("sha256", b"\x02" * 32, env).hash_domain
    assert a.hash_domain != fingerprint("sha256_cbor", b"\x01" * 32, env).hash_domain
    assert (
        fingerprint("xxhash", 12345, env).hash_domain
        != fingerprint("xxhash", 1234, env).hash_domain
    )


def test_seed_source():
    assert fingerprint("sha256", b"x", {"PYTHONHASHSEED": "0"}).seed_source == "PYTHONHASHSEED"
    assert fingerprint("sha256", b"x", {}).seed_source == "vLLM default"
    assert fingerprint("xxhash", b"x", {}).seed_source == "random per process"


def test_messages_name_both_sides_and_the_fix():
    mine = fingerprint("sha256", b"\x01", {"PYTHONHASHSEED": "1"})
    other = fingerprint("xxhash", b"\x02", {}).as_dict() | {"instances": 3}
    msg = mismatch_message("Qwen3-8B", mine, [other])
    assert "Qwen3-8B" in msg and mine.hash_domain in msg and other["hash_domain"] in msg
    assert "xxhash seeded by random per process" in msg and "3 instance(s)" in msg
    assert "PYTHONHASHSEED" in msg and "--prefix-caching-hash-algo" in msg
    rnd = random_seed_message(fingerprint("xxhash", b"\x02", {}))
    assert "random" in rnd and "PYTHONHASHSEED" in rnd


def test_status_table_shows_a_mismatch_only_when_there_is_one():
    status = PoolStatus("p", "kvray", "mooncake", "127.0.0.1:1", True, 1)
    one = fingerprint("sha256", b"\x01", {"PYTHONHASHSEED": "1"}).as_dict() | {"instances": 2}
    two = fingerprint("sha256", b"\x02", {"PYTHONHASHSEED": "2"}).as_dict() | {"instances": 1}
    status.fingerprints = {"m@float32-b128-h4x64": {one["hash_domain"]: one}}
    assert status.hash_mismatches() == {} and "HASH MISMATCH" not in status.table()
    assert "model key spaces: m@float32-b128-h4x64" in status.table()
    status.fingerprints["m@float32-b128-h4x64"][two["hash_domain"]] = two
    assert list(status.hash_mismatches()) == ["m@float32-b128-h4x64"]
    table = status.table()
    assert "HASH MISMATCH for m@float32-b128-h4x64: 2 ways" in table
    assert "(2 instance(s)" in table and "(1 instance(s)" in table
    assert status.to_dict()["fingerprints"] == status.fingerprints
