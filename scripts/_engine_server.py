"""One vLLM engine (in-process, ``LLM``) kept alive and driven over stdin/stdout, so a
benchmark can interleave the repetitions of several configurations, each in its own
live engine, instead of running one configuration after another.

    python scripts/_engine_server.py SPEC.json

SPEC: {"model": dir, "max_len": int, "prefix_caching": bool,
       "kv_transfer_config": null | {...}}

Commands, one JSON object per stdin line; one JSON answer per stdout line (everything
else the engine prints goes to stderr):

- ``{"op": "ttft", "prompt": [ids]}`` -> ``{"ttft_s": float}``: one request generating
  one token, alone in the engine;
- ``{"op": "drain"}`` -> ``{}``: step until the connector's saves are done;
- ``{"op": "quit"}``.

The first line written is ``{"ready": true}`` once the engine is up.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's and Ray's prints go to stderr; stdout carries answers only
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: no IPC in the timing
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

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
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector

    def reply(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "ttft":
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False)
            reply({"ttft_s": time.perf_counter() - t0})
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
