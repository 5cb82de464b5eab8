"""A real vLLM engine (in-process ``LLM``, tiny local model, CPU) in a process of its own,
driven by a test or a benchmark: the one engine driver of kvray's tests and scripts.

Two ways to run it:

- **live**: ``python -m kvray.testing.engine SPEC.json``, kept alive and driven over
  stdin/stdout, one JSON command per line and one JSON answer per line (everything else
  the engine prints goes to stderr). :class:`LiveEngine` is the driving side. Tests share
  such engines across tests (their prompts keep them apart); benchmarks interleave the
  repetitions of several.
- **once**: ``python -m kvray.testing.engine SPEC.json OUT.json``: ``SPEC["runs"]`` (each a
  list of prompts, generated together), then the result as JSON in OUT; for a test whose
  point is a process of its own (a node of the multi-node harness, a hash seed).

SPEC: ``{"model": dir, "max_len": 4096, "prefix_caching": false, "max_tokens": 8,
"kv_transfer_config": null | {...}, "executor": null | "ray" | "mp", "tp": 1,
"env": {...}, "ray_env": null | {...}, "timelines": false,
"drop_hook": null | [pool name, namespace], "hooks": true, "fork": true, "runs": [...],
"wait_saves": false, "drop": false, "skip_layer_hooks": false}`` (the last four for once
mode: every run alike)

- ``fork``: where the driver asks for it (``LiveEngine(fork=True)``, ``run_once(fork=True)``:
  the test suite), the process is forked from a fork server that imported vLLM once
  (:mod:`kvray.testing.forkserver`: a start of ~4 s instead of ~15 s on 2 cores); ``false``
  keeps a fresh interpreter where the process's start is the point (a hash seed).

- ``env``: set in the engine's environment before vLLM is imported; ``ray_env``: the engine
  joins ``RAY_ADDRESS`` as a job whose runtime env carries these variables (Ray starts the
  job's workers, vLLM's Ray-executor workers too, with them).
- ``timelines``: the connector's per-request timelines (its DEBUG records) are collected
  and returned with each answer.
- ``hooks``: with a connector, the test hooks are installed (each request's block hashes
  recorded, ``wait_for_layer_load`` skippable, the drop hook); a benchmark turns them off
  so that the engine it times runs vLLM's and kvray's code alone.
- ``drop_hook``: fault injection for the load-failure tests, armed per command with
  ``"drop": true``: right after a lookup hit is allocated, the hit blocks are removed from
  that pool (attached in that namespace), so the load that follows fails.

Commands (live):

- ``{"op": "generate", "prompts": [[ids], ...], "max_tokens": 8, "drop": false,
  "skip_layer_hooks": false, "wait_saves": true, "reset_prefix_cache": true,
  "logprobs": null}`` -> ``{"outputs": [[ids], ...], "logprobs": [[[[id, logprob], ...]
  per token] per prompt] (with ``"logprobs": k``: each token's top ``k``, best first),
  "finish_reasons": [...], "lines": [...], "block_hashes": [[hex], ...], "timelines":
  [...], "seconds": float}``: the prompts generated together; ``lines`` are the
  connector's per-request lines of these requests (:mod:`kvray.connector.log_lines`),
  ``block_hashes`` vLLM's block hashes of each prompt as the connector keys them.
  ``skip_layer_hooks``: the connector's ``wait_for_layer_load`` is not called (an engine
  without per-layer hooks), for the layer-wise safety test. ``wait_saves``: the engine
  steps until the connector's saves are done before answering. ``reset_prefix_cache``:
  vLLM's own prefix cache (where the spec turns it on) is emptied first, so that a hit
  can only come from the pool.
- ``{"op": "ttft", "prompt": [ids]}`` -> ``{"ttft_s": float, "cached_tokens": int,
  "timelines": [...]}``: one request generating one token, alone in the engine;
  ``cached_tokens`` is vLLM's count of prompt tokens it did not compute.
- ``{"op": "drain"}`` -> ``{}``: step until the connector's saves are done.
- ``{"op": "reset_prefix_cache", "external": false}`` -> ``{"reset": bool}``: vLLM's own
  prefix cache emptied, so a shared engine's next hit can only come from the pool;
  ``external``: the connector's too (vLLM's ``reset_connector``, what
  ``/reset_prefix_cache?reset_external=true`` asks).
- ``{"op": "kv_cache_groups"}`` -> ``{"groups": [spec class names]}``: the KV cache
  groups vLLM's allocator made (a hybrid model's, under its hybrid allocator).
- ``{"op": "kv_digests"}`` -> ``{"groups": [[digest or null per block]]}``: the KV bytes
  of the last finished request, per KV cache group and block (null: vLLM's null block,
  where a sliding window kept none), digested from the in-process worker's KV cache.
- ``{"op": "block_size"}`` -> ``{"block_size": int}``: the block size vLLM chose (a
  hybrid model with state groups grows it).
- ``{"op": "quit"}``.

The first line a live engine writes is ``{"ready": true}`` once it is up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from kvray.connector.log_lines import RequestLine, request_counts
from kvray.testing import forkserver
from kvray.testing.forkserver import ForkedProcess

ENGINE_MODULE = "kvray.testing.engine"
FORK_ENV = "KVRAY_ENGINE_FORK"
"""Set to ``1``, the benchmarks' engines are forked from the fork server too (the test
suite's smoke runs of them)."""


class LiveEngine:
    """One live engine process, the driving side."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        env: dict[str, str],
        tmp: Path,
        fork: bool = False,
    ) -> None:
        """``fork``: the process is forked from a fork server that imported vLLM once
        (:mod:`kvray.testing.forkserver`), unless the spec says ``"fork": false``."""
        self.name = name
        self.spec = spec
        self.max_len: int = spec.get("max_len", 4096)
        path = tmp / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        self.log_path = tmp / f"{name}.log"
        self._log: IO[str] = self.log_path.open("w")
        self.proc = _start([str(path)], env, spec, tmp, fork, stderr=self._log)
        self._lines: queue.Queue[str] = queue.Queue()
        self._ended = threading.Event()
        self.paused = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._ended.set()
        self._lines.put("")  # wakes a waiting answer

    def log(self) -> str:
        """Everything the engine printed so far (vLLM's log and the connector's)."""
        return self.log_path.read_text(errors="replace")

    def answer(self, timeout_s: float = 600) -> dict[str, Any]:
        try:
            # Once the engine's output ended, no answer comes: say so at once (a second
            # question to a dead engine would otherwise wait out the timeout).
            line = self._lines.get(timeout=0 if self._ended.is_set() else timeout_s)
        except queue.Empty:
            line = ""
        if not line:
            raise RuntimeError(
                f"engine {self.name} ended or gave no answer in {timeout_s:.0f} s; "
                f"its log ends:\n{self.log()[-6000:]}"
            )
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"engine {self.name}: {out['error']}\n{self.log()[-3000:]}")
        return out

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.resume()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def wait_ready(self, timeout_s: float = 600) -> None:
        self.answer(timeout_s)

    def generate(self, prompts: list[list[int]], **options: Any) -> dict[str, Any]:
        """``prompts`` generated together (see the module for ``options``)."""
        return self.call(op="generate", prompts=prompts, **options)

    def pause(self) -> None:
        """SIGSTOP between turns: an idle engine's Ray and vLLM threads (measured on a
        2-core machine: ~12 % of a core each, plus the GCS serving them) would otherwise
        take CPU from the engine being measured or started."""
        if not self.paused and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def request_counts(self) -> list[dict[str, int]]:
        """The connector's per-request lines (hit and load counts) so far."""
        return request_counts(self.log())

    def close(self) -> None:
        left = _vllm_shm(self.proc.pid) if self.proc.poll() is None else set()
        if self.proc.poll() is None:
            try:
                self.call(op="quit")
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a stuck engine is killed below
                self.proc.kill()
                self.proc.wait()
        # vLLM unlinks these as its objects are collected, which an engine that ends in
        # os._exit (a forked one, a killed one) skips: its TP workers' all-reduce buffers
        # (vllm_dist_*) and its queues (psm_*) stay in /dev/shm unless removed here.
        for path in left:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._log.close()


def _vllm_shm(pid: int) -> set[Path]:
    """vLLM's shared-memory files (``psm_*``, ``vllm_dist_*``) mapped by process ``pid``
    and its descendants (an engine and its workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    found: set[Path] = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for m in proc.memory_maps(grouped=True):
                path = Path(m.path)
                if m.path.startswith("/dev/shm/") and path.name.startswith(VLLM_SHM):
                    found.add(path)
    return found


def _vllm_shm_files() -> set[Path]:
    return {p for p in Path("/dev/shm").glob("*") if p.name.startswith(VLLM_SHM)}


def unmapped_shm(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` no live process maps (an engine still running beside this one,
    another test's, maps its own)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {ln.split()[-1] for ln in maps.read_text().splitlines() if "/dev/shm/" in ln}
    return {p for p in paths if str(p) not in mapped}


VLLM_SHM = ("psm_", "vllm_dist_")
"""The prefixes of vLLM's own /dev/shm files (message queues, CPU all-reduce buffers)."""


def _child_env(env: dict[str, str], spec: dict[str, Any]) -> dict[str, str]:
    """The environment the engine runs with: ``env`` and the spec's own ``env``."""
    return {**env, **{k: str(v) for k, v in spec.get("env", {}).items()}}


def _start(
    argv: list[str],
    env: dict[str, str],
    spec: dict[str, Any],
    tmp: Path,
    fork: bool,
    stderr: IO[str],
    stdout: IO[str] | None = None,
) -> subprocess.Popen[str] | ForkedProcess:
    """``python -m kvray.testing.engine ARGV``: forked from the fork server where ``fork``
    asks for it and the spec does not say ``"fork": false``, else a fresh interpreter; a
    pipe to its stdin and, unless ``stdout`` is given, from its stdout."""
    if fork and spec.get("fork", True):
        return forkserver.spawn(
            f"{ENGINE_MODULE}:main", [ENGINE_MODULE, *argv], _child_env(env, spec), tmp,
            stderr=stderr, stdout=stdout,
        )  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", ENGINE_MODULE, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=stderr,
        env=env,
        text=True,
        bufsize=1,
    )


def run_once(
    spec: dict[str, Any],
    env: dict[str, str],
    tmp: Path,
    name: str,
    fork: bool = False,
    timeout_s: float = 600,
) -> tuple[dict[str, Any] | None, str]:
    """Once mode: ``spec``'s runs in an engine process of its own, then gone (forked from
    a fork server as :class:`LiveEngine` says). ``(result or None if it failed, what it
    printed)``; a process past ``timeout_s`` is killed."""
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    log_path = tmp / f"{name}.log"
    before = _vllm_shm_files()
    with log_path.open("w") as log:
        proc = _start([str(spec_path), str(out_path)], env, spec, tmp, fork, log, stdout=log)
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(30)
    for path in unmapped_shm(_vllm_shm_files() - before):  # (as LiveEngine.close: os._exit)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    printed = log_path.read_text(errors="replace")
    if rc != 0 or not out_path.exists():
        return None, printed
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result, printed


def engine_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine's SPEC from a test's shorthand: ``connector``
    (``{"extra": {...}, "policy": ..., "role": ...}``) for KVRayConnector,
    ``wait_saves_for`` (a pool name) for ``wait_saves``, ``inject_drop`` (True: the
    connector's pool; or a pool name) for the drop hook armed on every run."""
    spec = dict(spec)
    conn = spec.pop("connector", None)
    extra = (conn or {}).get("extra", {})
    if conn is not None and spec.get("kv_transfer_config") is None:
        spec["kv_transfer_config"] = {
            "kv_connector": "KVRayConnector",
            "kv_connector_module_path": "kvray.connector",
            "kv_role": conn.get("role", "kv_both"),
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": conn.get("policy", "recompute"),
        }
    if spec.pop("wait_saves_for", None):
        spec["wait_saves"] = True
    if spec.get("drop_hook") is True:  # the connector's pool, armed per command
        spec["drop_hook"] = [extra.get("pool_name", "kvray"), extra.get("namespace", "kvray")]
    inject = spec.pop("inject_drop", None)
    if inject:
        pool_name = inject if isinstance(inject, str) else extra.get("pool_name", "kvray")
        namespace = "kvray" if isinstance(inject, str) else extra.get("namespace", "kvray")
        spec["drop_hook"] = [pool_name, namespace]
        spec["drop"] = True
    spec.pop("record_hashes", None)  # always recorded
    return spec


# ---- the engine's side -----------------------------------------------------------------


class _Collect(logging.Handler):
    """The connector's per-request lines and timelines, as its scheduler logs them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[RequestLine] = []
        self.timelines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        timeline = getattr(record, "kvray_timeline", None)
        if timeline is not None:
            self.timelines.append(timeline)
        else:
            line = getattr(record, "kvray_request", None)
            if isinstance(line, RequestLine):
                self.lines.append(line)

    def clear(self) -> None:
        self.lines.clear()
        self.timelines.clear()


class _Hooks:
    """What a command can switch on for its own requests (see the module)."""

    drop = False
    skip_layer_hooks = False


def _install_hooks(spec: dict[str, Any], hashes: dict[str, list[str]]) -> None:
    from kvray.connector import scheduler as sched_mod
    from kvray.connector.connector import KVRayConnector
    from kvray.connector.request_state import hash_bytes

    finished = sched_mod.KVRayScheduler.request_finished

    def record(self, request, block_ids):  # type: ignore[no-untyped-def]
        hashes[request.request_id] = [hash_bytes(h).hex() for h in request.block_hashes]
        return finished(self, request, block_ids)

    sched_mod.KVRayScheduler.request_finished = record  # type: ignore[method-assign]

    wait = KVRayConnector.wait_for_layer_load

    def maybe_wait(self, layer_name):  # type: ignore[no-untyped-def]
        if not _Hooks.skip_layer_hooks:
            wait(self, layer_name)

    KVRayConnector.wait_for_layer_load = maybe_wait  # type: ignore[method-assign]

    if spec.get("drop_hook"):
        from kvray import Pool

        pool_name, namespace = spec["drop_hook"]
        pool = Pool.attach(pool_name, namespace)
        alloc = sched_mod.KVRayScheduler.update_state_after_alloc

        def drop_then_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
            if _Hooks.drop and num_external_tokens > 0:
                st = self._reqs[request.request_id]
                first, last = st.local_blocks, st.local_blocks + st.pool_blocks
                block_hashes = request.block_hashes[first:last]
                keys = self.info.space.lookup_key_strs([hash_bytes(h) for h in block_hashes])
                pool.remove(keys, force=True)
            return alloc(self, request, blocks, num_external_tokens)

        sched_mod.KVRayScheduler.update_state_after_alloc = drop_then_alloc  # type: ignore[method-assign]


def _pop_hashes(hashes: dict[str, list[str]], request_id: str) -> list[str]:
    """The block hashes the scheduler saw for the request ``request_id`` names (vLLM's
    engine core adds a suffix to the id it was given: ``0`` is ``0-ad2b18d3`` there)."""
    for rid in list(hashes):
        if rid == request_id or rid.startswith(f"{request_id}-"):
            return hashes.pop(rid)
    raise KeyError(f"no block hashes recorded for request {request_id!r} (have {list(hashes)})")


def _wait_saves(core: Any, connector: Any, timeout_s: float = 60.0) -> None:
    """Step the engine until the connector has no delayed frees (saves in flight), a
    millisecond apart, as vLLM's engine loop steps while nothing computes (a benchmark
    counting CPU counts no spin a served engine would not make)."""
    deadline = time.monotonic() + timeout_s
    while connector is not None and connector.has_pending_push_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"saves still in flight after {timeout_s:g} s")
        core.step_fn()
        time.sleep(0.001)
    time.sleep(0.05)


def _record_freed_blocks(scheduler: Any) -> list[tuple[list[int], ...]]:
    """Every finished request's block ids per KV cache group, as vLLM frees them (what
    the ``kv_digests`` op reads: the blocks keep their bytes until reused)."""
    freed: list[tuple[list[int], ...]] = []
    free = scheduler._free_request_blocks

    def record(request: Any) -> None:
        freed.append(scheduler.kv_cache_manager.get_block_ids(request.request_id))
        free(request)

    scheduler._free_request_blocks = record
    return freed


def _kv_digests(llm: Any, core: Any, block_ids: tuple[list[int], ...]) -> list[list[str | None]]:
    """Per KV cache group, per block of ``block_ids`` (None for vLLM's null block): a
    digest of the block's bytes in every layer of the group, from the in-process worker's
    KV cache tensors."""
    import hashlib

    import torch

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    groups = core.scheduler.kv_cache_config.kv_cache_groups

    def planes(entry: Any) -> list[torch.Tensor]:
        if isinstance(entry, torch.Tensor):
            return [entry]
        return [t for e in entry for t in planes(e)]

    out: list[list[str | None]] = []
    for group, ids in zip(groups, block_ids, strict=True):
        tensors = [t for name in group.layer_names for t in planes(context[name].kv_cache)]
        digests: list[str | None] = []
        for b in ids:
            if b == 0:
                digests.append(None)
                continue
            h = hashlib.sha256()
            for t in tensors:
                h.update(t[b].contiguous().view(torch.uint8).numpy().tobytes())
            digests.append(h.hexdigest()[:16])
        out.append(digests)
    return out


def _engine(spec: dict[str, Any]) -> int:
    live = "runs" not in spec
    if live:
        answers = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # vLLM's and Ray's prints go to stderr; stdout carries answers only
    os.environ.update(spec.get("env", {}))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process, no IPC
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("ray_env"):
        from kvray.ray_env import ray_init

        ray_init(
            os.environ["RAY_ADDRESS"], runtime_env={"env_vars": spec["ray_env"]}, log_to_driver=True
        )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    collect = _Collect()
    # On the scheduler module's logger: the "kvray" logger itself must stay without
    # handlers of its own, so that the connector routes it through vLLM's.
    scheduler_logger = logging.getLogger("kvray.connector.scheduler")
    scheduler_logger.addHandler(collect)
    if spec.get("timelines"):
        scheduler_logger.setLevel(logging.DEBUG)
    hashes: dict[str, list[str]] = {}
    hooked = bool(spec.get("kv_transfer_config")) and spec.get("hooks", True)
    if hooked:
        _install_hooks(spec, hashes)

    kwargs: dict[str, Any] = {"enable_prefix_caching": bool(spec.get("prefix_caching"))}
    if spec.get("hma") is False:  # vLLM's hybrid allocator off: one group of every layer
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("kv_events_config"):  # the engine's own KV events (vLLM's publisher)
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_len", 4096),
        distributed_executor_backend=spec.get("executor"),
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        **kwargs,
    )
    core: Any = None
    connector: Any = None
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "1":
        # In-process engine: the client is an InprocClient holding the EngineCore itself,
        # which vLLM's EngineCoreClient type does not show.
        client: Any = llm.llm_engine.engine_core
        core = client.engine_core
        connector = core.scheduler.connector
        freed = _record_freed_blocks(core.scheduler)

    def generate(cmd: dict[str, Any]) -> dict[str, Any]:
        collect.clear()
        _Hooks.drop = bool(cmd.get("drop"))
        _Hooks.skip_layer_hooks = bool(cmd.get("skip_layer_hooks"))
        params = SamplingParams(
            max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=cmd.get("logprobs")
        )
        # (With vLLM's prefix cache off there is nothing to empty; a finished request whose
        # saves are still in flight holds its blocks, and vLLM refuses a reset then.)
        reset = cmd.get("reset_prefix_cache", True) and spec.get("prefix_caching")
        if reset and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running)")
        t0 = time.perf_counter()
        try:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]],
                params,
                use_tqdm=False,
            )
            if cmd.get("wait_saves", True) and core is not None:
                _wait_saves(core, connector)
        finally:
            _Hooks.drop = _Hooks.skip_layer_hooks = False
        return {
            "seconds": time.perf_counter() - t0,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "finish_reasons": [str(o.outputs[0].finish_reason) for o in outs],
            "cached_tokens": [o.num_cached_tokens or 0 for o in outs],
            "logprobs": [
                [
                    sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: -x[1])
                    for step in o.outputs[0].logprobs or []
                ]
                for o in outs
            ],
            "lines": [line.counts | {"request_id": line.request_id} for line in collect.lines],
            "block_hashes": [_pop_hashes(hashes, o.request_id) for o in outs] if hooked else [],
            "timelines": list(collect.timelines),
        }

    if not live:
        result = {
            "runs": [
                generate({"prompts": prompts, "max_tokens": spec.get("max_tokens", 8),
                          "wait_saves": spec.get("wait_saves", False),
                          "drop": spec.get("drop", False),
                          "skip_layer_hooks": spec.get("skip_layer_hooks", False),
                          "reset_prefix_cache": False,
                          "logprobs": spec.get("logprobs")})
                for prompts in spec["runs"]
            ]
        }  # fmt: skip
        Path(sys.argv[2]).write_text(json.dumps(result))
        return 0

    def reply(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")

    reply({"ready": True})
    for raw in sys.stdin:
        cmd = json.loads(raw)
        op = cmd["op"]
        try:
            if op == "generate":
                reply(generate(cmd))
            elif op == "ttft":
                collect.clear()
                t0 = time.perf_counter()
                (out,) = llm.generate(
                    [TokensPrompt(prompt_token_ids=cmd["prompt"])],
                    SamplingParams(max_tokens=1, temperature=0.0),
                    use_tqdm=False,
                )
                reply(
                    {
                        "ttft_s": time.perf_counter() - t0,
                        "cached_tokens": out.num_cached_tokens or 0,
                        "timelines": list(collect.timelines),
                    }
                )
            elif op == "drain":
                if core is not None:
                    _wait_saves(core, connector)
                reply({})
            elif op == "kv_cache_groups":  # what vLLM's (hybrid) allocator made
                groups = core.scheduler.kv_cache_config.kv_cache_groups if core else []
                reply({"groups": [type(g.kv_cache_spec).__name__ for g in groups]})
            elif op == "kv_digests":  # the last finished request's KV bytes, per block
                reply({"groups": _kv_digests(llm, core, freed[-1]) if freed else []})
            elif op == "block_size":
                config = core.scheduler.kv_cache_config if core else None
                size = config.kv_cache_groups[0].kv_cache_spec.block_size if config else 0
                reply({"block_size": size})
            elif op == "reset_prefix_cache":
                external = bool(cmd.get("external", False))
                reply({"reset": bool(llm.reset_prefix_cache(reset_connector=external))})
            elif op == "quit":
                reply({})
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - the driving side raises it
            reply({"error": f"{op}: {type(exc).__name__}: {exc}"})
    return 0


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if len(sys.argv) > 2:
        spec.setdefault("runs", [])
    return _engine(spec)


if __name__ == "__main__":
    sys.exit(main())
