"""``GenerationRoute``: the generation routes' requests handled without FastAPI's machinery.

Every agent turn is one request to ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` or ``/v1/messages``. FastAPI's per-request handler (body
reading through content-type sniffing, dependency solving, telemetry, exit
stacks) cost about 7% of the proxy's CPU per streamed request under load, for
routes whose only needs are a JSON body and the caller.

A ``GenerationRoute`` is declared as any route (FastAPI builds its OpenAPI
schema from the endpoint as usual); only the handler that runs per request
is this module's. It does what FastAPI does for such an endpoint, in the same
order and with the same errors:

1. read the body; a JSON body (``application/json``, ``+json``, or no
   content type) that does not parse, or is nested deeper than Python's parser
   goes (a ``RecursionError``, where FastAPI answers 500), is a
   ``RequestValidationError`` of type ``json_invalid``; a body that cannot be read is a 400, and the body-limit
   middleware's 413 passes through;
2. find the caller (``get_principal``: 401 before any validation of the body);
3. validate the body with the endpoint's model; errors are a
   ``RequestValidationError`` located under ``body``, as FastAPI reports them;
4. call the endpoint with ``(body, request, principal)``.

A body without a content type is JSON only if the route is not strict about
content types (FastAPI's ``strict_content_type``, on by default).

This handler is the only one these routes have: it solves no dependencies, so the
caller and the service come from ``get_principal`` and ``service_of`` whatever
``app.dependency_overrides`` holds (a test swaps them in the ``AppState`` it builds).
"""

from __future__ import annotations

import email.message
import functools
import inspect
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, cast, get_type_hints

from fastapi import FastAPI, Request
from fastapi.datastructures import DefaultPlaceholder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute, APIRouter
from proxima.proxy.api.deps import get_principal
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class GenerationRoute(APIRoute):
    """A route whose endpoint is ``async def f(body: Model, request: Request, principal)``."""

    def get_route_handler(self) -> Handler:
        endpoint = self.endpoint
        names = list(inspect.signature(endpoint).parameters)
        if names != ["body", "request", "principal"]:
            raise TypeError(
                f"{endpoint.__name__}: a GenerationRoute's endpoint takes (body, request, "
                f"principal), not {names}"
            )
        model = get_type_hints(endpoint)["body"]
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{endpoint.__name__}: the body must be a pydantic model")

        strict = self.strict_content_type
        strict = strict.value if isinstance(strict, DefaultPlaceholder) else strict

        async def handler(request: Request) -> Response:
            payload = await _json_body(request, strict_content_type=strict)
            if payload is _EMPTY:
                missing = {"type": "missing", "loc": ("body",), "msg": "Field required"}
                raise RequestValidationError([{**missing, "input": None}])
            principal = await get_principal(request)
            try:
                # from_attributes: FastAPI's own validation mode (and its message for a body
                # that is not an object)
                body = model.model_validate(payload, from_attributes=True)
            except ValidationError as exc:
                errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
                raise RequestValidationError(errors, body=payload) from None
            response: Response = await endpoint(body, request, principal)
            return response

        return handler


_EMPTY = object()


async def _json_body(request: Request, *, strict_content_type: bool) -> Any:
    """The body as FastAPI hands it to a model: parsed JSON, or the raw bytes when the
    content type is not JSON (or, strictly, absent); ``_EMPTY`` without a body."""
    try:
        raw = await request.body()
    except HTTPException:  # the body-limit middleware's 413
        raise
    except Exception as exc:  # the client went away mid-body, a broken chunked body
        raise HTTPException(400, "There was an error parsing the body") from exc
    if not raw:
        return _EMPTY
    content_type = request.headers.get("content-type")
    if not content_type and strict_content_type:
        return raw  # FastAPI's default: a body without a content type is not JSON
    if content_type and not _is_json(content_type):
        return raw  # validated as is: not an object, so a clear 400
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error], body=exc.doc) from exc
    except RecursionError as exc:  # arrays/objects nested deeper than the parser's stack
        error = {
            "type": "json_invalid",
            "loc": ("body",),
            "msg": "JSON nested too deeply",
            "input": {},
            "ctx": {"error": "the JSON is nested too deeply"},
        }
        raise RequestValidationError([error]) from exc
    except UnicodeDecodeError as exc:  # not UTF-8: FastAPI's reading fails the same way
        raise HTTPException(400, "There was an error parsing the body") from exc


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str) -> bool:
    """Whether a content type is JSON as FastAPI tells (``application/json`` or ``+json``);
    parsed once per distinct header value, as clients send the same one on every request."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class GenerationDispatch:
    """The innermost app of the proxy's middleware stack, in the router's place.

    A POST to a generation route's path goes straight to that route's handler; every
    other request (another route, another method, a root path, a route with a body limit
    of its own, a request FastAPI traces: ``--opentelemetry``) to the router. FastAPI's
    router finds a route by trying every included router's candidates, twice (``matches``,
    then ``_handle_selected``), and wraps the handler in a ``Request``, two exit stacks and
    an exception wrapper: about 60 us of CPU per request on the development machine, some
    2% of a 16-token request (``bench/proxy_dispatch.py``; docs/benchmarks.md, "Proxy
    overhead").

    What the router leaves in the scope for a matched route and what the middlewares
    read (``route``: the metrics' and the request log's template, ``endpoint``,
    ``path_params``, ``router``) is set the same way. An exception goes to the
    ``ExceptionMiddleware`` outside, which calls the app's handlers as the router's
    exception wrapper would (the same ones: FastAPI gives both the app's).
    """

    def __init__(self, router: APIRouter):
        self.router = router
        self.routes: dict[str, tuple[GenerationRoute, Handler]] = {}
        for context in _route_contexts(router):
            route = context.original_route
            if (
                isinstance(route, GenerationRoute)
                and context.methods == {"POST"}
                and context.max_body_size is None
                and not context.param_convertors
            ):
                self.routes[context.path_format] = (route, route.get_route_handler())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = (
            self.routes.get(scope["path"])
            if scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and "fastapi.telemetry" not in scope  # --opentelemetry: the router names the span
            else None
        )
        if found is None:
            await self.router(scope, receive, send)
            return
        route, handler = found
        scope.setdefault("router", self.router)
        scope["endpoint"] = route.endpoint
        scope["path_params"] = {}
        scope["route"] = route
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)


def _route_contexts(router: APIRouter) -> Iterator[Any]:
    """Every route ``router`` serves, as FastAPI resolves it (path with its prefixes, methods,
    body limit), through the routers it includes."""
    for route in router.routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is not None:
            yield from contexts()


class GenerationApp(FastAPI):
    """FastAPI whose middleware stack ends in ``GenerationDispatch`` rather than the router:
    the generation routes' requests skip the router's search. Built, as FastAPI builds its
    stack, on the first request, once every router is included."""

    def build_middleware_stack(self) -> ASGIApp:
        router = self.router
        self.router = cast(Any, GenerationDispatch(router))  # what FastAPI's stack wraps
        try:
            return super().build_middleware_stack()
        finally:
            self.router = router
