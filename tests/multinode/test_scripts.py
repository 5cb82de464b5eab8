"""``scripts/bench_store.py --cross-node`` in its smoke mode: the same run as the
committed full one (its own two-node harness, blocks on node A, gets on node B over the
veth link), with small arguments and the same JSON keys."""

from __future__ import annotations

import pytest

from tests.script_smoke import committed_keys, json_keys, run_script

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_bench_store_cross_node_smoke(tmp_path):
    out = tmp_path / "bench_cross_node.json"
    res = run_script("bench_store.py", "--cross-node", "--json", str(out), timeout_s=380)
    assert "cross-node get" in res.stdout
    assert json_keys(out) == committed_keys("bench_cross_node.json")
