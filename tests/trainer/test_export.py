"""``proxima export``: the store's sessions as Parquet or a Hugging Face dataset.

A store is populated through the store API (chains of turns that extend each other, a branch,
a completion sampled under a grammar, per-turn and session rewards, groups, a trained group,
a failed session); the export is read back and compared with the store's own records, the
filters are checked, the loss-mask tokens are compared with the samples the trainer builds
for the same sessions, and the memory of an export of a large store is measured in a child
process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from proxima.proxy.inspector.queries import SessionFilter
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.store.records import CompletionRecord, SessionStatus
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.export import export, schema
from proxima.trainer.samples import build_samples

from tests.proxy.store.factories import key_hash

T0 = datetime(2026, 3, 1, tzinfo=UTC)
ADV = AdvantageConfig(discount=0.9)


def _completion(
    session_id: str, n: int, prompt: list[int], output: list[int], **kw: Any
) -> CompletionRecord:
    values: dict[str, Any] = {
        "id": f"{session_id}-c{n}",
        "session_id": session_id,
        "parent_id": None,
        "prompt_ids": prompt,
        "output_ids": output,
        "output_logprobs": [-0.1 * (i + 1) for i in range(len(output))],
        "output_versions": [n % 2] * len(output),
        "finish_reason": "stop",
        "created_at": T0 + timedelta(seconds=n),
        "request_messages": [{"role": "user", "content": f"turn {n}"}],
        "response_message": {"role": "assistant", "content": f"reply {n}"},
        "response_text": f"reply {n}",
        "sampling": {"temperature": 1.0},
        "model": "tiny",
    }
    values.update(kw)
    return CompletionRecord(**values)


async def _session(
    store: Store, group: str | None, run: str, rewards: tuple[float | None, float | None]
) -> str:
    """A session of three turns: turn 1, turn 2 extending it, and turn 2' (a branch of
    turn 1, sampled under a grammar); per-turn reward on turn 1, then the session's."""
    s = await store.create_session(
        api_key_hash=key_hash(), group_id=group, data_id=group, metadata={"rollout": run}
    )
    a = _completion(
        s.id, 1, [1, 2, 3], [4, 5], request_tools=[{"type": "function", "function": {"name": "f"}}]
    )
    b = _completion(s.id, 2, [1, 2, 3, 4, 5, 6], [7, 8, 9], parent_id=a.id)
    c = _completion(
        s.id, 3, [1, 2, 3, 4, 5, 10], [11], parent_id=a.id,
        sampling={"temperature": 1.0, "logit_transforms": ["grammar"]},
    )  # fmt: skip
    await store.record_completions(completions=[a, b, c])
    turn_reward, session_reward = rewards
    if turn_reward is not None:
        await store.set_completion_reward(session_id=s.id, completion_id=a.id, reward=turn_reward)
    if session_reward is not None:
        await store.set_session_reward(session_id=s.id, reward=session_reward)
    await store.finish_session(session_id=s.id)
    return s.id


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    ids: dict[str, list[str]] = {"g1": [], "g2": [], "none": []}
    for reward in ((0.5, 1.0), (None, 0.0), (None, 1.0)):
        ids["g1"].append(await _session(store, "g1@r1", "r1", reward))
    for reward in ((1.0, 0.0), (None, 0.0)):
        ids["g2"].append(await _session(store, "g2@r2", "r2", reward))
    ids["none"].append(await _session(store, None, "r2", (None, 1.0)))
    failed = await store.create_session(api_key_hash=key_hash(), group_id="g2@r2", data_id="g2")
    await store.finish_session(session_id=failed.id, status=SessionStatus.FAILED)
    claimed = await store.claim_groups(min_sessions=3, trainer_id="t")
    assert {s.group_id for s in claimed} == {"g1@r1"}
    await store.mark_sessions(
        session_ids=[s.id for s in claimed], status=SessionStatus.TRAINED, trained_version=1
    )
    try:
        yield url, store, ids
    finally:
        await store.close()


async def test_the_export_holds_the_stores_records(store: Any, tmp_path: Path) -> None:
    url, db, ids = store
    out = tmp_path / "all.parquet"
    done = await export(url, SessionFilter(), out, advantage=ADV, page_size=2)
    assert (done.sessions, done.completions) == (7, 18)  # the failed session has none
    table = pq.read_table(out)
    assert table.schema == schema()
    rows = table.to_pylist()
    assert pq.ParquetFile(out).metadata.num_row_groups == 4  # a row group per page of 2

    every = [*ids["g1"], *ids["g2"], *ids["none"]]
    assert list(dict.fromkeys(r["session_id"] for r in rows)) == every  # oldest first
    for session_id in every:
        session = await db.get_session(session_id=session_id)
        mine = [r for r in rows if r["session_id"] == session_id]
        records = await db.list_completions(session_id=session_id)
        assert [r["completion_id"] for r in mine] == [c.id for c in records]
        for row, c in zip(mine, records, strict=True):
            assert row["parent_id"] == c.parent_id and row["turn"] == records.index(c)
            assert row["prompt_ids"] == c.prompt_ids and row["output_ids"] == c.output_ids
            assert row["output_versions"] == c.output_versions
            assert row["output_logprobs"] == list(np.float32(c.output_logprobs))
            assert json.loads(row["messages"]) == c.request_messages
            assert json.loads(row["tools"] or "null") == c.request_tools
            assert json.loads(row["response_message"]) == c.response_message
            assert json.loads(row["sampling"]) == c.sampling and row["reward"] == c.reward
            assert row["created_at"] == c.created_at
            assert (
                row["session_reward"] == session.reward
                and row["run"] == session.metadata["rollout"]
            )
            assert row["status"] == session.status.value and row["problem"] is None
            assert row["trained_version"] == session.trained_version
            grammar = "logit_transforms" in c.sampling
            assert row["loss_mask"] == [0 if grammar else 1] * len(c.output_ids)
    first = [r for r in rows if r["session_id"] == ids["g1"][0]]
    # Rewards [0.5, 0, 1.0] over the turns (the session's on the last), discount 0.9.
    assert [r["return"] for r in first] == pytest.approx([0.5 + 0.81, 0.9, 1.0])
    assert rows[0]["status"] == "trained" and rows[0]["trained_version"] == 1
    ungrouped = [r for r in rows if r["session_id"] in ids["none"]]
    assert {r["advantage"] for r in ungrouped} == {None}  # pooled per batch by the trainer


async def test_the_filters_select_sessions(store: Any, tmp_path: Path) -> None:
    url, _, ids = store

    async def exported(**fields: Any) -> list[str]:
        out = tmp_path / "f.parquet"
        await export(url, SessionFilter(**fields), out)
        return list(
            dict.fromkeys(pq.read_table(out, columns=["session_id"])["session_id"].to_pylist())
        )

    assert await exported(group="g2@r2") == ids["g2"]
    assert await exported(run="r2") == [*ids["g2"], *ids["none"]]
    assert await exported(status="trained") == ids["g1"]
    assert await exported(reward_min=0.5) == [ids["g1"][0], ids["g1"][2], *ids["none"]]
    assert await exported(reward_max=0.0, kind="train") == [ids["g1"][1], *ids["g2"]]
    assert await exported(since=datetime.now(UTC) + timedelta(hours=1)) == []


async def test_the_loss_mask_is_what_the_trainer_trains(store: Any, tmp_path: Path) -> None:
    """A supervised step on the export's loss-mask tokens trains exactly the tokens (with the
    same behaviour logprobs, versions and advantages) the trainer's samples train."""
    url, db, ids = store
    out = tmp_path / "all.parquet"
    await export(url, SessionFilter(), out, advantage=ADV)
    rows = {r["completion_id"]: r for r in pq.read_table(out).to_pylist()}
    grouped = [*ids["g1"], *ids["g2"]]
    batch = [
        (await db.get_session(session_id=s), await db.list_completions(session_id=s))
        for s in grouped
    ]
    samples = build_samples(batch, ADV)
    assert samples
    records = {c.id: c for _, completions in batch for c in completions}
    from_samples: dict[str, list[tuple[int, float, int, float]]] = {}
    for sample in samples:
        covered = 0
        for cid in sample.completion_ids:
            start = len(records[cid].prompt_ids)
            end = start + len(records[cid].output_ids)
            assert sample.loss_mask[start:end] == [1] * (end - start)
            covered += end - start
            from_samples[cid] = list(
                zip(
                    sample.input_ids[start:end],
                    sample.behav_logprobs[start:end],
                    sample.versions[start:end],
                    sample.advantages[start:end],
                    strict=True,
                )
            )
        assert sample.num_loss_tokens == covered  # nothing else trained
    from_export = {
        cid: [
            (t, lp, v, row["advantage"])
            for t, lp, v, m in zip(
                row["output_ids"],
                row["output_logprobs"],
                row["output_versions"],
                row["loss_mask"],
                strict=True,
            )  # fmt: skip
            if m
        ]
        for cid, row in rows.items()
        if row["session_id"] in grouped and any(row["loss_mask"])
    }
    assert from_export.keys() == from_samples.keys()
    for cid, tokens in from_samples.items():
        assert [t for t, *_ in from_export[cid]] == [t for t, *_ in tokens]
        assert [(v, pytest.approx(a)) for _, _, v, a in from_export[cid]] == [
            (v, a) for _, _, v, a in tokens
        ]
        assert [lp for _, lp, *_ in from_export[cid]] == pytest.approx([lp for _, lp, *_ in tokens])


async def test_a_hugging_face_dataset_and_plain_parquet_load(store: Any, tmp_path: Path) -> None:
    import datasets

    url, _, _ = store
    await export(url, SessionFilter(), tmp_path / "hf", fmt="hf")
    loaded = datasets.load_from_disk(str(tmp_path / "hf"))
    await export(url, SessionFilter(), tmp_path / "plain.parquet")
    plain = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "plain.parquet"), split="train",
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert loaded.num_rows == plain.num_rows == 18
    assert loaded["completion_id"] == plain["completion_id"]
    assert loaded[0]["prompt_ids"] == plain[0]["prompt_ids"] == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export-")]  # cleaned up
    with pytest.raises(FileExistsError):
        await export(url, SessionFilter(), tmp_path / "hf", fmt="hf")


MEMORY_SCRIPT = """
import asyncio, json, resource, sys
from pathlib import Path
from proxima.proxy.inspector.queries import SessionFilter
from proxima.trainer.export import export, schema
import pyarrow.parquet, datasets  # what the export imports, before the baseline
schema()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
done = asyncio.run(export(sys.argv[1], SessionFilter(), Path(sys.argv[2]), page_size=500))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"sessions": done.sessions, "growth_mb": (after - before) / 1024}))
"""


def _export_growth(db: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, db, str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


async def test_memory_stays_bounded_as_the_store_grows(tmp_path: Path) -> None:
    """Exporting 10x the sessions grows the peak memory no more than exporting 1x does, give
    or take: a page at a time is held, never the store (30k completions, ~110 tokens each)."""
    from proxima.proxy.store.database import create_engine
    from proxima.proxy.testing.inspector_store import fill_store

    growth = {}
    for n in (1000, 10_000):
        url = f"sqlite:///{tmp_path / f'big{n}.db'}"
        await ensure_schema(url)
        engine = create_engine(url)
        try:
            await fill_store(engine, n)
        finally:
            await engine.dispose()
        result = _export_growth(url, tmp_path / f"big{n}.parquet")
        assert result["sessions"] == n
        growth[n] = result["growth_mb"]
        assert pq.ParquetFile(tmp_path / f"big{n}.parquet").metadata.num_rows == 3 * n
    assert growth[10_000] < growth[1000] + 40, growth


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from proxima.proxy.store.database import create_engine
    from proxima.proxy.testing.inspector_store import ADAPTER, fill_store

    from proxima.cli import main

    url = f"sqlite:///{tmp_path / 'store.db'}"

    async def fill() -> None:
        await ensure_schema(url)
        engine = create_engine(url)
        try:
            await fill_store(engine, 80, adapter_every=2)
        finally:
            await engine.dispose()

    asyncio.run(fill())
    out = tmp_path / "tenant.parquet"
    assert main(["export", "--db", url, "-o", str(out), "--adapter", ADAPTER]) == 0
    assert capsys.readouterr().out.strip() == f"exported 40 sessions (120 completions) to {out}"
    assert set(pq.read_table(out, columns=["adapter"])["adapter"].to_pylist()) == {ADAPTER}
    assert (
        main(["export", "--db", url, "-o", str(out), "--reward-min", "2", "--reward-max", "1"]) == 2
    )
    assert "--reward-max: below reward_min" in capsys.readouterr().err
    assert main(["export", "--db", url, "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
