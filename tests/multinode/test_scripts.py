"""``scripts/bench_store.py --cross-node`` in its smoke mode: the same run as the
committed full one (blocks on node A, gets on node B over the veth link), on the tests'
harness (``--harness``: one cluster per test run), with small arguments and the same
JSON keys."""

from __future__ import annotations

import json

import pytest

from tests.script_smoke import committed_keys, json_keys, run_script

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_bench_store_cross_node_smoke(two_nodes, tmp_path):
    out, harness = tmp_path / "bench_cross_node.json", tmp_path / "harness.json"
    harness.write_text(json.dumps(two_nodes.describe()))
    res = run_script("bench_store.py", "--cross-node", "--harness", str(harness),
                     "--json", str(out), timeout_s=380)  # fmt: skip
    assert "cross-node get" in res.stdout
    assert json_keys(out) == committed_keys("bench_cross_node.json")
