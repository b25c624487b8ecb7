"""Every ``/generate`` body the proxy sends passes SGLang 0.5.23's own JSON contract.

SGLang's HTTP server refuses a ``/generate`` body with 400 when its generated
decoder (``sglang/api/v1/api_types.py``, ``GenerateRequest.from_json_value``,
called by ``entrypoints/api_contract.py``) rejects it; ``sampling_params``
rejects unknown keys there. That module needs only ``msgspec``, so it is
loaded from the installed wheel (``pip install --no-deps sglang==0.5.23``)
by file path: importing the ``sglang`` package itself would pull its GPU
stack (its ``__init__`` imports ``sglang.srt.utils``, which needs pybase64,
zmq and more).

The proxy runs in front of the fake SGLang (incremental streaming), which
records every body and aborts requests every few tokens (so resumed bodies are
checked too).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest
from openai import OpenAI
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

SGLANG_VERSION = "0.5.23"


def _sglang_api_types() -> ModuleType:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, (
        f"install SGLang's wheel: pip install --no-deps sglang=={SGLANG_VERSION}"
    )
    from importlib.metadata import version

    assert version("sglang") == SGLANG_VERSION
    path = Path(next(iter(spec.submodule_search_locations))) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


API = _sglang_api_types()


def test_sglang_contract_is_the_real_one() -> None:
    """The loaded decoder refuses what real SGLang refuses (the proxy's old bug among them)."""
    good = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}
    API.GenerateRequest.from_json_value(good)
    with pytest.raises(API.JsonContractError, match="unknown field `seed`"):
        API.GenerateRequest.from_json_value(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "seed": 1}}
        )


@pytest.fixture(scope="module")
def recording_proxy(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveProxy, FakeBackend]]:
    # Incremental chunks, as compose launches SGLang (cumulative: test_backends, production).
    fake = FakeBackend(
        tokens_per_s=500,
        chunk_tokens=2,
        incremental=True,
        record_bodies=True,
        abort_at=frozenset(range(0, 4096, 9)),
    )
    work = tmp_path_factory.mktemp("contract")
    with ThreadedServer(create_fake_app(fake)) as server:
        proxy = LiveProxy(
            tiny_model_dir,
            db_url=f"sqlite:///{work / 'store.db'}",
            log_path=work / "serve.log",
            extra_args=["--backend", server.url],
        )
        proxy.start()
        try:
            yield proxy, fake
        finally:
            proxy.stop()


def _requests(client: OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    common: dict[str, Any] = {"model": model, "max_tokens": 20}
    for stream in (False, True):
        for extra in (
            {},
            {"seed": 7, "temperature": 0.8, "top_p": 0.9},
            {"stop": ["zz", "\n\n"]},
            {"logprobs": True, "top_logprobs": 3, "temperature": 0.0},
            {"frequency_penalty": 0.5, "presence_penalty": 0.2},
            {"response_format": {"type": "json_object"}},
        ):
            reply = client.chat.completions.create(
                messages=messages, stream=stream, **common, **extra
            )
            if stream:
                list(reply)  # type: ignore[arg-type]
        for extra in ({}, {"seed": 3, "stop": "x", "logprobs": 2}):
            reply = client.completions.create(prompt="Once", stream=stream, **common, **extra)
            if stream:
                list(reply)  # type: ignore[arg-type]


def test_every_body_the_proxy_sends_passes_sglangs_contract(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    proxy, fake = recording_proxy
    client = OpenAI(base_url=proxy.base_url, api_key=proxy.new_session()["api_key"], max_retries=0)
    _requests(client, proxy.model_name)
    bodies = list(fake.bodies)
    resumed = [b for b in bodies if len(b["input_ids"]) % 9 == 0]
    assert len(bodies) > 16 and resumed, "every kind of body (16 requests), resumed ones too"
    seen_keys: set[str] = set()
    for body in bodies:
        parsed = API.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
        assert parsed.input_ids == body["input_ids"]
        seen_keys |= set(body["sampling_params"])
    # The interesting fields did reach the wire (and passed).
    assert {"sampling_seed", "stop", "frequency_penalty", "presence_penalty"} <= seen_keys
    assert seen_keys & {"json_schema", "regex", "ebnf", "structural_tag"}
    assert any(b.get("top_logprobs_num") == 3 for b in bodies)


def test_scheduler_error_in_the_stream_is_an_openai_400(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    """A prompt over SGLang's input limit: ``finish_reason.status_code`` 400, not a resume."""
    proxy, fake = recording_proxy
    session = proxy.new_session()
    client = OpenAI(base_url=proxy.base_url, api_key=session["api_key"], max_retries=0)
    fake.max_input_tokens = 5
    requests_before = fake.requests
    try:
        messages: Any = [{"role": "user", "content": "A prompt longer than five tokens."}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=proxy.model_name, messages=messages, max_tokens=8)
        assert caught.value.status_code == 400
        assert caught.value.code == "context_length_exceeded"
        assert "exceeds the maximum allowed length" in caught.value.message
        # Streamed: the stream has begun, so the error arrives as its error event.
        with pytest.raises(openai.APIError, match="exceeds the maximum allowed length"):
            list(
                client.chat.completions.create(
                    model=proxy.model_name, messages=messages, max_tokens=8, stream=True
                )
            )
    finally:
        fake.max_input_tokens = None
    assert fake.requests - requests_before == 2  # one backend request each: never resumed
    assert proxy.trajectory(session["session_id"])["completions"] == []


def test_a_null_sampled_logprob_is_refused_and_never_stored(
    recording_proxy: tuple[LiveProxy, FakeBackend],
) -> None:
    proxy, fake = recording_proxy
    session = proxy.new_session()
    client = OpenAI(base_url=proxy.base_url, api_key=session["api_key"], max_retries=0)
    fake.null_logprob_at = frozenset({2})  # NaN or -inf for the third token: JSON null
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model=proxy.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
            )
    finally:
        fake.null_logprob_at = frozenset()
    assert caught.value.status_code == 503
    assert "non-finite logprob" in caught.value.message
    assert proxy.trajectory(session["session_id"])["completions"] == []
