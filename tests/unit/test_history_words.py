"""kvray's code, tests, scripts and configs speak of the product, never of its history.

The history goes to CHANGELOG.md (and git); README.md and docs/*.md are held to the same
rule by tests/unit/test_docs_rendered.py, whose matchers this test reuses. Read here:
every file git tracks or would track under kvray/, actors/, tests/, scripts/ and
configs/ (bench-results/ and CHANGELOG.md are not under them).

What is read as prose:

- in a Python file, its comments and the strings that stand as statements (docstrings);
  every other string literal (str, bytes, f-string) is data: a test vector, a log format,
  a fixture, a negative control;
- in any other file, every line.

In prose, code spans (text between backticks) are quoted code and URLs are addresses
(except one to kvray's own issues or pull requests), and neither is read. What fails:

- a kvray issue number or session word: ``issue``/``stop``/``turn``/``session`` and a
  number, and a bare ``#`` and number; either may follow an upstream project's name
  (``vLLM``, ``owner/repo``), which makes it that project's reference;
- a commit hash: 7 to 40 lowercase hex digits with a digit and a letter, standing as a
  word of prose (not glued by ``@ - / . _`` to a larger token such as a key or a path);
- a date: ``YYYY-MM-DD``, or a month's name next to a day or a year.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

from tests.history_words import HASH, HISTORY

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("kvray", "actors", "tests", "scripts", "configs")

MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t|tember)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?"
MONTH_DATE = re.compile(
    rf"\b(?:{MONTH}\.? {DAY}(?!\d)(?:,? 20\d\d)?|{DAY} {MONTH}\b(?: 20\d\d)?|{MONTH} 20\d\d)\b"
)
NUMBER_SIGN = re.compile(r"(?<![\w&#/])#\d+\b")
# A hash stands alone: what precedes it is the line's start, a space, a bracket or a quote.
HASH_WORD = re.compile(rf"(?<![^\s(\[{{\"']){HASH.pattern}(?![@/_-])")
URL = re.compile(r"https?://\S+")
OWN_LINK = re.compile(r"/kvray/(?:issues|pull)/\d+")
CODE_SPAN = re.compile(r"(`+).*?\1")
UPSTREAM = re.compile(
    r"(?i)(?:\bvllm|vllm-ascend|\bray|mooncake|lmcache|sglang|pytorch|\btorch|memcache"
    r"|yuanrong|datasystem|\bucm|\w[\w.-]*/[\w.-]+)\s*$"
)


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split("\n")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def python_prose(source: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of every comment and docstring line of a Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string.lstrip("#")))
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            assert node.end_lineno is not None and node.end_col_offset is not None
            for number in range(node.lineno, node.end_lineno + 1):
                line = lines[number - 1]
                if number == node.end_lineno:
                    line = line[: node.end_col_offset]
                if number == node.lineno:
                    line = line[node.col_offset :]
                out.append((number, line))
    return sorted(out)


def prose(path: Path, text: str) -> list[tuple[int, str]]:
    if path.suffix == ".py":
        return python_prose(text)
    return list(enumerate(text.splitlines(), 1))


def upstream_before(line: str, start: int) -> bool:
    return bool(UPSTREAM.search(line[:start]))


def findings(path: Path, text: str) -> list[str]:
    """``line: kind 'text'`` for every history mark in the file's prose, in reading order."""
    found: list[tuple[int, int, str]] = []
    for number, raw in prose(path, text):
        # Blanking (not deleting) keeps the positions of what is left, for the order.
        line = CODE_SPAN.sub(lambda m: " " * len(m[0]), raw)
        found += [(number, m.start(), f"issue link {m[0]!r}") for m in OWN_LINK.finditer(line)]
        line = URL.sub(lambda m: " " * len(m[0]), line)
        for m in HISTORY.finditer(line):
            if m[0][0].isdigit():
                found.append((number, m.start(), f"date {m[0]!r}"))
            elif not upstream_before(line, m.start()):
                found.append((number, m.start(), f"history {m[0]!r}"))
        for m in NUMBER_SIGN.finditer(line):
            if not upstream_before(line, m.start()):
                found.append((number, m.start(), f"history {m[0]!r}"))
        found += [(number, m.start(), f"commit hash {m[0]!r}") for m in HASH_WORD.finditer(line)]
        found += [(number, m.start(), f"date {m[0]!r}") for m in MONTH_DATE.finditer(line)]
    return [f"{number}: {what}" for number, _, what in sorted(found)]


def test_no_history_in_code_tests_scripts_or_configs():
    files = tracked_files()
    assert len(files) > 200 and ROOT / "actors" / "manager.py" in files  # the tree was read
    problems = [
        f"{path.relative_to(ROOT)}:{finding}"
        for path in files
        for finding in findings(path, path.read_text(errors="replace"))
    ]
    assert not problems, (
        "the product speaks of itself: say why, not which issue, session, commit or day "
        "(the story goes to CHANGELOG.md):\n" + "\n".join(problems)
    )


def test_the_rule_sees_history_and_lets_data_pass():
    """A negative control: each kind of history mark is found, with its line; data,
    quoted code and upstream references pass."""
    source = (
        '"""Lookups answered locally (issue 27).\n'
        "\n"
        "Fixed in a2e60fd, since stop 40, on 2026-03-02.\n"
        '"""\n'
        "import re  # see #31; measured March 3, 2026\n"
        'VECTOR = b"9f86d081884c7d65"  # the digest of a test vector\n'
        'KEY = "model@g0f1e2d3c4b5@9f86d08"\n'
        "# vLLM #53505 and https://github.com/vllm-project/vllm/issues/53505 are upstream's;\n"
        "# ``issue 12``, a key ``...@9f86d08`` and model@g0f1e2d3 are quoted or glued.\n"
        "# https://github.com/o/kvray/issues/12 is kvray's own; turn 3 too.\n"
        "def f():\n"
        '    """Since 3 May."""\n'
        '    return "issue 27, a2e60fd"\n'
    )
    assert findings(Path("x.py"), source) == [
        "1: history 'issue 27'",
        "3: commit hash 'a2e60fd'",
        "3: history 'stop 40'",
        "3: date '2026-03-02'",
        "5: history '#31'",
        "5: date 'March 3, 2026'",
        "10: issue link '/kvray/issues/12'",
        "10: history 'turn 3'",
        "12: date '3 May'",
    ]
    assert findings(Path("pool.yaml"), "# tuned at e10c9ec\nseed: 1234abcd\n") == [
        "1: commit hash 'e10c9ec'",
        "2: commit hash '1234abcd'",
    ]
