"""The Completions route: POST /v1/completions (a raw prompt, text or token ids)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from proxima.proxy.api.deps import SESSION_HEADER_DOC, PrincipalDep, service_of, session_id_of
from proxima.proxy.api.disconnect import unless_disconnected
from proxima.proxy.api.event_stream import EventStreamResponse
from proxima.proxy.api.routing import GenerationRoute
from proxima.proxy.surfaces.completions.events import completion_response, completion_stream
from proxima.proxy.surfaces.completions.schema import CompletionRequest
from proxima.proxy.surfaces.completions.translate import completion_request
from proxima.proxy.surfaces.openai_common import session_header

generation = APIRouter(prefix="/v1", tags=["openai"], route_class=GenerationRoute)


@generation.post("/completions", response_model=None, openapi_extra=SESSION_HEADER_DOC)
async def completions(
    body: CompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse | EventStreamResponse:
    service, x_session_id = service_of(request), session_id_of(request)
    service.check_model(body.model)
    prep = await service.prepare(completion_request(body), principal, x_session_id)
    headers = session_header(prep.session)
    model = service.settings.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            completion_stream(prep, service.stream(prep), model=model, include_usage=include_usage),
            headers,
        )
    completion = await unless_disconnected(request, service.complete(prep))
    return JSONResponse(completion_response(prep, completion, model=model), headers=headers)
