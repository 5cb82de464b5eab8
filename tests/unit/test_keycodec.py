import re

import pytest

from kvray.backends.keycodec import MEMCACHE, YUANRONG
from kvray.keys import BlockKey, KVLayout, hash_block

YR_VALID = re.compile(r"^[a-zA-Z0-9\-_!@#%\^\*\(\)\+\=\:;]{1,255}$")  # the datasystem's own rule


def test_fitting_keys_stay_readable():
    key = BlockKey("Qwen3-8B", KVLayout("bfloat16", 128, 8, 128).tag(), 1, 0, hash_block(None, [1]))
    assert YUANRONG.encode(key.to_str()) == key.to_str()


@pytest.mark.parametrize(
    "key",
    [
        "Qwen/Qwen3-8B@bfloat16-b128-h8x128@tp0@pp0@" + "ab" * 32,  # '/' not allowed
        "meta-llama/Llama-3.1-8B@x",  # '.' not allowed
        "a" * 300,  # too long
        "spaces and $dollars&",
        "k%h" + "0" * 32,  # looks like an encoded key: rewritten too
        "ü",
    ],
)
def test_other_keys_are_rewritten_validly(key):
    enc = YUANRONG.encode(key)
    assert YR_VALID.match(enc), enc
    assert enc != key
    assert YUANRONG.encode(key) == enc  # deterministic


def test_no_collisions_between_similar_keys():
    # Keys that sanitize or truncate to the same text stay distinct, and never equal a kept key.
    keys = ["a/b", "a.b", "a_b", "a b", "a/b" + "x" * 300, "a/b" + "y" * 300]
    keys += [f"model.{i}/layer@{i}" for i in range(2000)]
    encoded = [YUANRONG.encode(k) for k in keys]
    assert len(set(encoded)) == len(keys)
    assert YUANRONG.encode("a_b") == "a_b"


def test_memcache_limit():
    long_key = "m" * 300
    enc = MEMCACHE.encode(long_key)
    assert len(enc) <= 256 and enc != long_key
    assert MEMCACHE.encode("Qwen/Qwen3-8B@x") == "Qwen/Qwen3-8B@x"  # '/' is fine there
