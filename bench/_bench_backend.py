"""The benchmark's backend: the fake SGLang server plus an OpenAI-compatible chat route.

``/generate`` is the fake SGLang server of ``proxima.proxy.testing.fake_sglang``
(incremental streaming, as SGLang is launched for Proxima). ``/v1/chat/completions``
streams the same fake tokens as OpenAI chunks, so a generic gateway (LiteLLM) can be
measured in front of the same backend doing the same work per token.

    python bench/_bench_backend.py --port 30000
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import Request
from fastapi.responses import StreamingResponse
from proxima.proxy.backends.protocol import GenerateRequest, SamplingParams
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

PROMPT_IDS = list(range(20))


def create_bench_app(fake: FakeBackend) -> Any:
    app = create_fake_app(fake)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        req = GenerateRequest(
            input_ids=PROMPT_IDS,
            sampling_params=SamplingParams(
                max_new_tokens=int(body.get("max_tokens") or 16), ignore_eos=True
            ),
            stream=True,
        )
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]

        async def events() -> AsyncIterator[bytes]:
            async for out in fake.run(req, stream=True):
                finish = out["meta_info"]["finish_reason"]
                chunk = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": "x" * len(out["output_ids"])},
                            "finish_reason": finish and "length",
                        }
                    ],
                }
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=250)
    p.add_argument(
        "--script",
        default="",
        help="comma-separated token ids: the token at sequence position p is script[p %% len] "
        "(printable text for benches whose replies go back into the conversation)",
    )
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=0.0,
        help="each request's decode rate (0: as fast as possible); a rate the proxy keeps up "
        "with sends every token in a read of its own, as a GPU's decode steps do",
    )
    args = p.parse_args()
    script = [int(t) for t in args.script.split(",")] if args.script else None
    fake = FakeBackend(
        vocab_size=args.vocab_size,
        chunk_tokens=1,
        incremental=True,
        script=script,
        tokens_per_s=args.tokens_per_s,
    )
    uvicorn.run(
        create_bench_app(fake),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        # As `proxima serve`: clients keep connections between the arms, and uvicorn's 5 s
        # default would close them under a client about to reuse one (a ReadError).
        timeout_keep_alive=75,
    )


if __name__ == "__main__":
    main()
