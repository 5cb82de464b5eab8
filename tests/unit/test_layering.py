"""The layering contract (docs/architecture.md, "Layering" and "Code map"), read from the
source: no import circles among kvray's modules, the actor shells imported only by the
launcher and each other, and the subsystem packages kept apart (``PACKAGE_RULES``).
Every import counts: inside functions, under ``TYPE_CHECKING``, and
``importlib.import_module`` / ``__import__`` of a literal module name. (Ray's own
boundary is ruff's banned-api rule, TID251 in pyproject.toml.) import-linter would
read the same graph, but it finds modules by directory, and ``kvray.actors`` is
setuptools' mapping of the top-level actors/."""

from __future__ import annotations

import ast
from collections.abc import Callable
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
    first anyway, and their imports are checked as theirs). So a package rule holds for
    the package's modules as written; an ancestor's ``__init__`` runs too, which is why
    ``kvray/__init__.py`` loads its public names lazily (test_a_subsystem_imports_alone)."""
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


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# (importer package, what it must not import, why): each a direction the packages keep.
PACKAGE_RULES: list[tuple[str, Callable[[str], bool], str]] = [
    (
        "kvray.proxy",
        lambda t: not within(t, "kvray.proxy") and t != "kvray.warn_once",
        "the routing proxy runs in front of engines, apart from the pool: it imports only "
        "itself and kvray.warn_once",
    ),
    (
        "kvray.index",
        lambda t: within(t, "kvray.connector"),
        "what the pool holds is the pool's side; the engine's connector builds on it",
    ),
    (
        "kvray.store",
        lambda t: within(t, "kvray.connector"),
        "a rank's store is the pool's side; the engine's connector builds on it",
    ),
    (
        "kvray.index",
        lambda t: within(t, "kvray.store"),
        "the stores publish to the index, the index never reaches into a store",
    ),
]


def package_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``importer -> imported: why`` for each edge that breaks a package rule, and for each
    import of the test harness (kvray.testing) from outside it."""
    out = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            for package, forbidden, why in PACKAGE_RULES:
                if within(module, package) and forbidden(target):
                    out.append(f"{module} -> {target}: {why}")
            if within(target, "kvray.testing") and not within(module, "kvray.testing"):
                out.append(f"{module} -> {target}: the test harness is imported only by tests")
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


def test_the_subsystem_packages_keep_their_direction():
    edges = graph(ROOT)
    assert {"kvray.proxy.router", "kvray.index.block_index", "kvray.store.rank_store"} <= set(
        edges
    ) and any(within(m, "kvray.testing") for m in edges)  # the packages are where the rules say
    assert package_breaches(edges) == []


def test_the_package_rules_see_each_breach(tmp_path):
    """A negative control: an import that breaks each rule is found, through a function and
    a relative import too, and the imports each rule allows pass."""
    for folder in ("actors", "kvray", "kvray/proxy", "kvray/index", "kvray/store", "kvray/testing"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "kvray" / "warn_once.py").write_text("")
    (tmp_path / "kvray" / "pool.py").write_text("def f():\n    from kvray.testing import t\n")
    (tmp_path / "kvray" / "connector.py").write_text("")
    (tmp_path / "kvray" / "proxy" / "router.py").write_text(
        "from kvray import warn_once\nfrom . import feeds\nimport kvray.pool\n"
    )
    (tmp_path / "kvray" / "proxy" / "feeds.py").write_text("")
    (tmp_path / "kvray" / "index" / "ledger.py").write_text(
        "from kvray.keys import x\nfrom ..store import rank_store\n"
    )
    (tmp_path / "kvray" / "keys.py").write_text("")
    (tmp_path / "kvray" / "store" / "rank_store.py").write_text(
        "from kvray.index import ledger\nimport kvray.connector\n"
    )
    (tmp_path / "kvray" / "testing" / "t.py").write_text("from kvray.testing import u\n")
    (tmp_path / "kvray" / "testing" / "u.py").write_text("import kvray.store.rank_store\n")
    (tmp_path / "actors" / "shell.py").write_text("import kvray.testing.u\n")
    assert [b.partition(":")[0] for b in package_breaches(graph(tmp_path))] == [
        "kvray.actors.shell -> kvray.testing.u",
        "kvray.index.ledger -> kvray.store",
        "kvray.index.ledger -> kvray.store.rank_store",
        "kvray.pool -> kvray.testing",
        "kvray.pool -> kvray.testing.t",
        "kvray.proxy.router -> kvray.pool",
        "kvray.store.rank_store -> kvray.connector",
    ]


def test_a_subsystem_imports_alone():
    """kvray's package loads its public names on first use: importing the routing proxy
    (a process of its own) loads neither the Pool API nor Ray, and ``from kvray import
    Pool`` still works."""
    import subprocess
    import sys

    code = (
        "import sys, kvray.proxy.server\n"
        "print(sorted(m for m in ('ray', 'kvray.pool', 'kvray.launcher') if m in sys.modules))\n"
        "from kvray import Pool, PoolConfig\n"
        "print(Pool.__module__, PoolConfig.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[0] == "[]", out
    assert out[1] == "kvray.pool kvray.config.pool", out
