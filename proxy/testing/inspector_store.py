"""A store filled with synthetic training history, written straight into its tables.

``fill_store`` writes ``sessions`` sessions (and their completions, policy versions, held-out
scores) through Core bulk inserts on the store's engine: the inspector's list and run pages
are tested (``tests/proxy/test_inspector_store.py``) and measured (``bench/inspector.py``) on
a store of the size a long run leaves, without generating anything.

The history it writes, deterministic for a ``seed``: sessions opened one second apart,
``group_size`` to a group (``item<k>@<run>``); a version pushed every ``batch`` sessions; the
sessions before the last two batches trained (a few failed or dropped) two versions after the
one they were opened under, so their tokens are one version stale; the rest finished or still
open; rewards 0 or 1 with a success rate that rises with the version; every
``adapter_every``-th group on adapter ``tenant-a`` (its own versions); ``runs`` rollout passes
one after the other; each session ``turns`` completions that extend each other token-exactly,
the last one of about one session in twenty interrupted by a push (tokens of two versions).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from proxima.proxy.store.convert import completion_values
from proxima.proxy.store.models import (
    AdapterVersionRow,
    CompletionRow,
    PolicyVersionRow,
    SessionRow,
    VersionEvalRow,
)
from proxima.proxy.store.records import CompletionRecord
from sqlalchemy import Table, insert
from sqlalchemy.ext.asyncio import AsyncEngine

ADAPTER = "tenant-a"
START = datetime(2026, 1, 1, tzinfo=UTC)
_CHUNK = 2000


def _table(model: Any) -> Table:
    table: Table = model.__table__
    return table


@dataclass(frozen=True, slots=True)
class Filled:
    """What ``fill_store`` wrote."""

    sessions: int
    completions: int
    versions: int  # the base's newest version
    runs: list[str]
    first: datetime
    last: datetime  # the newest session's creation time


def _session(i: int, rng: random.Random, *, sessions: int, batch: int, group_size: int,
             runs: int, adapter_every: int) -> dict[str, Any]:  # fmt: skip
    group = i // group_size
    run = f"run{i * runs // sessions}"
    adapter = ADAPTER if adapter_every and group % adapter_every == adapter_every - 1 else None
    version = i // batch
    trained = i < (sessions // batch - 2) * batch
    if trained:
        status = rng.choices(["trained", "failed", "dropped"], [90, 5, 5])[0]
    else:
        status = rng.choice(["finished", "finished", "open"])
    p = min(0.9, 0.2 + 0.7 * version / max(1, sessions // batch))
    reward = None if status in ("open", "failed") else float(rng.random() < p)
    created = START + timedelta(seconds=i)
    return {
        "id": f"s{i:08d}",
        "kind": "train",
        "status": status,
        "api_key_hash": None,
        "group_id": f"item{group}@{run}",
        "data_id": f"item{group}",
        "metadata": {"rollout": run, "sample": i % group_size, "group_size": group_size},
        "reward": reward,
        "created_at": created,
        "finished_at": None if status == "open" else created + timedelta(seconds=1),
        "claimed_by": None,
        "external_id": None,
        "api_key_id": None,
        "trained_version": version + 2 if status == "trained" else None,
        "adapter": adapter,
    }


def _completions(session: dict[str, Any], rng: random.Random, *, version: int, turns: int,
                 vocab: int) -> list[dict[str, Any]]:  # fmt: skip
    """The session's ``turns`` completions, each extending the one before; tokens of
    ``version`` (the last turn, now and then, of ``version`` and the next: interrupted)."""
    out: list[dict[str, Any]] = []
    parent: CompletionRecord | None = None
    prompt = [rng.randrange(vocab) for _ in range(24)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 2?"}]
    for turn in range(turns):
        output = [rng.randrange(vocab) for _ in range(16)]
        versions = [version] * 16
        if turn == turns - 1 and rng.random() < 0.05:  # interrupted by a push
            versions = [version] * 8 + [version + 1] * 8
        record = CompletionRecord(
            id=f"{session['id']}-c{turn}",
            session_id=session["id"],
            parent_id=None if parent is None else parent.id,
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=[-rng.random() * 3 for _ in output],
            output_versions=versions,
            finish_reason="stop",
            created_at=session["created_at"] + timedelta(milliseconds=100 * (turn + 1)),
            request_messages=messages,
            response_message={"role": "assistant", "content": f"reply {turn}"},
            response_text=f"reply {turn}",
            model="synthetic",
            adapter=session["adapter"],
        )
        out.append(completion_values(record, parent))
        parent = record
        prompt = [*prompt, *output, *(rng.randrange(vocab) for _ in range(8))]
        messages = [*messages, record.response_message or {}, {"role": "user", "content": "go on"}]
    return out


async def fill_store(
    engine: AsyncEngine,
    sessions: int,
    *,
    seed: int = 0,
    turns: int = 3,
    group_size: int = 4,
    batch: int = 64,
    runs: int = 2,
    adapter_every: int = 10,
    vocab: int = 256,
) -> Filled:
    """Write the synthetic history described in the module docs; see ``Filled``."""
    rng = random.Random(seed)
    count = 0
    for start in range(0, sessions, _CHUNK):
        rows = [
            _session(
                i,
                rng,
                sessions=sessions,
                batch=batch,
                group_size=group_size,
                runs=runs,
                adapter_every=adapter_every,
            )  # fmt: skip
            for i in range(start, min(sessions, start + _CHUNK))
        ]
        done = [
            c
            for i, row in enumerate(rows, start)
            for c in _completions(row, rng, version=i // batch, turns=turns, vocab=vocab)
        ]
        count += len(done)
        async with engine.begin() as conn:
            await conn.execute(insert(_table(SessionRow)), rows)
            if done:
                await conn.execute(insert(_table(CompletionRow)), done)
    newest = max(0, (sessions - 1) // batch)
    pushes = [START + timedelta(seconds=v * batch) for v in range(newest + 1)]
    async with engine.begin() as conn:
        if newest:
            await conn.execute(
                insert(_table(PolicyVersionRow)),
                [
                    {"version": v, "path": f"/w/v{v}", "created_at": pushes[v]}
                    for v in range(1, newest + 1)
                ],  # fmt: skip
            )
            await conn.execute(
                insert(_table(AdapterVersionRow)),
                [
                    {"adapter": ADAPTER, "version": v, "path": f"/w/a{v}", "created_at": pushes[v]}
                    for v in range(1, newest + 1)
                ],  # fmt: skip
            )
        await conn.execute(
            insert(_table(VersionEvalRow)),
            [
                {
                    "version": v,
                    "score": min(0.95, 0.2 + 0.7 * v / max(1, newest)),
                    "items": 50,
                    "name": "held-out",
                    "created_at": pushes[v],
                    "adapter": None,
                }
                for v in range(0, newest + 1, max(1, newest // 10))
            ],  # fmt: skip
        )
    return Filled(
        sessions=sessions,
        completions=count,
        versions=newest,
        runs=[f"run{r}" for r in range(runs)],
        first=START,
        last=START + timedelta(seconds=sessions - 1),
    )
