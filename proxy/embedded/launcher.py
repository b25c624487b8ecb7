"""The embedded engine as a child process of ``proxima serve``.

The engine runs in its own process (``python -m proxima.proxy.embedded``), exactly like a
separate SGLang server: the proxy's event loop never competes with model
compute for the interpreter, and the proxy talks to it over HTTP with the same
client it uses for SGLang.

The process is in a process group of its own: a terminal's Ctrl-C reaches ``proxima serve``,
which stops its engines as it shuts down, and not the engines first (the supervisor,
``proxima.proxy.embedded.supervisor``, would take an engine that died of it for a crash and
start it again). An engine still dies with ``proxima serve``, even by SIGKILL
(``parent_watch``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

from proxima.proxy.embedded.parent_watch import child_env
from proxima.proxy.serving import free_port, wait_healthy

logger = logging.getLogger(__name__)


def default_num_threads() -> int:
    """Half the CPUs this process may use (at least one).

    The engine shares the machine with the event loop, the proxy and usually
    the trainer; intra-op threads that compete for busy cores spin and slow
    every step down (on a loaded 2-core machine, 2 threads ran a tiny model
    about 6x slower than 1).
    """
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (available or 1) // 2)


class EngineProcess:
    """One embedded engine process: started, watched (``poll``), restarted, stopped.

    ``start`` may be called again once the process has exited: the new process listens on
    the same port, so the pool's backend URL stays the engine's.
    """

    def __init__(
        self,
        model: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_running_requests: int = 32,
        weight_version: str = "0",
        enable_lora: bool = False,
        max_loras_per_batch: int = 8,
        max_lora_rank: int | None = None,
        num_threads: int | None = None,
    ):
        self.model = model
        self.num_threads = num_threads  # None: the engine's default (half the CPUs)
        self.host = host
        self.port = port or free_port(host)
        self.max_running_requests = max_running_requests
        self.weight_version = weight_version
        self.lora_args = ["--enable-lora"] if enable_lora else []
        self.lora_args += ["--max-loras-per-batch", str(max_loras_per_batch)]
        if max_lora_rank is not None:
            self.lora_args += ["--max-lora-rank", str(max_lora_rank)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # processes started (1 + restarts)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        """The exit status of a process that has exited (reaped: no zombie is left), else
        None (running, or never started)."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "proxima.proxy.embedded",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-running-requests",
            str(self.max_running_requests),
            "--weight-version",
            self.weight_version,
            *self.lora_args,
            *(["--num-threads", str(self.num_threads)] if self.num_threads else []),
        ]
        logger.info("starting embedded engine: %s", " ".join(cmd))
        # child_env: the engine exits when this process dies, even by SIGKILL.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child_env()}
        self.proc = subprocess.Popen(cmd, env=env, process_group=0)
        self.starts += 1

    async def wait_healthy(self, timeout: float = 180.0) -> None:
        assert self.proc is not None, "start() first"
        await asyncio.to_thread(
            wait_healthy, self.proc, self.url, timeout=timeout, name="embedded engine"
        )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
