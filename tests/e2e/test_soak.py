"""The soak under faults, CI-sized (scripts/soak.py, 60 s of 4 concurrent clients with a
fault every ~4 s: each kind injected at least once): every completed request's greedy
tokens equal the run without kvray, none fails or waits past the bound, and nothing is
left behind. docs/reliability.md has the long run's counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(900)
def test_soak_under_faults(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "60",
           "--fault-every", "4", "--hold", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    report = proc.stdout[proc.stdout.find("soak:") :]
    assert proc.returncode == 0, f"{report}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["failures"] == []
    injected = {kind for _, kind, _ in result["faults"]}
    kinds = set(result["meta"]["faults"].split(","))  # soak.py's default: every kind
    assert len(kinds) == 6 and injected == kinds, f"faults injected: {sorted(injected)}\n{report}"
    done = [r for r in result["requests"] if "error" not in r]
    assert len(done) == len(result["requests"]) > 100
    assert all(r["ok"] for r in done)
    assert result["blocks"]["loaded"] > 0, "no request loaded anything from the pool"
