"""Alembic migrations of the trajectory store.

The schema is created only by these migrations. ``proxima.proxy.store.migrate`` runs
them programmatically (``proxima db upgrade``, server start-up); developers can
also use the Alembic CLI with ``alembic -c migrations/alembic.ini -x db=URL ...``.
"""

from __future__ import annotations

from pathlib import Path

SCRIPT_LOCATION = Path(__file__).resolve().parent
"""Directory holding ``env.py``, ``script.py.mako`` and ``versions/`` (works when installed)."""
