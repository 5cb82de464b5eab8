"""Lines of code in kvray/, actors/ and scripts/ (.py files), docstrings and comments
excluded: what a change meant to shrink the code is measured by. Not a test: run it on
two checkouts.

    python3 tests/count_loc.py .
"""

import ast
import io
import sys
import tokenize
from pathlib import Path


def loc(path: Path) -> int:
    src = path.read_text()
    doc_lines = set()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        # attribute docstrings: a bare string expression statement anywhere
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            continue
        for ln in range(tok.start[0], tok.end[0] + 1):
            if ln not in doc_lines:
                code_lines.add(ln)
    return len(code_lines)


root = Path(sys.argv[1])
total = 0
for d in ("kvray", "actors", "scripts"):
    n = sum(loc(p) for p in sorted((root / d).rglob("*.py")))
    print(d, n)
    total += n
print("total", total)
