"""The loop with ``backend = "megatron"`` (megatron-core on CPU, world size 1) matches torch.

One loop step on the same batch (two copies of one SQLite store) with each
backend. Tolerances: the two compute the same float32 ops in a different
order, and their logprobs agree to ~1e-6 (see test_megatron_backend.py); the
step, two minibatches of it, is held to: loss 1e-4 absolute, gradient norm 1e-3
relative, the PPO statistics (importance weights, approximate KL, clip
fraction) 1e-4 absolute, and the two exported models' logits 1e-2 absolute.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from proxima.proxy.store import SessionStatus, Store, ensure_schema
from proxima.trainer.backends.megatron import MegatronPPOBackend
from proxima.trainer.loop import Trainer
from proxima.trainer.weights import weights_dir
from transformers import AutoModelForCausalLM

from tests.trainer.test_loop import RecordingSink, _cfg, add_batch, statuses

pytestmark = pytest.mark.usefixtures("megatron_process_group")


async def _one_step(
    db: Path, tmp_path: Path, model_dir: Path, backend: str, ids: list[str]
) -> dict:
    store = await Store.open(f"sqlite:///{db}")
    try:
        cfg = _cfg(tmp_path / backend, model_dir, backend=backend, ppo={"ppo_minibatches": 2})
        trainer = await Trainer.start(cfg, store=store, sink=RecordingSink(store), console=False)
        assert isinstance(trainer.backend, MegatronPPOBackend) == (backend == "megatron")
        record = await trainer.step()
        await trainer.close()
        assert record is not None and record.version == 1
        assert await statuses(store, ids) == [(SessionStatus.TRAINED, 1)] * 4
        return {"ppo": record.ppo, "weights": weights_dir(cfg.output_dir, 1)}
    finally:
        await store.close()


async def test_megatron_loop_step_matches_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    await ensure_schema(f"sqlite:///{db}")
    store = await Store.open(f"sqlite:///{db}")
    ids = await add_batch(store, 4)
    await store.close()
    shutil.copyfile(db, tmp_path / "copy.db")

    torch_step = await _one_step(db, tmp_path, tiny_model_dir, "torch", ids)
    megatron_step = await _one_step(tmp_path / "copy.db", tmp_path, tiny_model_dir, "megatron", ids)

    a, b = torch_step["ppo"], megatron_step["ppo"]
    assert a["minibatches"] == b["minibatches"] == 2
    assert a["loss_tokens"] == b["loss_tokens"] == 20
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)  # two implementations
    for key in ("importance_weight_mean", "importance_weight_max", "approx_kl", "clip_fraction"):
        assert b[key] == pytest.approx(a[key], abs=1e-4), key
    # Both exports load in transformers as the same architecture and stay close.
    hf_a = AutoModelForCausalLM.from_pretrained(torch_step["weights"])
    hf_b = AutoModelForCausalLM.from_pretrained(megatron_step["weights"])
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        logits_a, logits_b = hf_a(ids).logits, hf_b(ids).logits
    torch.testing.assert_close(logits_a, logits_b, atol=1e-2, rtol=0)
