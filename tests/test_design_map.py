"""docs/design.md's code map ("Components") lists every module, and only files that exist.

The map is the first fenced block of the "## Components" section: a tree, two spaces of
indent per level, one entry per line (a folder ``name/`` or a file ``name.py``, then its
description). An entry's path is its folders' names followed by its own
(``proxy/backends/pool.py``). Every ``.py`` file under ``proxy/``, ``trainer/`` and
``proxima/`` must be listed, a package's ``__init__.py`` by its folder's line; every listed
entry must exist. A line whose first word is not a folder or a ``.py`` file continues the
description above it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
MAPPED = ("proxy", "trainer", "proxima")
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.-]+(?:/|\.py))(?:\s+(?P<desc>\S.*))?$")


def map_block(text: str) -> str:
    """The first fenced block after the "## Components" heading."""
    section = text.split("\n## Components\n", 1)[1].split("\n## ", 1)[0]
    parts = section.split("```")
    assert len(parts) >= 3, "the Components section has no fenced block"
    return parts[1]


def map_entries(block: str) -> tuple[list[str], list[str]]:
    """The paths the map lists (folders end in ``/``), and what is wrong with its lines."""
    paths: list[str] = []
    problems: list[str] = []
    folders: list[str] = []  # the folder each depth is in, outermost first
    for number, line in enumerate(block.splitlines(), 1):
        match = ENTRY.match(line)
        if match is None:
            continue  # blank, or a description's continuation
        indent, name = match["indent"], match["name"]
        depth = len(indent) // 2
        if len(indent) % 2 or depth > len(folders):
            problems.append(f"line {number}: {name!r} is indented under no folder")
            continue
        if not match["desc"]:
            problems.append(f"line {number}: {name!r} has no description")
        path = "".join(folders[:depth]) + name
        paths.append(path)
        folders = folders[:depth] + ([name] if name.endswith("/") else [])
    return paths, problems


def required_entries() -> set[str]:
    """What the map must list: each module of the mapped folders, each package's folder."""
    required: set[str] = set()
    for top in MAPPED:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            required.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    return required


def test_the_map_parser_reads_paths_and_flags_bad_lines() -> None:
    block = (
        "\nproxy/        the server\n  app.py      the app\n  store/      the store\n"
        "    models.py ORM models,\n              on two lines\n  caches.py   caches\n"
        "trainer/      the trainer\n      deep.py   too deep\n  loop.py\n"
    )
    paths, problems = map_entries(block)
    assert paths == [
        "proxy/",
        "proxy/app.py",
        "proxy/store/",
        "proxy/store/models.py",
        "proxy/caches.py",
        "trainer/",
        "trainer/loop.py",
    ]
    assert problems == [
        "line 9: 'deep.py' is indented under no folder",
        "line 10: 'loop.py' has no description",
    ]


def test_the_map_is_well_formed() -> None:
    paths, problems = map_entries(map_block(DESIGN.read_text(encoding="utf-8")))
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    assert not problems, "docs/design.md's map:\n" + "\n".join(problems)
    assert not duplicates, f"listed twice in docs/design.md's map: {duplicates}"


def test_the_map_lists_every_module() -> None:
    paths, _ = map_entries(map_block(DESIGN.read_text(encoding="utf-8")))
    missing = sorted(required_entries() - set(paths))
    assert not missing, "modules missing from docs/design.md's Components map:\n" + "\n".join(
        missing
    )


def test_every_file_the_map_lists_exists() -> None:
    paths, _ = map_entries(map_block(DESIGN.read_text(encoding="utf-8")))
    assert len(paths) > len(MAPPED)
    absent = [p for p in paths if not (ROOT / p).exists() or p.endswith("/") != (ROOT / p).is_dir()]
    assert not absent, "docs/design.md's Components map lists what does not exist:\n" + "\n".join(
        absent
    )
