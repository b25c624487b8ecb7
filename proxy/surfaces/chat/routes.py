"""The Chat Completions route: POST /v1/chat/completions.

It validates the body (``schema``), translates it into a canonical request
(``translate``), has the service prepare and run it, and hands the result to
``events`` (a ``chat.completion`` or its chunk stream).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from proxima.proxy.api.deps import SESSION_HEADER_DOC, PrincipalDep, service_of, session_id_of
from proxima.proxy.api.disconnect import unless_disconnected
from proxima.proxy.api.event_stream import EventStreamResponse
from proxima.proxy.api.routing import GenerationRoute
from proxima.proxy.surfaces.chat import translate
from proxima.proxy.surfaces.chat.events import chat_response, chat_stream
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.surfaces.openai_common import session_header

generation = APIRouter(prefix="/v1", tags=["openai"], route_class=GenerationRoute)


@generation.post("/chat/completions", response_model=None, openapi_extra=SESSION_HEADER_DOC)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse | EventStreamResponse:
    service, x_session_id = service_of(request), session_id_of(request)
    service.check_model(body.model)
    prep = await service.prepare(translate.chat_request(body), principal, x_session_id)
    headers = session_header(prep.session)
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
