"""Private PostgreSQL clusters for tests.

When PostgreSQL server binaries are installed (``/usr/lib/postgresql/*/bin``,
or the directory in ``$PROXIMA_PG_BIN``), ``postgres_cluster`` starts one
throw-away cluster per test run on 127.0.0.1 with a free port (as the
``postgres`` user when running as root, since ``initdb`` refuses root), and
``create_test_database`` gives each test its own database.

Tests parametrized with the value ``"postgres"`` need the binaries: without
them the items are deselected with a message, or, when ``CI=true``, they fail
with that message (CI must never silently skip PostgreSQL). Use from a
``conftest.py``::

    from tests.pg import postgres_cluster, select_postgres_items  # noqa: F401

    def pytest_collection_modifyitems(config, items):
        select_postgres_items(config, items)

Install the server with ``apt-get install -y postgresql-15``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

logger = logging.getLogger(__name__)

POSTGRES_PARAM = "postgres"
"""The parameter value that marks a test item as needing PostgreSQL."""

MISSING_MESSAGE = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found in /usr/lib/postgresql/*/bin "
    "(or $PROXIMA_PG_BIN); install them with `apt-get install -y postgresql-15`"
)
_SUMMARY_KEY = pytest.StashKey[str]()


def is_ci() -> bool:
    """Whether we run in CI (``CI=true``), where PostgreSQL tests must not be skipped."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def find_pg_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl`` (newest version first), or ``None``.

    ``$PROXIMA_PG_BIN``, when set, is the only place looked at (set it to a
    non-existent path to run as if PostgreSQL were not installed).
    """
    env = os.environ.get("PROXIMA_PG_BIN")
    candidates = [Path(env)] if env else _default_candidates()
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    return None


def _default_candidates() -> list[Path]:
    candidates: list[Path] = []
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates.extend(versions)
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).parent)
    return candidates


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PostgresCluster:
    """A running throw-away PostgreSQL cluster reachable on 127.0.0.1 with trust auth."""

    bin_dir: Path
    root: Path
    port: int
    run_as: str | None  # OS user the server runs as (None: the current user)
    user: str = "postgres"
    host: str = "127.0.0.1"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str) -> str:
        """A plain ``postgresql://`` URL of ``database`` in this cluster."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    @classmethod
    def start(cls, bin_dir: Path) -> PostgresCluster:
        """initdb a cluster in a new temp dir and start it on a free port."""
        run_as = "postgres" if os.geteuid() == 0 else None
        root = Path(tempfile.mkdtemp(prefix="proxima-pg-"))
        if run_as is not None:
            shutil.chown(root, user=run_as)
        cluster = cls(bin_dir=bin_dir, root=root, port=0, run_as=run_as)
        cluster._pg(
            "initdb",
            "-D", str(cluster.data_dir),
            "-U", cluster.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )  # fmt: skip
        last_error: Exception | None = None
        for _ in range(3):  # the free port may be taken between probing and binding
            cluster.port = _free_port()
            try:
                cluster._start_server()
                logger.info("postgres test cluster started", extra={"port": cluster.port})
                return cluster
            except subprocess.CalledProcessError as exc:
                last_error = exc
        cluster.remove()
        raise RuntimeError(f"could not start PostgreSQL: {last_error}\n{cluster.log_tail()}")

    def _start_server(self) -> None:
        options = " ".join(
            [
                f"-p {self.port}",
                f"-k {self.root}",
                "-c listen_addresses=127.0.0.1",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
            ]
        )
        self._pg(
            "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file),
            "-o", options, "-w", "-t", "60", "start",
        )  # fmt: skip

    def _pg(self, program: str, *args: str) -> str:
        command = [str(self.bin_dir / program), *args]
        if self.run_as is not None:
            command = ["runuser", "-u", self.run_as, "--", *command]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, command, output=done.stdout, stderr=done.stderr
            )
        return done.stdout

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Run one SQL statement with ``psql`` (as a client over TCP)."""
        psql = self.bin_dir / "psql"
        command = [
            str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=1",
            "-h", self.host, "-p", str(self.port), "-U", self.user,
            "-d", database, "-c", statement,
        ]  # fmt: skip
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {statement}: {done.stderr.strip()}")
        return done.stdout

    def create_database(self) -> str:
        """Create a fresh, uniquely named database; return its name."""
        name = f"test_{uuid.uuid4().hex[:16]}"
        self.sql(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        """Drop a database, disconnecting any leftover clients."""
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text().splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def pause(self) -> None:
        """Stop the server (clients are disconnected), keeping its files: an outage."""
        self._pg("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Start the paused server again, on the same port."""
        self._start_server()

    def stop(self) -> None:
        """Stop the server and delete the cluster's files."""
        try:
            self._pg("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError as exc:
            logger.warning("pg_ctl stop failed", extra={"stderr": exc.stderr})
        finally:
            self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One private PostgreSQL cluster for the whole test run (fails clearly if absent)."""
    bin_dir = find_pg_bin()
    if bin_dir is None:
        pytest.fail(MISSING_MESSAGE, pytrace=False)
    cluster = PostgresCluster.start(bin_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


def create_test_database(request: pytest.FixtureRequest) -> str:
    """A fresh database in the session cluster, dropped after the requesting test; its URL."""
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    name = cluster.create_database()
    request.addfinalizer(lambda: cluster.drop_database(name))
    return cluster.url(name)


def _needs_postgres(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(
        isinstance(value, str) and value == POSTGRES_PARAM for value in callspec.params.values()
    )


def select_postgres_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect PostgreSQL-parametrized items when the server is not installed.

    In CI (``CI=true``) nothing is deselected: those items then fail in the
    ``postgres_cluster`` fixture with ``MISSING_MESSAGE``.
    """
    if find_pg_bin() is not None or is_ci():
        return
    deselected = [item for item in items if _needs_postgres(item)]
    if not deselected:
        return
    items[:] = [item for item in items if not _needs_postgres(item)]
    config.hook.pytest_deselected(items=deselected)
    message = f"deselected {len(deselected)} PostgreSQL test(s): {MISSING_MESSAGE}"
    config.stash[_SUMMARY_KEY] = message
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, yellow=True)


def report_postgres_deselection(terminalreporter: pytest.TerminalReporter) -> None:
    """Repeat the deselection message in the terminal summary (call from the hook)."""
    message = terminalreporter.config.stash.get(_SUMMARY_KEY, None)
    if message:
        terminalreporter.write_sep("=", "PostgreSQL", yellow=True)
        terminalreporter.write_line(message, yellow=True)
