"""docs/architecture.md's "Code map" names every module of kvray/ and actors/, and names
no module that is gone.

A module is named by its path in a code span (`` `kvray/index/ledger.py` ``); a package's
``__init__.py`` by its folder (`` `kvray/index/` ``). The modules are the ``.py`` files on
disk, so one just written is missed until the map names it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("kvray", "actors")
NAME = re.compile(r"`((?:kvray|actors)/(?:[\w.]+/)*(?:[\w.]+\.py)?)`")


def code_map(text: str) -> str:
    """The "Code map" section: from its heading to the next heading of its level."""
    m = re.search(r"^## Code map\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "docs/architecture.md has a '## Code map' section"
    return m[1]


def modules(root: Path) -> set[str]:
    """Each module's name as the map writes it: its path, or its folder for __init__.py."""
    out = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            out.add(rel.removesuffix("__init__.py") if path.name == "__init__.py" else rel)
    return out


def mismatches(root: Path, section: str) -> list[str]:
    named = set(NAME.findall(section))
    present = modules(root)
    return [f"{m}: not in the code map" for m in sorted(present - named)] + [
        f"{m}: in the code map, not on disk" for m in sorted(named - present)
    ]


def test_the_code_map_names_every_module():
    present = modules(ROOT)
    assert "kvray/index/block_index.py" in present and "actors/manager.py" in present
    problems = mismatches(ROOT, code_map(DOC.read_text()))
    assert not problems, "docs/architecture.md, Code map:\n" + "\n".join(problems)


def test_the_check_sees_a_missing_and_a_stale_module(tmp_path):
    """A negative control: a module the map leaves out and one it names that is gone are
    each found; a package named by its folder passes."""
    for path in ("kvray/__init__.py", "kvray/index/__init__.py", "kvray/index/ledger.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "manager.py").write_text("")
    text = (
        "# How\n\n## Code map\n\n| `kvray/` | x |\n| `kvray/index/` | x |\n"
        "| `kvray/index/ledger.py` | x |\n| `kvray/lookups.py` | gone |\n"
        "\n## Layering\n\n`actors/manager.py` is named here, outside the map.\n"
    )
    assert mismatches(tmp_path, code_map(text)) == [
        "actors/manager.py: not in the code map",
        "kvray/lookups.py: in the code map, not on disk",
    ]
