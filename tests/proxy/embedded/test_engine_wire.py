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


def test_non_finite_logprobs_are_written_as_null_like_sglang() -> None:
    """JSON has no NaN or inf: the engine writes them as null, as SGLang's orjson does."""
    import json

    from proxima.proxy.embedded.engine import GenerationState
    from proxima.proxy.embedded.payloads import generate_payload

    class Decoder:
        def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
            return "x" * len(ids)

    state = GenerationState(
        rid="r",
        prompt_tokens=2,
        output_ids=(5, 6, 7),
        output_logprobs=(-0.5, float("nan"), float("-inf")),
        output_top_logprobs=(((-0.5, 5), (float("-inf"), 9)), ((float("nan"), 6),), ((-1.0, 7),)),
        finish_reason=None,
        weight_version="0",
    )
    payload = generate_payload(Decoder(), state, return_logprob=True, skip_special_tokens=True)  # type: ignore[arg-type]
    text = json.dumps(payload, allow_nan=False)  # would raise on NaN/inf
    meta = json.loads(text)["meta_info"]
    assert [e[0] for e in meta["output_token_logprobs"]] == [-0.5, None, None]
    assert meta["output_top_logprobs"][0] == [[-0.5, 5, None], [None, 9, None]]
