"""Mapping a client's segment ahead of stores: which memory, and that it maps pages
without changing a byte."""

from __future__ import annotations

import mmap
import resource

import numpy as np
import pytest

from kvray.backends.segment_warmer import SegmentWarmer, anonymous_ranges, new_ranges

MiB = 1 << 20


def test_new_ranges_are_what_setup_mapped_even_merged_with_an_old_neighbour():
    before = [(0, 4 * MiB), (100 * MiB, 101 * MiB)]
    # the new mapping grew the first one and another one appeared
    after = [(0, 40 * MiB), (100 * MiB, 101 * MiB), (200 * MiB, 300 * MiB), (400 * MiB, 401 * MiB)]
    assert new_ranges(before, after) == [(200 * MiB, 300 * MiB), (4 * MiB, 40 * MiB)]
    assert new_ranges(before, after, min_bytes=50 * MiB) == [(200 * MiB, 300 * MiB)]


def test_an_anonymous_mapping_is_listed_and_a_file_mapping_is_not(tmp_path):
    anon = mmap.mmap(-1, 32 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (32 * MiB))
    with path.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    a = np.frombuffer(anon, dtype=np.uint8).ctypes.data
    b = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    ranges = anonymous_ranges()
    assert any(lo <= a < hi for lo, hi in ranges)
    assert not any(lo <= b < hi for lo, hi in ranges)


def test_the_warmer_maps_every_page_and_keeps_the_bytes_stores_wrote():
    size = 48 * MiB
    before = anonymous_ranges()
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mem, dtype=np.uint8)
    ranges = new_ranges(before, anonymous_ranges())
    lo = arr.ctypes.data
    assert any(a <= lo and lo + size <= b for a, b in ranges)
    arr[7 * 4096 : 9 * 4096] = 0xAB  # a store wrote these pages before the warmer ran
    warmer = SegmentWarmer.start([(lo, lo + size)], "test segment")
    assert warmer is not None
    assert warmer.done.wait(60)
    if warmer.mapped < warmer.total:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 or later)")
    assert (arr[7 * 4096 : 9 * 4096] == 0xAB).all()
    assert not arr[: 7 * 4096].any() and not arr[9 * 4096 :].any()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arr[::4096] = 1  # every page written: none faults any more
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 64
    warmer.stop()


def test_a_segment_larger_than_the_memory_available_is_left_to_the_stores(monkeypatch):
    monkeypatch.setattr("kvray.backends.segment_warmer.mem_available", lambda: 100 * MiB)
    assert SegmentWarmer.start([(0, 200 * MiB)], "test segment") is None


def test_the_warmer_stops_when_the_hosts_memory_runs_low(monkeypatch, caplog):
    """Several clients start together: each start check passed, then the host's available
    memory fell below the floor while this one mapped; it stops and leaves the rest to
    the stores."""
    size = 256 * MiB
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    lo = np.frombuffer(mem, dtype=np.uint8).ctypes.data
    total = 64 << 30
    reads = iter([total, total])  # the start check and the first chunk's, then low
    monkeypatch.setattr(
        "kvray.backends.segment_warmer.mem_available", lambda: next(reads, total // 10)
    )
    monkeypatch.setattr("kvray.backends.segment_warmer.mem_total", lambda: total)
    warmer = SegmentWarmer.start([(lo, lo + size)], "test segment")
    assert warmer is not None
    assert warmer.done.wait(60)
    warmer.stop()
    if warmer.mapped == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14 or later)")
    # one check's worth of chunks mapped (64 MiB), then the next check found memory low
    assert warmer.mapped == 64 * MiB < warmer.total
    assert "stopped mapping its segment ahead of stores at 64 of 256 MiB" in caplog.text
