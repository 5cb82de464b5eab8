"""Live vLLM engines for the benchmarks: each configuration is one engine (in-process
``LLM``, its own process) kept alive and driven over stdin/stdout, so a benchmark can
interleave the repetitions of several configurations instead of running one after
another. :class:`Engine` is the benchmark's side; ``main`` the engine's:

    python scripts/_engines.py SPEC.json

SPEC: {"model": dir, "max_len": int, "prefix_caching": bool,
       "kv_transfer_config": null | {...}, "timeline": bool}

With ``timeline`` the connector's per-request timelines (DEBUG records of the
``kvray`` logger) are collected and returned with each ``ttft`` answer.

Commands, one JSON object per stdin line; one JSON answer per stdout line (everything
else the engine prints goes to stderr):

- ``{"op": "ttft", "prompt": [ids]}`` -> ``{"ttft_s": float, "cached_tokens": int,
  "timelines": [...]}``: one request generating one token, alone in the engine;
  ``cached_tokens`` is vLLM's count of prompt tokens it did not compute (its prefix
  cache or a connector's load);
- ``{"op": "drain"}`` -> ``{}``: step until the connector's saves are done;
- ``{"op": "quit"}``.

The first line written is ``{"ready": true}`` once the engine is up.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvray.connector.log_lines import request_counts


class Engine:
    """One live engine process, benchmark side."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], tmp: Path) -> None:
        self.name = name
        self.max_len: int = spec["max_len"]
        path = tmp / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        self.log_path = tmp / f"{name}.log"
        self._log: IO[str] = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._ended.set()
        self._lines.put("")  # wakes a waiting answer

    def answer(self, timeout_s: float = 600) -> dict[str, Any]:
        try:
            # Once the engine's output ended, no answer comes: say so at once (a second
            # question to a dead engine would otherwise wait out the timeout).
            line = self._lines.get(timeout=0 if self._ended.is_set() else timeout_s)
        except queue.Empty:
            line = ""
        if not line:
            tail = self.log_path.read_text()[-4000:]
            raise RuntimeError(
                f"engine {self.name} ended or gave no answer in {timeout_s:.0f} s; "
                f"its log ends:\n{tail}"
            )
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"engine {self.name}: {out['error']}")
        return out

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def pause(self) -> None:
        """SIGSTOP between turns: an idle engine's Ray and vLLM threads (measured on a
        2-core machine: ~12 % of a core each, plus the GCS serving them) would otherwise
        take CPU from the engine being measured."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def start(self) -> None:
        """Wait until the engine is up, run one warm-up request, then pause it."""
        self.answer()
        self.call(op="ttft", prompt=list(range(3, 3 + min(300, self.max_len - 1))))
        self.call(op="drain")
        self.pause()

    def turn(self, seed: list[int] | None, probe: list[int]) -> dict[str, Any]:
        """One rep: resumed, ``seed`` computes (and stores) the prefix, its saves drain,
        ``probe`` (same prefix) is timed, its saves drain, paused again. Without ``seed``
        (nothing to seed) only ``probe`` runs."""
        self.resume()
        if seed is not None:
            self.call(op="ttft", prompt=seed)
            self.call(op="drain")
        answer = self.call(op="ttft", prompt=probe)
        self.call(op="drain")  # nothing in flight while paused
        self.pause()
        return answer

    def request_lines(self) -> list[dict[str, int]]:
        """The connector's per-request lines (hit and load counts) so far."""
        return request_counts(self.log_path.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            try:
                self.call(op="quit")
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a stuck engine is killed below
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_bench_pool(
    segment: str = "4GB", local_buffer: str = "256MB", master: dict[str, Any] | None = None
) -> tuple[Any, str]:
    """A local loopback Ray and a kvray pool ``bench`` (embedded master, one client per
    node, the default config otherwise: block checksums on); returns the pool and the Ray
    address engines join."""
    import ray

    from kvray.ray_env import ray_init

    print("== starting Ray (loopback) and a kvray pool with its embedded master", file=sys.stderr)
    ray_init("local", num_cpus=4)
    pool = bench_pool("bench", segment, local_buffer, master)
    return pool, ray.get_runtime_context().gcs_address


def bench_pool(
    name: str,
    segment: str,
    local_buffer: str,
    master: dict[str, Any] | None = None,
    *,
    checksum: bool = True,
) -> Any:
    """A kvray pool ``name`` in the connected Ray cluster (embedded master, one client per
    node); ``checksum=False``: without block checksums (what they cost is measured
    against it)."""
    from kvray import Pool, PoolConfig

    spec: dict[str, Any] = {
        "name": name,
        "world_size": 1,
        "detached": False,
        "checksum": checksum,
        "mooncake": {"global_segment_size": segment, "local_buffer_size": local_buffer},
    }
    if master is not None:
        spec["master"] = master
    return Pool.start(PoolConfig.from_dict(spec, environ={}))


def interleaved(
    configs: list[str], lengths: list[int], rates: list[float], reps: int, block: int
) -> Iterator[tuple[int, float, int, int, list[int], list[int], list[str]]]:
    """The benchmarks' schedule: for every (input length, hit rate, rep) the prefix (whole
    ``block``-token blocks, ``rate`` of the input), a seed prompt and a probe prompt that
    share it, and the configurations in the order they take their turns (rotated per rep):
    ``(length, rate, rep, prefix_len, seed, probe, order)``."""
    import numpy as np

    for length in lengths:
        for rate in rates:
            prefix_len = int(rate * length) // block * block
            for rep in range(reps):
                rng = np.random.default_rng([length, int(rate * 100), rep])
                prefix = rng.integers(3, 1000, prefix_len).tolist()
                seed = prefix + rng.integers(3, 1000, length - prefix_len).tolist()
                probe = prefix + rng.integers(3, 1000, length - prefix_len).tolist()
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
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
    }
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def kvray_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVRayConnector",
        "kv_connector_module_path": "kvray.connector",
        "kv_role": "kv_both",
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
                ".",
                ":!bench-results",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            cwd=cwd,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return head + ("+dirty" if dirty else "")


class _Timelines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.got: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        timeline = getattr(record, "kvray_timeline", None)
        if timeline is not None:
            self.got.append(timeline)


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's and Ray's prints go to stderr; stdout carries answers only
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: no IPC in the timing
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timelines = _Timelines()
    if spec.get("timeline"):
        # On the scheduler module's logger: "kvray" itself must stay without handlers
        # of its own, so that the connector routes it through vLLM's.
        scheduler_logger = logging.getLogger("kvray.connector.scheduler")
        scheduler_logger.addHandler(timelines)
        scheduler_logger.setLevel(logging.DEBUG)

    kwargs: dict[str, Any] = {"enable_prefix_caching": bool(spec.get("prefix_caching"))}
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        dtype="float32",
        max_model_len=spec["max_len"],
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # In-process engine (multiprocessing off): the client is an InprocClient holding the
    # EngineCore itself, which vLLM's EngineCoreClient type does not show.
    client: Any = llm.llm_engine.engine_core
    core = client.engine_core
    connector = core.scheduler.connector

    def reply(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "ttft":
            timelines.got.clear()
            t0 = time.perf_counter()
            (out,) = llm.generate(
                [TokensPrompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False
            )
            reply(
                {
                    "ttft_s": time.perf_counter() - t0,
                    "cached_tokens": out.num_cached_tokens or 0,
                    "timelines": list(timelines.got),
                }
            )
        elif op == "drain":
            deadline = time.monotonic() + 60
            while (
                connector is not None
                and connector.has_pending_push_work()
                and time.monotonic() < deadline
            ):
                core.step_fn()
            time.sleep(0.05)
            reply({})
        elif op == "quit":
            reply({})
            break
        else:
            reply({"error": f"unknown op {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
