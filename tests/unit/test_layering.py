"""The layering contract (docs/architecture.md, "Layering"), read from the source: no
import circles among kvray's modules, and the actor shells imported only by the launcher
and each other. Every import counts: inside functions, under ``TYPE_CHECKING``, and
``importlib.import_module`` / ``__import__`` of a literal module name. (Ray's own
boundary is ruff's banned-api rule, TID251 in pyproject.toml.) import-linter would
read the same graph, but it finds modules by directory, and ``kvray.actors`` is
setuptools' mapping of the top-level actors/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for kvray/ and actors/ (installed as kvray.actors)."""
    out = {}
    for base, package in (("kvray", "kvray"), ("actors", "kvray.actors")):
        for path in (root / base).rglob("*.py"):
            parts = [package, *path.relative_to(root / base).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(module: str, path: Path) -> set[str]:
    """Every name ``module`` imports (``from a import b``: ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args:
            fn, arg = node.func, node.args[0]
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                names.add(str(arg.value))
    return names


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the kvray modules it imports (not its own packages: Python imports those
    first anyway)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for module, path in mods.items():
        found = {resolve(n) for n in imported(module, path)}
        edges[module] = {m for m in found if m and m != module and not module.startswith(m + ".")}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_kvray_has_no_import_circles():
    edges = graph(ROOT)
    assert len(edges) > 90 and "kvray.actors.manager" in edges  # the whole tree was read
    assert circles(edges) == []


def test_only_the_launcher_imports_the_actor_shells():
    outside = {
        (m, t)
        for m, targets in graph(ROOT).items()
        for t in targets
        if t.startswith("kvray.actors") and not m.startswith("kvray.actors")
    }
    assert {m for m, _ in outside} == {"kvray.launcher"}, sorted(outside)


def test_the_check_sees_circles_through_functions_and_importlib(tmp_path):
    """A negative control: a circle closed by an import inside a function, one under
    TYPE_CHECKING and one through importlib are each found."""
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "__init__.py").write_text("")
    pkg = tmp_path / "kvray"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvray import b\n")
    (pkg / "b.py").write_text("def f():\n    from kvray.a import x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvray.d\n"
    )
    (pkg / "d.py").write_text("import importlib\nimportlib.import_module('kvray.c')\n")
    (tmp_path / "actors" / "shell.py").write_text("from kvray import a\n")
    (pkg / "e.py").write_text("from . import f\n")
    (pkg / "f.py").write_text("__import__('kvray.actors.shell')\nimport kvray.e\n")
    assert circles(graph(tmp_path)) == [
        ["kvray.a", "kvray.b"],
        ["kvray.c", "kvray.d"],
        ["kvray.e", "kvray.f"],
    ]
