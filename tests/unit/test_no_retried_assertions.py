"""No test catches its own failed assertion: a check that fails and is then tried again
(another seed, another poll) turns "wrong after recovery" into a pass. A test waits for a
condition by asking the system, then asserts once.

Read from the source of every Python file under tests/ (``ast``, so a comment or a string
that names the exception does not count). What fails:

- an ``except`` (or ``except*``) clause that names ``AssertionError``, alone, in a tuple
  or dotted (``builtins.AssertionError``), whatever its ``try`` holds;
- an ``except`` clause that catches everything (bare, ``Exception``, ``BaseException``)
  around a ``try`` body with an ``assert`` statement in it: it catches that assertion;
- ``contextlib.suppress`` naming ``AssertionError``; ``suppress(Exception)`` or
  ``suppress(BaseException)`` around an ``assert`` statement;
- ``pytest.raises`` of ``AssertionError`` around an ``assert`` statement (the test's own
  check expected to fail). Around a call it is allowed: that tests an assertion kvray
  makes (an ``assert`` naming whose bug it is).

Raising ``AssertionError`` (a fake that must not be reached) is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CATCH_ALL = {"Exception", "BaseException"}


def _names(node: ast.expr | None) -> set[str]:
    """The exception names an ``except`` clause or a call's arguments name (``None``:
    a bare ``except``, which catches everything)."""
    if node is None:
        return {"BaseException"}
    elements = node.elts if isinstance(node, ast.Tuple) else [node]
    out = set()
    for e in elements:
        if isinstance(e, ast.Name):
            out.add(e.id)
        elif isinstance(e, ast.Attribute):
            out.add(e.attr)
    return out


def _asserts(body: list[ast.stmt]) -> bool:
    """Whether an ``assert`` statement runs in ``body`` itself (not in a function or
    class it only defines)."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return False


def _called(call: ast.expr) -> str:
    """``pytest.raises`` -> ``raises``; ``suppress`` -> ``suppress``."""
    if not isinstance(call, ast.Call):
        return ""
    fn = call.func
    return fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")


def retried_assertions(source: str) -> list[tuple[int, str]]:
    """``(line, why)`` for each place in ``source`` that catches an assertion."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try | ast.TryStar):
            checks = _asserts(node.body)
            for handler in node.handlers:
                names = _names(handler.type)
                if "AssertionError" in names:
                    out.append((handler.lineno, "an except clause catches AssertionError"))
                elif checks and names & CATCH_ALL:
                    out.append((handler.lineno, "an except clause catches the assert in its try"))
        elif isinstance(node, ast.With | ast.AsyncWith):
            checks = _asserts(node.body)
            for item in node.items:
                call, kind = item.context_expr, _called(item.context_expr)
                if kind not in ("suppress", "raises") or not isinstance(call, ast.Call):
                    continue
                names = set().union(*(_names(a) for a in call.args)) if call.args else set()
                if kind == "suppress" and "AssertionError" in names:
                    out.append((node.lineno, "suppress(AssertionError)"))
                elif kind == "suppress" and checks and names & CATCH_ALL:
                    out.append((node.lineno, "suppress catches the assert in its body"))
                elif kind == "raises" and checks and "AssertionError" in names:
                    out.append((node.lineno, "pytest.raises(AssertionError) around an assert"))
    return sorted(out)


def test_no_test_catches_its_own_assertion():
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len(files) > 100  # the whole tests/ tree was read
    found = [
        f"{path.relative_to(ROOT)}:{line}: {why}"
        for path in files
        for line, why in retried_assertions(path.read_text())
    ]
    assert found == [], "wait for the condition by asking the system, then assert once"


def test_the_rule_sees_each_form_and_lets_the_allowed_pass():
    """A negative control: each form the rule names is found, on its line; the allowed
    forms are not."""
    source = """
import builtins, contextlib, pytest
def retry():
    while True:
        try:
            check()
        except AssertionError:
            continue
def tuple_form():
    try:
        check()
    except (ValueError, builtins.AssertionError) as exc:
        pass
def catch_all():
    try:
        assert ready()
    except Exception:
        pass
def bare():
    try:
        if x:
            assert ready()
    except:
        pass
def star():
    try:
        check()
    except* AssertionError:
        pass
def suppressed():
    with contextlib.suppress(AssertionError):
        check()
    with contextlib.suppress(Exception):
        assert ready()
def inverted():
    with pytest.raises(AssertionError):
        assert tokens() == expected
# allowed below
def fake():
    raise AssertionError("must not be reached")
def kvray_asserts():
    with pytest.raises(AssertionError, match="kvray's bug"):
        make_node_watch_without_index()
def catches_a_call():
    try:
        call()
    except Exception:
        pass
def assert_in_a_nested_function():
    try:
        def later():
            assert x
    except Exception:
        pass
    with pytest.raises(ValueError):
        assert parse("x")
"""
    assert retried_assertions(source) == [
        (7, "an except clause catches AssertionError"),
        (12, "an except clause catches AssertionError"),
        (17, "an except clause catches the assert in its try"),
        (23, "an except clause catches the assert in its try"),
        (28, "an except clause catches AssertionError"),
        (31, "suppress(AssertionError)"),
        (33, "suppress catches the assert in its body"),
        (36, "pytest.raises(AssertionError) around an assert"),
    ]
