"""Helpers shared by the engine tests: requests, SSE parsing, reference computations."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from proxima.proxy.embedded.app import create_engine_app
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "hello",
    "Once upon a time, in a land far away, there lived",
    "x",
    "0123456789" * 4,
]


async def generate(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    """POST /generate and return the JSON reply (asserting HTTP 200)."""
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def logprobs_of(reply: dict[str, Any]) -> list[float]:
    """The logprobs of ``meta_info.output_token_logprobs``, checking their token ids."""
    entries = reply["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in entries] == reply["output_ids"]
    return [entry[0] for entry in entries]


def sse_payloads(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """Parse SSE ``data:`` lines into JSON chunks; also whether ``[DONE]`` came last."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


@asynccontextmanager
async def serve_in_process(model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client for an engine on ``model_dir``."""
    app = create_engine_app(model_dir, num_threads=1)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://engine", timeout=30
        ) as c:
            yield c


class Reference:
    """The model run directly through transformers, to check the engine against."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(self.tokenizer.encode(text))

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """HF greedy ``generate``: new tokens and their log-softmax (T = 1) logprobs."""
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, len(prompt_ids) :].tolist()
        logprobs = [
            float(torch.log_softmax(step_logits[0], dim=-1)[token])
            for step_logits, token in zip(out.logits, new, strict=False)
        ]
        return new, logprobs

    @torch.no_grad()
    def scored(
        self, prompt_ids: list[int], output_ids: list[int], temperature: float
    ) -> torch.Tensor:
        """``log_softmax(logits / T)`` at ``output_ids`` from one full forward pass. Shape ``(n,)``."""
        full = torch.tensor([prompt_ids + output_ids])
        logits = self.model(full).logits[0, len(prompt_ids) - 1 : -1]  # (n, V)
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1)
