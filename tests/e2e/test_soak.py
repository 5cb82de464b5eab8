"""The soak under faults, CI-sized: scripts/soak.py's full run with smaller arguments
(40 s of 4 concurrent clients, a fault every ~2 s), once with the pool's block checksums
on and once off. Every completed request's greedy tokens equal the run without kvray,
none fails or waits past the bound, nothing is left behind, and every fault kind was
*injected*: each one shows its effect (a PID that changed and a restart Ray counted,
removed blocks that no longer exist or were stored again since, files that changed,
bytes a fill wrote).
docs/reliability.md has the long run's counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvray.testing.multinode import unavailable_reason

ROOT = Path(__file__).parents[2]
SHM_SIZE = "1g"
PRIVATE_SHM = unavailable_reason() is None
"""The soak runs in a mount namespace of its own with a tmpfs of :data:`SHM_SIZE` on
/dev/shm (root and ``unshare``, as in CI; the multi-node harness gives each node one the
same way): its shm_full fault fills that, and another test worker runs beside it. 1 GiB:
the soak's /dev/shm users are vLLM's rings and Ray's object store (which goes to /tmp
below 30 % of RAM); kvray's regions are memory files, not /dev/shm names. A fill of 1 GiB
needs 1 GiB of RAM, which CI has beside the other worker (a 4 GiB one found only 6 GiB
free once and could not be filled). Where no namespace can be made, it fills the
machine's /dev/shm to a few GiB short of RAM, so it runs alone (``exclusive``)."""
RAM_RESERVE = (2 if PRIVATE_SHM else 6) << 30
"""What the fill leaves of available memory: the other worker's engines beside a private
fill, the whole machine's use for the machine's own /dev/shm."""

pytestmark = [pytest.mark.e2e, *([] if PRIVATE_SHM else [pytest.mark.exclusive])]
KINDS = {"kill_client", "kill_master", "remove_blocks", "corrupt_ssd", "pool_full", "shm_full"}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The no-connector run's tokens, computed by the first mode and read by the second
    (the soak checks that the model files, prompts and length are the same)."""
    return tmp_path_factory.mktemp("soak-oracle") / "oracle.json"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("checksum", ["on", "off"])
def test_soak_under_faults(tmp_path: Path, oracle: Path, tiny_model: str, checksum: str) -> None:
    out, requests = tmp_path / "soak.json", tmp_path / "requests.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--model", tiny_model,
           "--duration", "40", "--fault-every", "2", "--hold", "1",
           "--ram-reserve", str(RAM_RESERVE),
           "--checksum", checksum, "--oracle", str(oracle),
           "--json", str(out), "--requests-json", str(requests)]  # fmt: skip
    if PRIVATE_SHM:
        mount = f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT)
    report = proc.stdout[proc.stdout.find("soak:") :]
    assert proc.returncode == 0, f"{report}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["failures"] == [], report
    assert result["meta"]["checksum"] == checksum
    assert result["meta"]["pool_checksum"] is (checksum == "on")

    # Every kind injected, each with the evidence of its effect.
    assert set(result["faults_by_kind"]) == KINDS
    assert all(
        n["injected"] >= 1 and n["not_shown"] == 0 for n in result["faults_by_kind"].values()
    )
    seen: dict[str, list[dict]] = {}
    for fault in result["faults"]:
        assert fault["ok"] and fault["error"] is None, fault
        seen.setdefault(fault["kind"], []).append(fault["evidence"])
    assert set(seen) == KINDS, report
    for e in seen["kill_client"]:
        assert e["pid_after"] != e["pid_before"] and e["old_pid_gone"], e
        assert e["ray_restarts_after"] > e["ray_restarts_before"], e
    for e in seen["kill_master"]:
        assert e["pid_after"] != e["pid_before"] and e["old_pid_gone"], e
        assert e["restarts_after"] > e["restarts_before"], e
    for e in seen["remove_blocks"]:
        # what still exists right after was stored again since, as the ledger shows
        assert e["removed"] > 0 and e["exist_after"] == e["stored_again"], e
    for e in seen["corrupt_ssd"]:
        assert e["files"], e
    for e in seen["pool_full"]:
        assert e["acknowledged_bytes"] > 0, e
        assert e["dram_put_bytes"] >= e["segment_bytes"] or e["dram_refused_full"] > 0, e
    for e in seen["shm_full"]:
        assert e["allocated_bytes"] >= e["fill_bytes"] > 0, e

    # The oracle: every request completed with the no-connector run's tokens.
    counts = result["requests"]
    assert counts["total"] == counts["completed"] > 0, report
    assert counts["wrong"] == counts["failed"] == counts["slow"] == 0, report
    rows = json.loads(requests.read_text())["requests"]
    assert len(rows) == counts["total"] and all(r["ok"] for r in rows)
    assert result["blocks"]["loaded"] > 0, "no request loaded anything from the pool"
