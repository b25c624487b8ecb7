"""HAProxy in front of proxy replicas: the load balancer of the fleet tests and benchmark.

``haproxy_config`` writes what a deployment runs (``docker/haproxy.cfg`` is
the same rule with compose's service names): HTTP mode, affinity by
``X-Session-Id`` (production conversations) or else the ``Authorization``
header (each training session has its own key), so a session's turns go to
one replica and hit that replica's history cache; round robin for requests
with neither; active health checks on ``/health``, and
timeouts long enough for streamed completions.

Affinity is only speed: any replica serves any turn correctly, because
everything a turn depends on (session status, history, version, admission)
is read from the store. A replica that goes down simply moves its sessions.

``HAProxyProcess`` runs the Debian ``haproxy`` binary (``make haproxy`` installs
it) in the foreground on a loopback port.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from proxima.proxy.serving import free_port


def haproxy_config(replicas: list[str], *, bind: str) -> str:
    """An HAProxy configuration balancing over ``replicas`` (``host:port`` each)."""
    servers = "\n".join(
        f"    server replica{i} {addr} check inter 1s fall 2 rise 1"
        for i, addr in enumerate(replicas)
    )
    return f"""global
    maxconn 4096

defaults
    mode http
    option http-keep-alive
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout http-request 30s
    retries 2
    option redispatch

frontend proxima
    bind {bind}
    default_backend replicas

backend replicas
    # Affinity by the production session (X-Session-Id), else the caller's key (a training
    # session's own): speed only, any replica serves any turn correctly.
    http-request set-header X-Proxima-Affinity %[req.hdr(X-Session-Id)] if {{ req.hdr(X-Session-Id) -m found }}
    http-request set-header X-Proxima-Affinity %[req.hdr(Authorization)] unless {{ req.hdr(X-Session-Id) -m found }}
    balance hdr(X-Proxima-Affinity)
    hash-type consistent
    option httpchk GET /health
    http-check expect status 200
{servers}
"""


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).is_file()), None
    )


@dataclass
class HAProxyProcess:
    replicas: list[str]  # "127.0.0.1:port" of each proxy replica
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    directory: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> HAProxyProcess:
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError(
                "haproxy is not installed: run `make haproxy` (Debian package haproxy)"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="proxima-haproxy-"))
        config = self.directory / "haproxy.cfg"
        config.write_text(haproxy_config(self.replicas, bind=f"127.0.0.1:{self.port}"))
        log = open(self.directory / "haproxy.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"haproxy exited: {(self.directory / 'haproxy.log').read_text()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"haproxy did not serve {self.url}/health within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
