"""The embedded engine dies with ``proxima serve``: no orphaned engine after a crash.

``EngineProcess`` starts the engine with :func:`child_env`; the engine calls
:func:`exit_with_parent` before loading its model. Two mechanisms:

- Linux's ``PR_SET_PDEATHSIG`` (``prctl`` through ctypes): the kernel sends
  the engine SIGTERM the moment its parent dies, even by ``kill -9``. The
  signal follows the parent *thread* that forked the child, so it is asked
  for only when the engine was started from the parent's main thread.
- A watchdog thread (any POSIX system, and the fallback): once a second it
  compares ``os.getppid()`` with the parent's pid (an orphan is re-parented,
  to pid 1 or a subreaper), then sends itself SIGTERM (uvicorn shuts down
  cleanly) and exits hard if that has not ended it within ``grace_s``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "PROXIMA_ENGINE_PARENT_PID"
PDEATHSIG_ENV = "PROXIMA_ENGINE_PDEATHSIG"
_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """Environment for an engine child of this process."""
    env = {PARENT_PID_ENV: str(os.getpid())}
    if threading.current_thread() is threading.main_thread():
        env[PDEATHSIG_ENV] = "1"
    return env


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status: int = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        return status == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(*, poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """Arrange to exit when the parent named in the environment dies (no-op without it)."""
    raw = os.environ.pop(PARENT_PID_ENV, None)
    pdeathsig = os.environ.pop(PDEATHSIG_ENV, None) == "1"
    if not raw:
        return
    parent = int(raw)
    if pdeathsig:
        _set_pdeathsig()
    if os.getppid() != parent:  # it died before we could ask
        logger.error("parent process %d is gone; exiting", parent)
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("parent process %d died; the engine exits with it", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
