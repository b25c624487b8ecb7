"""Alembic migrations: the only source of the schema, in sync with the models."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from proxima.proxy.store import migrate
from proxima.proxy.store.database import create_engine, prepare_sqlite_file
from proxima.proxy.store.errors import StoreError
from proxima.proxy.store.models import Base
from proxima.proxy.store.store import Store
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

TABLES = {
    "sessions",
    "completions",
    "policy_versions",
    "api_keys",
    "version_evals",
    "production_promotions",
    "fleet_counters",
    "adapter_versions",
}


async def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda c: inspect(c).get_table_names())
    finally:
        await engine.dispose()
    return set(names) - {"alembic_version"}


async def _indexes(url: str, table: str) -> dict[str | None, tuple[list[str | None], bool]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            found = await conn.run_sync(lambda c: inspect(c).get_indexes(table))
    finally:
        await engine.dispose()
    return {ix["name"]: (list(ix["column_names"]), bool(ix["unique"])) for ix in found}


async def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    assert await migrate.current_revision_async(db_url) is None
    assert await _tables(db_url) == set()

    await migrate.upgrade_async(db_url)
    assert await _tables(db_url) == TABLES
    assert await migrate.current_revision_async(db_url) == migrate.head_revision()

    await migrate.downgrade_async(db_url, "base")
    assert await _tables(db_url) == set()
    assert await migrate.current_revision_async(db_url) is None

    await migrate.upgrade_async(db_url, "head")
    assert await _tables(db_url) == TABLES


async def test_ensure_schema_is_idempotent(db_url: str) -> None:
    await migrate.ensure_schema(db_url)
    await migrate.ensure_schema(db_url)
    assert await _tables(db_url) == TABLES
    assert await migrate.current_revision_async(db_url) == migrate.head_revision()


async def test_concurrent_ensure_schema_calls_serialize(db_url: str) -> None:
    await asyncio.gather(*(migrate.ensure_schema(db_url) for _ in range(3)))
    assert await _tables(db_url) == TABLES
    assert await migrate.current_revision_async(db_url) == migrate.head_revision()


def _first_connections_at_once(url: str, count: int) -> list[BaseException]:
    """``count`` threads call ``prepare_sqlite_file(url)`` together; the errors they raised."""
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def first_connection() -> None:
        start.wait()
        try:
            prepare_sqlite_file(url, timeout_s=10)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=first_connection) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_fresh_sqlite_file_switches_to_wal_under_concurrent_first_connections(
    tmp_path: Path,
) -> None:
    # SQLite does not wait on its busy timeout when two connections switch a new file to WAL
    # at once (bare PRAGMAs fail "database is locked" about a third of the time here).
    for trial in range(20):
        path = tmp_path / f"t{trial}" / "store.db"
        assert _first_connections_at_once(f"sqlite:///{path}", 4) == []
        db = sqlite3.connect(path)
        try:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        finally:
            db.close()


def test_proxy_replicas_migrate_a_fresh_sqlite_file_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    code = "import asyncio, sys; from proxima.proxy.store import migrate; "
    code += "asyncio.run(migrate.ensure_schema(sys.argv[1]))"
    replicas = [
        subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for replica in replicas:
        _, stderr = replica.communicate(timeout=120)
        assert replica.returncode == 0, stderr
    assert asyncio.run(_tables(url)) == TABLES


async def test_lookup_indexes_exist(db_url: str) -> None:
    await migrate.ensure_schema(db_url)
    sessions = await _indexes(db_url, "sessions")
    assert sessions["ix_sessions_api_key_hash"] == (["api_key_hash"], True)
    assert sessions["ix_sessions_status_finished_at"] == (["status", "finished_at"], False)
    completions = await _indexes(db_url, "completions")
    assert completions["ix_completions_session_id"] == (["session_id"], False)


async def test_models_match_migrations(db_url: str) -> None:
    await migrate.ensure_schema(db_url)

    def diff(connection: Connection) -> list[object]:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))

    engine = create_engine(db_url)
    try:
        async with engine.connect() as conn:
            changes = await conn.run_sync(diff)
    finally:
        await engine.dispose()
    assert changes == []


async def test_store_refuses_unmigrated_database(db_url: str) -> None:
    with pytest.raises(StoreError, match="proxima db upgrade"):
        await Store.open(db_url)


def test_sync_entry_points_for_the_cli(tmp_path: Path) -> None:
    url = str(tmp_path / "nested" / "cli.db")  # a bare path; the directory is created
    assert migrate.current_revision(url) is None
    migrate.upgrade(url)
    assert migrate.current_revision(url) == migrate.head_revision()
    migrate.downgrade(url)
    assert migrate.current_revision(url) is None


def test_scripts_are_found_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    migrate.upgrade("cwd.db")
    assert (tmp_path / "cwd.db").is_file()
    assert migrate.current_revision(f"sqlite:///{tmp_path / 'cwd.db'}") == migrate.head_revision()


async def test_response_text_survives_the_json_migration(db_url: str) -> None:
    """0003 turns ``response_text`` into JSON in place: old rows read back unchanged."""
    await migrate.upgrade_async(db_url, "0002")
    texts = {"c-plain": "plain", "c-quote": 'say "hi" \\ there', "c-num": "42", "c-empty": ""}
    engine = create_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO sessions (id, kind, status, metadata, created_at) "
                    "VALUES ('s', 'train', 'open', '{}', CURRENT_TIMESTAMP)"
                )
            )
            for cid, body in texts.items():
                await conn.execute(
                    text(
                        "INSERT INTO completions (id, session_id, prompt_ids, output_ids, "
                        "output_logprobs, output_versions, finish_reason, created_at, "
                        "response_text, sampling, model, choice_index) VALUES (:id, 's', :b, "
                        ":b, :b, :b, 'stop', CURRENT_TIMESTAMP, :text, '{}', 'm', 0)"
                    ),
                    {"id": cid, "b": b"", "text": body},
                )
    finally:
        await engine.dispose()
    await migrate.upgrade_async(db_url, "head")
    store = await Store.open(db_url)
    try:
        for cid, body in texts.items():
            loaded = await store.get_completion(completion_id=cid)
            assert loaded is not None and loaded.response_text == body
    finally:
        await store.close()
    await migrate.downgrade_async(db_url, "0002")
    engine = create_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, response_text FROM completions"))
            assert dict(rows.tuples().all()) == texts
    finally:
        await engine.dispose()
