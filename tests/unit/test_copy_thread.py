"""Which thread a native client copies on, and its niceness around loads (the rule, on
threads of this test; tests/integration/test_copy_priority.py runs it on Mooncake's)."""

from __future__ import annotations

import os
import threading

import pytest

from kvray.backends import copy_thread
from kvray.backends.copy_thread import CopyThread


@pytest.fixture
def idle_threads():
    """Three threads of this process that wait: stand-ins for a client's native threads."""
    stop = threading.Event()
    tids: list[int] = []
    ready = threading.Barrier(4)

    def wait() -> None:
        tids.append(threading.get_native_id())
        ready.wait()
        stop.wait()

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    yield tids
    stop.set()
    for t in threads:
        t.join()


def _runs(monkeypatch, marks):  # type: ignore[no-untyped-def]
    """run_ns answers the given snapshots, one per call."""
    it = iter(marks)
    monkeypatch.setattr(copy_thread, "run_ns", lambda tids: dict(next(it)))


def test_the_thread_that_copied_is_held_nicer_except_during_loads(idle_threads, monkeypatch):
    a, b, c = idle_threads
    own = os.getpriority(os.PRIO_PROCESS, a)  # (what this run started at: CI's may not be 0)
    ms = 1_000_000
    _runs(monkeypatch, [{a: 0, b: 0, c: 0}, {a: 9 * ms, b: 1 * ms, c: 0}])
    copier = CopyThread("test client", set(idle_threads), 19)
    copier.before_store()
    copier.after_store(24 << 20)  # (not enough to tell yet: the window stays open)
    assert copier.tid is None and copier.searching
    copier.before_store()
    copier.after_store(8 << 20)
    assert copier.tid == a and not copier.searching
    assert os.getpriority(os.PRIO_PROCESS, a) == 19
    assert os.getpriority(os.PRIO_PROCESS, b) == own
    copier.load_started()
    copier.load_started()
    assert os.getpriority(os.PRIO_PROCESS, a) == own
    copier.load_ended()
    assert os.getpriority(os.PRIO_PROCESS, a) == own  # (one load still in flight)
    copier.load_ended()
    assert os.getpriority(os.PRIO_PROCESS, a) == 19


def test_a_load_in_flight_when_found_keeps_the_thread_at_its_own(idle_threads, monkeypatch):
    a, b, c = idle_threads
    own = os.getpriority(os.PRIO_PROCESS, a)
    _runs(monkeypatch, [{a: 0, b: 0, c: 0}, {a: 5_000_000, b: 0, c: 0}])
    copier = CopyThread("test client", set(idle_threads), 10)
    copier.before_store()
    copier.load_started()
    copier.after_store(32 << 20)
    assert copier.tid == a and os.getpriority(os.PRIO_PROCESS, a) == own
    copier.load_ended()
    assert os.getpriority(os.PRIO_PROCESS, a) == 10


def test_no_clear_copier_decides_nothing_and_the_search_ends(idle_threads, monkeypatch, caplog):
    a, b, c = idle_threads
    own = {os.getpriority(os.PRIO_PROCESS, t) for t in idle_threads}
    # two threads alike: no single copier
    even = [{a: 0, b: 0, c: 0}, {a: 3_000_000, b: 2_000_000, c: 0}] * copy_thread.TRIES
    _runs(monkeypatch, even)
    copier = CopyThread("test client", set(idle_threads), 19)
    with caplog.at_level("INFO", logger="kvray.backends.copy_thread"):
        for _ in range(copy_thread.TRIES):
            copier.before_store()
            copier.after_store(32 << 20)
    assert copier.tid is None and not copier.searching
    assert "no single thread did its stores' copies over" in caplog.text
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in idle_threads} == own


def test_a_window_that_stores_too_little_too_slowly_is_dropped(idle_threads, monkeypatch):
    a, b, c = idle_threads
    # the first window's marks are never read again: the second decides
    _runs(monkeypatch, [{a: 0, b: 0, c: 0}, {a: 100, b: 0, c: 0}, {a: 3_000_000, b: 0, c: 0}])
    clock = iter([0.0, 10.0, 20.0, 20.1])
    monkeypatch.setattr(copy_thread.time, "monotonic", lambda: next(clock))
    copier = CopyThread("test client", set(idle_threads), 19)
    copier.before_store()
    copier.after_store(1 << 20)  # (ten seconds for 1 MiB: dropped)
    copier.before_store()
    copier.after_store(32 << 20)
    assert copier.tid == a


def test_niceness_0_never_searches(idle_threads):
    copier = CopyThread("test client", set(idle_threads), 0)
    assert not copier.searching


def test_without_the_right_to_lower_a_niceness_the_thread_keeps_its_own(
    idle_threads, monkeypatch, caplog
):
    monkeypatch.setattr(copy_thread, "can_lower_niceness", lambda: False)
    with caplog.at_level("INFO", logger="kvray.backends.copy_thread"):
        copier = CopyThread("test client", set(idle_threads), 19)
    assert not copier.searching
    assert "no CAP_SYS_NICE" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as root, as CI does")
def test_root_may_lower_a_niceness_again():
    assert copy_thread.can_lower_niceness()
