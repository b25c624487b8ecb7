"""A directory built once and shared: taught test models cached under ``.cache/``.

Several processes may want the same entry at once (``make test`` runs the suite in
parallel workers, and a second checkout may share the cache): one builds it, under a file
lock next to it, while the others wait and then reuse what it built. The entry is built in
a staging directory and moved into place whole, so a process killed mid-build leaves no
half-built entry behind, only a staging directory that is removed on the next build.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def built_once(final: Path, build: Callable[[Path], object], marker: str) -> Path:
    """``final``, made by ``build(staging)`` unless ``final / marker`` exists already.

    ``build`` gets a path that does not exist yet, named as ``final`` is, and must leave the
    finished entry there (``marker`` written last or with it). Only one process builds a
    given ``final`` at a time; one that waited for another's build returns that one.
    """
    if (final / marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if (final / marker).exists():
            return final  # another process built it while this one waited
        staging_root = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-", dir=final.parent))
        try:
            staging = staging_root / final.name
            build(staging)
            if not (staging / marker).exists():
                raise RuntimeError(f"building {final} left no {marker}")
            shutil.rmtree(final, ignore_errors=True)  # an entry without its marker: unfinished
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging_root, ignore_errors=True)
    return final
