"""Every file path that a docstring, comment or document of the project cites exists.

A reader who follows a reference (``see proxy/backends/pool.py``, ``docs/design.md``)
must find the file; nothing may cite a file outside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("proxy", "trainer", "proxima", "tests", "bench", "docs", "migrations",
       "agents_examples", "docker", "deploy", ".ci")  # fmt: skip
# A repository-relative path: a top-level folder, then path characters. Not part of a
# longer path or URL (no path character before it).
_TOPS = "|".join(re.escape(t) for t in TOP)
CITED = re.compile(rf"(?<![\w./-])((?:{_TOPS})/[\w./-]*\w)")
OUTSIDE = re.compile(r"\bDESIGN\.md\b|\bSTYLE\.md\b|\.\./shared\b")
TEXT = (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".mjs", ".ini")


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = [n for n in out.splitlines() if n.endswith(TEXT) or Path(n).name == "Makefile"]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def _cited(text: str) -> set[str]:
    found = set()
    for match in CITED.finditer(text):
        path = match.group(1).rstrip(".")
        if "*" in path or "{" in path or any(Path(part).stem.isupper() for part in path.split("/")):
            continue  # a pattern or a placeholder (bench/NAME.py), not a file
        found.add(path)
    return found


def test_every_cited_path_exists() -> None:
    missing = []
    for file in _tracked():
        if file == Path(__file__).resolve():
            continue
        for path in sorted(_cited(file.read_text(encoding="utf-8", errors="replace"))):
            if not (ROOT / path).exists():
                missing.append(f"{file.relative_to(ROOT)}: {path}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_nothing_cites_a_file_outside_the_repository() -> None:
    citing = [
        str(file.relative_to(ROOT))
        for file in _tracked()
        if file != Path(__file__).resolve() and OUTSIDE.search(file.read_text(errors="replace"))
    ]
    assert not citing, f"files citing documents outside the repository: {citing}"


def test_the_citation_pattern_finds_paths() -> None:
    text = "see proxy/backends/pool.py, and docs/design.md. Not http://x/docs/a.md"
    assert _cited(text) == {"proxy/backends/pool.py", "docs/design.md"}
    assert _cited("a script bench/NAME.py") == set()  # a placeholder
