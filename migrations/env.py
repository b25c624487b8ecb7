"""Alembic environment for Proxima's async engines.

Two ways in:

* programmatic (``proxima.proxy.store.migrate``): the caller opens the connection (and
  the lock) and hands it over in ``config.attributes["connection"]``;
* the Alembic CLI: the URL comes from ``-x db=URL``, ``$PROXIMA_DB_URL`` or
  ``sqlalchemy.url``, and this module opens an async connection itself.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from proxima.proxy.store.migrate import run_on_new_connection
from proxima.proxy.store.models import Base
from sqlalchemy.engine import Connection

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("db") or os.environ.get("PROXIMA_DB_URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass -x db=URL or set PROXIMA_DB_URL")
    return url


def _run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        # SQLite does run DDL transactionally once BEGIN is emitted (see engine.py).
        transactional_ddl=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_migrations(connection)
        return
    asyncio.run(run_on_new_connection(_url(), _run_migrations))


if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    _run_offline()
else:
    _run_online()
