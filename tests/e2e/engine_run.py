"""Run one real vLLM engine (in-process, tiny local Llama) over a list of prompts and
write what happened as JSON. The e2e tests start it as a subprocess per engine, so
each engine is a fresh process that joins the test's Ray cluster (RAY_ADDRESS) the
way a vLLM deployment's workers do.

    python tests/e2e/engine_run.py SPEC.json OUT.json

SPEC: {"model": dir, "connector": null | {"extra": {...}, "policy": "recompute",
       "role": "kv_both"}, "kv_transfer_config": null | {...} (used as given),
       "runs": [[prompt token ids, ...], ...], "max_tokens": 8,
       "wait_saves_for": "pool name" | null, "inject_drop": false | "pool name",
       "record_hashes": false, "skip_layer_hooks": false, "timelines": false,
       "hang": false}

``hang``: after writing OUT.json, print ``engine-run: hanging`` and sleep, so a test can
kill the engine (SIGKILL) while everything it set up is still in place.

``inject_drop`` is fault injection for the load-failure tests: right after a lookup hit
is allocated, the hit blocks are removed from the pool (the connector's, or the named one
for a whole ``kv_transfer_config``), so the load that follows fails.
``skip_layer_hooks``: the connector's ``wait_for_layer_load`` is never called (an engine
without per-layer hooks), for the layer-wise safety test.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _inject_drop_after_lookup(pool_name: str, namespace: str) -> None:
    from kvray import Pool
    from kvray.connector import scheduler as sched_mod

    pool = Pool.attach(pool_name, namespace)
    original = sched_mod.KVRayScheduler.update_state_after_alloc

    def drop_then_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        if num_external_tokens > 0:
            st = self._reqs[request.request_id]
            first, last = st.local_blocks, st.local_blocks + st.pool_blocks
            hashes = [sched_mod.hash_bytes(h) for h in request.block_hashes[first:last]]
            keys = self.info.space.lookup_key_strs(hashes)
            pool.remove(keys, force=True)
        return original(self, request, blocks, num_external_tokens)

    sched_mod.KVRayScheduler.update_state_after_alloc = drop_then_alloc


def _record_block_hashes(into: list[list[str]]) -> None:
    """Each finished request's vLLM block hashes (hex), as the connector keys them."""
    from kvray.connector import scheduler as sched_mod

    original = sched_mod.KVRayScheduler.request_finished

    def record(self, request, block_ids):  # type: ignore[no-untyped-def]
        into.append([sched_mod.hash_bytes(h).hex() for h in request.block_hashes])
        return original(self, request, block_ids)

    sched_mod.KVRayScheduler.request_finished = record


def _collect_timelines(into: list[dict]) -> None:
    """The connector's per-request timelines (its DEBUG records) into ``into``."""
    import logging

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            timeline = getattr(record, "kvray_timeline", None)
            if timeline is not None:
                into.append(timeline)

    # On the scheduler module's logger: the "kvray" logger itself must stay without
    # handlers of its own, so that the connector routes it through vLLM's.
    scheduler_logger = logging.getLogger("kvray.connector.scheduler")
    scheduler_logger.addHandler(Collect(logging.DEBUG))
    scheduler_logger.setLevel(logging.DEBUG)


def _skip_layer_hooks() -> None:
    """An engine that never calls wait_for_layer_load (as under full CUDA graphs): the
    layer-wise connector must report the step's loads failed, never use late bytes."""
    from kvray.connector.connector import KVRayConnector

    KVRayConnector.wait_for_layer_load = lambda self, layer_name: None  # type: ignore[method-assign]


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    if spec.get("ray_env"):
        # Join the cluster as a job whose runtime env carries these variables: Ray starts
        # the job's workers (vLLM's Ray-executor workers too) with them.
        from kvray.ray_env import ray_init

        ray_init(
            os.environ["RAY_ADDRESS"], runtime_env={"env_vars": spec["ray_env"]}, log_to_driver=True
        )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timelines: list[dict] = []
    if spec.get("timelines"):
        _collect_timelines(timelines)

    kwargs: dict = {}
    conn = spec.get("connector")
    hashes: list[list[str]] = []
    if spec.get("record_hashes"):
        _record_block_hashes(hashes)
    if spec.get("skip_layer_hooks"):
        _skip_layer_hooks()
    inject = spec.get("inject_drop")
    if isinstance(inject, str):
        _inject_drop_after_lookup(inject, "kvray")
    elif inject and conn is not None:
        _inject_drop_after_lookup(
            conn["extra"].get("pool_name", "kvray"), conn["extra"].get("namespace", "kvray")
        )
    if spec.get("kv_transfer_config") is not None:  # a whole config (e.g. MultiConnector)
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    elif conn is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVRayConnector",
            "kv_connector_module_path": "kvray.connector",
            "kv_role": conn.get("role", "kv_both"),
            "kv_connector_extra_config": conn["extra"],
            "kv_load_failure_policy": conn.get("policy", "recompute"),
        }
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=False,
        distributed_executor_backend=spec.get("executor"),
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    results = []
    for prompts in spec["runs"]:
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        results.append(
            {
                "seconds": time.perf_counter() - t0,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "finish_reasons": [str(o.outputs[0].finish_reason) for o in outs],
            }
        )
        if spec.get("wait_saves_for"):
            _wait_for_saves(llm)
    with open(sys.argv[2], "w") as f:
        json.dump({"runs": results, "block_hashes": hashes, "timelines": timelines}, f)
    if spec.get("hang"):
        print("engine-run: hanging", flush=True)
        time.sleep(3600)
    return 0


def _wait_for_saves(llm, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Step the engine until the connector has no delayed frees (saves in flight)."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while core.scheduler.connector.has_pending_push_work():
        if time.monotonic() > deadline:
            raise TimeoutError("saves still in flight")
        core.step_fn()


if __name__ == "__main__":
    sys.exit(main())
