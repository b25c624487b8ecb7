"""Store records built in memory for the tests of sessions -> samples (no store involved).

``session_record``: a claimed training session (id ``s`` unless named), created at ``T0``.
``completion_record``: one completion of it, ``minute`` minutes after ``T0``, its output
tokens all of one policy ``version``, behaviour logprobs -0.5 a token unless given, sampled at
temperature 1 unless ``sampling`` says otherwise; any other field of ``CompletionRecord``
passes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from proxima.proxy.store.records import CompletionRecord, SessionKind, SessionRecord, SessionStatus

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def session_record(
    sid: str = "s", *, group: str | None = None, reward: float | None = None
) -> SessionRecord:
    """A claimed training session of ``group`` with ``reward`` (see the module docstring)."""
    return SessionRecord(
        id=sid,
        kind=SessionKind.TRAIN,
        status=SessionStatus.CLAIMED,
        group_id=group,
        data_id=None,
        metadata={},
        reward=reward,
        created_at=T0,
    )


def completion_record(
    cid: str,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    minute: int,
    parent: str | None = None,
    session: str = "s",
    version: int = 0,
    logprobs: Sequence[float] | None = None,
    sampling: dict[str, Any] | None = None,
    **fields: Any,
) -> CompletionRecord:
    """A finished (``stop``) completion of ``session`` (see the module docstring)."""
    return CompletionRecord(
        id=cid,
        session_id=session,
        parent_id=parent,
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_logprobs=[-0.5] * len(output) if logprobs is None else list(logprobs),
        output_versions=[version] * len(output),
        finish_reason="stop",
        created_at=T0 + timedelta(minutes=minute),
        sampling={"temperature": 1.0} if sampling is None else sampling,
        **fields,
    )
