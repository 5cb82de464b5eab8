"""kvray speaks of itself, never of its history: no kvray issue numbers, session words,
hand-typed commit hashes or dates in README.md, docs/*.md, or any file git tracks (or
would track) under kvray/, actors/, tests/, scripts/ and configs/. The story goes to
CHANGELOG.md (exempt, as is bench-results/, which holds the measurements' own records).

Every line is read whole: code, comments, docstrings and string literals alike, since a
log line or an error message is something users read. What fails:

- a kvray issue, pull request or session reference: ``issue``, ``PR``, ``stop``, ``turn``
  or ``session`` and a number, a bare ``#`` and number, or a link to kvray's own issues.
  An upstream project's name just before it (``vLLM``, ``Ray``, ``owner/repo``, with an
  optional ``issue`` or ``PR`` between) makes it that project's reference, and URLs are
  addresses: both pass;
- a commit hash: 7 to 40 lowercase hex digits with a digit and a letter, standing as a
  word (not glued by ``@ - / _`` to a larger token such as a key or a path);
- a date: ISO ``YYYY-MM-DD`` or ``YYYY-MM``, or a month's name next to a day or a year.

Hex that is data is not a hash, by where it stands, never by a list of values:

- in a bytes literal (``b"..."``), anywhere;
- in a string literal of a Python file under tests/ that is not a docstring (a test
  vector, a key, a node id, a backend's message as a fixture);
- in README.md and docs/*.md: inside a block ``scripts/report.py`` renders
  (``<!-- report:... -->`` to ``<!-- /report -->``, where it writes the commit a result
  was measured at), and inside a fenced code block (commands and their output: node ids).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
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
# A hash stands alone: what precedes it is the line's start, a space, a bracket, a quote
# or a backtick; what follows is not a joint of a larger token.
HASH_WORD = re.compile(rf"(?<![^\s(\[{{\"'`]){HASH.pattern}(?![@/_-])")
URL = re.compile(r"https?://\S+")
OWN_LINK = re.compile(r"/kvray/(?:issues|pull)/\d+")
UPSTREAM = re.compile(
    r"(?i)(?:\bvllm|vllm-ascend|\bray|mooncake|lmcache|sglang|pytorch|\btorch|memcache"
    r"|yuanrong|datasystem|\bucm|\w[\w.-]*/[\w.-]+)(?:'s)?"
    r"(?:\s+(?:issues?|PRs?|pull requests?|bug))?\s*$"
)
BLOCK = re.compile(r"<!-- report:[^>]*-->.*?<!-- /report -->", re.S)
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.S | re.M)


def scanned_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split("\n")
    tree = [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *tree]


def blank(text: str, spans: Iterator[tuple[int, int]]) -> str:
    """``text`` with each ``(start, end)`` span of characters made spaces (newlines kept,
    so lines and columns stay those of the file)."""
    chars = list(text)
    for start, end in spans:
        for i in range(start, end):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def data_strings(text: str, in_tests: bool) -> Iterator[tuple[int, int]]:
    """The spans of a Python source's string literals that hold data: bytes literals, and
    under tests/ every string literal that is not a docstring."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]  # tokenize's rows
    docstrings = [
        ((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset))
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.STRING:
            continue
        prefix = tok.string[: len(tok.string) - len(tok.string.lstrip("rRbBfFuU"))]
        docstring = any(first <= tok.start and tok.end <= last for first, last in docstrings)
        if "b" in prefix.lower() or (in_tests and not docstring):
            yield starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]


def data_in_docs(text: str) -> Iterator[tuple[int, int]]:
    """The rendered blocks and fenced code blocks of a Markdown page."""
    for pattern in (BLOCK, FENCE):
        yield from (m.span() for m in pattern.finditer(text))


def upstream_before(line: str, start: int) -> bool:
    return bool(UPSTREAM.search(line[:start]))


def findings(path: Path, text: str) -> list[str]:
    """``line: kind 'match' in: the line`` for every history mark in a file, in reading
    order. ``path`` is relative to the repository's root: it decides what is data."""
    if path.suffix == ".py":
        hex_text = blank(text, data_strings(text, path.parts[0] == "tests"))
    elif path.suffix == ".md":
        hex_text = blank(text, data_in_docs(text))
    else:
        hex_text = text
    found = []
    for number, (raw, hex_line) in enumerate(
        zip(text.split("\n"), hex_text.split("\n"), strict=True), 1
    ):
        marks = [("issue link", m) for m in OWN_LINK.finditer(raw)]
        # Blanking (not deleting) keeps the positions of what is left, for the order.
        line = URL.sub(lambda m: " " * len(m[0]), raw)
        for m in HISTORY.finditer(line):
            if m[0][0].isdigit():
                marks.append(("date", m))
            elif not upstream_before(line, m.start()):
                marks.append(("history", m))
        marks += [
            ("history", m)
            for m in NUMBER_SIGN.finditer(line)
            if not upstream_before(line, m.start())
        ]
        marks += [("date", m) for m in MONTH_DATE.finditer(line)]
        hex_line = URL.sub(lambda m: " " * len(m[0]), hex_line)
        marks += [("commit hash", m) for m in HASH_WORD.finditer(hex_line)]
        found += [(number, m.start(), f"{kind} {m[0]!r}", raw.strip()[:120]) for kind, m in marks]
    return [f"{n}: {what} in: {line}" for n, _, what, line in sorted(found)]


def test_no_history_in_the_product():
    files = scanned_files()
    assert len(files) > 200 and ROOT / "actors" / "manager.py" in files  # the tree was read
    assert ROOT / "docs" / "architecture.md" in files
    problems = [
        f"{path.relative_to(ROOT)}:{finding}"
        for path in files
        for finding in findings(path.relative_to(ROOT), path.read_text(errors="replace"))
    ]
    assert not problems, (
        "the product speaks of itself: say why, not which issue, session, commit or day "
        "(the story goes to CHANGELOG.md):\n" + "\n".join(problems)
    )


# Each mark of the samples below is spelt apart here and joined when the test runs, so
# that this file's own text holds none of the marks it looks for.
MARKS = {
    key: spelt.replace("|", "")
    for key, spelt in {
        "i": "issue| 27",
        "u": "issue| 4711",
        "s": "stop| 40",
        "t": "turn| 3",
        "p": "#|31",
        "d": "2026-|03-02",
        "m": "March| 3, 2026",
        "y": "3| May",
        "c": "Dec| 2026",
        "o": "https://github.com/o/kvray/issues|/12",
        "l": "/kvray/issues|/12",
    }.items()
}


def sample(*texts: str) -> list[str]:
    return [text.format(**MARKS) for text in texts]


def kinds(path: str, text: str) -> list[str]:
    """What ``findings`` reports, without the lines' text."""
    return [f.partition(" in: ")[0] for f in findings(Path(path), text)]


def test_the_rule_sees_history_in_code_and_lets_data_pass():
    """A negative control: each kind of history mark is found, with its line, in code,
    comments, docstrings and strings; upstream references, glued keys and bytes pass."""
    (source,) = sample(
        '"""Lookups answered locally ({i}).\n'
        "\n"
        "Fixed in a2e60fd, since {s}, on {d}.\n"
        '"""\n'
        "import re  # see {p}; measured {m}\n"
        'VECTOR = b"9f86d081884c7d65"  # the digest of a test vector\n'
        'KEY = "model@g0f1e2d3c4b5@9f86d08"\n'
        "# vLLM {p} and https://github.com/vllm-project/vllm/issues/53505 are upstream's;\n"
        "# so is Ray's {u}; a key ``...@9f86d08`` and model@g0f1e2d3 are glued.\n"
        "# {o} is kvray's own; {t} too.\n"
        "def f():\n"
        '    """Since {y}."""\n'
        '    raise ValueError("`{i}`, see e10c9ec")\n'
    )
    assert kinds("kvray/x.py", source) == sample(
        "1: history '{i}'",
        "3: commit hash 'a2e60fd'",
        "3: history '{s}'",
        "3: date '{d}'",
        "5: history '{p}'",
        "5: date '{m}'",
        "10: issue link '{l}'",
        "10: history '{t}'",
        "12: date '{y}'",
        "13: history '{i}'",
        "13: commit hash 'e10c9ec'",
    )
    assert findings(Path("kvray/x.py"), *sample("x = 1  # {i}\n")) == sample(
        "1: history '{i}' in: x = 1  # {i}"
    )


def test_the_rule_reads_tests_strings_as_data_for_hex_only():
    """Under tests/ a string literal's hex is data; its history words, and a docstring's or
    a comment's hex, are not. Elsewhere a string's hex is a hash too."""
    (source,) = sample(
        '"""Fixed in a2e60fd."""\n'
        'GEO = ("0123456789ab", "traceId: d804e0ca")  # since e10c9ec\n'
        'assert x, "broken since {s}"\n'
    )
    assert kinds("tests/unit/t.py", source) == sample(
        "1: commit hash 'a2e60fd'",
        "2: commit hash 'e10c9ec'",
        "3: history '{s}'",
    )
    assert kinds("kvray/t.py", source) == sample(
        "1: commit hash 'a2e60fd'",
        "2: commit hash '0123456789ab'",
        "2: commit hash 'd804e0ca'",
        "2: commit hash 'e10c9ec'",
        "3: history '{s}'",
    )


def test_the_rule_reads_docs_and_configs():
    """In docs a hash passes only inside a rendered block or a code block, and nothing else
    does; in a config every line is read."""
    (page,) = sample(
        "Measured since {s} ({i}), on {d}; see `a2e60fd`.\n"
        "<!-- report:ttft x.json -->\n| 1024 | 46.7 ms |\nat commit c65b3a3, {t}\n"
        "<!-- /report -->\n"
        "```\nnode 5c1f0d2a9b3e 10.0.0.12   3\n```\n"
        "As of {c}, node 5c1f0d2a9b3e.\n"
    )
    assert kinds("docs/x.md", page) == sample(
        "1: history '{s}'",
        "1: history '{i}'",
        "1: date '{d}'",
        "1: commit hash 'a2e60fd'",
        "4: history '{t}'",
        "9: date '{c}'",
        "9: commit hash '5c1f0d2a9b3e'",
    )
    assert kinds("configs/pool.yaml", "# tuned at e10c9ec\nseed: 1234abcd\n") == [
        "1: commit hash 'e10c9ec'",
        "2: commit hash '1234abcd'",
    ]
