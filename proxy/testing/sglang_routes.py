"""SGLang's native HTTP routes over callbacks, with strictly checked bodies.

Shared by the fake SGLang (:mod:`proxima.proxy.testing.fake_sglang`) and the
bench simulator (``bench/_sim.py``): bodies are parsed with the wire schema of
:mod:`proxima.proxy.backends.protocol` and refused with SGLang's 400
``{"error": "..."}`` when they do not fit.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    GenerateRequest,
    LoadLoRAAdapterBody,
    LoRAUpdateResponse,
    ModelCard,
    ModelList,
    PauseGenerationBody,
    UnloadLoRAAdapterBody,
    UpdateWeightsFromDiskBody,
)
from pydantic import BaseModel, ValidationError

Chunk = dict[str, Any]


class RequestRefused(ValueError):
    """Raised by a ``run`` before or between chunks: SGLang's tokenizer manager raises
    ``ValueError`` (an unknown LoRA adapter, say), which its HTTP server answers as 400
    ``{"error": {"message"}}``, or, once a stream has begun, as one error event."""


def _bad_request(exc: ValidationError | json.JSONDecodeError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=400)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        return model.model_validate(json.loads(raw or b"{}"))
    except (ValidationError, json.JSONDecodeError) as exc:
        return _bad_request(exc)


async def generate_response(
    run: Callable[[GenerateRequest], AsyncIterator[Chunk]], request: GenerateRequest
) -> Any:
    """SGLang's ``/generate`` answer for ``run``'s chunks: SSE, or the final chunk as JSON."""
    if request.stream:

        async def events() -> AsyncIterator[bytes]:
            try:
                async for out in run(request):
                    yield b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"
            except RequestRefused as exc:  # http_server.py's stream_results
                error = {
                    "message": str(exc),
                    "type": "invalid_request_error",
                    "code": 400,
                    "retryable": False,
                }
                yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    last: Chunk = {}
    try:
        async for out in run(request):
            last = out
    except RequestRefused as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    return JSONResponse({**last, "output_ids": list(last["output_ids"])})


def sglang_app(
    title: str,
    model_path: str,
    *,
    generate: Callable[[GenerateRequest], Awaitable[Any]],
    abort: Callable[[AbortRequestBody], Awaitable[None]],
    pause: Callable[[str], Awaitable[None]],
    resume: Callable[[], Awaitable[None]],
    update: Callable[[UpdateWeightsFromDiskBody], Awaitable[dict[str, Any]]],
    weight_version: Callable[[], str],
    health: Callable[[], Awaitable[int]] | None = None,
    on_body: Callable[[dict[str, Any]], None] | None = None,
    load_lora: Callable[[LoadLoRAAdapterBody], Awaitable[LoRAUpdateResponse]] | None = None,
    unload_lora: Callable[[UnloadLoRAAdapterBody], Awaitable[LoRAUpdateResponse]] | None = None,
    loaded_loras: Callable[[], dict[str, str]] | None = None,
) -> FastAPI:
    """An app with SGLang's native routes over the given callbacks; bodies are checked strictly.

    ``generate`` gets the parsed ``/generate`` body and returns the response;
    ``abort`` the ``/abort_request`` body; ``pause`` the pause mode;
    ``update`` the weight update body, returning SGLang's reply;
    ``health`` the status of ``/health`` (200 at once when not given);
    ``on_body`` sees every raw ``/generate`` body; ``load_lora`` and
    ``unload_lora`` serve the LoRA calls (without them: SGLang's refusal when
    ``--enable-lora`` is not given); ``loaded_loras`` (name -> path) adds the
    adapters' cards to ``/v1/models``.
    """
    app = FastAPI(title=title)
    _generation_routes(app, generate=generate, abort=abort, on_body=on_body)
    _control_routes(app, pause=pause, resume=resume, update=update, health=health)
    _lora_routes(app, load_lora=load_lora, unload_lora=unload_lora)
    _info_routes(app, model_path, weight_version=weight_version, loaded_loras=loaded_loras)
    return app


def _generation_routes(
    app: FastAPI,
    *,
    generate: Callable[[GenerateRequest], Awaitable[Any]],
    abort: Callable[[AbortRequestBody], Awaitable[None]],
    on_body: Callable[[dict[str, Any]], None] | None,
) -> None:
    """``/generate`` and ``/abort_request``."""

    @app.post("/generate")
    async def generate_route(request: Request) -> Any:
        if on_body is not None:
            with contextlib.suppress(json.JSONDecodeError):
                on_body(json.loads(await request.body()))
        parsed = await _parse(request, GenerateRequest)
        return parsed if isinstance(parsed, Response) else await generate(parsed)

    @app.post("/abort_request")
    async def abort_route(request: Request) -> Any:
        parsed = await _parse(request, AbortRequestBody)
        if isinstance(parsed, Response):
            return parsed
        await abort(parsed)
        return Response(status_code=200)


def _control_routes(
    app: FastAPI,
    *,
    pause: Callable[[str], Awaitable[None]],
    resume: Callable[[], Awaitable[None]],
    update: Callable[[UpdateWeightsFromDiskBody], Awaitable[dict[str, Any]]],
    health: Callable[[], Awaitable[int]] | None,
) -> None:
    """Pause and continue, weight updates from disk, the cache flush and the health checks."""

    @app.post("/pause_generation")
    async def pause_route(request: Request) -> Any:
        parsed = await _parse(request, PauseGenerationBody)
        if isinstance(parsed, Response):
            return parsed
        await pause(parsed.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_route() -> dict[str, Any]:
        await resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_route(request: Request) -> Any:
        parsed = await _parse(request, UpdateWeightsFromDiskBody)
        if isinstance(parsed, Response):
            return parsed
        result = await update(parsed)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> Response:
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/health")
    @app.get("/health_generate")
    async def health_route() -> Response:
        return Response(status_code=200 if health is None else await health())


def _lora_routes(
    app: FastAPI,
    *,
    load_lora: Callable[[LoadLoRAAdapterBody], Awaitable[LoRAUpdateResponse]] | None,
    unload_lora: Callable[[UnloadLoRAAdapterBody], Awaitable[LoRAUpdateResponse]] | None,
) -> None:
    """``/load_lora_adapter`` and ``/unload_lora_adapter`` (SGLang's refusal without LoRA)."""

    @app.post("/load_lora_adapter")
    async def load_lora_route(request: Request) -> Any:
        parsed = await _parse(request, LoadLoRAAdapterBody)
        if isinstance(parsed, Response):
            return parsed
        result = LORA_NOT_ENABLED if load_lora is None else await load_lora(parsed)
        return _lora_reply(result)

    @app.post("/unload_lora_adapter")
    async def unload_lora_route(request: Request) -> Any:
        parsed = await _parse(request, UnloadLoRAAdapterBody)
        if isinstance(parsed, Response):
            return parsed
        result = LORA_NOT_ENABLED if unload_lora is None else await unload_lora(parsed)
        return _lora_reply(result)


def _info_routes(
    app: FastAPI,
    model_path: str,
    *,
    weight_version: Callable[[], str],
    loaded_loras: Callable[[], dict[str, str]] | None,
) -> None:
    """``/v1/models`` (the base and its loaded adapters) and ``/model_info``."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [ModelCard(id=model_path, root=model_path)]
        for name, path in (loaded_loras() if loaded_loras else {}).items():
            cards.append(ModelCard(id=name, root=path, parent=model_path))
        return ModelList(data=cards).model_dump()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def info() -> dict[str, Any]:
        return {"model_path": model_path, "is_generation": True, "weight_version": weight_version()}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        # SGLang's start-up arguments and live state; one worker, as a single-GPU server.
        return {
            "version": "0.5.23",
            "model_path": model_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "weight_version": weight_version(),
        }


LORA_NOT_ENABLED = LoRAUpdateResponse(
    success=False, error_message="LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
)


def _lora_reply(result: LoRAUpdateResponse) -> JSONResponse:
    """SGLang's reply, 400 when it failed."""
    return JSONResponse(result.wire(), status_code=200 if result.success else 400)
