"""``proxima export``: sessions of the trajectory store as Parquet or a Hugging Face dataset.

One row per completion (:func:`schema`), sessions oldest first, each session's completions in
the order the trainer orders them (created_at, then choice index, then id). The sessions are
those of a filter (:class:`proxima.proxy.inspector.queries.SessionFilter`, the inspector's
session list's: run, group, adapter, status, kind, reward range, version, time), read a page
at a time (``proxima.proxy.store.pages``) and written a page at a time (one Parquet row group
per page, ``pyarrow.parquet.ParquetWriter``): memory holds one page, however large the store.

What a row holds beyond the store's records:

- ``loss_mask`` (one entry per output token): 1 on the tokens the trainer trains when it trains
  the session (``trainer.samples``: every generated token, but none of a completion sampled from
  a transformed distribution, of a session whose records it cannot train, or of an empty
  output), before its staleness bound, which depends on the version it trains at;
- ``return``: the turn's discounted return ``G_t`` (``trainer.advantages``), from the session's
  rewards;
- ``advantage``: the turn's group-relative advantage as the trainer computes it
  (``trainer.advantages.group_advantages``) over the session's group: every session of the
  group the trainer would claim with it (finished or consumed, rewarded), whether or not the
  filter selects them. None for a session outside such a group (open, failed, unrewarded),
  and for one without a group unless ``advantage.ungrouped = "alone"`` (the trainer pools
  those per batch, which an export does not know).

``--format hf`` writes a ``datasets`` dataset (``datasets.load_from_disk``) and needs
``datasets``; the Parquet file of ``--format parquet`` is what ``datasets.load_dataset(
"parquet", data_files=...)`` reads without it.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson
from proxima.proxy.inspector.queries import SessionFilter, conditions
from proxima.proxy.store import ensure_schema
from proxima.proxy.store.pages import (
    SessionRewards,
    SessionWithCompletions,
    group_rewards,
    session_id_pages,
    sessions_with_completions,
)
from proxima.proxy.store.records import CompletionRecord, SessionStatus
from proxima.proxy.store.store import Store
from proxima.trainer.advantages import advantage_groups, discounted_returns, group_advantages
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.logit_transforms import behaviour_logprobs_reproducible
from proxima.trainer.samples import session_problem

if TYPE_CHECKING:
    import pyarrow as pa

Format = Literal["parquet", "hf"]
PAGE_SIZE = 500
CLAIMABLE = frozenset(
    {SessionStatus.FINISHED, SessionStatus.CLAIMED, SessionStatus.TRAINED, SessionStatus.DROPPED}
)
"""Statuses of the sessions a trainer claims with their group (or has)."""


class ExportUnavailable(RuntimeError):
    """The package a format needs is not installed."""


@dataclass(frozen=True)
class Exported:
    sessions: int
    completions: int
    path: Path


def schema() -> pa.Schema:
    """The columns of an export, one row per completion (docs/reference.md, "Export")."""
    pa = _pyarrow()
    text, json_text, stamp = pa.string(), pa.string(), pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("session_id", text),
            ("completion_id", text),
            ("parent_id", text),  # the completion this one extends (None: a first turn)
            ("turn", pa.int32()),  # its place in the session, from 0
            ("choice_index", pa.int32()),
            ("group_id", text),
            ("data_id", text),
            ("run", text),  # the session's metadata.rollout
            ("kind", text),
            ("status", text),
            ("adapter", text),  # None: the base model
            ("session_reward", pa.float64()),
            ("session_metadata", json_text),
            ("session_created_at", stamp),
            ("session_finished_at", stamp),
            ("trained_version", pa.int32()),
            ("created_at", stamp),
            ("model", text),
            ("finish_reason", text),
            ("sampling", json_text),
            ("prompt_ids", pa.list_(pa.int32())),
            ("output_ids", pa.list_(pa.int32())),
            ("output_logprobs", pa.list_(pa.float32())),
            ("output_versions", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("messages", json_text),  # the request's messages (chat requests)
            ("tools", json_text),
            ("response_message", json_text),
            ("response_text", text),
            ("reward", pa.float64()),  # this completion's own (per-turn) reward
            ("return", pa.float64()),
            ("advantage", pa.float64()),
            ("problem", text),  # why the trainer cannot train the session (None: it can)
        ]
    )


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as exc:
        raise ExportUnavailable(
            f"proxima export writes Parquet with pyarrow, which is not installed ({exc}): "
            "pip install 'proxima[export]'"
        ) from exc
    return pyarrow


def _json(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer past 64 bits, a key that is not a string
        return json.dumps(value, ensure_ascii=False)


def turn_rewards(session_reward: float | None, rewards: list[float | None]) -> list[float]:
    """Per-turn rewards as the trainer sums them (``samples.session_rewards``): each turn's
    own (unset: 0), plus the session's on the last turn."""
    out = [0.0 if r is None else float(r) for r in rewards]
    if out and session_reward is not None:
        out[-1] += float(session_reward)
    return out


def advantages_of(members: list[SessionRewards], cfg: AdvantageConfig) -> dict[str, list[float]]:
    """Per-turn advantages of the sessions a trainer would claim together, by session id."""
    claimable = [
        m
        for m in members
        if m.status in CLAIMABLE
        and (m.reward is not None or any(r is not None for r in m.turn_rewards))
    ]
    returns = {
        m.session_id: discounted_returns(turn_rewards(m.reward, m.turn_rewards), cfg.discount)
        for m in claimable
    }
    groups = advantage_groups({m.session_id: m.group_id for m in claimable}, ungrouped="alone")
    return group_advantages(returns, groups, baseline=cfg.baseline, normalize_std=cfg.normalize_std)


def loss_mask(completion: CompletionRecord, trainable: bool) -> list[int]:
    """1 on each output token the trainer trains (``samples._session_samples``), else 0."""
    trained = trainable and behaviour_logprobs_reproducible(completion)
    return [1 if trained else 0] * len(completion.output_ids)


def _rows(
    page: list[SessionWithCompletions], advantages: dict[str, list[float]], discount: float
) -> dict[str, list[Any]]:
    """The page's rows, as columns."""
    columns: dict[str, list[Any]] = {name: [] for name in schema().names}
    for session, completions in page:
        problem = session_problem(completions)
        rewards = turn_rewards(session.reward, [c.reward for c in completions])
        returns = discounted_returns(rewards, discount)
        mine = advantages.get(session.id)
        for turn, c in enumerate(completions):
            row = {
                "session_id": session.id,
                "completion_id": c.id,
                "parent_id": c.parent_id,
                "turn": turn,
                "choice_index": c.choice_index,
                "group_id": session.group_id,
                "data_id": session.data_id,
                "run": _text_or_none(session.metadata.get("rollout")),
                "kind": session.kind.value,
                "status": session.status.value,
                "adapter": session.adapter,
                "session_reward": session.reward,
                "session_metadata": _json(session.metadata),
                "session_created_at": session.created_at,
                "session_finished_at": session.finished_at,
                "trained_version": session.trained_version,
                "created_at": c.created_at,
                "model": c.model,
                "finish_reason": c.finish_reason,
                "sampling": _json(c.sampling),
                "prompt_ids": c.prompt_ids,
                "output_ids": c.output_ids,
                "output_logprobs": c.output_logprobs,
                "output_versions": c.output_versions,
                "loss_mask": loss_mask(c, problem is None),
                "messages": _json(c.request_messages),
                "tools": _json(c.request_tools),
                "response_message": _json(c.response_message),
                "response_text": c.response_text,
                "reward": c.reward,
                "return": returns[turn],
                "advantage": None if mine is None else mine[turn],
                "problem": problem,
            }
            for name, value in row.items():
                columns[name].append(value)
    return columns


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def _page_advantages(
    store: Store, page: list[SessionWithCompletions], cfg: AdvantageConfig
) -> dict[str, list[float]]:
    """Per-turn advantages of the page's sessions (each over its whole group)."""
    groups = {session.group_id for session, _ in page if session.group_id is not None}
    members = await group_rewards(store, groups) if groups else []
    if cfg.ungrouped == "alone":
        members += [
            SessionRewards(s.id, None, s.status, s.reward, [c.reward for c in completions])
            for s, completions in page
            if s.group_id is None
        ]
    return advantages_of(members, cfg)


async def write_parquet(
    store: Store,
    selected: SessionFilter,
    path: Path,
    *,
    advantage: AdvantageConfig | None = None,
    page_size: int = PAGE_SIZE,
) -> Exported:
    """Write the sessions ``selected`` picks to the Parquet file ``path``, a page at a time."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    cfg = advantage or AdvantageConfig()
    columns = schema()
    path.parent.mkdir(parents=True, exist_ok=True)
    sessions = completions = 0
    with pq.ParquetWriter(path, columns) as writer:
        async for ids in session_id_pages(store, conditions(selected), page_size=page_size):
            page = await sessions_with_completions(store, ids)
            rows = _rows(page, await _page_advantages(store, page, cfg), cfg.discount)
            writer.write_table(pa.Table.from_pydict(rows, schema=columns))
            sessions += len(page)
            completions += len(rows["completion_id"])
    return Exported(sessions, completions, path)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ExportUnavailable(
            f"--format hf writes a Hugging Face dataset with datasets, which is not installed "
            f"({exc}): pip install 'proxima[export]', or export --format parquet, which "
            "datasets.load_dataset('parquet', data_files=FILE) reads"
        ) from exc
    return datasets


def _save_dataset(parquet: Path, out: Path) -> None:
    """``parquet`` as a ``datasets`` dataset saved at ``out`` (memory-mapped: bounded memory)."""
    dataset = _datasets().Dataset.from_parquet(
        str(parquet), cache_dir=str(parquet.parent / "cache")
    )
    dataset.save_to_disk(str(out))


async def export(
    db: str,
    selected: SessionFilter,
    out: Path,
    *,
    fmt: Format = "parquet",
    advantage: AdvantageConfig | None = None,
    page_size: int = PAGE_SIZE,
) -> Exported:
    """``proxima export``: the store at ``db`` (migrated first, as ``serve`` does) to ``out``:
    a Parquet file, or with ``fmt = "hf"`` a ``datasets`` dataset directory."""
    _pyarrow()
    if fmt == "hf":
        _datasets()
        if out.exists():
            raise FileExistsError(f"{out} exists: a dataset is written to a new directory")
    elif out.is_dir():
        raise IsADirectoryError(f"{out} is a directory: --format parquet writes one file")
    await ensure_schema(db)
    store = await Store.open(db)
    try:
        if fmt == "parquet":
            return await write_parquet(
                store, selected, out, advantage=advantage, page_size=page_size
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".export-") as work:
            parquet = Path(work) / "sessions.parquet"
            done = await write_parquet(
                store, selected, parquet, advantage=advantage, page_size=page_size
            )
            await asyncio.to_thread(_save_dataset, parquet, out)
        return Exported(done.sessions, done.completions, out)
    finally:
        await store.close()
