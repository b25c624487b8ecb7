"""The package as it was at a git commit, importable beside the working tree's: for A/B runs.

``code_at(ref, into)`` extracts ``git archive <ref>`` under ``into`` and lays out a tree of
links that mirrors the package-dir mapping (``proxima.proxy`` is ``proxy/``, ...), as
``make typecheck`` does. A process started with ``code_env(folder)`` (``PYTHONPATH`` set to the returned
folder, and ``PYTHONSAFEPATH`` so that ``python -m`` does not put the current directory, the
repository's root with its own ``proxima/``, first) imports ``proxima`` from that commit: the
path finder comes before the editable install's finder, so the working tree's code is not seen. Only the package's sources come from the
commit; third-party packages are the venv's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SUBPACKAGES = ("proxy", "trainer", "agents_examples", "migrations")


def code_at(ref: str, into: Path) -> tuple[Path, str]:
    """A folder to put on ``PYTHONPATH`` for the code at ``ref``, and ``ref``'s short hash."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    src = into / f"src-{commit}"
    pkg = into / f"pkg-{commit}"
    if not src.exists():
        src.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    top = pkg / "proxima"
    if not top.exists():
        top.mkdir(parents=True)
        for path in (src / "proxima").iterdir():
            (top / path.name).symlink_to(path)
        for name in _SUBPACKAGES:
            (top / name).symlink_to(src / name)
    return pkg, commit


def code_env(pkg: Path) -> dict[str, str]:
    """The environment variables that make a Python process import ``proxima`` from ``pkg``."""
    return {"PYTHONPATH": str(pkg), "PYTHONSAFEPATH": "1"}
