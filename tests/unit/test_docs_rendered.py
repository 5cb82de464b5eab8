"""README.md and docs/*.md hold measurements only where scripts/report.py renders them.

The rule, for a line of README.md or docs/*.md outside a rendered block
(``<!-- report:... -->`` ... ``<!-- /report -->``):

- A **measurement** is a number followed by a unit of time, bandwidth, ratio or share:
  ``ms``, ``s``, ``min``, ``seconds``, ``minutes``, ``hours``, ``GB/s``, ``GiB/s``,
  ``MB/s``, ``MiB/s``, ``%``, or ``x`` written against the number (``1.2x``); and in a
  Markdown table whose header names such a unit, any cell that is a bare number (so a
  table of measurements is never typed by hand). None may appear: it goes in a rendered
  block, from a JSON under bench-results/.
- A **setting** (a default, a timeout, a flag's value, a constant of the code) is written
  in a code span or a code block (``lookup_timeout_ms: 200``, ``--duration 900``,
  `` `5 s` ``): code is never read as a measurement. Counts and sizes (``14 MiB``,
  ``1000 blocks``) carry no such unit and are neither.
- Link targets (``](docs/x.md#y)``) are addresses, not text.
- No commit hash (7 to 40 hex digits, with a digit and a letter) outside code, no kvray
  issue number or session word (``issue N``, ``stop N``) and no date (``YYYY-MM-DD``):
  the commit a result was measured at is named only by its rendered block.

And every rendered block is what ``scripts/report.py`` renders now (``--check``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.history_words import HASH, HISTORY

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "scripts" / "report.py"

UNIT = r"(?:ms|s|min|seconds?|minutes?|hours?|GB/s|GiB/s|MB/s|MiB/s|%)"
NUMBER = r"[-+±~]?\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?"  # 31.4, +9.0, ~2, 3-7
MEASUREMENT = re.compile(rf"(?<![\w.#/]){NUMBER}(?:\s?{UNIT}(?![\w/])|x(?!\w))")
TABLE_UNIT = re.compile(rf"(?<![\w-]){UNIT}(?![\w/])")
BARE_NUMBER = re.compile(r"^\s*[-+±~]?\d+(?:\.\d+)?\s*$")
BLOCK = re.compile(r"<!-- report:[^>]*-->.*?<!-- /report -->", re.S)


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, the line without code spans and link targets, in a table)`` for
    every line outside code blocks and rendered blocks."""
    # Rendered blocks become blank lines, so line numbers stay those of the file.
    text = BLOCK.sub(lambda m: "\n" * m[0].count("\n"), text)
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        prose = re.sub(r"\]\([^)]*\)", "]", prose)
        out.append((number, prose, line.lstrip().startswith("|")))
    return out


def findings(text: str) -> list[str]:
    """Every measurement, hash and history mark outside rendered blocks and code."""
    found = []
    header_has_unit = False
    previous_was_table = False
    for number, line, in_table in prose_lines(text):
        for m in MEASUREMENT.finditer(line):
            found.append(f"{number}: measurement {m[0].strip()!r}")
        for m in HASH.finditer(line):
            found.append(f"{number}: commit hash {m[0]!r}")
        for m in HISTORY.finditer(line):
            found.append(f"{number}: history {m[0]!r}")
        if in_table and not previous_was_table:
            header_has_unit = bool(TABLE_UNIT.search(line))
        elif in_table and header_has_unit and not re.fullmatch(r"[\s|:-]*", line):
            cells = line.strip().strip("|").split("|")
            found += [f"{number}: table cell {c.strip()!r}" for c in cells if BARE_NUMBER.match(c)]
        previous_was_table = in_table
    return found


def load_report() -> ModuleType:
    sys.path.insert(0, str(REPORT.parent))
    try:
        spec = importlib.util.spec_from_file_location("report", REPORT)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules["report"] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPORT.parent))


def test_no_measurement_outside_rendered_blocks():
    problems = [
        f"{path.relative_to(ROOT)}:{finding}"
        for path in docs()
        for finding in findings(path.read_text())
    ]
    assert not problems, (
        "measurements belong in a block scripts/report.py renders; settings in code spans:\n"
        + "\n".join(problems)
    )


# Spelt apart, so that the whole-tree history check (test_history_words.py) does not read
# this sample as kvray's history.
SESSION = "stop" + " 39"


def test_the_rule_sees_measurements_and_lets_settings_pass():
    text = (
        "A hit takes 31.4 ms, 1.22x the peer, at 5.5 GB/s; 90 % of it in 19 s; 3-7 ms.\n"
        "The default `lookup_timeout_ms: 200`, every `0.5 s`, 14 MiB, 1000 blocks.\n"
        "```bash\nscripts/soak.py --duration 900   # 15 min\n```\n"
        "| input | kvray ms |\n|---|---|\n| 1024 | 46.7 |\n"
        f"At commit c65b3a3, since {SESSION}.\n"
        "<!-- report:ttft x.json -->\n| 1024 | 46.7 ms |\nat commit c65b3a3\n<!-- /report -->\n"
    )
    got = findings(text)
    assert got == [
        "1: measurement '31.4 ms'",
        "1: measurement '1.22x'",
        "1: measurement '5.5 GB/s'",
        "1: measurement '90 %'",
        "1: measurement '19 s'",
        "1: measurement '3-7 ms'",
        "8: table cell '1024'",
        "8: table cell '46.7'",
        "9: commit hash 'c65b3a3'",
        f"9: history {SESSION!r}",
    ]


def test_rendered_blocks_are_current():
    """What ``report.py --check`` says: every block as the JSON renders it now, and every
    result rendered somewhere."""
    res = subprocess.run(
        [sys.executable, str(REPORT), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr


def test_check_sees_a_block_edited_by_hand():
    report = load_report()
    results = report.Results(report.RESULTS)
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    m = report.BLOCK.search(text)
    assert m, "docs/benchmarks.md has rendered blocks"
    edited = text[: m.start("body")] + m["body"].replace("|", "| 1.0 ms", 1) + text[m.end("body") :]
    assert [c.block for c in report.changes(doc, edited, results)] == [m["name"]]
    assert report.render_text(edited, results) == text


def test_stale_names_every_result():
    res = subprocess.run(
        [sys.executable, str(REPORT), "--stale"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    for path in (ROOT / "bench-results").glob("*.json"):
        assert path.name in res.stdout
