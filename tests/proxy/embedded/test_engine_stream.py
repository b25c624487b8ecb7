"""Streaming and aborts against a live uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from engine_helpers import generate, sse_payloads


async def _read_stream(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[list[str], list[float]]:
    lines: list[str] = []
    arrivals: list[float] = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
                arrivals.append(time.monotonic())
    return lines, arrivals


async def test_stream_chunks_are_cumulative_and_arrive_progressively(live_url: str) -> None:
    body = {
        "text": "Once upon a time",
        "sampling_params": {
            "temperature": 0.8,
            "sampling_seed": 4,
            "max_new_tokens": 64,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    async with httpx.AsyncClient(base_url=live_url, timeout=30) as client:
        lines, arrivals = await _read_stream(client, body)
        final = await generate(client, **body)
    chunks, done = sse_payloads(lines)
    assert done
    assert len(chunks) > 1
    assert arrivals[0] < arrivals[len(chunks) - 1]
    for earlier, later in zip(chunks, chunks[1:], strict=False):
        n = len(earlier["output_ids"])
        assert 0 < n < len(later["output_ids"])
        assert later["output_ids"][:n] == earlier["output_ids"]
        assert (
            later["meta_info"]["output_token_logprobs"][:n]
            == earlier["meta_info"]["output_token_logprobs"]
        )
    for chunk in chunks:
        assert chunk["meta_info"]["completion_tokens"] == len(chunk["output_ids"])
        assert len(chunk["meta_info"]["output_token_logprobs"]) == len(chunk["output_ids"])
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 64}
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["text"] == final["text"]


async def test_abort_by_rid_mid_stream_returns_partial_tokens(live_url: str) -> None:
    body = {
        "text": "hello",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True},
    }
    async with httpx.AsyncClient(base_url=live_url, timeout=30) as client:
        lines: list[str] = []
        async with client.stream("POST", "/generate", json=body) as response:
            lines_iter = response.aiter_lines()
            async for line in lines_iter:
                if line:
                    lines.append(line)
                    break
            aborted = await client.post("/abort_request", json={"rid": "abort-me"})
            assert aborted.status_code == 200
            lines += [line async for line in lines_iter if line]
    chunks, done = sse_payloads(lines)
    assert done
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(last["output_ids"]) < 1500
    assert last["meta_info"]["id"] == "abort-me"


async def test_abort_all_ends_non_streaming_requests(live_url: str) -> None:
    params = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live_url, timeout=30) as client:
        tasks = [
            asyncio.create_task(generate(client, text=f"job {i}", sampling_params=params))
            for i in range(3)
        ]
        while (await client.get("/get_server_info")).json()["num_running_reqs"] < 3:
            await asyncio.sleep(0.01)
        assert (await client.post("/abort_request", json={"abort_all": True})).status_code == 200
        replies = await asyncio.gather(*tasks)
    for reply in replies:
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert 1 <= len(reply["output_ids"]) < 1500


async def test_client_leaving_a_stream_aborts_its_request(live_url: str) -> None:
    body = {
        "text": "bye",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True},
    }
    async with httpx.AsyncClient(base_url=live_url, timeout=30) as client:
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    break
        deadline = time.monotonic() + 10
        while (info := (await client.get("/get_server_info")).json())["num_running_reqs"] > 0:
            assert time.monotonic() < deadline, "the abandoned request kept running"
            await asyncio.sleep(0.02)
    assert info["stats"]["decoded_tokens"] < 1000  # stopped early, not run to max_new_tokens
