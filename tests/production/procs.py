"""Processes of the production-readiness tests: backends the tests can kill and restart.

``BackendProcess`` runs one SGLang-protocol backend as a child process on a
fixed loopback port: the embedded engine (``python -m proxima.proxy.embedded``) with a
real tiny model, or the fake timing backend (``python -m
proxy.testing.fake_sglang``) where a real model would only slow the test
down. ``kill()`` is SIGKILL, and ``start()`` again brings it back on the same
port, as a crashed server restarted by its supervisor.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from proxima.proxy.auth import PRODUCTION_KEY_PREFIX
from proxima.proxy.serving import free_port, wait_healthy


@dataclass
class BackendProcess:
    argv: list[str]
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def engine(cls, model_dir: Path, log_path: Path | None = None) -> BackendProcess:
        return cls(
            [
                sys.executable,
                "-m",
                "proxima.proxy.embedded",
                "--model",
                str(model_dir),
                "--max-running-requests",
                "8",
            ],
            log_path=log_path,
        )

    @classmethod
    def fake(
        cls, *, tokens_per_s: float = 0.0, chunk_tokens: int = 1, log_path: Path | None = None
    ) -> BackendProcess:
        return cls(
            [
                sys.executable,
                "-m",
                "proxima.proxy.testing.fake_sglang",
                "--tokens-per-s",
                str(tokens_per_s),
                "--chunk-tokens",
                str(chunk_tokens),
            ],
            log_path=log_path,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> BackendProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.argv, "--port", str(self.port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            wait_healthy(self.proc, self.url, timeout=timeout, name=self.argv[2], log=self.log_path)
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, open connections are cut."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def create_production_key(db_url: str, name: str, *, record: bool = True) -> str:
    """``proxima keys create`` as an operator runs it; returns the printed key."""
    cmd = [
        sys.executable,
        "-m",
        "proxima.cli",
        "--log-level",
        "warning",
        "keys",
        "create",
        "--name",
        name,
        "--db",
        db_url,
    ]
    if not record:
        cmd.append("--no-record")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
    key = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("key: "))
    assert key.startswith(PRODUCTION_KEY_PREFIX), out
    return key


def wait_until(
    predicate: Callable[[], bool], timeout: float, *, interval: float = 0.1, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
