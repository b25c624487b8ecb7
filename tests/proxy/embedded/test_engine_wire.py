"""The engine reads SGLang's wire schema strictly: unknown keys are a 400, seeds are honoured."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({**GOOD, "sampling_params": {"max_new_tokens": 2, "seed": 3}}, "seed"),
        ({**GOOD, "sampling_params": {"max_new_tokens": 2, "max_tokens": 3}}, "max_tokens"),
        ({**GOOD, "logprobs": True}, "logprobs"),
    ],
)
async def test_engine_refuses_unknown_keys(
    client: httpx.AsyncClient, body: dict[str, Any], word: str
) -> None:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert word in resp.json()["error"]["message"]


async def test_engine_sampling_seed_repeats(client: httpx.AsyncClient) -> None:
    def body(seed: int) -> dict[str, Any]:
        params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
        return {**GOOD, "sampling_params": {**params, "sampling_seed": seed}}

    a, b, c = [
        (await client.post("/generate", json=body(s))).json()["output_ids"] for s in (7, 7, 8)
    ]
    assert a == b != c
