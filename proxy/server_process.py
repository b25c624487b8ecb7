"""A ``proxima serve`` child process on loopback (used by ``proxima train``, tests, benchmarks).

Its admin token is handed over in the environment (``PROXIMA_ADMIN_TOKEN``), never as a
command-line argument.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from proxima.proxy.serving import free_port, wait_healthy

ADMIN_TOKEN_ENV = "PROXIMA_ADMIN_TOKEN"
"""Where ``proxima serve`` reads its admin token when no flag gives one."""


@dataclass
class ProxyProcess:
    model_dir: Path
    db_url: str
    admin_token: str = "test-admin-token"
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def model_name(self) -> str:
        return self.model_dir.resolve().name

    def start(self, timeout: float = 180.0) -> ProxyProcess:
        cmd = [
            sys.executable,
            "-m",
            "proxima.cli",
            "--log-level",
            "warning",
            "serve",
            "--model",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--db",
            self.db_url,
            *self.extra_args,
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # The token in the environment, not on the command line: no other user reads it in
        # the process list, and a token that starts with "-" is never taken for a flag.
        env = {**os.environ, **self.env, ADMIN_TOKEN_ENV: self.admin_token}
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(
                self.proc, self.url, timeout=timeout, name="proxima serve", log=self.log_path
            )
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def push_weights(self, version: int, path: Path) -> None:
        """``POST /admin/weights``: every backend loads ``path`` as ``version``."""
        resp = httpx.post(
            self.url + "/admin/weights",
            json={"version": version, "path": str(path)},
            headers=self.admin_headers(),
            timeout=300,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"weight push {version} failed: {resp.status_code} {resp.text}")

    def new_session(self, **body: Any) -> dict[str, Any]:
        resp = httpx.post(
            self.url + "/rl/sessions", json=body, headers=self.admin_headers(), timeout=30
        )
        resp.raise_for_status()
        session: dict[str, Any] = resp.json()
        return session

    def trajectory(self, session_id: str) -> dict[str, Any]:
        resp = httpx.get(
            f"{self.url}/rl/sessions/{session_id}", headers=self.admin_headers(), timeout=30
        )
        resp.raise_for_status()
        trajectory: dict[str, Any] = resp.json()
        return trajectory
