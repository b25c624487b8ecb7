"""Conversions between ORM rows and the frozen records of ``records.py``."""

from __future__ import annotations

from typing import Any

from proxima.proxy.store.chains import rebuild, split
from proxima.proxy.store.codec import decode_float32, decode_int32, encode_float32, encode_int32
from proxima.proxy.store.models import (
    AdapterVersionRow,
    ApiKeyRow,
    CompletionRow,
    PolicyVersionRow,
    PromotionRow,
    SessionRow,
    VersionEvalRow,
)
from proxima.proxy.store.records import (
    ApiKeyRecord,
    CompletionRecord,
    PolicyVersionRecord,
    PromotionRecord,
    SessionKind,
    SessionRecord,
    SessionStatus,
    VersionEvalRecord,
)


def session_record(row: SessionRow) -> SessionRecord:
    """Build the record of a session row."""
    return SessionRecord(
        id=row.id,
        kind=SessionKind(row.kind),
        status=SessionStatus(row.status),
        group_id=row.group_id,
        data_id=row.data_id,
        metadata=dict(row.metadata_ or {}),
        reward=row.reward,
        created_at=row.created_at,
        finished_at=row.finished_at,
        claimed_by=row.claimed_by,
        external_id=row.external_id,
        api_key_id=row.api_key_id,
        trained_version=row.trained_version,
        adapter=row.adapter,
    )


def completion_values(
    record: CompletionRecord, parent: CompletionRecord | None = None
) -> dict[str, Any]:
    """The column values of a new completion row, token arrays packed.

    With ``parent`` (the record of ``record.parent_id``, whole), the row stores only
    what ``record`` adds to it (``chains.split``). A plain dict for a Core insert: the recording hot path never builds an
    ORM object for a row it will not read back.

    Raises:
        ValueError: the per-token arrays disagree in length, or a timestamp is naive.
    """
    n_out = len(record.output_ids)
    if len(record.output_logprobs) != n_out or len(record.output_versions) != n_out:
        raise ValueError(
            "output_ids, output_logprobs and output_versions must have equal lengths "
            f"(got {n_out}, {len(record.output_logprobs)}, {len(record.output_versions)})"
        )
    for name, value in (("created_at", record.created_at), ("finished_at", record.finished_at)):
        if value is not None and value.tzinfo is None:
            raise ValueError(f"completion {name} is a naive datetime; use an aware UTC time")
    stored = split(record, parent)
    return {
        "id": record.id,
        "session_id": record.session_id,
        "parent_id": record.parent_id,
        "prompt_prefix": stored.prompt_prefix,
        "prompt_ids": encode_int32(stored.prompt_ids),
        "messages_prefix": stored.messages_prefix,
        "tools_from_parent": stored.tools_from_parent,
        "output_ids": encode_int32(record.output_ids),
        "output_logprobs": encode_float32(record.output_logprobs),
        "output_versions": encode_int32(record.output_versions),
        "finish_reason": record.finish_reason,
        "created_at": record.created_at,
        "request_messages": stored.request_messages,
        "request_tools": stored.request_tools,
        "response_message": record.response_message,
        "response_text": record.response_text,
        "sampling": dict(record.sampling),
        "model": record.model,
        "reward": record.reward,
        "choice_index": record.choice_index,
        "finished_at": record.finished_at,
        "time_to_first_token": record.time_to_first_token,
        "duration": record.duration,
        "backend": record.backend,
        "adapter": record.adapter,
        "grammar": record.grammar,
    }


def completion_record(
    row: CompletionRow, parent: CompletionRecord | None = None
) -> CompletionRecord:
    """Build the record of a completion row, unpacking its token arrays.

    ``parent`` is the (rebuilt) record of the row's parent, needed when the row
    stores only what it adds to it (``chains.rebuild`` raises ``StoreError`` if so
    and it is missing).
    """
    prompt_ids, request_messages, request_tools = rebuild(
        parent,
        completion_id=row.id,
        prompt_prefix=row.prompt_prefix,
        prompt_ids=decode_int32(row.prompt_ids),
        messages_prefix=row.messages_prefix,
        request_messages=row.request_messages,
        tools_from_parent=row.tools_from_parent,
        request_tools=row.request_tools,
    )
    return CompletionRecord(
        id=row.id,
        session_id=row.session_id,
        parent_id=row.parent_id,
        prompt_ids=prompt_ids,
        output_ids=decode_int32(row.output_ids),
        output_logprobs=decode_float32(row.output_logprobs),
        output_versions=decode_int32(row.output_versions),
        finish_reason=row.finish_reason,
        created_at=row.created_at,
        request_messages=request_messages,
        request_tools=request_tools,
        response_message=row.response_message,
        response_text=row.response_text,
        sampling=dict(row.sampling or {}),
        model=row.model,
        reward=row.reward,
        choice_index=row.choice_index,
        finished_at=row.finished_at,
        time_to_first_token=row.time_to_first_token,
        duration=row.duration,
        backend=row.backend,
        adapter=row.adapter,
        grammar=row.grammar,
    )


def api_key_record(row: ApiKeyRow) -> ApiKeyRecord:
    """Build the record of an API key row (the hash is not part of it)."""
    return ApiKeyRecord(
        id=row.id,
        name=row.name,
        record=row.record,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        adapter=row.adapter,
    )


def policy_version_record(row: PolicyVersionRow | AdapterVersionRow) -> PolicyVersionRecord:
    """Build the record of a policy version row (the base's or an adapter's)."""
    if not isinstance(row, AdapterVersionRow):
        return PolicyVersionRecord(version=row.version, path=row.path, created_at=row.created_at)
    return PolicyVersionRecord(
        version=row.version,
        path=row.path,
        created_at=row.created_at,
        adapter=row.adapter,
        failed_at=row.failed_at,
        failure=row.failure,
    )


def version_eval_record(row: VersionEvalRow) -> VersionEvalRecord:
    """Build the record of a version's eval score row."""
    return VersionEvalRecord(
        version=row.version,
        score=row.score,
        items=row.items,
        name=row.name,
        created_at=row.created_at,
        adapter=row.adapter,
    )


def promotion_record(row: PromotionRow) -> PromotionRecord:
    """Build the record of a production promotion (or rollback) row."""
    return PromotionRecord(
        id=row.id,
        action=row.action,
        version=row.version,
        canary_version=row.canary_version,
        canary_fraction=row.canary_fraction,
        created_at=row.created_at,
        adapter=row.adapter,
    )
