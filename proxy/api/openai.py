"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse, StreamingResponse
from proxima.proxy.api.deps import PrincipalDep, ServiceDep, SettingsDep
from proxima.proxy.api.schemas import ChatCompletionRequest, CompletionRequest
from proxima.proxy.store.records import SessionRecord

router = APIRouter(prefix="/v1", tags=["openai"])

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _session_header(session: SessionRecord | None) -> dict[str, str]:
    """Recorded requests name their session, so production traffic can be rewarded later."""
    return {"X-Proxima-Session-Id": session.id} if session is not None else {}


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    principal: PrincipalDep,
    service: ServiceDep,
    x_session_id: Annotated[str | None, Header()] = None,
) -> JSONResponse | StreamingResponse:
    prep = await service.prepare_chat(body, principal, x_session_id)
    headers = _session_header(prep.session)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            service.chat_stream(prep, body.n, body.logprobs, include_usage),
            media_type="text/event-stream",
            headers={**_SSE_HEADERS, **headers},
        )
    return JSONResponse(await service.chat(prep, body.n, body.logprobs), headers=headers)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest,
    principal: PrincipalDep,
    service: ServiceDep,
    x_session_id: Annotated[str | None, Header()] = None,
) -> JSONResponse | StreamingResponse:
    prep = await service.prepare_text(body, principal, x_session_id)
    headers = _session_header(prep.session)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            service.complete_stream(prep, body.n, include_usage),
            media_type="text/event-stream",
            headers={**_SSE_HEADERS, **headers},
        )
    return JSONResponse(
        await service.complete(prep, body.n, body.logprobs is not None), headers=headers
    )


@router.get("/models")
async def list_models(_: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "proxima"}
        ],
    }
