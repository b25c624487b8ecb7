"""Migration version files are frozen history: they import nothing from the live code.

A migration runs on databases written by older releases, long after it was written; code
it imported from ``proxima.proxy`` or ``proxima.trainer`` would change under it. Each
version file carries its own copy of the logic it applies (0004 its row split, rebuild and
token encoding), which is checked here against today's store format.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from proxima.proxy.store.codec import decode_int32, encode_int32

VERSIONS = Path(__file__).resolve().parents[3] / "migrations" / "versions"
FORBIDDEN = ("proxima.proxy", "proxima.trainer")


def _live_imports(tree: ast.AST) -> list[str]:
    """Modules under ``FORBIDDEN`` that ``tree`` imports, by statement or by name."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names.append(str(first.value))
    return [n for n in names if n == "proxima" or n.startswith(FORBIDDEN)]


def _version_files() -> list[Path]:
    files = sorted(VERSIONS.glob("[0-9]*.py"))
    assert len(files) >= 8, f"migration versions not found under {VERSIONS}"
    return files


@pytest.mark.parametrize("path", _version_files(), ids=lambda p: p.stem)
def test_a_migration_imports_no_live_code(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    assert _live_imports(tree) == [], f"{path.name} imports live code"


def test_the_check_sees_every_way_of_importing() -> None:
    source = (
        "import proxima.proxy.store\n"
        "from proxima.trainer import loop\n"
        "from proxima import cli\n"
        "import importlib\n"
        "importlib.import_module('proxima.proxy.store.chains')\n"
        "from alembic import op\n"
        "from . import sibling\n"
    )
    assert _live_imports(ast.parse(source)) == [
        "proxima.proxy.store",
        "proxima.trainer",
        "proxima",
        "proxima.proxy.store.chains",
    ]


def _load(stem: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"frozen_{stem}", VERSIONS / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_0004_encodes_tokens_as_the_store_does() -> None:
    m = _load("0004_completion_deltas")
    for ids in ([], [0], [1, 2, 3], [-(2**31), 2**31 - 1, 151_643, -1]):
        assert m._encode_int32(ids) == encode_int32(ids)
        assert m._decode_int32(encode_int32(ids)) == ids == decode_int32(m._encode_int32(ids))
    assert m._decode_int32(None) == []
