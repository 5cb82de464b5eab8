"""Render every measured number of README.md and docs/*.md from ``bench-results/*.json``.

A doc holds a measurement only inside a rendered block:

    <!-- report:RENDERER FILE.json [FILE.json ...] -->
    (text this script writes)
    <!-- /report -->

``RENDERER`` is a key of :data:`RENDERERS`; the files are results under ``bench-results/``
(one JSON per benchmark and configuration). Each block ends with the commit every result
in it was measured at, read from the JSON: the only place a commit hash appears in the
docs.

    .venv/bin/python scripts/report.py           # rewrite every block in place
    .venv/bin/python scripts/report.py --check   # exit 1 naming each block that would change
    .venv/bin/python scripts/report.py --stale   # how old each result is (for CI's log)

``--stale`` prints, per result, how many commits since the one it was measured at touched
what its script measures: the script's module constant ``MEASURES`` (paths, read with
``ast``, never imported) where it has one, else :data:`MEASURES` here. It is never
written into a doc: it changes with every commit.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _report_format import ReportError, Results, meta
from _report_render import RENDERERS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench-results"
SMOKE = ["--check"]
"""The suite's smoke run (``tests/unit/test_docs_rendered.py``): render, write nothing."""

BLOCK = re.compile(r"(<!-- report:(?P<name>[^>]*?) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)

ENGINE = ("kvray", "actors", "scripts/_engines.py", "scripts/_common.py")
STORE = ("kvray/backends", "kvray/store", "kvray/index", "kvray/transfer.py", "kvray/shm.py")
MEASURES: dict[str, tuple[str, ...]] = {
    "bench_store.py": (
        *STORE,
        "kvray/pool.py",
        "actors",
        "scripts/bench_store.py",
        "scripts/_raw_clients.py",
    ),
    "bench_ssd.py": (
        "kvray/backends/ssd.py",
        "kvray/store/tiers.py",
        "kvray/pool.py",
        "actors",
        "scripts/bench_ssd.py",
    ),
    "bench_channel.py": (*STORE, "actors", "scripts/bench_channel.py"),
    "bench_ttft.py": (*ENGINE, "scripts/bench_ttft.py"),
    "bench_layerwise.py": (*ENGINE, "scripts/bench_layerwise.py"),
    "ttft_breakdown.py": (*ENGINE, "scripts/ttft_breakdown.py"),
    "bench_serve.py": (*ENGINE, "scripts/bench_serve.py", "scripts/_serving.py"),
    "bench_route.py": (*ENGINE, "scripts/bench_route.py"),
    "bench_workloads.py": (*ENGINE, "scripts/bench_workloads.py", "scripts/_serving.py"),
    "soak.py": (*ENGINE, "scripts/soak.py", "scripts/_soak_faults.py"),
}
"""What each script measures, for scripts that declare no ``MEASURES`` of their own."""

PRODUCER: dict[str, str] = {
    "bench_store": "bench_store.py",
    "bench_cross_node": "bench_store.py",
    "bench_ssd": "bench_ssd.py",
    "bench_channel": "bench_channel.py",
    "bench_ttft": "bench_ttft.py",
    "bench_layerwise": "bench_layerwise.py",
    "ttft_breakdown": "ttft_breakdown.py",
    "bench_serve": "bench_serve.py",
    "bench_route": "bench_route.py",
    "bench_workloads": "bench_workloads.py",
    "soak": "soak.py",
}
"""The script that writes a result, by the result's name up to its configuration."""

# --- blocks in files -------------------------------------------------------------------


def render_block(name: str, results: Results) -> str:
    renderer, *files = name.split()
    if renderer not in RENDERERS:
        raise ReportError(f"unknown renderer {renderer!r} (known: {', '.join(RENDERERS)})")
    return "\n" + RENDERERS[renderer](results, files) + "\n\n"


def render_text(text: str, results: Results) -> str:
    """``text`` with every rendered block's body rendered anew."""
    return BLOCK.sub(lambda m: m[1] + render_block(m["name"], results) + m[4], text)


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass
class Change:
    path: Path
    block: str


def changes(path: Path, text: str, results: Results) -> list[Change]:
    """The blocks of ``path`` whose committed text differs from a new render."""
    out = []
    for m in BLOCK.finditer(text):
        if m["body"] != render_block(m["name"], results):
            out.append(Change(path, m["name"]))
    return out


@dataclass
class Stale:
    result: str
    script: str
    commit: str
    since: int | None


def producer(result: str) -> str:
    stem = result.removesuffix(".json")
    for prefix in sorted(PRODUCER, key=len, reverse=True):
        if stem == prefix or stem.startswith(prefix + "_"):
            return PRODUCER[prefix]
    raise ReportError(f"bench-results/{result}: no script in PRODUCER writes it")


def measures(script: str, root: Path = ROOT) -> tuple[str, ...]:
    """The script's ``MEASURES`` (a tuple of path strings at its top level), else the
    table's."""
    tree = ast.parse((root / "scripts" / script).read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "MEASURES" and node.value is not None:  # type: ignore[attr-defined]
            return tuple(ast.literal_eval(node.value))  # type: ignore[attr-defined]
    return MEASURES[script]


def staleness(results: Results, root: Path = ROOT) -> list[Stale]:
    out = []
    for path in sorted((root / "bench-results").glob("*.json")):
        script = producer(path.name)
        commit = str(meta(results(path.name))["commit"])
        rev = commit.split("+")[0]
        res = subprocess.run(
            ["git", "rev-list", "--count", f"{rev}..HEAD", "--", *measures(script, root)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        out.append(
            Stale(path.name, script, commit, int(res.stdout) if res.returncode == 0 else None)
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a block would change")
    mode.add_argument("--stale", action="store_true", help="how old each result is")
    mode.add_argument("--smoke", action="store_true", help="the suite's run: --check")
    args = parser.parse_args(argv)
    results = Results(RESULTS)
    if args.stale:
        print(
            f"{'result':34} {'script':20} {'measured at':14} "
            "commits since that touched what it measures"
        )
        for s in staleness(results):
            since = "commit not in this repository" if s.since is None else str(s.since)
            print(f"{s.result:34} {s.script:20} {s.commit:14} {since}")
        return 0
    found: list[Change] = []
    for path in doc_files():
        text = path.read_text()
        if args.check or args.smoke:
            found += changes(path, text, results)
        else:
            new = render_text(text, results)
            if new != text:
                path.write_text(new)
                print(f"rendered {path.relative_to(ROOT)}")
    unused = sorted(p.name for p in RESULTS.glob("*.json") if p.name not in results.used)
    for c in found:
        print(
            f"{c.path.relative_to(ROOT)}: block 'report:{c.block}' would change: "
            "run scripts/report.py and commit",
            file=sys.stderr,
        )
    for name in unused:
        print(f"bench-results/{name}: no doc renders it (render it or delete it)", file=sys.stderr)
    return 1 if found or unused else 0


if __name__ == "__main__":
    sys.exit(main())
