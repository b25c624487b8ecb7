"""The shape of the code: no module of proxy/ or trainer/ over 500 lines, no function over 80.

A function's length runs from its ``def`` line to its last line (decorators excluded), as
the ``ast`` module places them; nested functions and methods count on their own (and
inside the function that holds them). One test per file, so a failure names the file, and
its message names each function too long with its length.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("proxy", "trainer")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

FILES = sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """``(qualified name, def line, length)`` of every function and method in ``tree``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                end = child.end_lineno if child.end_lineno is not None else child.lineno
                found.append((name, child.lineno, end - child.lineno + 1))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_the_files_are_found() -> None:
    """Both folders are walked (an empty parametrization would pass for nothing)."""
    for folder in FOLDERS:
        assert any(path.is_relative_to(ROOT / folder) for path in FILES), folder


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_file_and_functions_are_short(path: Path) -> None:
    text = path.read_text()
    where = path.relative_to(ROOT)
    problems = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        problems.append(f"{where} has {lines} lines (at most {MAX_FILE_LINES})")
    for name, line, length in function_lengths(ast.parse(text, filename=str(where))):
        if length > MAX_FUNCTION_LINES:
            problems.append(
                f"{where}:{line} {name} has {length} lines (at most {MAX_FUNCTION_LINES})"
            )
    assert not problems, "\n".join(problems)


def test_function_lengths_count_from_def_to_last_line() -> None:
    """The measure itself: decorators excluded, methods and nested functions named."""
    source = (
        "@decorator\n"
        "def top():\n"
        "    def inner():\n"
        "        return 1\n"
        "    return inner\n"
        "class Box:\n"
        "    async def method(self):\n"
        "        pass\n"
    )
    assert function_lengths(ast.parse(source)) == [
        ("top", 2, 4),
        ("top.<locals>.inner", 3, 2),
        ("Box.method", 7, 2),
    ]
