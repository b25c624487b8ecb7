"""The HTTP edge of the error tree: every error answered in its path's surface's envelope.

``proxima.proxy.errors`` holds the tree and its status table and knows no surface; this
module, at the edge with the routes and the middleware, picks each path's envelope from the
surface registry (OpenAI's off every surface) and installs the app's exception handlers.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from proxima.proxy.errors import (
    INTERNAL_MESSAGE,
    OPENAI_ENVELOPE,
    ErrorEnvelope,
    ProximaError,
    error_envelope,
    kind_of,
)
from proxima.proxy.store.errors import is_outage, unavailable
from proxima.proxy.surfaces import envelope_for as surface_envelope
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("proxima.proxy.errors")


def envelope_for(path: str) -> ErrorEnvelope:
    """The envelope of the surface that serves ``path`` (OpenAI's off every surface)."""
    return surface_envelope(path) or OPENAI_ENVELOPE


def _answer(
    request: Request,
    status: int,
    envelope: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """``envelope`` (OpenAI's) as the response, in the path's surface's own envelope."""
    body = envelope_for(request.url.path).of_status(status, envelope)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProximaError)
    async def _proxima(request: Request, exc: ProximaError) -> JSONResponse:
        if kind_of(exc).internal:
            logger.error("%s on %s %s: %s", type(exc).__name__, request.method, request.url, exc)
        body = envelope_for(request.url.path).of(exc)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(envelope_for(request.url.path).of_validation(exc), status_code=400)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return _answer(
            request,
            400,
            error_envelope(f"Malformed JSON body: {exc.msg}.", "invalid_request_error"),
        )

    async def _database(request: Request, exc: Exception) -> JSONResponse:
        # A driver error that reached the edge outside the store's transactions: an outage
        # is a 503 like the store's own; anything else is a bug's 500. Answered here, not by
        # the catch-all below, which closes the client's keep-alive connection.
        if is_outage(exc):
            return await _proxima(request, unavailable(exc))
        logger.exception("database error on %s %s", request.method, request.url.path)
        return _answer(request, 500, error_envelope(INTERNAL_MESSAGE, "api_error"))

    app.add_exception_handler(SQLAlchemyError, _database)
    app.add_exception_handler(sqlite3.Error, _database)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug: log it with its traceback, answer in the envelope (never a bare text 500).
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _answer(request, 500, error_envelope(INTERNAL_MESSAGE, "api_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error"
        )
        return _answer(
            request,
            exc.status_code,
            error_envelope(str(exc.detail), kind),
            getattr(exc, "headers", None),
        )
