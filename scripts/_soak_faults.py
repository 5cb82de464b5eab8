"""The soak's faults (scripts/soak.py). Each one is injected, then shown to have taken
effect, or it raises :class:`FaultNotShown` and the soak fails: a kill that killed
nothing, a removal that removed nothing or a fill that wrote nothing is a check that
cannot fail, not a fault survived.

What each fault shows (its ``Evidence.shown``, logged and kept in the soak's JSON):

- ``kill_client``: the rank's BackendClient process is SIGKILLed (a crash, not a Ray
  kill); the old PID is gone, the actor answers from another PID, and Ray's record of it
  (the GCS actor table) counts one more restart; then the DRAM tier takes a put again.
- ``kill_master``: the embedded ``mooncake_master`` is SIGKILLed; the pool's supervisor
  runs another PID and counts a restart; then the DRAM tier takes a put again.
- ``remove_blocks``: blocks of random prompts that the pool holds are removed; the pool
  reports them removed, and right after, ``exists()`` is false for every one of them
  that the pool's ledger does not show stored again since (requests keep running).
- ``corrupt_ssd``: SSD block files get a byte flipped or are truncated; read back, each
  differs as intended.
- ``pool_full``: the DRAM tier is filled with other blocks: bytes the pool acknowledged,
  and the rank's DRAM counters during the fill (it took a segment's worth of new bytes,
  or refused some as full).
- ``shm_full``: ``/dev/shm`` filled: the bytes the kernel allocated to the fill file.

Every wait for an effect is bounded by ``recover_s``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvray import Pool
from kvray.backends.base import KeyStatus
from kvray.errors import KVRayError, PoolFullError
from kvray.index.ledger import Seen, block_digest
from kvray.naming import client_name, manager_name
from kvray.remote import ManagerHandle, StoreHandle
from kvray.stats import RankStats

FAULTS = ("kill_client", "kill_master", "remove_blocks", "corrupt_ssd", "pool_full", "shm_full")
HOLDS = ("pool_full", "shm_full")
"""Faults that hold for ``--hold`` seconds, then undo themselves (``undo_<kind>``)."""

_T = TypeVar("_T")
_MiB = 1 << 20


class FaultNotShown(Exception):
    """A fault's effect was not shown; ``shown`` holds what was seen."""

    def __init__(self, message: str, shown: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.shown = shown or {}


@dataclass
class Evidence:
    """What a fault did (one line for the log) and what shows it took effect."""

    what: str
    shown: dict[str, Any] = field(default_factory=dict)


def gcs_actor(name: str) -> dict[str, Any]:
    """Ray's record of the live actor ``name``: its state, PID and restart count, from the
    GCS actor table (what Ray's state API serves; the soak's Ray runs without the
    dashboard that API needs)."""
    from ray._private import state

    live = [a for a in state.actors().values() if a["Name"] == name and a["State"] != "DEAD"]
    if len(live) != 1:
        raise FaultNotShown(f"Ray's actor table has {len(live)} live actors named {name!r}")
    record: dict[str, Any] = live[0]
    return record


def pid_gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


class Faults:
    """The faults on one pool. ``prompt_keys``: the pool keys of each prompt's blocks."""

    def __init__(
        self,
        pool: Pool,
        ssd_dir: Path,
        prompt_keys: Sequence[Sequence[str]],
        *,
        seed: int,
        recover_s: float,
        shm_headroom: int,
        ram_reserve: int,
    ) -> None:
        self.pool, self.ssd_dir, self.prompt_keys = pool, ssd_dir, prompt_keys
        self.rng = random.Random(seed)
        self.recover_s = recover_s
        self.shm_headroom, self.ram_reserve = shm_headroom, ram_reserve
        self.fill_keys: list[str] = []
        self.shm_fill = Path(f"/dev/shm/kvray-soak-fill-{os.getpid()}")

    # ---- helpers ---------------------------------------------------------------------

    def _until(self, probe: Callable[[], _T | None], what: str, since: float) -> tuple[_T, float]:
        """Poll ``probe`` until it returns a value; ``(value, seconds since since)``;
        FaultNotShown naming ``what`` after ``recover_s``."""
        deadline = time.monotonic() + self.recover_s
        while True:
            value = probe()
            if value is not None:
                return value, round(time.monotonic() - since, 3)
            if time.monotonic() > deadline:
                raise FaultNotShown(f"{what}: not seen within {self.recover_s:g} s")
            time.sleep(0.2)

    def _client(self) -> StoreHandle:
        """Slot 0's BackendClient on this node (the engine's, in the soak)."""
        import ray

        cfg = self.pool.config
        name = client_name(cfg.name, ray.get_runtime_context().get_node_id(), 0)
        return StoreHandle(ray.get_actor(name, namespace=cfg.namespace), name)

    def _manager(self) -> ManagerHandle:
        import ray

        cfg = self.pool.config
        name = manager_name(cfg.name)
        return ManagerHandle(ray.get_actor(name, namespace=cfg.namespace), name)

    def _dram_stats(self) -> tuple[RankStats, int]:
        """Slot 0's DRAM counters and segment size, from its BackendClient."""
        snap = self._client().snapshot().result(30)
        return RankStats.from_dict(snap["stats"]), int(snap["info"].get("segment_bytes") or 0)

    def _dram_takes_a_put(self) -> bool | None:
        """One probe block put through the pool, stored by the DRAM tier itself (the pool
        acknowledges a put the SSD tier alone stored): True, else None."""
        key = f"soak-probe-{time.monotonic_ns()}"
        try:
            before, _ = self._dram_stats()
            self.pool.put(key, np.ones(64 << 10, np.uint8))
            after, _ = self._dram_stats()
        except KVRayError:
            return None
        finally:
            with contextlib.suppress(KVRayError):
                self.pool.remove([key], force=True)
        refused = (after.put_failed + after.put_pool_full) - (
            before.put_failed + before.put_pool_full
        )
        return True if after.put_keys > before.put_keys and refused == 0 else None

    # ---- the faults ------------------------------------------------------------------

    def kill_client(self) -> Evidence:
        client = self._client()
        record = gcs_actor(client.name)
        pid = int(client.probe().result(30)["pid"])
        restarts = int(record["NumRestarts"])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def restarted() -> tuple[int, int] | None:
            now = gcs_actor(client.name)
            if now["State"] != "ALIVE" or int(now["NumRestarts"]) <= restarts:
                return None
            try:
                new_pid = int(client.probe().result(5)["pid"])
            except KVRayError:
                return None
            return (new_pid, int(now["NumRestarts"])) if new_pid != pid else None

        (new_pid, new_restarts), restarted_s = self._until(
            restarted, f"BackendClient {client.name} restarted by Ray", killed
        )
        shown: dict[str, Any] = {
            "actor": client.name, "pid_before": pid, "pid_after": new_pid,
            "old_pid_gone": pid_gone(pid), "ray_restarts_before": restarts,
            "ray_restarts_after": new_restarts, "restarted_s": restarted_s,
        }  # fmt: skip
        what = f"BackendClient pid {pid} -> {new_pid}, Ray restarts {restarts} -> {new_restarts}"
        return self._back_after_kill(f"{what} ({restarted_s:.1f} s)", pid, shown, killed)

    def _back_after_kill(
        self, what: str, pid: int, shown: dict[str, Any], killed: float
    ) -> Evidence:
        """A kill's evidence, once the process was restarted: the old one is gone, and
        the DRAM tier takes a put again."""
        if not shown["old_pid_gone"]:
            raise FaultNotShown(f"pid {pid} still runs after SIGKILL", shown)
        _, shown["dram_serves_s"] = self._until(self._dram_takes_a_put, "DRAM serves", killed)
        return Evidence(f"{what}, DRAM serves after {shown['dram_serves_s']:.1f} s", shown)

    def kill_master(self) -> Evidence:
        manager = self._manager()
        spec = manager.spec().result(30)
        pid, restarts = spec.server_pid, spec.server_restarts
        if pid is None:
            raise FaultNotShown("the pool runs no embedded master to kill")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def restarted() -> tuple[int, int] | None:
            now = manager.spec().result(30)
            ok = now.server_pid not in (None, pid) and bool(now.server_alive)
            ok = ok and now.server_restarts > restarts
            return (now.server_pid, now.server_restarts) if ok and now.server_pid else None

        (new_pid, new_restarts), restarted_s = self._until(
            restarted, "mooncake_master restarted by the pool", killed
        )
        shown: dict[str, Any] = {
            "pid_before": pid, "pid_after": new_pid, "old_pid_gone": pid_gone(pid),
            "restarts_before": restarts, "restarts_after": new_restarts,
            "restarted_s": restarted_s,
        }  # fmt: skip
        what = f"mooncake_master pid {pid} -> {new_pid}, restarts {restarts} -> {new_restarts}"
        return self._back_after_kill(f"{what} ({restarted_s:.1f} s)", pid, shown, killed)

    def remove_blocks(self) -> Evidence:
        def stored() -> dict[int, list[str]] | None:
            flat = [k for keys in self.prompt_keys for k in keys]
            present = set(k for k, p in zip(flat, self.pool.exists(flat), strict=True) if p)
            held = {i: [k for k in keys if k in present] for i, keys in enumerate(self.prompt_keys)}
            return {i: ks for i, ks in held.items() if ks} or None

        held, _ = self._until(stored, "blocks of the prompts stored", time.monotonic())
        n = min(len(held), max(1, len(self.prompt_keys) // 4))
        chosen = sorted(self.rng.sample(sorted(held), k=n))
        keys = [k for i in chosen for k in held[i]]
        at = time.time()
        statuses = self.pool.remove(keys, force=True)
        removed = [k for k, s in zip(keys, statuses, strict=True) if s is KeyStatus.OK]
        after = self.pool.exists(removed) if removed else []
        counts: dict[str, int] = {}
        for s in statuses:
            counts[s.value] = counts.get(s.value, 0) + 1
        back = [k for k, present in zip(removed, after, strict=True) if present]
        shown: dict[str, Any] = {
            "prompts": chosen, "blocks_held": len(keys), "statuses": counts,
            "removed": len(removed), "exist_after": len(back), "stored_again": 0,
        }  # fmt: skip
        if not removed:
            raise FaultNotShown(f"none of {len(keys)} held blocks removed: {counts}", shown)
        if back:
            # The clients keep sending, and prompts share prefixes: a request that missed
            # (or had a save in flight) stores a removed block again. That is a removal
            # followed by a store, not a removal that failed, when the pool's ledger shows
            # the block stored after the removal; anything else is a failure.
            try:
                self._until(lambda: self._stored_since(back, at), "", time.monotonic())
            except FaultNotShown:
                raise FaultNotShown(
                    f"{len(back)} of {len(removed)} blocks reported removed still exist, "
                    "and the pool's ledger shows no store of them since the removal",
                    shown,
                ) from None
            shown["stored_again"] = len(back)
        again = f"; {len(back)} stored again since by requests (ledger)" if back else ""
        return Evidence(
            f"removed {len(removed)} of {len(keys)} held blocks of prompts {chosen}; "
            f"exists() false for {len(removed) - len(back)}{again}",
            shown,
        )

    def _stored_since(self, keys: list[str], at: float) -> bool | None:
        """True once the manager's ledger records every one of ``keys`` as stored at or
        after ``at`` (epoch seconds; reports reach it every ``ledger.FLUSH_S``)."""
        _, entries, _, _ = self._manager().ledger_since(-1).result(30)  # the whole record
        latest = {d: (s, t) for d, s, t in entries.rows()}
        for k in keys:
            s, t = latest.get(block_digest(k), (Seen.NEVER, 0.0))
            if s != Seen.STORED or t < at:
                return None
        return True

    def corrupt_ssd(self) -> Evidence:
        files, _ = self._until(
            lambda: sorted(self.ssd_dir.rglob("*.blk")) or None,
            "SSD block files",
            time.monotonic(),
        )
        changed: list[dict[str, Any]] = []
        for path in self.rng.sample(files, k=len(files)):
            if len(changed) == 3:
                break
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: another
                change = self._corrupt(path)
                if change is not None:
                    changed.append(change)
        shown: dict[str, Any] = {"files": changed, "candidates": len(files)}
        if not changed:
            raise FaultNotShown(f"none of {len(files)} SSD block files changed", shown)
        return Evidence("SSD files: " + ", ".join(c["action"] for c in changed), shown)

    def _corrupt(self, path: Path) -> dict[str, Any] | None:
        """Flip one byte of ``path``'s payload (past its header page) or truncate it to
        half; read back, the change is there: what was done, else None."""
        size = path.stat().st_size
        if size < 2:
            return None
        if self.rng.random() < 0.5:
            at = self.rng.randrange(min(4096, size - 1), size)
            with path.open("r+b") as f:
                f.seek(at)
                old = f.read(1)[0]
                f.seek(at)
                f.write(bytes([old ^ 0xFF]))
            with path.open("rb") as f:
                f.seek(at)
                now = f.read(1)
            if now != bytes([old ^ 0xFF]):
                return None
            action = f"flipped byte {at} ({old:#04x} -> {old ^ 0xFF:#04x})"
        else:
            os.truncate(path, size // 2)
            if path.stat().st_size != size // 2:
                return None
            action = f"truncated {size} -> {size // 2} bytes"
        return {"file": path.name, "action": action}

    def pool_full(self) -> Evidence:
        # The DRAM tier must serve first: one still mounting after a kill refuses the fill
        # as full without being full.
        _, ready_s = self._until(self._dram_takes_a_put, "DRAM serves", time.monotonic())
        chunk = np.zeros(_MiB, np.uint8)
        before, segment = self._dram_stats()
        n = segment // _MiB
        keys = [f"soak-fill-{time.monotonic_ns()}-{i}" for i in range(n)]
        self.fill_keys = keys
        stored, full = 0, False
        for lo in range(0, n, 8):
            batch = keys[lo : lo + 8]
            try:
                self.pool.put(batch, [chunk] * len(batch))
                stored += len(batch)
            except PoolFullError as exc:  # neither tier had room for some: the pool is full
                stored += len(exc.stored)
                full = True
                break
        after, _ = self._dram_stats()
        shown: dict[str, Any] = {
            "segment_bytes": segment, "acknowledged_bytes": stored * _MiB,
            "dram_put_bytes": after.put_bytes - before.put_bytes,
            "dram_refused_full": after.put_pool_full - before.put_pool_full,
            "pool_refused_full": full, "dram_ready_s": ready_s,
        }  # fmt: skip
        if not stored:
            raise FaultNotShown("the pool acknowledged no byte of the fill", shown)
        if shown["dram_put_bytes"] < segment and not shown["dram_refused_full"]:
            raise FaultNotShown(
                "the DRAM tier took less than its segment and refused nothing: not full", shown
            )
        return Evidence(
            f"DRAM filled: {shown['dram_put_bytes'] >> 20} MiB taken by the DRAM tier, "
            f"{shown['dram_refused_full']} blocks refused as full ({segment >> 20} MiB segment)",
            shown,
        )

    def undo_pool_full(self) -> None:
        if self.fill_keys:
            keys, self.fill_keys = self.fill_keys, []
            self.pool.remove(keys, force=True)

    def shm_full(self) -> Evidence:
        """/dev/shm is tmpfs: its pages are RAM. Where it may grow as large as RAM (this
        test machine: 24 GiB of each), filling it means exhausting memory and the kernel's
        OOM killer ends processes (seen: it killed this script), which is no test of kvray;
        the fill then stops ``ram_reserve`` short of available memory, and says so."""
        import psutil

        free = shutil.disk_usage("/dev/shm").free
        available = psutil.virtual_memory().available
        ram = available - self.ram_reserve
        size = max(0, min(free - self.shm_headroom, ram))
        shown: dict[str, Any] = {
            "shm_free_before": free, "fill_bytes": size, "mem_available": available,
            "limit": "RAM reserve" if ram < free - self.shm_headroom else "headroom",
        }  # fmt: skip
        if size == 0:
            raise FaultNotShown(
                f"no room to fill /dev/shm within the limits: {free >> 20} MiB free on it "
                f"(keeping {self.shm_headroom >> 20}), {available >> 20} MiB of RAM "
                f"available (keeping {self.ram_reserve >> 20})",
                shown,
            )
        with self.shm_fill.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
        shown["allocated_bytes"] = self.shm_fill.stat().st_blocks * 512
        shown["shm_free_after"] = shutil.disk_usage("/dev/shm").free
        if shown["allocated_bytes"] < size:
            raise FaultNotShown("the kernel allocated less than the fill", shown)
        return Evidence(
            f"/dev/shm filled with {size >> 20} MiB (allocated), "
            f"{shown['shm_free_after'] >> 20} MiB left ({shown['limit']})",
            shown,
        )

    def undo_shm_full(self) -> None:
        self.shm_fill.unlink(missing_ok=True)
