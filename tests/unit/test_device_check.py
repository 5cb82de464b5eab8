"""scripts/device_check.py (the GPU machine's check) keeps working: its smoke mode runs
here on CPU with its own loader (no Ray, vLLM or pydantic imports), every layout
round-trips, and its JSON has the full run's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.script_smoke import json_keys

ROOT = Path(__file__).parents[2]
FULL_RUN_KEYS = {
    "device", "device_name", "torch", "round_trips", "bandwidth",
    *(f"round_trips[].{k}" for k in ("layout", "pinned", "staged_bytes_exact",
                                     "restored_exact", "layerwise_exact", "geometry", "dtype")),
    *(f"bandwidth.{k}" for k in ("bytes_per_step", "layers", "step_blocks", "pinned",
                                 "median_gbps", "reps")),
    *(f"bandwidth.median_gbps.{p}" for p in ("staged_d2h", "torch_d2h", "staged_h2d",
                                             "torch_h2d")),
    *(f"bandwidth.reps[].{k}" for k in ("rep", "path", "seconds", "gbps")),
}  # fmt: skip
"""What ``main`` and ``bandwidth`` write (the full run's keys: the smoke changes only the
bandwidth step's size and reps)."""


def test_device_check_runs_on_cpu(tmp_path):
    out = tmp_path / "device_check.json"
    # What the GPU machine lacks cannot be imported here either.
    code = (
        "import sys, runpy\n"
        "for m in ('ray', 'vllm', 'pydantic', 'mooncake'): sys.modules[m] = None\n"
        f"sys.argv = ['device_check.py', '--smoke', '--device', 'cpu', '--out', {str(out)!r}]\n"
        f"runpy.run_path({str(ROOT / 'scripts' / 'device_check.py')!r}, run_name='__main__')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "median GB/s" in res.stdout  # its table
    assert json_keys(out) == FULL_RUN_KEYS
    result = json.loads(out.read_text())
    trips = result["round_trips"]
    assert len(trips) == 15 and all(
        r["staged_bytes_exact"] and r["restored_exact"] and r["layerwise_exact"] for r in trips
    )
    reps = result["bandwidth"]["reps"]
    assert {r["path"] for r in reps} == {"staged_d2h", "torch_d2h", "staged_h2d", "torch_h2d"}
    assert len(reps) == 8 and all(r["gbps"] > 0 for r in reps)
