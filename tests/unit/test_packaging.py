"""What ``pip install kvray`` (a wheel, not the editable checkout) ships: every package
of the source tree, so no import that works in the checkout fails once installed."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_lists_every_package_of_the_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    dirs = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    on_disk = set()
    for name, top in dirs.items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            on_disk.add(".".join((name, *rel)))
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - on_disk == set(), "packages listed that the tree no longer has"
