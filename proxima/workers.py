"""``proxima serve --workers N``: N proxy processes on one port, for every core of a host.

One Python process streams through one core; a GPU node serves more tokens than that.
``serve_workers`` is the parent:

1. it migrates the store once (N workers would race to);
2. it binds the port and listens: one socket, which every worker accepts on (the kernel
   hands a new connection to a worker waiting in ``accept``, so an idle worker takes it
   before a busy one; a client's keep-alive connection stays with its worker);
3. it starts the embedded engines once, when no ``--backend`` is given, waits until they
   answer, and gives their URLs to the workers as ``--backend`` URLs (the production
   engine's as ``--production-backend``): one set of engines and one pool of backends per
   host, as SGLang servers are shared by replicas;
4. it starts the N workers (``multiprocessing``'s spawn: a fresh interpreter each, given
   the settings and the socket), each a whole ``proxima serve`` on that socket whose store
   is shared (``Store.open(shared=True)``): like replicas on PostgreSQL, a worker reads
   admission, session status and histories from the store, follows the newest version and
   production state (polling every 0.5 s on SQLite, ``NOTIFY`` on PostgreSQL), and loads
   weights under the fleet-wide publish lock (on SQLite a lock file beside the database);
5. it supervises: a worker or an engine that exits is started again (an engine on its
   port); a worker that keeps dying within a minute of its start (three times in a row)
   ends the parent with an error. SIGTERM or SIGINT stops the workers (each finishes its
   requests: uvicorn's graceful shutdown) and then the engines.

The workers exit with the parent, even when it is killed (``exit_with_parent``). Without a
``--signing-key`` or an admin token, the parent draws one signing key for all, so a
reasoning token sealed by one worker verifies on another.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from pydantic import SecretStr

from proxima.proxy.config import Settings
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.embedded.startup import StartedEngines, start_engines
from proxima.proxy.serving import bind_socket, wait_healthy

logger = logging.getLogger("proxima.workers")

BACKLOG = 2048  # uvicorn's own listen backlog
FAST_FAILURE_S = 60.0  # a worker that dies this soon after its start failed to start
MAX_FAST_FAILURES = 3  # in a row: the parent gives up
SHUTDOWN_S = 45.0  # uvicorn's graceful shutdown (30 s) and some
ENGINE_START_S = 600.0  # until the engines answer


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    started: float = field(default_factory=time.monotonic)


def worker_settings(settings: Settings, engines: StartedEngines) -> Settings:
    """What each worker serves: the engines' URLs as backends, and one signing key."""
    update: dict[str, Any] = {}
    if engines.training:
        update["backends"] = [engine.url for engine in engines.training]
    if engines.production:
        update["production_backends"] = [engine.url for engine in engines.production]
        update["production_engine"] = False
    if settings.signing_key is None and settings.admin_token is None:
        update["signing_key"] = SecretStr(secrets.token_urlsafe(32))
    return settings.model_copy(update=update)


def run_worker(
    settings: Settings,
    sock: socket.socket,
    index: int,
    parent_pid: int,
    log_level: str,
    json_logs: bool,
) -> None:
    """One worker: a ``proxima serve`` on the shared socket (a spawned process's target)."""
    from proxima.proxy.embedded.parent_watch import (
        PARENT_PID_ENV,
        PDEATHSIG_ENV,
        exit_with_parent,
    )
    from proxima.proxy.logs import configure_logging

    os.environ.update({PARENT_PID_ENV: str(parent_pid), PDEATHSIG_ENV: "1"})
    exit_with_parent()
    configure_logging(log_level, json_logs=json_logs)

    import uvicorn

    from proxima.proxy.app import create_app
    from proxima.proxy.serving import Worker, proxy_config, set_worker

    set_worker(Worker(index, settings.workers))
    app = create_app(settings, bound_port=sock.getsockname()[1], engines=StartedEngines())
    config = proxy_config(
        app, header_timeout=settings.http_header_timeout, idle_timeout=settings.http_idle_timeout
    )
    uvicorn.Server(config).run(sockets=[sock])


class _Parent:
    """The workers and engines of one ``proxima serve --workers N``, supervised."""

    def __init__(self, settings: Settings, *, log_level: str, json_logs: bool):
        self.settings = settings
        self.log_level = log_level
        self.json_logs = json_logs
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.engines = StartedEngines()
        self.stopping = threading.Event()
        self.fast_failures = 0
        self.engine_restarted: dict[int, float] = {}

    def start_worker(self, index: int, settings: Settings, sock: socket.socket) -> _Worker:
        process = self.context.Process(
            target=run_worker,
            args=(settings, sock, index, os.getpid(), self.log_level, self.json_logs),
            name=f"proxima-worker-{index}",
        )
        process.start()
        return _Worker(index, process)

    def supervise(self, settings: Settings, sock: socket.socket) -> int:
        """Restart what exits until asked to stop; 1 when workers cannot start."""
        while not self.stopping.wait(0.5):
            for i, worker in enumerate(self.workers):
                code = worker.process.exitcode
                if code is None or self.stopping.is_set():
                    continue
                quick = time.monotonic() - worker.started < FAST_FAILURE_S
                self.fast_failures = self.fast_failures + 1 if quick else 0
                logger.error("worker %d exited with %s; starting it again", worker.index, code)
                if self.fast_failures >= MAX_FAST_FAILURES:
                    logger.error("workers keep dying at start-up; proxima serve stops")
                    return 1
                time.sleep(1.0 if quick else 0.0)
                self.workers[i] = self.start_worker(worker.index, settings, sock)
            self._restart_engines()
        return 0

    def _restart_engines(self) -> None:
        for engine in [*self.engines.training, *self.engines.production]:
            if engine.poll() is None:
                continue
            last = self.engine_restarted.get(id(engine), 0.0)
            if time.monotonic() - last < 5.0:
                continue
            self.engine_restarted[id(engine)] = time.monotonic()
            logger.error("embedded engine on %s exited; starting it again", engine.url)
            engine.start()  # on its port: the workers' pools bring it to the current version

    def stop(self) -> None:
        for worker in self.workers:
            if worker.process.exitcode is None:
                worker.process.terminate()  # SIGTERM: uvicorn's graceful shutdown
        deadline = time.monotonic() + SHUTDOWN_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join()
        self.engines.stop()


def shareable(db: str) -> bool:
    """Whether processes can share the database ``db``: PostgreSQL, or a SQLite file."""
    from sqlalchemy.engine import make_url

    from proxima.proxy.store.database import is_sqlite, normalize_db_url

    if not is_sqlite(db):
        return True
    database = make_url(normalize_db_url(db)).database or ""
    return database not in ("", ":memory:") and not database.startswith("file:")


def _wait_engines(engines: list[EngineProcess]) -> None:
    for engine in engines:
        assert engine.proc is not None
        wait_healthy(engine.proc, engine.url, timeout=ENGINE_START_S, name="embedded engine")


def serve_workers(settings: Settings, *, log_level: str, json_logs: bool) -> int:
    """``proxima serve`` with ``settings.workers`` processes (module docstring)."""
    from proxima.proxy.store.migrate import ensure_schema

    if not shareable(settings.db):
        print(
            "proxima serve: --workers needs a SQLite database file (sqlite:///path) or "
            "PostgreSQL: the workers share it",
            file=sys.stderr,
        )
        return 2
    asyncio.run(ensure_schema(settings.db))
    sock = bind_socket(settings.host, settings.port)
    sock.listen(BACKLOG)
    port = sock.getsockname()[1]
    parent = _Parent(settings, log_level=log_level, json_logs=json_logs)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: parent.stopping.set())
    try:
        parent.engines = start_engines(settings)
        _wait_engines([*parent.engines.training, *parent.engines.production])
        shared = worker_settings(settings, parent.engines)
        parent.workers = [parent.start_worker(i, shared, sock) for i in range(settings.workers)]
        print(
            f"proxima: serving {settings.model_name} on http://{settings.host}:{port}/v1 "
            f"({settings.workers} workers)",
            flush=True,
        )
        return parent.supervise(shared, sock)
    finally:
        parent.stop()
        sock.close()
