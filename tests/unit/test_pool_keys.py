"""The Pool API's key check: the same keys pass and fail as a per-character whitespace
scan would decide, at a fraction of its cost (it runs once per key of every call). And a
pool shut down inside its ``with`` block is stopped once."""

from __future__ import annotations

import sys

import pytest

from kvray.errors import KeyFormatError
from kvray.pool import _key_str


def test_every_whitespace_character_is_refused_wherever_it_stands():
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert len(spaces) > 20  # (ASCII's, the separators, NBSP, U+3000, ...)
    for ws in spaces:
        for key in (f"a{ws}b", f"{ws}ab", f"ab{ws}", ws):
            with pytest.raises(KeyFormatError, match="whitespace"):
                _key_str(key)


@pytest.mark.parametrize(
    "key", ["kv-1", "ns:model:float16-b16-h8x128:r0:" + "ab" * 16, "ключ-é", "x" * 4096]
)
def test_printable_keys_without_whitespace_pass(key):
    assert _key_str(key) == key


@pytest.mark.parametrize("key", ["", "x" * 4097, "a\x00b", "a\x7fb", 7, b"bytes"])
def test_other_bad_keys_are_refused(key):
    with pytest.raises(KeyFormatError):
        _key_str(key)


def test_a_pool_shut_down_inside_its_with_block_is_stopped_once(monkeypatch):
    """A second stop would ask a manager already killed (the pool's teardown warns that it
    did not answer): leaving the block after ``shutdown()`` stops nothing more."""
    from types import SimpleNamespace

    from kvray import pool as pool_module
    from kvray.config import PoolConfig

    stopped: list[object] = []
    monkeypatch.setattr(pool_module.launcher, "shutdown", stopped.append)
    handles = SimpleNamespace(config=PoolConfig.from_dict({"name": "once"}, environ={}),
                              known_clients=lambda: [])  # fmt: skip
    with pool_module.Pool(handles, owner=True) as pool:  # type: ignore[arg-type]
        pool.shutdown()
        assert stopped == [handles]
    pool.shutdown()
    assert stopped == [handles]
