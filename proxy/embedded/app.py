"""The engine's HTTP server: SGLang's native API over :class:`~proxy.embedded.engine.Engine`.

The lifespan loads the model (off the event loop) and starts the worker
thread; routes receive the engine through :data:`EngineDep`, and the weight-update groups
of a broadcast push (``proxima.proxy.embedded.weight_groups``) through :data:`GroupsDep`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    BeginWeightUpdateBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    GenerateRequest,
    InitWeightsUpdateGroupBody,
    LoadLoRAAdapterBody,
    LoRAUpdateResponse,
    ModelCard,
    ModelInfo,
    ModelList,
    PauseGenerationBody,
    SamplingParams,
    StatusResponse,
    UnloadLoRAAdapterBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    WeightSyncResponse,
)
from proxima.proxy.embedded.engine import (
    Engine,
    EngineUnavailableError,
    InvalidRequestError,
    RequestHandle,
)
from proxima.proxy.embedded.parent_watch import exit_with_parent
from proxima.proxy.embedded.payloads import generate_payload
from proxima.proxy.embedded.weight_groups import WeightGroups

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


def get_engine(request: Request) -> Engine:
    """The engine the lifespan built."""
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(get_engine)]


def get_weight_groups(request: Request) -> WeightGroups:
    """The engine's weight-update groups the lifespan built."""
    groups: WeightGroups = request.app.state.weight_groups
    return groups


GroupsDep = Annotated[WeightGroups, Depends(get_weight_groups)]

router = APIRouter(tags=["engine"])


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, engine: EngineDep) -> dict[str, Any] | StreamingResponse:
    """Generate for one prompt; SSE with cumulative chunks when ``stream`` is set."""
    prompt_ids = body.input_ids if body.input_ids is not None else engine.encode(body.text or "")
    await engine.compile_grammar(body.sampling_params)  # off the event loop; submit hits the cache
    adapter = None
    if body.lora_path:
        # Resolved last: nothing awaits between here and submit, so no unload slips between.
        try:
            adapter = await engine.resolve_adapter(body.lora_path)
        except InvalidRequestError as exc:
            if not body.stream:
                raise
            # SGLang's stream answers a refused request with one error event (HTTP 200).
            return StreamingResponse(_sse_error(str(exc)), media_type="text/event-stream")
    handle = engine.submit(
        prompt_ids,
        body.sampling_params,
        rid=body.rid,
        top_logprobs_num=body.top_logprobs_num,
        stream=body.stream,
        adapter=adapter,
    )
    if body.stream:
        return StreamingResponse(_sse_chunks(engine, handle, body), media_type="text/event-stream")
    try:
        state = await handle.result()
    finally:
        if not handle.finished:  # the handler was cancelled (client gone)
            engine.request_abort(handle.rid)
    return generate_payload(
        engine,
        state,
        return_logprob=body.return_logprob,
        skip_special_tokens=body.sampling_params.skip_special_tokens,
    )


async def _sse_error(message: str) -> AsyncIterator[str]:
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"


async def _sse_chunks(
    engine: Engine, handle: RequestHandle, body: GenerateRequest
) -> AsyncIterator[str]:
    try:
        async for state in handle.updates():
            payload = generate_payload(
                engine,
                state,
                return_logprob=body.return_logprob,
                skip_special_tokens=body.sampling_params.skip_special_tokens,
            )
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not handle.finished:  # the client went away mid-stream
            engine.request_abort(handle.rid)


@router.post("/abort_request")
async def abort_request(body: AbortRequestBody, engine: EngineDep) -> Response:
    """Abort one request by rid, or all; they finish with ``abort`` and their partial tokens."""
    aborted = await engine.abort(body.rid or None, abort_all=body.abort_all)
    logger.info("abort_request rid=%r abort_all=%s aborted=%d", body.rid, body.abort_all, aborted)
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(body: PauseGenerationBody, engine: EngineDep) -> StatusResponse:
    """Hold new and queued requests until ``/continue_generation``."""
    aborted = await engine.pause(body.mode)
    logger.info("generation paused (mode=%s, aborted=%d)", body.mode, aborted)
    return StatusResponse(message="Generation paused successfully.")


@router.post("/continue_generation")
async def continue_generation(engine: EngineDep) -> StatusResponse:
    """Release the requests held by ``/pause_generation``."""
    await engine.resume()
    logger.info("generation continued")
    return StatusResponse(message="Generation continued successfully.")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskBody, engine: EngineDep
) -> JSONResponse:
    """Load new weights between decode steps; HTTP 400 with ``success: false`` on failure."""
    result = await engine.update_weights_from_disk(
        body.model_path,
        weight_version=body.weight_version,
        abort_all_requests=body.abort_all_requests,
        load_format=body.load_format,
    )
    return JSONResponse(result.model_dump(), status_code=200 if result.success else 400)


def _sync_reply(result: WeightSyncResponse) -> JSONResponse:
    return JSONResponse(result.model_dump(), status_code=200 if result.success else 400)


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    body: InitWeightsUpdateGroupBody, groups: GroupsDep
) -> JSONResponse:
    """Join the trainer's process group as rank ``rank_offset``; answers once all ranks
    joined, 400 with ``success: false`` when the rendezvous failed or timed out."""
    return _sync_reply(await groups.init_group(body))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupBody, groups: GroupsDep
) -> JSONResponse:
    """Leave a weight-update group (400 for a group this engine is not in)."""
    return _sync_reply(await groups.destroy_group(body.group_name))


@router.post("/begin_weight_update")
async def begin_weight_update(_: BeginWeightUpdateBody, groups: GroupsDep) -> JSONResponse:
    """Open the session the bucket updates run in (400 if one is open)."""
    return _sync_reply(await groups.begin())


@router.post("/end_weight_update")
async def end_weight_update(_: EndWeightUpdateBody, groups: GroupsDep) -> JSONResponse:
    """Close the session (400 if none is open)."""
    return _sync_reply(await groups.end())


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedBody, groups: GroupsDep
) -> JSONResponse:
    """Receive one bucket by broadcast from rank 0 into the staging area; the bucket that
    carries ``weight_version`` swaps every staged tensor in. 400 with ``success: false``
    when the receive or the checks failed (the old weights stay)."""
    return _sync_reply(await groups.update(body))


def _lora_reply(result: LoRAUpdateResponse) -> JSONResponse:
    return JSONResponse(result.wire(), status_code=200 if result.success else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterBody, engine: EngineDep) -> JSONResponse:
    """Load a peft adapter directory under a name, without pausing generation; HTTP 400
    with ``success: false`` on failure (SGLang's reply)."""
    return _lora_reply(await engine.load_lora_adapter(body.lora_name, body.lora_path))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterBody, engine: EngineDep) -> JSONResponse:
    """Unload an adapter; answers once the requests running with it have finished."""
    return _lora_reply(await engine.unload_lora_adapter(body.lora_name))


@router.get("/v1/models")
async def models(engine: EngineDep) -> ModelList:
    """The base model, then one card per loaded LoRA adapter (``parent``: the base)."""
    base = engine.model_path
    cards = [ModelCard(id=base, root=base, max_model_len=engine.context_length)]
    for name, path in engine.loaded_lora_adapters().items():
        cards.append(ModelCard(id=name, root=path, parent=base))
    return ModelList(data=cards)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache() -> PlainTextResponse:
    """Nothing to flush: the engine keeps no prefix cache across requests."""
    return PlainTextResponse("Cache flushed.\n")


@router.get("/health")
async def health(engine: EngineDep) -> Response:
    """200 while the worker thread runs."""
    return Response(status_code=200 if engine.is_alive else 503)


@router.get("/health_generate")
async def health_generate(engine: EngineDep) -> Response:
    """200 when the engine can generate one token (or is paused with a live worker)."""
    if not engine.is_alive:
        return Response(status_code=503)
    if engine.paused:
        return Response(status_code=200)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    handle = engine.submit([0], params)
    try:
        await asyncio.wait_for(handle.result(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        engine.request_abort(handle.rid)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(engine: EngineDep) -> ModelInfo:
    """Model and tokenizer paths, weight version and context length (``/get_model_info``:
    SGLang's deprecated alias)."""
    return ModelInfo(
        model_path=engine.model_path,
        tokenizer_path=engine.model_path,
        weight_version=engine.weight_version,
        max_context_length=engine.context_length,
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(engine: EngineDep, groups: GroupsDep) -> dict[str, Any]:
    """A minimal server description and load (``/get_server_info``: SGLang's deprecated
    alias). One worker: SGLang's ``tp_size``, ``dp_size`` and ``pp_size`` are 1, so the
    engine takes one rank of a weight-update group. ``last_weight_update``: where the last
    broadcast push's time went on this engine (``WeightGroups.last_update``), or null."""
    return {
        "version": "proxima-engine",
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "context_length": engine.context_length,
        "max_running_requests": engine.max_running_requests,
        "weight_version": engine.weight_version,
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_waiting,
        "stats": dataclasses.asdict(engine.stats),
        "last_weight_update": groups.last_update,
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid_request(_: Request, exc: Exception) -> JSONResponse:
        return _error(400, str(exc))

    async def invalid_body(_: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        return _error(503, str(exc))

    app.add_exception_handler(InvalidRequestError, invalid_request)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(EngineUnavailableError, unavailable)


def create_engine_app(
    model_dir: str | Path,
    *,
    weight_version: str = "0",
    max_running_requests: int = 32,
    max_prefill_tokens: int = 4096,
    num_threads: int | None = None,
    enable_lora: bool = False,
    max_loras_per_batch: int = 8,
    max_lora_rank: int | None = None,
) -> FastAPI:
    """The engine as a FastAPI app; its lifespan loads the model and runs the worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await asyncio.to_thread(
            Engine,
            model_dir,
            weight_version=weight_version,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            num_threads=num_threads,
            enable_lora=enable_lora,
            max_loras_per_batch=max_loras_per_batch,
            max_lora_rank=max_lora_rank,
        )
        engine.start()
        app.state.engine = engine
        app.state.weight_groups = WeightGroups(engine.model, engine.apply_weights)
        try:
            yield
        finally:
            await app.state.weight_groups.close()
            await engine.stop()

    app = FastAPI(title="Proxima engine (SGLang native API)", lifespan=lifespan)
    app.include_router(router)
    _install_error_handlers(app)
    return app


def run_engine(
    model_dir: str | Path, host: str = "127.0.0.1", port: int = 30000, **kwargs: Any
) -> None:
    """Serve the engine with uvicorn until interrupted (``proxima engine``).

    ``kwargs`` go to :func:`create_engine_app` (``weight_version``,
    ``max_running_requests``, ``max_prefill_tokens``, ``num_threads``,
    ``enable_lora``, ``max_loras_per_batch``, ``max_lora_rank``).
    Started by ``proxima serve``, it exits when that process dies.
    """
    exit_with_parent()
    uvicorn.run(
        create_engine_app(model_dir, **kwargs),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
    )
