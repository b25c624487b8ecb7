"""Typed async client for SGLang's native HTTP API.

The same client drives a real SGLang server and Proxima's embedded engine,
which serves the same protocol. Endpoint names are SGLang's own. Every call
has an explicit timeout and raises a ``BackendError`` subclass on failure;
admin calls raise on ``success: false``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx
import orjson
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendOperationFailed,
    BackendRejected,
)
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    BeginWeightUpdateBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupBody,
    LoadLoRAAdapterBody,
    LoRAUpdateResponse,
    ModelInfo,
    ModelList,
    PauseGenerationBody,
    UnloadLoRAAdapterBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsResponse,
    WeightSyncResponse,
)
from proxima.proxy.backends.stream_chunks import (
    LOGPROB_FLOOR,
    ChunkReader,
    NonFiniteLogprob,
    TokenDelta,
    error_text,
)
from proxima.proxy.backends.wire import WirePool

__all__ = ["LOGPROB_FLOOR", "NonFiniteLogprob", "SGLangClient", "TokenDelta"]

# Generation may wait long for its first token (prefill, a paused server):
# reads get a generous limit, connecting does not.
GENERATE_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
ADMIN_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
# Longer than SGLang's own health timeout (20 s): a slow probe is not a failed one.
HEALTH_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=5.0, pool=5.0)
# Idle admin connections are dropped after this long, before the server's own keep-alive
# timeout closes them (uvicorn's default, and SGLang's unless ``SGLANG_TIMEOUT_KEEP_ALIVE``
# says otherwise, is 5 s; httpx's own default is also 5 s). At equal timeouts a request
# sent on an idle connection races the server's close and fails without a response: a
# health probe every 5 s failed about once in a hundred and took a live backend out.
ADMIN_KEEPALIVE_S = 2.0


class SGLangClient:
    """One backend server, addressed by its base URL (``http://host:port``).

    Generation (``/generate``) goes through a lean keep-alive client
    (:mod:`proxima.proxy.backends.wire`); admin calls go through ``http``.
    """

    def __init__(self, base_url: str, *, http: httpx.AsyncClient):
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._wire = WirePool(
            self.base_url,
            connect_timeout=GENERATE_TIMEOUT.connect or 5.0,
            read_timeout=GENERATE_TIMEOUT.read or 600.0,
            write_timeout=GENERATE_TIMEOUT.write or 30.0,
            pool_timeout=GENERATE_TIMEOUT.pool or 30.0,
        )

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    def close(self) -> None:
        """Close the idle generation connections."""
        self._wire.close()

    async def _get(self, path: str, timeout: httpx.Timeout) -> httpx.Response:
        """An idempotent GET, sent once more on a new connection when the first one was
        dropped without a response (a server that closed it while idle, whatever its
        keep-alive timeout); a timeout is not retried."""
        for attempt in (1, 2):
            try:
                return await self._http.get(self.base_url + path, timeout=timeout)
            except httpx.HTTPError as exc:
                dropped = isinstance(exc, httpx.TransportError) and not isinstance(
                    exc, httpx.TimeoutException
                )
                if attempt == 2 or not dropped:
                    raise BackendConnectionError(
                        f"{path} failed: {exc!r}", url=self.base_url
                    ) from exc
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: dict[str, Any] | None, timeout: httpx.Timeout) -> Any:
        try:
            resp = await self._http.post(self.base_url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise BackendConnectionError(f"{path} failed: {exc!r}", url=self.base_url) from exc
        return self._check(resp.status_code, resp.content, path)

    def _check(self, status: int, content: bytes, path: str) -> Any:
        if status >= 500:
            text = content.decode("utf-8", "replace")
            raise BackendOperationFailed(
                f"{path} answered {status}: {text[:500]}", url=self.base_url
            )
        if status >= 400:
            raise BackendRejected(
                _error_message(status, content), url=self.base_url, backend_status=status
            )
        if not content:
            return None
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            return content.decode("utf-8", "replace")

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        body = orjson.dumps(request.wire(stream=False))
        async with await self._wire.post("/generate", body) as resp:
            content = await resp.read()
        return GenerateResponse.model_validate(self._check(resp.status, content, "/generate"))

    async def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[TokenDelta]:
        """Stream ``/generate``; yields only the tokens that are new in each chunk.

        SGLang's default chunks are cumulative; with incremental streaming they
        carry deltas, except the abort of a queued request, which repeats the
        last token (``output_ids=[last]``) and all logprobs. Every chunk's
        ``completion_tokens`` is the running total, so the new tokens are the
        last ``completion_tokens - seen`` of its lists in every mode.

        Chunks that arrived together (the proxy fell behind the backend) are
        yielded as one delta, so everything downstream runs once for them, not
        once per token; only chunks of the same weight version are merged, so
        every token keeps the version that generated it. A read's chunks are found
        and checked by whole-read operations (``stream_chunks.ChunkReader``).

        Leaving the iteration early (``aclose``, a cancelled task) closes the
        connection, which tells the server the client went away.
        """
        body = orjson.dumps(request.wire(stream=True))
        chunks = ChunkReader(self.base_url)
        async with await self._wire.post("/generate", body) as resp:
            if resp.status >= 400:
                self._check(resp.status, await resp.read(), "/generate")
            # Read the body to its end (past [DONE]) so the connection goes back to the pool;
            # the read loop is this generator's own (a generator layer less per read).
            stream = resp.data_stream()
            try:
                while True:
                    fields = stream.take()
                    if fields:
                        for delta in chunks.read(fields):
                            yield delta
                        if chunks.failure is not None:  # an error chunk, after its tokens
                            raise chunks.failure
                    if stream.ended:
                        break
                    waiter = stream.waiter()
                    if waiter is not None:
                        await waiter
            finally:
                stream.close()
        if not chunks.done:
            # The stream ended without [DONE]: the server went away mid-generation.
            raise BackendConnectionError("/generate stream ended early", url=self.base_url)

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        body = AbortRequestBody(rid=rid, abort_all=abort_all).model_dump()
        await self._post("/abort_request", body, ADMIN_TIMEOUT)

    async def pause_generation(self, *, mode: str = "abort") -> None:
        await self._post(
            "/pause_generation", PauseGenerationBody(mode=mode).model_dump(), ADMIN_TIMEOUT
        )

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {}, ADMIN_TIMEOUT)

    async def update_weights_from_disk(
        self, *, model_path: str, weight_version: str, abort_all_requests: bool = True
    ) -> UpdateWeightsResponse:
        body = UpdateWeightsFromDiskBody(
            model_path=model_path,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
        ).model_dump(exclude_none=True)
        result = UpdateWeightsResponse.model_validate(
            await self._post("/update_weights_from_disk", body, ADMIN_TIMEOUT)
        )
        if not result.success:
            raise BackendOperationFailed(
                f"update_weights_from_disk({model_path}) failed: {result.message}",
                url=self.base_url,
            )
        return result

    async def _weight_sync(
        self, path: str, body: dict[str, Any], timeout: httpx.Timeout
    ) -> WeightSyncResponse:
        """One call of the weight-group family: SGLang answers 400 with ``{success: false,
        message}`` when it failed (raised as ``BackendOperationFailed`` with the message)."""
        try:
            resp = await self._http.post(self.base_url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise BackendConnectionError(f"{path} failed: {exc!r}", url=self.base_url) from exc
        if resp.status_code == 400:
            try:
                result = WeightSyncResponse.model_validate_json(resp.content)
            except ValueError:
                result = None  # a refused body: {"error": ...}
            if result is not None and not result.success:
                raise BackendOperationFailed(f"{path} failed: {result.message}", url=self.base_url)
        return WeightSyncResponse.model_validate(self._check(resp.status_code, resp.content, path))

    async def init_weights_update_group(
        self, body: InitWeightsUpdateGroupBody, *, timeout_s: float
    ) -> WeightSyncResponse:
        """Join the server's workers to the trainer's process group; answers once every
        rank joined (or the server's own rendezvous timed out). ``timeout_s`` bounds the
        wait here."""
        timeout = httpx.Timeout(connect=5.0, read=timeout_s, write=30.0, pool=30.0)
        return await self._weight_sync("/init_weights_update_group", body.model_dump(), timeout)

    async def destroy_weights_update_group(self, group_name: str) -> WeightSyncResponse:
        body = DestroyWeightsUpdateGroupBody(group_name=group_name).model_dump()
        return await self._weight_sync("/destroy_weights_update_group", body, ADMIN_TIMEOUT)

    async def begin_weight_update(self) -> WeightSyncResponse:
        """Open the session ``update_weights_from_distributed`` runs in."""
        body = BeginWeightUpdateBody().model_dump()
        return await self._weight_sync("/begin_weight_update", body, ADMIN_TIMEOUT)

    async def end_weight_update(self) -> WeightSyncResponse:
        body = EndWeightUpdateBody().model_dump()
        return await self._weight_sync("/end_weight_update", body, ADMIN_TIMEOUT)

    async def update_weights_from_distributed(
        self, body: UpdateWeightsFromDistributedBody, *, timeout_s: float
    ) -> WeightSyncResponse:
        """Receive one bucket by broadcast from rank 0 and load it; answers once it arrived
        (``timeout_s`` bounds the wait here)."""
        timeout = httpx.Timeout(connect=5.0, read=timeout_s, write=30.0, pool=30.0)
        wire = body.model_dump(exclude_none=True)
        return await self._weight_sync("/update_weights_from_distributed", wire, timeout)

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info``: the start-up configuration (``tp_size``, ``dp_size``,
        ``pp_size``...) and live state (SGLang's ``/get_server_info`` is its deprecated alias)."""
        resp = await self._get("/server_info", ADMIN_TIMEOUT)
        info = self._check(resp.status_code, resp.content, "/server_info")
        if not isinstance(info, dict):
            raise BackendOperationFailed("/server_info is not a JSON object", url=self.base_url)
        return info

    async def _lora_update(self, path: str, body: dict[str, Any]) -> LoRAUpdateResponse:
        """SGLang answers 400 with the reply body when ``success`` is false: read it either way."""
        try:
            resp = await self._http.post(self.base_url + path, json=body, timeout=ADMIN_TIMEOUT)
        except httpx.HTTPError as exc:
            raise BackendConnectionError(f"{path} failed: {exc!r}", url=self.base_url) from exc
        if resp.status_code == 400:
            try:
                result = LoRAUpdateResponse.model_validate_json(resp.content)
            except ValueError:
                result = None  # a refused body: SGLang's {"error": ...}
            if result is not None and not result.success:
                raise BackendOperationFailed(
                    f"{path} {body['lora_name']!r} failed: {result.error_message}",
                    url=self.base_url,
                )
        return LoRAUpdateResponse.model_validate(self._check(resp.status_code, resp.content, path))

    async def load_lora_adapter(
        self, name: str, path: str, *, pinned: bool = False
    ) -> LoRAUpdateResponse:
        """Load the peft adapter directory ``path`` under ``name`` (``lora_path`` of later
        requests). Raises ``BackendOperationFailed`` on ``success: false`` (a name already
        loaded, LoRA not enabled, a bad adapter): ask :meth:`loaded_lora_adapters` for the
        backend's own view before retrying."""
        body = LoadLoRAAdapterBody(lora_name=name, lora_path=path, pinned=pinned).model_dump()
        return await self._lora_update("/load_lora_adapter", body)

    async def unload_lora_adapter(self, name: str) -> LoRAUpdateResponse:
        """Unload ``name``. The backend stops giving it to new requests at once but answers
        only when the requests running with it have finished: abort them first (the pool
        resumes them on the new version). Raises ``BackendOperationFailed`` for a name
        not loaded."""
        body = UnloadLoRAAdapterBody(lora_name=name).model_dump()
        return await self._lora_update("/unload_lora_adapter", body)

    async def loaded_lora_adapters(self) -> set[str]:
        """The names of the adapters loaded now (SGLang lists them in ``GET /v1/models``,
        the cards with a ``parent``); empty when LoRA is not enabled."""
        resp = await self._get("/v1/models", ADMIN_TIMEOUT)
        models = ModelList.model_validate(self._check(resp.status_code, resp.content, "/v1/models"))
        return {card.id for card in models.data if card.parent is not None}

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", None, ADMIN_TIMEOUT)

    async def health(self) -> bool:
        """SGLang's ``GET /health``: a one-token generation, so it answers only when the
        scheduler does. It blocks while generation is paused and answers 503 itself
        after 20 s (``HEALTH_CHECK_TIMEOUT``), so our timeout is longer: SGLang's
        verdict decides, not our timer (see ``BackendPool.check_health``)."""
        try:
            resp = await self._get("/health", HEALTH_TIMEOUT)
        except BackendConnectionError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> ModelInfo:
        """``GET /model_info`` (SGLang's ``/get_model_info`` is deprecated)."""
        resp = await self._get("/model_info", ADMIN_TIMEOUT)
        return ModelInfo.model_validate(self._check(resp.status_code, resp.content, "/model_info"))


def _error_message(status: int, content: bytes) -> str:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    if isinstance(data, dict) and "error" in data:
        return error_text(data["error"])
    if isinstance(data, dict) and "message" in data:
        return str(data["message"])
    return str(data)[:500]
