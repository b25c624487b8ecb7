"""The embedded engine's distributed weight update: SGLang's routes over gloo, with staging.

The engine runs as its own process (torch registers a process group's name once per
process, so the trainer's rank 0, this test, cannot share one with it); the test is the
trainer: it joins the group as rank 0 and broadcasts buckets while ``SGLangClient`` sends
the engine SGLang's calls. Checked: a bucket is staged, not served, until the one carrying
``weight_version`` swaps every tensor in (generation between buckets still has the old
model's logprobs); a sender that goes away mid-push leaves the old weights and version;
SGLang's refusals (no session, an unknown group, a second session, a bad bucket) are 400s
with its messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from engine_helpers import PROMPTS, Reference
from proxima.proxy.backends.errors import BackendOperationFailed
from proxima.proxy.backends.protocol import (
    GenerateRequest,
    InitWeightsUpdateGroupBody,
    SamplingParams,
    UpdateWeightsFromDistributedBody,
)
from proxima.proxy.backends.sglang import SGLangClient
from proxima.proxy.embedded.process_group import (
    FLATTENED_BUCKET,
    TensorSpec,
    destroy_process_group,
    init_custom_process_group,
    send_bucket,
)
from proxima.proxy.embedded.weight_groups import TIMEOUT_ENV
from proxima.proxy.embedded.weights import all_finite
from proxima.proxy.serving import free_port
from proxima.trainer.weight_broadcast import plan_buckets, read_specs
from safetensors import safe_open

from tests.production.procs import BackendProcess

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("engine-groups") / "engine.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TIMEOUT_ENV, str(TIMEOUT_S))  # the engine's rendezvous and receive timeout
        proc = BackendProcess.engine(tiny_model_dir, log_path=log).start()
    yield proc.url
    proc.stop()


@pytest.fixture
async def client(engine: str) -> AsyncIterator[SGLangClient]:
    async with httpx.AsyncClient() as http:
        backend = SGLangClient(engine, http=http)
        yield backend
        backend.close()


async def _join(client: SGLangClient, name: str) -> dist.ProcessGroup:
    """Open ``name`` with the engine as rank 1; this process is rank 0."""
    port = free_port()
    joining = asyncio.ensure_future(
        asyncio.to_thread(
            init_custom_process_group,
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            world_size=2,
            rank=0,
            group_name=name,
            timeout_s=TIMEOUT_S,
        )
    )
    body = InitWeightsUpdateGroupBody(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        group_name=name,
        backend="gloo",
    )
    reply = await client.init_weights_update_group(body, timeout_s=TIMEOUT_S + 5)
    assert reply.success, reply.message
    return await joining


def _buckets(model_dir: Path) -> tuple[list[list[TensorSpec]], dict[str, Path]]:
    specs, files = read_specs(model_dir)
    total = sum(s.nbytes for s in specs)
    buckets = plan_buckets(specs, total // 3)  # several buckets
    assert len(buckets) >= 3
    return buckets, files


def _tensors(bucket: list[TensorSpec], files: dict[str, Path]) -> list[torch.Tensor]:
    out = []
    for spec in bucket:
        with safe_open(str(files[spec.name]), framework="pt", device="cpu") as f:
            out.append(f.get_tensor(spec.name))
    return out


async def _send(
    client: SGLangClient,
    group: dist.ProcessGroup,
    name: str,
    bucket: list[TensorSpec],
    files: dict[str, Path],
    version: str | None,
) -> None:
    body = UpdateWeightsFromDistributedBody(
        names=[s.name for s in bucket],
        dtypes=[s.dtype for s in bucket],
        shapes=[list(s.shape) for s in bucket],
        group_name=name,
        weight_version=version,
        flush_cache=version is not None,
        load_format=FLATTENED_BUCKET,
    )
    relay = asyncio.ensure_future(client.update_weights_from_distributed(body, timeout_s=30))
    await asyncio.to_thread(send_bucket, group, _tensors(bucket, files), FLATTENED_BUCKET)
    assert (await relay).success


async def _greedy_logprobs(client: SGLangClient, prompt_ids: list[int]) -> list[float]:
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    reply = await client.generate(
        GenerateRequest(input_ids=prompt_ids, sampling_params=params, return_logprob=True)
    )
    entries = reply.meta_info.output_token_logprobs or []
    return [float(e[0]) for e in entries]


async def test_buckets_are_staged_until_the_versioned_one_swaps_them_in(
    client: SGLangClient, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    old, new = Reference(tiny_model_dir), Reference(other_model_dir)
    prompt = old.encode(PROMPTS[3])
    _, old_logprobs = old.greedy(prompt, max_new_tokens=12)
    _, new_logprobs = new.greedy(prompt, max_new_tokens=12)
    version = (await client.model_info()).weight_version
    buckets, files = _buckets(other_model_dir)
    group = await _join(client, "staging-test")
    try:
        assert (await client.begin_weight_update()).success
        for bucket in buckets[:-1]:
            await _send(client, group, "staging-test", bucket, files, None)
            # Staged, not served: the old weights and version until the last bucket.
            assert (await client.model_info()).weight_version == version
            assert await _greedy_logprobs(client, prompt) == pytest.approx(old_logprobs, abs=1e-4)
        await _send(client, group, "staging-test", buckets[-1], files, "7")
        assert (await client.end_weight_update()).success
    finally:
        destroy_process_group(group)
    assert (await client.model_info()).weight_version == "7"
    assert await _greedy_logprobs(client, prompt) == pytest.approx(new_logprobs, abs=1e-4)

    # A sender that goes away after the first bucket: nothing of that push is applied.
    buckets, files = _buckets(tiny_model_dir)
    group = await _join(client, "dying-sender")
    assert (await client.begin_weight_update()).success
    await _send(client, group, "dying-sender", buckets[0], files, None)
    body = UpdateWeightsFromDistributedBody(
        names=[s.name for s in buckets[1]],
        dtypes=[s.dtype for s in buckets[1]],
        shapes=[list(s.shape) for s in buckets[1]],
        group_name="dying-sender",
        load_format=FLATTENED_BUCKET,
    )
    relay = asyncio.ensure_future(client.update_weights_from_distributed(body, timeout_s=30))
    await asyncio.sleep(0.3)  # the engine waits in its receive
    destroy_process_group(group)  # the trainer's connections close, as when it dies
    with pytest.raises(BackendOperationFailed, match="Failed to receive weights"):
        await asyncio.wait_for(relay, TIMEOUT_S + 5)
    assert (await client.end_weight_update()).success
    assert (await client.model_info()).weight_version == "7"
    assert await _greedy_logprobs(client, prompt) == pytest.approx(new_logprobs, abs=1e-4)

    # A session ended before its update finished: the staged bucket is discarded.
    group = await _join(client, "unfinished")
    try:
        assert (await client.begin_weight_update()).success
        await _send(client, group, "unfinished", buckets[0], files, None)
        assert (await client.end_weight_update()).success
    finally:
        destroy_process_group(group)
    assert await _greedy_logprobs(client, prompt) == pytest.approx(new_logprobs, abs=1e-4)


async def test_sglangs_refusals(client: SGLangClient) -> None:
    body = UpdateWeightsFromDistributedBody(
        names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]], group_name="none"
    )
    with pytest.raises(BackendOperationFailed, match="must run between begin_weight_update"):
        await client.update_weights_from_distributed(body, timeout_s=10)
    assert (await client.begin_weight_update()).success
    try:
        with pytest.raises(BackendOperationFailed, match="session is already open"):
            await client.begin_weight_update()
        with pytest.raises(BackendOperationFailed, match="Group none not in"):
            await client.update_weights_from_distributed(body, timeout_s=10)
    finally:
        assert (await client.end_weight_update()).success
    with pytest.raises(BackendOperationFailed, match="no weight-update session is open"):
        await client.end_weight_update()
    with pytest.raises(BackendOperationFailed, match="does not exist"):
        await client.destroy_weights_update_group("none")

    # A bucket that does not fit the model is refused after the receive; nothing applies.
    group = await _join(client, "bad-bucket")
    try:
        assert (await client.begin_weight_update()).success
        bad = UpdateWeightsFromDistributedBody(
            names=["model.norm.weight"],
            dtypes=["float32"],
            shapes=[[65]],
            group_name="bad-bucket",
            weight_version="99",
        )
        relay = asyncio.ensure_future(client.update_weights_from_distributed(bad, timeout_s=30))
        await asyncio.to_thread(send_bucket, group, [torch.ones(65)], None)
        with pytest.raises(BackendOperationFailed, match="shape mismatch"):
            await relay
        assert (await client.end_weight_update()).success
    finally:
        destroy_process_group(group)
    assert (await client.model_info()).weight_version != "99"

    # A NaN in a staged bucket: that call answers at once (its values are checked beside
    # the next receive), the call that finishes the update fails, nothing applies.
    group = await _join(client, "nan-bucket")
    calls = [
        ("model.norm.weight", torch.full((64,), float("nan")), None),
        ("model.layers.0.input_layernorm.weight", torch.ones(64), "98"),
    ]
    try:
        assert (await client.begin_weight_update()).success
        for name, tensor, version in calls:
            call = UpdateWeightsFromDistributedBody(
                names=[name],
                dtypes=["float32"],
                shapes=[[64]],
                group_name="nan-bucket",
                weight_version=version,
                flush_cache=version is not None,  # SGLang's default (True) finishes the update
            )
            relay = asyncio.ensure_future(
                client.update_weights_from_distributed(call, timeout_s=30)
            )
            await asyncio.to_thread(send_bucket, group, [tensor], None)
            if version is None:
                assert (await relay).success  # staged
            else:
                with pytest.raises(BackendOperationFailed, match="non-finite values"):
                    await relay
        assert (await client.end_weight_update()).success
    finally:
        destroy_process_group(group)
    assert (await client.model_info()).weight_version != "98"


def test_the_nan_screen_is_exact() -> None:
    """The screen both a disk load and a received bucket go through: a fast sum, exact."""
    assert all_finite(torch.randn(1000))
    assert all_finite(torch.tensor([3e38, 3e38]))  # finite values whose sum overflows
    assert all_finite(torch.tensor([1e300, 1e300], dtype=torch.float64))
    assert all_finite(torch.arange(5))  # integers are always finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert not all_finite(torch.tensor([1.0, bad, 2.0], dtype=dtype)), (bad, dtype)
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # they sum to NaN
