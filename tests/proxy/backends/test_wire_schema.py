"""One SGLang wire schema: strict in the fake, the bench simulator and the engine; seeds arrive."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

_spec = importlib.util.spec_from_file_location(
    "bench_sim", Path(__file__).resolve().parents[3] / "bench" / "_sim.py"
)
assert _spec is not None and _spec.loader is not None
_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sim)

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
BAD_BODIES = [
    # OpenAI's name for SGLang's `sampling_seed`: the engine used to read it, silently.
    ({**GOOD, "sampling_params": {"max_new_tokens": 2, "seed": 3}}, "seed"),
    ({**GOOD, "sampling_params": {"max_new_tokens": 2, "max_tokens": 3}}, "max_tokens"),
    ({**GOOD, "logprobs": True}, "logprobs"),
    ({**GOOD, "sampling_params": {"max_new_tokens": 2, "top_k": 0}}, "top_k"),
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
]


def _apps() -> dict[str, Any]:
    return {
        "http://fake": create_fake_app(FakeBackend()),
        "http://sim": _sim.create_sim_app(_sim.SimGenerator(tokens_per_s=0, max_running=4)),
    }


@pytest.mark.parametrize(("body", "word"), BAD_BODIES)
async def test_fake_and_sim_refuse_unknown_keys_like_sglang(
    body: dict[str, Any], word: str
) -> None:
    apps = _apps()
    async with httpx.AsyncClient(
        mounts={u: httpx.ASGITransport(app=a) for u, a in apps.items()}
    ) as http:
        for url in apps:
            resp = await http.post(url + "/generate", json=body)
            assert resp.status_code == 400, (url, resp.text)
            assert word in resp.json()["error"]
            ok = await http.post(url + "/generate", json=GOOD)
            assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


async def test_fake_refuses_unknown_admin_keys() -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_fake_app()), base_url="http://f"
    ) as http:
        for path, body in [
            ("/abort_request", {"rid": "x", "everything": True}),
            ("/pause_generation", {"mode": "abort", "timeout": 3}),
            ("/update_weights_from_disk", {"model_path": "/w", "version": "2"}),
        ]:
            resp = await http.post(path, json=body)
            assert resp.status_code == 400, (path, resp.text)


async def test_seeded_fake_repeats_itself() -> None:
    body = {**GOOD, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 5}}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_fake_app()), base_url="http://f"
    ) as http:
        a, b = [(await http.post("/generate", json=body)).json()["output_ids"] for _ in range(2)]
        other = {**body, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 6}}
        c = (await http.post("/generate", json=other)).json()["output_ids"]
    assert a == b != c


def test_openai_seed_reaches_the_embedded_engine(live_proxy: LiveProxy) -> None:
    """Same seed, same sampled completion, through the proxy to the engine (temperature 1)."""
    client = OpenAI(base_url=live_proxy.base_url, api_key=live_proxy.new_session()["api_key"])

    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=live_proxy.model_name,
            messages=[{"role": "user", "content": "Tell me anything."}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
        )
        return reply.choices[0].message.content or ""

    first = sample(1234)
    assert sample(1234) == first
    # Unseeded (or differently seeded) samples of 24 tokens at temperature 1 differ.
    assert len({first, sample(1), sample(2), sample(3)}) > 1
