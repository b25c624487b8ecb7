"""``proxima trainer`` with the megatron backend under torchrun: 2 ranks on CPU (gloo).

Rank 0 claims the batch from a live proxy's store and broadcasts the samples.
With tensor parallel 2 both ranks run the proximal logprobs and the PPO step
on their half of the model and the export gathers both shards; with tensor
parallel 1 (data parallel 2) each rank holds the whole model and runs its
share of the micro-batches, and the gradients are summed. Rank 0 pushes
version 1 and logs the whole step.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from proxima.proxy.serving import free_port
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.testing.live import LiveProxy
from proxima.trainer.log import read_log
from proxima.trainer.weights import latest_checkpoint, weights_dir
from transformers import AutoModelForCausalLM


def run_session(proxy: LiveProxy, *, reward: float) -> str:
    """One agent run: a chat completion through the SDK, then reward and finish it."""
    session = proxy.new_session(group_id="g0")
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    sid, key = session["session_id"], {"Authorization": f"Bearer {session['api_key']}"}
    httpx.post(
        f"{proxy.url}/rl/sessions/{sid}/reward", json={"reward": reward}, headers=key
    ).raise_for_status()
    httpx.post(f"{proxy.url}/rl/sessions/{sid}/finish", headers=key).raise_for_status()
    return sid


async def session_states(db_url: str, ids: list[str]) -> list[tuple[SessionStatus, int | None]]:
    store = await Store.open(db_url)
    try:
        states = []
        for sid in ids:
            session = await store.get_session(session_id=sid)
            assert session is not None
            states.append((session.status, session.trained_version))
        return states
    finally:
        await store.close()


@pytest.mark.parametrize("tensor_parallel", [2, 1], ids=["tp2", "tp1-dp2"])
def test_two_ranks_under_torchrun_train_and_push(
    proxy: LiveProxy, tmp_path: Path, tensor_parallel: int
) -> None:
    ids = [run_session(proxy, reward=float(i)) for i in range(2)]
    output_dir = tmp_path / "trainer"
    config = tmp_path / "trainer.toml"
    config.write_text(
        'backend = "megatron"\nbatch_size = 2\ncheckpoint_every = 1\n'
        f'output_dir = "{output_dir}"\n'
        "[optim]\nlr = 1e-3\n"
        f"[megatron]\ntensor_parallel = {tensor_parallel}\n"
        '[loop]\npoll_interval_s = 0.1\ntrainer_id = "tp-trainer"\n'
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "proxima.cli", "--log-level", "warning", "trainer",
        "--config", str(config), "--proxy", proxy.url, "--db", proxy.db_url,
        "--model", str(proxy.model_dir), "--admin-token", proxy.admin_token,
        "--max-steps", "1", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    assert int(httpx.get(proxy.url + "/health").json()["version"]) == 1
    states = asyncio.run(session_states(proxy.db_url, ids))
    assert states == [(SessionStatus.TRAINED, 1)] * 2
    pushed = weights_dir(output_dir, 1)
    model = AutoModelForCausalLM.from_pretrained(pushed)
    initial = AutoModelForCausalLM.from_pretrained(proxy.model_dir)
    # The full (gathered) model was written, and the step changed it.
    assert model.state_dict().keys() == initial.state_dict().keys()
    changed = [
        k for k, v in model.state_dict().items() if not torch.equal(v, initial.state_dict()[k])
    ]
    assert changed
    # Rank 0 logged the whole step (every replica's micro-batches), not its own share.
    (record,) = [r for r in read_log(output_dir) if r.get("event") == "step"]
    assert record["ppo"]["loss_tokens"] == record["loss_tokens"] > 0
    data_parallel = 2 // tensor_parallel
    assert record["ppo"]["micro_batches"] == data_parallel  # the two samples fit in one
    # The checkpoint holds one copy of each tensor-parallel shard (gathered on rank 0).
    checkpoint = latest_checkpoint(output_dir)
    assert checkpoint is not None and checkpoint.state.version == 1
    ranks = checkpoint.load_tensors()["ranks"]
    assert len(ranks) == tensor_parallel
    assert all(r["model"] and r["optimizer"]["state"] for r in ranks)
    vocab = [r["model"]["embedding.word_embeddings.weight"].shape[0] for r in ranks]
    assert len(set(vocab)) == 1 and tensor_parallel * vocab[0] >= initial.config.vocab_size
