"""Typed async client for SGLang's native HTTP API.

The same client drives a real SGLang server and Proxima's embedded engine,
which serves the same protocol. Endpoint names are SGLang's own. Every call
has an explicit timeout and raises a ``BackendError`` subclass on failure;
admin calls raise on ``success: false``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendOperationFailed,
    BackendRejected,
)
from proxima.proxy.backends.protocol import (
    AbortRequestBody,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    PauseGenerationBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsResponse,
)

# Generation may wait long for its first token (prefill, a paused server):
# reads get a generous limit, connecting does not.
GENERATE_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
ADMIN_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
HEALTH_TIMEOUT = httpx.Timeout(5.0)


@dataclass(slots=True)
class GenerateDelta:
    """New tokens of one ``/generate`` stream chunk, whatever the server's stream mode."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    weight_version: str | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0


def _top_pairs(entry: list[list[Any]] | None) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for lp, t, *_ in entry or []]


class SGLangClient:
    """One backend server, addressed by its base URL (``http://host:port``)."""

    def __init__(self, base_url: str, *, http: httpx.AsyncClient):
        self.base_url = base_url.rstrip("/")
        self._http = http

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    async def _post(self, path: str, body: dict[str, Any] | None, timeout: httpx.Timeout) -> Any:
        try:
            resp = await self._http.post(self.base_url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise BackendConnectionError(f"{path} failed: {exc!r}", url=self.base_url) from exc
        return self._check(resp, path)

    def _check(self, resp: httpx.Response, path: str) -> Any:
        if resp.status_code >= 500:
            raise BackendOperationFailed(
                f"{path} answered {resp.status_code}: {resp.text[:500]}", url=self.base_url
            )
        if resp.status_code >= 400:
            raise BackendRejected(
                _error_message(resp), url=self.base_url, status_code=resp.status_code
            )
        if not resp.content:
            return None
        try:
            return resp.json()
        except json.JSONDecodeError:
            return resp.text

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        body = request.model_copy(update={"stream": False}).model_dump(exclude_none=True)
        data = await self._post("/generate", body, GENERATE_TIMEOUT)
        return GenerateResponse.model_validate(data)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream ``/generate``; yields only the tokens that are new in each chunk.

        SGLang's default chunks are cumulative; with incremental streaming they
        carry deltas. A chunk is cumulative when its ``output_ids`` cover all
        ``completion_tokens`` so far.
        """
        body = request.model_copy(update={"stream": True}).model_dump(exclude_none=True)
        seen = 0
        try:
            async with self._http.stream(
                "POST", self.base_url + "/generate", json=body, timeout=GENERATE_TIMEOUT
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._check(resp, "/generate")
                done = False
                async for line in resp.aiter_lines():
                    if done or not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        # Read the body to its end so the connection goes back to the pool.
                        done = True
                        continue
                    chunk = json.loads(payload)
                    meta = chunk.get("meta_info")
                    if meta is None:
                        raise BackendRejected(
                            _error_text(chunk.get("error", chunk)), url=self.base_url
                        )
                    # Plain dict access, not pydantic: default SGLang chunks are cumulative,
                    # so validating each one would cost O(n^2) over a generation.
                    ids = chunk.get("output_ids") or []
                    cumulative = len(ids) == meta.get("completion_tokens", -1) and len(ids) >= seen
                    start = seen if cumulative else 0
                    new_ids = ids[start:]
                    lps = meta.get("output_token_logprobs") or []
                    new_lps = lps[start:] if cumulative else lps
                    tops = meta.get("output_top_logprobs") or []
                    new_tops = tops[start:] if cumulative else tops
                    seen = len(ids) if cumulative else seen + len(ids)
                    if len(new_lps) != len(new_ids):
                        new_lps = new_lps[-len(new_ids) :] if new_ids else []
                    finish = meta.get("finish_reason")
                    yield GenerateDelta(
                        token_ids=new_ids,
                        logprobs=[float(e[0]) for e in new_lps],
                        top_logprobs=[_top_pairs(e) for e in new_tops],
                        weight_version=meta.get("weight_version"),
                        finish_reason=FinishReason.model_validate(finish) if finish else None,
                        prompt_tokens=meta.get("prompt_tokens", 0),
                    )
        except httpx.HTTPError as exc:
            raise BackendConnectionError(
                f"/generate stream broke: {exc!r}", url=self.base_url
            ) from exc
        if not done:
            # The stream ended without [DONE]: the server went away mid-generation.
            raise BackendConnectionError("/generate stream ended early", url=self.base_url)

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        body = AbortRequestBody(rid=rid, abort_all=abort_all).model_dump()
        await self._post("/abort_request", body, ADMIN_TIMEOUT)

    async def pause_generation(self, *, mode: str = "abort") -> None:
        await self._post(
            "/pause_generation", PauseGenerationBody(mode=mode).model_dump(), ADMIN_TIMEOUT
        )  # type: ignore[arg-type]

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

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", None, ADMIN_TIMEOUT)

    async def health(self) -> bool:
        try:
            resp = await self._http.get(self.base_url + "/health", timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def get_model_info(self) -> dict[str, Any]:
        try:
            resp = await self._http.get(self.base_url + "/get_model_info", timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            raise BackendConnectionError(
                f"/get_model_info failed: {exc!r}", url=self.base_url
            ) from exc
        return self._check(resp, "/get_model_info")


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except json.JSONDecodeError:
        return resp.text[:500] or f"HTTP {resp.status_code}"
    if isinstance(data, dict) and "error" in data:
        return _error_text(data["error"])
    if isinstance(data, dict) and "message" in data:
        return str(data["message"])
    return str(data)[:500]
