"""Live vLLM engines for the benchmarks: each configuration is one engine kept alive
(kvray's engine driver, :mod:`kvray.testing.engine`: an in-process ``LLM`` in a process of
its own, driven over stdin/stdout), so a benchmark can interleave the repetitions of
several configurations instead of running one after another. :class:`Engine` adds the
benchmarks' turn-taking; the rest are the benchmarks' pools, schedule and baselines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import log

from kvray.testing import forkserver
from kvray.testing.engine import FORK_ENV, LiveEngine

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""What :class:`Engine` adds to its environment: the engine in the driven process (no IPC
in the timing)."""


class Engine(LiveEngine):
    """One live engine of a benchmark: in-process (no IPC in the timing), without the test
    hooks (nothing but vLLM's and kvray's code in what it times), paused between its
    turns."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], tmp: Path) -> None:
        env_over = {**ENGINE_ENV, **spec.get("env", {})}
        spec = {**spec, "env": env_over, "hooks": False}
        # Fresh processes, as users start engines; the test suite's smoke runs set
        # KVRAY_ENGINE_FORK=1 to fork them from a process that imported vLLM once.
        fork = os.environ.get(FORK_ENV) == "1"
        if fork:
            log(f"   {name}: forked from the engines' fork server ({FORK_ENV}=1)")
        super().__init__(name, spec, env, tmp, fork=fork)

    def start(self, warm: bool = True) -> None:
        """Wait until the engine is up, run one warm-up request (with ``warm``), then
        pause it."""
        self.wait_ready()
        if warm:
            self.call(op="ttft", prompt=list(range(3, 3 + min(300, self.max_len - 1))))
            self.call(op="drain")
        self.pause()

    def turn(
        self,
        seed: list[int] | None,
        probe: list[int],
        *,
        back_to_back: bool = False,
        reset_own: bool = False,
        twin: list[int] | None = None,
    ) -> dict[str, Any]:
        """One rep: resumed, ``seed`` computes (and stores) the prefix, its saves drain,
        ``probe`` (same prefix) is timed, its saves drain, paused again. Without ``seed``
        (nothing to seed) only ``probe`` runs. ``back_to_back``: the probe is sent as soon
        as the seed's response returned, its saves still in flight, as users send
        requests. ``reset_own``: vLLM's own prefix cache is emptied before the probe (an
        engine that runs with it on for the connector's sake). ``twin``: then this prompt
        is timed too, with nothing in flight (``twin_ttft_s``: the same engine's time
        for a like request that meets no pool work)."""
        if seed is not None:
            self.call(op="ttft", prompt=seed)
            if not back_to_back:
                self.call(op="drain")
        if reset_own:
            self.call(op="reset_prefix_cache")
        answer = self.call(op="ttft", prompt=probe)
        self.call(op="drain")  # nothing in flight while paused
        if twin is not None:
            answer["twin_ttft_s"] = self.call(op="ttft", prompt=twin)["ttft_s"]
            self.call(op="drain")
        self.pause()
        return answer


def workload_args(parser: argparse.ArgumentParser, lengths: str, rates: str) -> None:
    """The engine benchmarks' arguments: the workload (input lengths, hit rates, reps), the
    model's folder and ``--json``."""
    parser.add_argument("--lengths", default=lengths)
    parser.add_argument("--rates", default=rates)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--model-dir", default=os.path.join(tempfile.gettempdir(), "kvray-bench-model")
    )
    parser.add_argument("--json", type=Path, help="write results here")
    pool_memory_arg(parser)
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="send each probe as soon as its seed returned (the seed's saves in flight, as "
        "users send requests), every configuration seeding, misses too (an unrelated seed); "
        "default: the seed's saves drain first",
    )


def workload(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, misses: bool = False
) -> tuple[list[int], list[float]]:
    """``--lengths`` and ``--rates``, checked with ``--reps``: hit rates in (0, 1), or
    with ``misses`` in [0, 1)."""
    if args.reps < 3:
        parser.error("--reps must be >= 3")
    lengths = [int(x) for x in args.lengths.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    if not all(0 <= r < 1 if misses else 0 < r < 1 for r in rates):
        parser.error(f"--rates must be hit rates in {'[0' if misses else '(0'}, 1)")
    return lengths, rates


def chosen(parser: argparse.ArgumentParser, names: list[str], known: tuple[str, ...]) -> None:
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(known)}")


FAMILIES = ("llama", "gemma3", "qwen3_next")
"""Model families of the engine benchmarks (``--family``): the bench model (full
attention), a sliding-window hybrid (four KV cache groups under vLLM's hybrid allocator)
and a Gated DeltaNet hybrid (three state groups and one full-attention group, bfloat16)."""


def bench_model(model_dir: str, family: str = "llama") -> str:
    """The benchmarks' prefill-bound model of ``family``, built once in ``model_dir``
    (a family's own folder below it, but for the default)."""
    from kvray.testing import tiny_model

    build = {
        "llama": tiny_model.build_prefill_bound_llama,
        "gemma3": tiny_model.build_prefill_bound_gemma3,
        "qwen3_next": tiny_model.build_prefill_bound_qwen3_next,
    }[family]
    path = model_dir if family == "llama" else os.path.join(model_dir, family)
    log(f"== building the {family} model in {path}")
    return str(build(path))


@contextlib.contextmanager
def live_engines(tmp: Path, stops: list[Callable[[], Any]]) -> Iterator[dict[str, Engine]]:
    """The run's engines by name (added with :func:`start_engine`); at the end they are
    closed, then everything in ``stops`` (pools, masters) is stopped, and Ray shut down.
    ``tmp`` (the engines' logs) is removed only when the run succeeded."""
    import ray

    engines: dict[str, Engine] = {}
    try:
        yield engines
    finally:
        with ThreadPoolExecutor() as closing:  # each waits for its engine to exit
            list(closing.map(Engine.close, engines.values()))
        for stop in stops:
            stop()
        ray.shutdown()
    shutil.rmtree(tmp)


def start_engine(
    engines: dict[str, Engine], name: str, spec: dict[str, Any], env: dict[str, str], tmp: Path
) -> None:
    """One at a time: a 2-core machine starts engines slowly."""
    log(f"== starting engine {name}")
    engines[name] = Engine(name, spec, env, tmp)
    engines[name].start()


def start_engines(
    engines: dict[str, Engine],
    specs: dict[str, tuple[dict[str, Any], dict[str, str]]],
    tmp: Path,
    smoke: bool,
) -> None:
    """The engines of ``specs`` (name: spec and environment). A full run starts them one
    at a time, each warmed up by one request before the next starts (what is timed later
    starts warm, and no start competes with another). A smoke run times nothing that
    counts: it starts them all at once, without the warm-up, so that one engine's start
    waits on the machine while another's computes."""
    if not smoke:
        for name, (spec, env) in specs.items():
            start_engine(engines, name, spec, env, tmp)
        return
    log(f"== starting engines {', '.join(specs)} together (smoke run)")
    for name, (spec, env) in specs.items():
        engines[name] = Engine(name, spec, env, tmp)
    for engine in engines.values():
        engine.start(warm=False)


def prestart_fork_servers(envs: list[dict[str, str]], tmp: Path) -> list[threading.Thread]:
    """When the engines fork (``KVRAY_ENGINE_FORK=1``): the fork server of each of
    ``envs`` (the engines' environments) started now, each in a thread, so that their
    import of vLLM overlaps what the run starts meanwhile (Ray, the pools); the engines
    that need them wait for them."""
    if os.environ.get(FORK_ENV) != "1":
        return []
    threads = []
    for env in envs:
        child = {**env, **ENGINE_ENV}
        t = threading.Thread(target=forkserver.server_for, args=(child, tmp), daemon=True)
        t.start()
        threads.append(t)
    return threads


POOL_MEMORY = 4 << 30
"""Each pool's (and the peer's) segment by default: room for a default run's blocks."""
SMOKE_POOL_MEMORY = "512MB"
"""A smoke run's: it stores a few blocks, and test workers run beside it (a segment is
mapped ahead of stores, so it takes its memory at start)."""


def pool_memory_arg(parser: argparse.ArgumentParser) -> None:
    """``--pool-memory``: each pool's segment, and the peer's."""
    from kvray.sizes import parse_size

    def size(value: str) -> int:
        try:
            return parse_size(value, field="value")
        except ValueError as exc:  # (its message names the flag and the units)
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--pool-memory",
        type=size,
        default=POOL_MEMORY,
        help="memory of each kvray pool's segment and of the peer's (e.g. 4GB, the "
        "default: room for a default run's blocks)",
    )


def start_bench_pool(
    segment: int | str = POOL_MEMORY,
    local_buffer: str = "256MB",
    master: dict[str, Any] | None = None,
    **settings: Any,
) -> tuple[Any, str]:
    """A local loopback Ray and a kvray pool ``bench`` (:func:`bench_pool`); returns the
    pool and the Ray address engines join."""
    import ray

    from kvray.ray_env import ray_init

    print("== starting Ray (loopback) and a kvray pool with its embedded master", file=sys.stderr)
    ray_init("local", num_cpus=4)
    pool = bench_pool("bench", segment, local_buffer, master, **settings)
    return pool, ray.get_runtime_context().gcs_address


def bench_pool(
    name: str,
    segment: int | str,
    local_buffer: str,
    master: dict[str, Any] | None = None,
    **settings: Any,
) -> Any:
    """A kvray pool ``name`` in the connected Ray cluster (embedded master, one client per
    node), with the default config but ``settings``: ``checksum=False`` (what block
    checksums cost is measured against it), ``lookup_index=False`` (lookups as calls to
    the Lookup actor, not answered from the node's block index), ``mooncake={...}``
    (merged into the client's settings), ..."""
    from kvray import Pool, PoolConfig

    mooncake = {"global_segment_size": segment, "local_buffer_size": local_buffer}
    spec: dict[str, Any] = {
        "name": name,
        "world_size": 1,
        "detached": False,
        **settings,
        "mooncake": {**mooncake, **settings.get("mooncake", {})},
    }
    if master is not None:
        spec["master"] = master
    return Pool.start(PoolConfig.from_dict(spec, environ={}))


def interleaved(
    configs: list[str],
    lengths: list[int],
    rates: list[float],
    reps: int,
    block: int,
    *,
    seed_tail: int | None = None,
) -> Iterator[tuple[int, float, int, int, list[int], list[int], list[str]]]:
    """The benchmarks' schedule: for every (input length, hit rate, rep) the prefix (whole
    ``block``-token blocks, ``rate`` of the input), a seed prompt and a probe prompt that
    share it, and the configurations in the order they take their turns (rotated per rep):
    ``(length, rate, rep, prefix_len, seed, probe, order)``. ``seed_tail``: the seed is the
    prefix and that many tokens (a sliding-window model's own prefix cache keeps only the
    window before the seed's end, so the ideal's hit needs the seed to end at the prefix)."""
    import numpy as np

    for length in lengths:
        for rate in rates:
            prefix_len = int(rate * length) // block * block
            for rep in range(reps):
                rng = np.random.default_rng([length, int(rate * 100), rep])
                prefix = rng.integers(3, 1000, prefix_len).tolist()
                seed = prefix + rng.integers(3, 1000, length - prefix_len).tolist()
                probe = prefix + rng.integers(3, 1000, length - prefix_len).tolist()
                if seed_tail is not None:
                    seed = seed[: prefix_len + seed_tail]
                k = rep % len(configs)
                yield length, rate, rep, prefix_len, seed, probe, configs[k:] + configs[:k]


def start_peer_master(
    tmp: Path, master: dict[str, Any], segment: int, local_buffer: int
) -> tuple[Any, dict[str, str]]:
    """A ``mooncake_master`` with ``master`` settings (those of the kvray pool's own
    master) for vLLM's MooncakeStoreConnector, the peer baseline (embedded mode: the
    engine's in-process client contributes ``segment`` bytes); returns the master and the
    environment its engines need."""
    from kvray.config import MooncakeMasterConfig
    from kvray.servers.mooncake_master import MooncakeMaster

    peer_master = MooncakeMaster(MooncakeMasterConfig(**master), tmp / "peer-master")
    cfg = {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": peer_master.start(),
        "protocol": "tcp",
        "global_segment_size": segment,
        "local_buffer_size": local_buffer,
        "mode": "embedded",
    }
    (tmp / "mooncake.json").write_text(json.dumps(cfg))
    env = {
        "MOONCAKE_CONFIG_PATH": str(tmp / "mooncake.json"),
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
    }
    return peer_master, env


PEER_TRANSFER_CONFIG = {
    "kv_connector": "MooncakeStoreConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {},
}


def engine_env(tmp: Path, ray_address: str | None, kv_cache_gb: int = 1) -> dict[str, str]:
    """The engines' environment: vLLM's ZMQ sockets (``ipc://`` files, about seven per
    server, which outlive their processes; by default in the system's temp dir) under the
    run's ``tmp``, removed with it, and so is vLLM's cache unless ``VLLM_CACHE_ROOT`` names
    one (where vLLM keeps what it learned of a model's class: an engine that finds it
    there does not inspect the class in a fresh interpreter, ~10 s of CPU)."""
    rpc = tmp / "vllm-rpc"
    rpc.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(tmp / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "VLLM_RPC_BASE_PATH": str(rpc),
    }
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    malloc = tcmalloc()
    if malloc and "libtcmalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (malloc, env.get("LD_PRELOAD", "")) if p)
    return env


@functools.cache
def tcmalloc() -> str | None:
    """The tcmalloc every benchmark engine runs with, as vLLM's CPU platform preloads the
    one its wheels bundle (``vllm/libs``; the CPU wheel here has none, so the system's,
    from ``libtcmalloc-minimal4``): with glibc's malloc each forward maps its large
    activations afresh (measured: 86,000 to 317,000 page faults in 20 s per engine of
    one run, the engines 25 ms apart on the same prompts). None: not installed (said once)."""
    found = ctypes.util.find_library("tcmalloc_minimal")  # (the loader's own cache)
    if found is None:
        print("!! no libtcmalloc_minimal.so.4: the engines run on glibc's malloc, whose "
              "page faults make engines of one run differ (apt-get install "
              "libtcmalloc-minimal4)", file=sys.stderr)  # fmt: skip
    return found


def kvray_transfer_config(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    return {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def run_meta(**extra: Any) -> dict[str, Any]:
    """What a benchmark's JSON records of the run: commit, machine, then ``extra``."""
    import platform

    return {
        "commit": git_commit(Path(__file__).resolve().parent),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        **extra,
    }


def git_commit(cwd: Path) -> str:
    """The measured code: HEAD, ``+dirty`` when the tree has uncommitted changes (outside
    ``bench-results/``)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=cwd
        ).stdout.strip()
        # Results written by earlier benchmarks of the same run are not code changes.
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ":/",  # the whole tree, whatever the working directory
                ":!/bench-results",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            cwd=cwd,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return head + ("+dirty" if dirty else "")
