"""``GenerationRoute`` answers every request exactly as FastAPI's own handler would.

One endpoint is mounted twice in one app, through ``GenerationRoute`` and
through a plain ``APIRoute``, with the proxy's real error handlers and
principal dependency; each request below (good, malformed, unauthenticated)
must get the same status and the same body from both. The app is a
``GenerationApp``, as the proxy's is: the lean route's requests take
``GenerationDispatch``, past the router, and must still answer the same.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from proxima.proxy.api.deps import PrincipalDep
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.api.routing import GenerationApp, GenerationDispatch, GenerationRoute
from proxima.proxy.config import Settings
from proxima.proxy.surfaces.chat.schema import ChatCompletionRequest
from proxima.proxy.testing.app_state import NoKeys, install_test_state

ADMIN = "admin-token"


async def endpoint(
    body: ChatCompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse:
    return JSONResponse(
        {"model": body.model, "messages": len(body.messages), "who": principal.kind.value}
    )


def make_app(model_dir: Path) -> FastAPI:
    app = GenerationApp()
    install_error_handlers(app)
    lean = APIRouter(route_class=GenerationRoute)
    lean.post("/lean")(endpoint)
    plain = APIRouter(route_class=APIRoute)
    plain.post("/plain")(endpoint)
    app.include_router(lean)
    app.include_router(plain)
    install_test_state(app, settings=Settings(model=model_dir, admin_token=ADMIN), store=NoKeys())
    return app


GOOD = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
JSON = {"content-type": "application/json"}

CASES = {
    "good": (GOOD, JSON, ADMIN),
    "good, +json content type": (GOOD, {"content-type": "application/vnd.x+json"}, ADMIN),
    "good, charset": (GOOD, {"content-type": "application/json; charset=utf-8"}, ADMIN),
    "no content type": (GOOD, {}, ADMIN),
    "text/plain": (GOOD, {"content-type": "text/plain"}, ADMIN),
    "empty body": (b"", JSON, ADMIN),
    "not JSON": (b'{"model": "m", "messages": [', JSON, ADMIN),
    "not UTF-8": (b'{"model": "\xff\xfe"}', JSON, ADMIN),
    "a JSON list": (b"[1, 2]", JSON, ADMIN),
    "missing field": (b'{"model": "m"}', JSON, ADMIN),
    "messages not a list": (b'{"model": "m", "messages": 5}', JSON, ADMIN),
    "wrong type": (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        JSON,
        ADMIN,
    ),
    "lone surrogate": (
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        JSON,
        ADMIN,
    ),
    "bad key, good body": (GOOD, JSON, "sk-wrong"),
    "bad key, invalid body": (b'{"model": "m"}', JSON, "sk-wrong"),
    "bad key, not JSON": (b"{", JSON, "sk-wrong"),
    "no key": (GOOD, JSON, None),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_lean_handler_answers_as_fastapi_does(case: str, tiny_model_dir: Path) -> None:
    body, headers, token = CASES[case]
    if token is not None:
        headers = {**headers, "authorization": f"Bearer {token}"}
    transport = httpx.ASGITransport(app=make_app(tiny_model_dir))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        lean = await client.post("/lean", content=body, headers=headers)
        plain = await client.post("/plain", content=body, headers=headers)
    assert (lean.status_code, lean.json()) == (plain.status_code, plain.json())
    if case.startswith("good"):
        assert lean.status_code == 200
    else:
        assert lean.status_code >= 400


def test_an_endpoint_of_another_shape_is_refused() -> None:
    async def other(request: Request, body: ChatCompletionRequest) -> JSONResponse:
        raise AssertionError("never called")

    router = APIRouter(route_class=GenerationRoute)
    with pytest.raises(TypeError, match=r"takes \(body, request, principal\)"):
        router.post("/x")(other)


async def where(
    body: ChatCompletionRequest, request: Request, principal: PrincipalDep
) -> JSONResponse:
    """What the router leaves in the scope for the middlewares, as the endpoint sees it."""
    scope = request.scope
    return JSONResponse(
        {
            "route": scope["route"].path,
            "endpoint": scope["endpoint"].__name__,
            "path_params": scope["path_params"],
            "router": scope["router"] is request.app.router,
            "dispatched": scope.get("fastapi_inner_astack") is None,  # the router's handler sets it
        }
    )


def dispatch_app(model_dir: Path) -> FastAPI:
    app = GenerationApp()
    install_error_handlers(app)
    lean = APIRouter(prefix="/v1", route_class=GenerationRoute)
    lean.post("/where")(where)
    lean.post("/items/{item}")(where)  # a path parameter: the router's
    app.include_router(lean)
    install_test_state(app, settings=Settings(model=model_dir, admin_token=ADMIN), store=NoKeys())
    return app


async def test_the_dispatch_takes_only_a_generation_routes_posts(tiny_model_dir: Path) -> None:
    app = dispatch_app(tiny_model_dir)
    headers = {**JSON, "authorization": f"Bearer {ADMIN}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        direct = await client.post("/v1/where", content=GOOD, headers=headers)
        routed = await client.post("/v1/items/7", content=GOOD, headers=headers)
        wrong_method = await client.get("/v1/where", headers=headers)
        missing = await client.post("/v1/nowhere", content=GOOD, headers=headers)
    assert direct.json() == {
        "route": "/v1/where",
        "endpoint": "where",
        "path_params": {},
        "router": True,
        "dispatched": True,
    }
    assert routed.json() == {
        "route": "/v1/items/{item}",
        "endpoint": "where",
        "path_params": {"item": "7"},
        "router": True,
        "dispatched": False,
    }
    assert wrong_method.status_code == 405  # the router's answer, as before
    assert missing.status_code == 404
    stack = app.middleware_stack
    while not isinstance(stack, GenerationDispatch):
        stack = stack.app  # type: ignore[union-attr]
    assert set(stack.routes) == {"/v1/where"}
