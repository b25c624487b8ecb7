"""RL session routes (/rl/sessions): create, reward, finish, read the trajectory."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse
from proxima.proxy.api.deps import (
    AdminDep,
    HistoriesDep,
    PrincipalDep,
    PrincipalsDep,
    StateDep,
    StoreDep,
)
from proxima.proxy.api.schemas import (
    MAX_ID_LENGTH,
    CreateSessionRequest,
    CreateSessionResponse,
    FinishRequest,
    RewardRequest,
)
from proxima.proxy.auth import SESSION_KEY_PREFIX, Principal, PrincipalKind, hash_key, new_key
from proxima.proxy.errors import BadRequest, NotFound, PermissionDenied, RateLimited
from proxima.proxy.logs import note_request
from proxima.proxy.policies.staleness import admit
from proxima.proxy.store.errors import NotAdmitted
from proxima.proxy.store.fleet import AdmissionState
from proxima.proxy.store.records import CompletionRecord, SessionRecord, SessionStatus
from proxima.proxy.store.store import Store


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (``\\u00e9``).

    Trajectories hold text recorded from clients; a string the store holds that
    is not valid Unicode (a lone surrogate, in a database written without the
    request checks) cannot be encoded as UTF-8, but escaped it still
    serializes, so the session stays readable.
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


router = APIRouter(prefix="/rl", tags=["rl"], default_response_class=AsciiJSONResponse)


async def _owned_session(store: Store, principal: Principal, session_id: str) -> SessionRecord:
    session = await store.get_session(session_id=session_id)
    if session is None:
        # A session key learns nothing about other sessions: same answer as "not yours".
        if principal.is_admin:
            raise NotFound(f"No session {session_id}.", param="session_id")
        raise PermissionDenied("This key does not grant access to that session.")
    if not principal.may_access_session(session):
        raise PermissionDenied("This key does not grant access to that session.")
    return session


def _idempotency_key(value: str | None) -> str | None:
    """The ``Idempotency-Key`` header, checked: 1 to 200 characters (its column's width), no NUL."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_ID_LENGTH or "\x00" in value:
        raise BadRequest(
            f"Invalid value for 'Idempotency-Key': it must be 1 to {MAX_ID_LENGTH} characters "
            "without NUL.",
            param="idempotency-key",
        )
    return value


@router.post("/sessions", response_model=CreateSessionResponse)
async def create_session(
    body: CreateSessionRequest,
    _: AdminDep,
    app_state: StateDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> CreateSessionResponse:
    """Open a training session. A repeat of an ``Idempotency-Key`` answers the session that
    key opened, with a new session key (see ``Store.admit_train_session``), or a 409."""
    store, pool, settings = app_state.store, app_state.pool, app_state.settings
    key_name = _idempotency_key(idempotency_key)
    asked: list[AdmissionState] = []  # stays empty when the key's session is answered again

    def decide(state: AdmissionState) -> str | None:
        asked.append(state)
        decision = admit(
            # Failed and dropped sessions never reach training: they must not use up
            # capacity, or the trainer would wait for batches that never fill.
            admitted_so_far=state.admitted,
            open_sessions=state.open,
            # The fleet's version is the store's (a push through another replica counts
            # at once); this replica's pool is never ahead of it but may lag a moment.
            # Both are the session's policy's: an adapter's sessions count against its own.
            version=max(state.version, pool.policy(body.adapter)[0]),
            max_staleness=settings.max_staleness,
            batch_size=settings.train_batch_size,
            max_open_sessions=settings.max_open_sessions,
            joins_admitted_group=state.joins_admitted_group,
        )
        return None if decision.admitted else decision.reason

    key = new_key(SESSION_KEY_PREFIX)
    key_hash = hash_key(key)
    # The store decides under a lock every replica takes; this process's lock only keeps
    # its own creates from each holding a database connection while they wait for it.
    async with app_state.admission_lock:
        try:
            session = await store.admit_train_session(
                decide=decide,
                api_key_hash=key_hash,
                group_id=body.group_id,
                data_id=body.data_id,
                metadata=body.metadata or {},
                adapter=body.adapter,
                idempotency_key=key_name,
            )
        except NotAdmitted as exc:
            raise RateLimited(
                f"Session not admitted: {exc.reason}.",
                retry_after=1.0,
                code="staleness_capacity",
            ) from exc
    if not asked:
        # A repeat: the key it had before is gone from the store; here too.
        app_state.principals.forget_session(session.id)
        response.headers["Idempotent-Replayed"] = "true"
    # Its first turn then reads neither its key nor its history from the store.
    app_state.principals.remember(key_hash, Principal(PrincipalKind.SESSION, session=session))
    app_state.histories.remember(session.id, [])
    note_request(session_id=session.id, policy=body.adapter or "base")
    return CreateSessionResponse(session_id=session.id, api_key=key, base_url=app_state.base_url)


def _session_json(session: SessionRecord) -> dict[str, Any]:
    return {
        "session_id": session.id,
        "kind": session.kind.value,
        "adapter": session.adapter,
        "status": session.status.value,
        "reward": session.reward,
        "group_id": session.group_id,
        "data_id": session.data_id,
        "metadata": session.metadata,
        "created_at": session.created_at.isoformat(),
        "finished_at": session.finished_at.isoformat() if session.finished_at else None,
    }


def _completion_json(c: CompletionRecord) -> dict[str, Any]:
    return {
        "id": c.id,
        "parent_id": c.parent_id,
        "prompt_ids": c.prompt_ids,
        "output_ids": c.output_ids,
        "output_logprobs": c.output_logprobs,
        "output_versions": c.output_versions,
        "finish_reason": c.finish_reason,
        "reward": c.reward,
        "response_text": c.response_text,
        "response_message": c.response_message,
        "request_messages": c.request_messages,
        "sampling": c.sampling,
        "choice_index": c.choice_index,
        "created_at": c.created_at.isoformat(),
        "time_to_first_token": c.time_to_first_token,
        "duration": c.duration,
        "backend": c.backend,
        "adapter": c.adapter,
    }


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, principal: PrincipalDep, store: StoreDep) -> dict[str, Any]:
    session = await _owned_session(store, principal, session_id)
    completions = await store.list_completions(session_id=session.id)
    return {**_session_json(session), "completions": [_completion_json(c) for c in completions]}


@router.post("/sessions/{session_id}/reward")
async def post_reward(
    session_id: str, body: RewardRequest, principal: PrincipalDep, store: StoreDep
) -> dict[str, Any]:
    session = await _owned_session(store, principal, session_id)
    if body.completion_id is None:
        session = await store.set_session_reward(session_id=session.id, reward=body.reward)
    else:
        await store.set_completion_reward(
            session_id=session.id, completion_id=body.completion_id, reward=body.reward
        )
    return _session_json(session)


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str,
    principal: PrincipalDep,
    store: StoreDep,
    principals: PrincipalsDep,
    histories: HistoriesDep,
    body: FinishRequest | None = None,
) -> dict[str, Any]:
    session = await _owned_session(store, principal, session_id)
    status = SessionStatus(body.status) if body else SessionStatus.FINISHED
    session = await store.finish_session(session_id=session.id, status=status)
    principals.forget_session(session.id)
    histories.forget_session(session.id)
    return _session_json(session)
