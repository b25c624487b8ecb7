"""A bad adapter push through a real ``proxima serve`` (embedded engine, ``--enable-lora``)
is a 400 naming the field; nothing is recorded and the tenant keeps serving its version.

Before the screen, an adapter with ``lora_alpha`` NaN (or weights that overflow float32
once scaled) was accepted with 200 and became the tenant's head: every chat of the tenant
was then a 503 ("the backend returned a non-finite logprob"). Here each bad push is
refused, and a chat of the tenant afterwards is a 200 whose tokens all carry version 1,
with finite logprobs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.lora import linear_shapes, write_peft_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TENANT = "tenant-a"
TARGETS = ("q_proj", "v_proj", "down_proj")
Setup = tuple[LiveProxy, Path]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The proxy, with the tenant's good version 1 pushed; the good adapter's directory."""
    work = tmp_path_factory.mktemp("screen")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    good = write_peft_adapter(work / "good", linear_shapes(model, TARGETS), rank=4, alpha=8)
    del model
    proxy = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=work / "serve.log",
        extra_args=["--enable-lora"],
    )
    proxy.start()
    try:
        pushed = _push(proxy, 1, good)
        assert pushed.status_code == 200, pushed.text
        yield proxy, good
    finally:
        proxy.stop()


def _push(proxy: LiveProxy, version: int, path: Path) -> httpx.Response:
    body = {"version": version, "path": str(path), "adapter": TENANT}
    return httpx.post(
        proxy.url + "/admin/weights", json=body, headers=proxy.admin_headers(), timeout=60
    )


def _variant(
    good: Path,
    out: Path,
    config: dict[str, Any] | None = None,
    change: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    out.mkdir()
    merged = {**json.loads((good / "adapter_config.json").read_text()), **(config or {})}
    (out / "adapter_config.json").write_text(json.dumps(merged))  # NaN, Infinity as literals
    tensors = load_file(good / "adapter_model.safetensors")
    if change is not None:
        change(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _first_b(tensors: dict[str, torch.Tensor]) -> str:
    return sorted(k for k in tensors if k.endswith("lora_B.weight"))[0]


def _scaled_overflow(tensors: dict[str, torch.Tensor]) -> None:
    tensors[_first_b(tensors)].view(-1)[0] = 1e36  # x (8000 / 4) = 2e39: inf in float32


def _float64_overflow(tensors: dict[str, torch.Tensor]) -> None:
    key = _first_b(tensors)
    b = tensors[key].double()
    b.view(-1)[0] = 1e39
    tensors[key] = b


CASES: dict[str, tuple[dict[str, Any] | None, Any, str]] = {
    "alpha NaN": ({"lora_alpha": math.nan}, None, "'lora_alpha' must be a finite number"),
    "alpha inf": ({"lora_alpha": math.inf}, None, "'lora_alpha' must be a finite number"),
    "alpha huge": ({"lora_alpha": 1e30}, None, "'lora_alpha' must be a finite number"),
    "r true": ({"r": True}, None, "'r' must be an integer"),
    "overflow once scaled": ({"lora_alpha": 8000}, _scaled_overflow, "overflow torch.float32"),
    "float64 past float32": (None, _float64_overflow, "overflow torch.float32"),
}


def _chat(proxy: LiveProxy, key: str) -> Any:
    client = OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
    return client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_push_is_refused_and_the_tenant_keeps_serving(
    case: str, served: Setup, tmp_path: Path
) -> None:
    proxy, good = served
    config, change, message = CASES[case]
    refused = _push(proxy, 2, _variant(good, tmp_path / "bad", config, change))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "path" and message in error["message"], error
    # Nothing recorded: the tenant's head is still version 1, and version 2 is still free.
    assert httpx.get(proxy.url + "/health", timeout=30).json()["adapters"][TENANT] == 1
    listed = httpx.get(
        proxy.url + f"/admin/versions?adapter={TENANT}", headers=proxy.admin_headers(), timeout=30
    ).json()
    assert [v["version"] for v in listed["versions"]] == [0, 1]
    # The tenant is served, by version 1, with finite logprobs.
    session = proxy.new_session(adapter=TENANT)
    reply = _chat(proxy, session["api_key"])
    assert all(math.isfinite(t.logprob) for t in reply.choices[0].logprobs.content)
    (completion,) = proxy.trajectory(session["session_id"])["completions"]
    assert set(completion["output_versions"]) == {1}
