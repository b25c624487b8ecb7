"""After ``kill -9`` of its parent, the embedded engine exits (no orphan holding memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from proxima.proxy.embedded.parent_watch import PARENT_PID_ENV
from proxima.proxy.testing.live import LiveProxy


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_engine_exits_after_kill_9_of_proxima_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    proxy = LiveProxy(tiny_model_dir, db_url=f"sqlite:///{tmp_path / 'store.db'}")
    proxy.start()
    engines: list[int] = []
    try:
        assert proxy.proc is not None
        engines = [
            pid
            for pid in _children(proxy.proc.pid)
            if b"proxima.proxy.embedded" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(engines) == 1
        os.kill(proxy.proc.pid, signal.SIGKILL)
        proxy.proc.wait(30)
        assert _wait_gone(engines[0], 30), "the engine outlived proxima serve"
    finally:
        proxy.stop(kill=True)
        for pid in engines:  # never leak one, even when the test fails
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_watchdog_alone_ends_an_orphan() -> None:
    """Without PR_SET_PDEATHSIG (not Linux, or started off the main thread)."""
    child = (
        "from proxima.proxy.embedded.parent_watch import exit_with_parent; import time; "
        "exit_with_parent(poll_s=0.1, grace_s=5); print('ready', flush=True); time.sleep(120)"
    )
    middle = (
        "import os, subprocess, sys; "
        f"env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=env, stdout=subprocess.PIPE); "
        "assert p.stdout.readline().strip() == b'ready'; print(p.pid, flush=True); "
        "import time; time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert _alive(grandchild)
        proc.kill()
        proc.wait(30)
        assert _wait_gone(grandchild, 15), "the orphan kept running"
    finally:
        proc.kill()
        if "grandchild" in locals() and _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
