"""kvray.remote's error mapping, without a Ray cluster: a Call awaits any awaitable."""

from __future__ import annotations

import asyncio

import pytest

from kvray.errors import BackendUnavailableError
from kvray.remote import Call, CallTimeoutError, as_kvray_error


async def test_timed_out_call_is_call_timeout_error():
    """asyncio.wait_for raises the builtin TimeoutError (Python >= 3.11, which kvray
    requires): it must come out as kvray's CallTimeoutError naming the call and setting."""
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    call: Call[int] = Call(never, "BackendClient[0].get")
    with pytest.raises(CallTimeoutError, match=r"BackendClient\[0\]\.get: no answer in 0.05 s"):
        await call.aresult(0.05, setting="call_timeout_s")
    assert never.cancelled(), "the timed-out wait must not leave the call's awaitable pending"


async def test_answered_call_returns_its_value():
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await Call(done, "x").aresult(1) == 7


def test_timeout_mapping_names_the_setting():
    err = as_kvray_error(TimeoutError(), "Lookup.lookup", 0.2, "lookup_timeout_ms")
    assert isinstance(err, CallTimeoutError)
    assert isinstance(err, BackendUnavailableError)
    assert "lookup_timeout_ms=0.2" in str(err)


def test_other_errors_are_not_timeouts():
    err = as_kvray_error(RuntimeError("boom"), "x", 1)
    assert type(err) is BackendUnavailableError
    assert "RuntimeError: boom" in str(err)


def test_the_cluster_record_kvray_reads_is_where_ray_2_60_keeps_it(monkeypatch, tmp_path):
    """Ray has no public call for "the cluster ``ray start`` made on this machine", so
    remote.local_clusters reads Ray's private record and GCS finder. Pinned to Ray 2.60:
    if Ray moves either, this fails (engines would otherwise quietly start clusters of
    their own next to the node's)."""
    from ray._private import services, utils

    from kvray import remote

    utils.write_ray_address("127.0.0.1:6390", str(tmp_path))
    assert (tmp_path / "ray_current_cluster").read_text() == "127.0.0.1:6390"
    assert utils.read_ray_address(str(tmp_path)) == "127.0.0.1:6390"
    assert all(isinstance(a, str) for a in services.find_gcs_addresses())  # a (frozen)set
    monkeypatch.setattr(utils, "read_ray_address", lambda temp_dir=None: "127.0.0.1:6390")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: {"127.0.0.1:6391"})
    assert remote.local_clusters() == ["127.0.0.1:6390"]
    assert remote.local_clusters(any_gcs=True) == ["127.0.0.1:6390", "127.0.0.1:6391"]
