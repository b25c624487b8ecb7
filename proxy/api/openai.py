"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Each route translates its body into a canonical request
(``openai_translate``), has the service prepare and run it, and hands the
result to its response builder (``proxima.proxy.service.builders``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from proxima.proxy.api import openai_translate as translate
from proxima.proxy.api.deps import (
    SESSION_HEADER_DOC,
    PrincipalDep,
    SettingsDep,
    service_of,
    session_id_of,
)
from proxima.proxy.api.disconnect import unless_disconnected
from proxima.proxy.api.event_stream import EventStreamResponse
from proxima.proxy.api.routing import GenerationRoute
from proxima.proxy.api.schemas import ChatCompletionRequest, CompletionRequest
from proxima.proxy.config import Settings
from proxima.proxy.errors import BadRequest, NotFound
from proxima.proxy.service.builders.chat import chat_response, chat_stream
from proxima.proxy.service.builders.completions import completion_response, completion_stream
from proxima.proxy.store.records import SessionRecord
from proxima.proxy.unicode import InvalidString

router = APIRouter(prefix="/v1", tags=["openai"])
generation = APIRouter(prefix="/v1", tags=["openai"], route_class=GenerationRoute)


def _session_header(session: SessionRecord | None) -> dict[str, str]:
    """Recorded requests name their session, so production traffic can be rewarded later."""
    return {"X-Proxima-Session-Id": session.id} if session is not None else {}


@generation.post("/chat/completions", response_model=None, openapi_extra=SESSION_HEADER_DOC)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse | EventStreamResponse:
    service, x_session_id = service_of(request), session_id_of(request)
    service.check_model(body.model)
    try:
        body.check_openai_tool_names()
    except InvalidString as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    prep = await service.prepare(translate.chat_request(body), principal, x_session_id)
    headers = _session_header(prep.session)
    model = service.settings.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            chat_stream(
                prep,
                service.stream(prep),
                model=model,
                policy_version=service.version_of(prep),
                include_usage=include_usage,
            ),
            headers,
        )
    completion = await unless_disconnected(request, service.complete(prep))
    return JSONResponse(chat_response(prep, completion, model=model), headers=headers)


@generation.post("/completions", response_model=None, openapi_extra=SESSION_HEADER_DOC)
async def completions(
    body: CompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse | EventStreamResponse:
    service, x_session_id = service_of(request), session_id_of(request)
    service.check_model(body.model)
    prep = await service.prepare(translate.completion_request(body), principal, x_session_id)
    headers = _session_header(prep.session)
    model = service.settings.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            completion_stream(prep, service.stream(prep), model=model, include_usage=include_usage),
            headers,
        )
    completion = await unless_disconnected(request, service.complete(prep))
    return JSONResponse(completion_response(prep, completion, model=model), headers=headers)


def _model_card(settings: Settings) -> dict[str, Any]:
    return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "proxima"}


@router.get("/models")
async def list_models(_: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(settings)]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, _: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    """The served model's card (the SDK's ``models.retrieve``); 404 for any other id."""
    if model_id != settings.model_name:
        raise NotFound(
            f"The model '{model_id}' does not exist; this server serves '{settings.model_name}'.",
            param="model",
            code="model_not_found",
        )
    return _model_card(settings)
