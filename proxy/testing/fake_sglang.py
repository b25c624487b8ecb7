"""A fast SGLang-protocol backend with a timing model instead of a model.

It speaks the same native API as SGLang and the embedded engine (``/generate``
streaming and not, with cumulative chunks; ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``,
``/health``, ``/get_model_info``, ``/flush_cache``), so the proxy's code path
is exercised unchanged. Tokens are drawn from a seeded RNG; each request
decodes at ``tokens_per_s`` (0 = as fast as possible). Used by benchmarks and
load tests where a real model would measure the model, not the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class FakeBackend:
    def __init__(
        self,
        *,
        vocab_size: int = 256,
        tokens_per_s: float = 0.0,
        eos_id: int | None = None,
        chunk_tokens: int = 1,
        seed: int = 0,
    ):
        self.vocab_size = vocab_size
        self.tokens_per_s = tokens_per_s
        self.eos_id = eos_id
        self.chunk_tokens = max(1, chunk_tokens)
        self.weight_version = "0"
        self.rng = random.Random(seed)
        self.paused = asyncio.Event()
        self.paused.set()  # set = running
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.generated_tokens = 0
        self.requests = 0

    def _finish(self, kind: str, n: int) -> dict[str, Any]:
        if kind == "length":
            return {"type": "length", "length": n}
        if kind == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": self.eos_id}

    async def run(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await self.paused.wait()
        rid = body.get("rid") or f"fake-{self.rng.getrandbits(48):x}"
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        prompt_len = len(body.get("input_ids") or [])
        ids: list[int] = []
        lps: list[list[Any]] = []
        self.running.add(rid)
        self.requests += 1
        finish = None
        try:
            while finish is None:
                step = min(self.chunk_tokens, max_new - len(ids))
                for _ in range(step):
                    ids.append(self.rng.randrange(self.vocab_size))
                    lps.append([-self.rng.random() * 3.0, ids[-1], None])
                self.generated_tokens += step
                if rid in self.aborted:
                    finish = self._finish("abort", len(ids))
                elif len(ids) >= max_new:
                    finish = self._finish("length", len(ids))
                yield {
                    "text": "",
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid,
                        "finish_reason": finish,
                        "prompt_tokens": prompt_len,
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "weight_version": self.weight_version,
                        "output_token_logprobs": lps,
                    },
                }
                if self.tokens_per_s > 0:
                    await asyncio.sleep(step / self.tokens_per_s)
                elif finish is None:
                    await asyncio.sleep(0)
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)


async def generate_response(
    run: Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]], body: dict[str, Any]
) -> Any:
    """SGLang's ``/generate`` answer for ``run``'s cumulative outputs: SSE or one final JSON."""
    if body.get("stream"):

        async def events() -> AsyncIterator[bytes]:
            async for out in run(body):
                yield b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    last: dict[str, Any] = {}
    async for out in run(body):
        last = out
    return JSONResponse({**last, "output_ids": list(last["output_ids"])})


def sglang_app(
    title: str,
    model_path: str,
    *,
    generate: Callable[[dict[str, Any]], Awaitable[Any]],
    abort: Callable[[dict[str, Any]], Awaitable[None]],
    pause: Callable[[], Awaitable[None]],
    resume: Callable[[], Awaitable[None]],
    update: Callable[[str], Awaitable[None]],
    weight_version: Callable[[], str],
) -> FastAPI:
    """An app with SGLang's native routes over the given callbacks.

    ``generate`` gets the ``/generate`` body and returns the response;
    ``abort`` the ``/abort_request`` body (``rid`` or ``abort_all``);
    ``update`` the new weight version (the current one when the body names none).
    """
    app = FastAPI(title=title)

    @app.post("/generate")
    async def generate_route(request: Request) -> Any:
        return await generate(json.loads(await request.body()))

    @app.post("/abort_request")
    async def abort_route(request: Request) -> dict[str, Any]:
        await abort(json.loads(await request.body() or b"{}"))
        return {}

    @app.post("/pause_generation")
    async def pause_route() -> dict[str, Any]:
        await pause()
        return {}

    @app.post("/continue_generation")
    async def continue_route() -> dict[str, Any]:
        await resume()
        return {}

    @app.post("/update_weights_from_disk")
    async def update_route(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        await update(str(body.get("weight_version") or weight_version()))
        return {"success": True, "message": "ok", "num_paused_requests": 0}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> dict[str, Any]:
        return {}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    @app.get("/get_model_info")
    async def info() -> dict[str, Any]:
        return {"model_path": model_path, "is_generation": True, "weight_version": weight_version()}

    return app


def create_fake_app(backend: FakeBackend | None = None) -> FastAPI:
    fake = backend or FakeBackend()

    async def abort(body: dict[str, Any]) -> None:
        fake.aborted |= set(fake.running) if body.get("abort_all") else {body.get("rid", "")}

    async def pause() -> None:
        fake.paused.clear()
        fake.aborted |= set(fake.running)

    async def resume() -> None:
        fake.paused.set()

    async def update(version: str) -> None:
        fake.weight_version = version

    app = sglang_app(
        "fake sglang",
        "fake",
        generate=lambda body: generate_response(fake.run, body),
        abort=abort,
        pause=pause,
        resume=resume,
        update=update,
        weight_version=lambda: fake.weight_version,
    )
    app.state.fake = fake
    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="fake SGLang-protocol backend (timing model)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tokens-per-s", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=1)
    args = p.parse_args()
    backend = FakeBackend(
        vocab_size=args.vocab_size, tokens_per_s=args.tokens_per_s, chunk_tokens=args.chunk_tokens
    )
    uvicorn.run(
        create_fake_app(backend),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
