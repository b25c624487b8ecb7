"""Pause/continue, weight updates from disk, and the service endpoints."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from engine_helpers import PROMPTS, Reference, generate, logprobs_of
from proxima.proxy.embedded.engine import Engine

LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


async def _wait_running(engine: Engine, count: int = 1) -> None:
    while engine.num_running < count:
        await asyncio.sleep(0.005)


async def test_pause_abort_aborts_running_and_holds_new_requests(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    running = asyncio.create_task(generate(client, text="running", sampling_params=LONG))
    await _wait_running(engine)
    assert (await client.post("/pause_generation", json={})).json()["status"] == "ok"
    aborted = await running
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(aborted["output_ids"]) < 1500

    held = asyncio.create_task(
        generate(client, text="held", sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    )
    done, _ = await asyncio.wait([held], timeout=0.3)
    assert not done
    assert engine.num_waiting == 1
    assert (await client.post("/continue_generation")).status_code == 200
    reply = await held
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_pause_in_place_freezes_and_resumes_running_requests(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    running = asyncio.create_task(generate(client, text="in place", sampling_params=params))
    await _wait_running(engine)
    await client.post("/pause_generation", json={"mode": "in_place"})
    steps = engine.stats.decode_steps
    await asyncio.sleep(0.2)
    assert engine.stats.decode_steps == steps
    assert not running.done()
    await client.post("/continue_generation")
    reply = await running
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


async def test_update_weights_from_disk_changes_version_and_output(
    client: httpx.AsyncClient, other_model_dir: Path
) -> None:
    other = Reference(other_model_dir)
    prompt_ids = other.encode(PROMPTS[0])
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 16},
        "return_logprob": True,
    }
    before = await generate(client, **body)
    response = await client.post(
        "/update_weights_from_disk",
        json={"model_path": str(other_model_dir), "weight_version": "v1"},
    )
    assert response.status_code == 200
    assert response.json() == {
        "success": True,
        "message": response.json()["message"],
        "num_paused_requests": 0,
    }
    assert (await client.get("/model_info")).json()["weight_version"] == "v1"

    after = await generate(client, **body)
    expected_ids, expected_logprobs = other.greedy(prompt_ids, max_new_tokens=16)
    assert after["meta_info"]["weight_version"] == "v1"
    assert after["output_ids"] == expected_ids
    assert logprobs_of(after) == pytest.approx(expected_logprobs, abs=1e-4)  # summation order
    assert logprobs_of(after) != pytest.approx(logprobs_of(before), abs=1e-3)


async def test_running_request_continues_with_new_weights(
    client: httpx.AsyncClient, engine: Engine, other_model_dir: Path
) -> None:
    running = asyncio.create_task(
        generate(client, text="continue", sampling_params={**LONG, "max_new_tokens": 600})
    )
    await _wait_running(engine)
    response = await client.post(
        "/update_weights_from_disk",
        json={"model_path": str(other_model_dir), "weight_version": "7"},
    )
    assert response.json()["success"] is True
    reply = await running
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert reply["meta_info"]["weight_version"] == "7"


def _nan_weights(tiny_model_dir: Path, where: Path) -> Path:
    """The tiny model's weights with one NaN and one inf: shapes and names all fit."""
    from safetensors.torch import load_file, save_file

    where.mkdir()
    tensors = load_file(tiny_model_dir / "model.safetensors")
    name = next(n for n in sorted(tensors) if "mlp" in n)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    tensors[name].view(-1)[1] = float("inf")
    save_file(tensors, where / "model.safetensors")
    return where


async def test_bad_weights_are_rejected_and_old_weights_kept(
    client: httpx.AsyncClient, tmp_path: Path, narrow_model_dir: Path, tiny_model_dir: Path
) -> None:
    body = {
        "text": "hello",
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "return_logprob": True,
    }
    before = await generate(client, **body)
    for path, reason in [
        (tmp_path / "missing", "not a directory"),
        (tmp_path, "no *.safetensors"),
        (narrow_model_dir, "shape mismatch"),
        (_nan_weights(tiny_model_dir, tmp_path / "nan"), "non-finite values"),
    ]:
        response = await client.post(
            "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"}
        )
        assert response.status_code == 400
        assert response.json()["success"] is False
        assert reason in response.json()["message"]
    after = await generate(client, **body)
    assert after["meta_info"]["weight_version"] == "0"
    assert after["output_ids"] == before["output_ids"]
    assert logprobs_of(after) == logprobs_of(before)


async def test_service_endpoints(client: httpx.AsyncClient, tiny_model_dir: Path) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    info = (await client.get("/model_info")).json()
    assert info == {
        "model_path": str(tiny_model_dir),
        "tokenizer_path": str(tiny_model_dir),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "0",
        "max_context_length": 2048,
    }
    assert (await client.post("/flush_cache")).status_code == 200
    assert (await client.get("/flush_cache")).status_code == 200
    server_info = (await client.get("/get_server_info")).json()
    assert server_info["max_running_requests"] == 32
    assert server_info["stats"]["prefills"] == 1  # the health_generate probe


async def test_duplicate_rid_in_flight_is_rejected(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    running = asyncio.create_task(generate(client, text="a", rid="same", sampling_params=LONG))
    await _wait_running(engine)
    response = await client.post("/generate", json={"text": "b", "rid": "same"})
    assert response.status_code == 400
    assert (await client.post("/abort_request", json={"rid": "same"})).status_code == 200
    assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"
    reused = await generate(client, text="c", rid="same", sampling_params={"max_new_tokens": 2})
    assert reused["meta_info"]["id"] == "same"
