"""The installed distribution: one ``proxima`` namespace, no generic top-level names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"proxima": "proxima", "proxy": "proxima.proxy", "trainer": "proxima.trainer",
           "agents_examples": "proxima.agents_examples", "migrations": "proxima.migrations"}  # fmt: skip


def test_every_package_folder_is_declared() -> None:
    """A subpackage missing from pyproject's explicit list would be left out of the wheel."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {"proxima.migrations.versions"}  # migration scripts: a folder without __init__
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert declared == found


def test_installs_under_one_namespace(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    top_level = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info"))
    assert top_level == ["bin", "proxima"] or top_level == ["proxima"], top_level
    probe = (
        "import importlib.util as u, proxima.trainer.loss, proxima.proxy.app, proxima.cli,"
        " proxima.migrations, proxima.agents_examples.math_agent;"
        " import proxima.migrations as m;"
        " assert (m.SCRIPT_LOCATION / 'alembic.ini').is_file() and (m.SCRIPT_LOCATION / 'versions').is_dir();"
        " print([n for n in ('proxy', 'trainer', 'migrations', 'agents_examples') if u.find_spec(n)])"
    )
    # A clean interpreter (-I: no cwd, no user site) that sees only the installed tree and the
    # dependencies of this environment.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {[str(target), *deps]!r}; {probe}"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout
