"""LoRA backend: a step on one adapter's batch moves that adapter only; logprobs and loss equal
those of the merged model; the pushed files are peft's; a checkpoint restores every adapter."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from proxima.trainer.backends.base import ppo_loss_fn
from proxima.trainer.backends.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraBackend
from proxima.trainer.batching import pack, unpack
from proxima.trainer.config import (
    BatchingConfig,
    LoraConfig,
    OptimConfig,
    PPOConfig,
    TrainerConfig,
)
from proxima.trainer.logprobs import forward_logprobs, use_varlen_attention
from proxima.trainer.samples import Sample
from pydantic import ValidationError
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM

from tests.trainer.test_torch_backend import _samples

ADAPTERS = ("tenant-a", "tenant-b")
PPO = PPOConfig(eps_clip=0.5, eps_clip_high=5.0)


def _backend(model_dir: Path, **lora: object) -> LoraBackend:
    options: dict = {"adapters": ADAPTERS, "rank": 4, "alpha": 8.0, **lora}
    return LoraBackend(
        model_dir,
        lora=LoraConfig(**options),
        ppo=PPO,
        batching=BatchingConfig(max_tokens_per_mb=256),
        optim=OptimConfig(lr=2e-2, grad_clip=1.0),
    )


def _with_prox(backend: LoraBackend, adapter: str, samples: list[Sample]) -> list[Sample]:
    prox = backend.policy(adapter).compute_logprobs(samples)
    return [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(samples, prox, strict=True)]


def _train(backend: LoraBackend, adapter: str, steps: int = 2, seed: int = 0) -> None:
    batch = _with_prox(backend, adapter, _samples(seed=seed))
    for _ in range(steps):
        backend.policy(adapter).train_step(batch)


def _snapshot(backend: LoraBackend) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def test_a_step_on_adapter_a_moves_a_alone(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    _train(backend, "tenant-b", seed=1)  # B is no longer the zero-initialised identity
    # Nor A: with lora_B = 0 (peft's init) lora_A's gradient is exactly 0 at A's first step.
    _train(backend, "tenant-a", steps=1, seed=2)
    names = {id(p): n for n, p in backend.model.named_parameters()}
    seen: list[dict[str, Tensor | None]] = []

    def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
        del optimizer
        seen.append({names[id(p)]: p.grad for p in backend.model.parameters()})

    backend.optimizers["tenant-a"].register_step_pre_hook(record)
    before = _snapshot(backend)
    _train(backend, "tenant-a", steps=1)

    a_names = {names[id(p)] for p in backend.adapter_parameters("tenant-a")}
    b_names = {names[id(p)] for p in backend.adapter_parameters("tenant-b")}
    base_names = {n for n, _ in backend.base_parameters()}
    # rank 4 on q/k/v/o of the tiny model's 2 layers: lora_A and lora_B of 8 modules each.
    assert len(a_names) == len(b_names) == 16 and not a_names & b_names
    assert base_names and not base_names & (a_names | b_names)
    assert set(before) == a_names | b_names | base_names
    (grads,) = seen  # A's optimizer stepped once, on these gradients
    for name, p in backend.model.named_parameters():
        if name in a_names:
            assert p.requires_grad and grads[name] is not None, name
        else:  # the frozen base and adapter B: outside the graph, no gradient at all
            assert not p.requires_grad and grads[name] is None, name
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in a_names)
    after = _snapshot(backend)
    for name in base_names | b_names:
        assert torch.equal(after[name], before[name]), name
    assert all(not torch.equal(after[n], before[n]) for n in a_names)
    # No state for B's parameters in A's optimizer, and B's optimizer did not step.
    b_ids = {id(p) for p in backend.adapter_parameters("tenant-b")}
    assert not b_ids & {id(p) for p in backend.optimizers["tenant-a"].state}


def _merged(tiny_model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_varlen_attention(base)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def test_logprobs_and_loss_with_an_adapter_equal_the_merged_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = _backend(tiny_model_dir)
    _train(backend, "tenant-a", steps=3)
    _train(backend, "tenant-b", steps=3, seed=1)
    policy = backend.policy("tenant-a")
    policy.export_hf(tmp_path)
    merged = _merged(tiny_model_dir, tmp_path)
    samples = _with_prox(backend, "tenant-b", _samples(seed=2))  # prox of another policy
    packed = pack(samples)
    with torch.no_grad():
        got = torch.tensor([x for values in policy.compute_logprobs(samples) for x in values])
        backend.model.eval()
        backend._activate("tenant-a")
        with_adapter = forward_logprobs(backend.model, packed, loss_tokens_only=True)  # (T,)
        expected = forward_logprobs(merged, packed, loss_tokens_only=True)  # (T,)
    mask = packed.loss_mask > 0
    # The adapter moved the logprobs (the comparison is not base against base)...
    with torch.no_grad(), backend.model.disable_adapter():
        base = forward_logprobs(backend.model, packed, loss_tokens_only=True)
    assert (base - expected)[mask].abs().max() > 1e-2
    # ... and W x + s B A x against (W + s B A) x differ by float32 rounding: |logprob| ~5,
    # noise ~1e-6, bounded at 1e-4 on any CPU.
    merged_by_sample = torch.tensor([x for values in unpack(packed, expected) for x in values])
    torch.testing.assert_close(got, merged_by_sample, atol=1e-4, rtol=0)
    torch.testing.assert_close(with_adapter[mask], expected[mask], atol=1e-4, rtol=0)
    loss_fn = ppo_loss_fn(PPO, int(mask.sum()))
    inputs = {
        "prox_logprobs": packed.prox_logprobs,
        "behav_logprobs": packed.behav_logprobs,
        "advantages": packed.advantages,
        "loss_mask": packed.loss_mask,
    }
    loss_adapter, _ = loss_fn(with_adapter, **inputs)
    loss_merged, _ = loss_fn(expected, **inputs)
    assert loss_adapter.item() == pytest.approx(loss_merged.item(), rel=1e-4, abs=1e-4)


def test_export_writes_peft_files_with_peft_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = _backend(tiny_model_dir, target_modules=("q_proj", "v_proj"))
    _train(backend, "tenant-b", steps=1)
    ours, peft_own = tmp_path / "ours", tmp_path / "peft"
    ours.mkdir()
    backend.policy("tenant-b").export_hf(ours)
    backend.model.save_pretrained(str(peft_own), selected_adapters=["tenant-b"])
    assert sorted(p.name for p in ours.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((ours / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    def tensors(path: Path) -> dict[str, Tensor]:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)

    ours_t = tensors(ours / ADAPTER_WEIGHTS)
    peft_t = tensors(peft_own / "tenant-b" / ADAPTER_WEIGHTS)  # peft nests a named adapter
    assert sorted(ours_t) == sorted(peft_t)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in ours_t
    assert all(torch.equal(ours_t[k], peft_t[k]) for k in ours_t)
    # Read back into a fresh backend: the same adapter, bit for bit.
    fresh = _backend(tiny_model_dir, target_modules=("q_proj", "v_proj"))
    fresh.policy("tenant-b").load_hf_weights(ours)
    for mine, theirs in zip(
        backend.adapter_parameters("tenant-b"), fresh.adapter_parameters("tenant-b"), strict=True
    ):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="rank 4"):
        _backend(tiny_model_dir, rank=2, target_modules=("q_proj", "v_proj")).policy(
            "tenant-b"
        ).load_hf_weights(ours)


def test_checkpoint_restores_both_adapters_and_their_optimizers(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    _train(backend, "tenant-a", steps=2)
    _train(backend, "tenant-b", steps=1, seed=1)
    state = backend.state_dict()
    assert sorted(state) == sorted(ADAPTERS)
    # Through a file, as proxima.trainer.weights saves and loads checkpoints.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = _backend(tiny_model_dir)
    restored.load_state_dict(torch.load(buffer, map_location="cpu", weights_only=True))
    for adapter, steps in (("tenant-a", 2), ("tenant-b", 1)):
        for mine, theirs in zip(
            backend.adapter_parameters(adapter), restored.adapter_parameters(adapter), strict=True
        ):
            assert torch.equal(mine, theirs)
        moments = list(restored.optimizers[adapter].state.values())
        assert moments and all(int(m["step"]) == steps for m in moments)
        original = list(backend.optimizers[adapter].state.values())
        for m, o in zip(moments, original, strict=True):
            assert torch.equal(m["exp_avg"], o["exp_avg"])
            assert torch.equal(m["exp_avg_sq"], o["exp_avg_sq"])
    # Both continue alike: one more step of each adapter on both backends.
    for b in (backend, restored):
        _train(b, "tenant-a", steps=1, seed=3)
        _train(b, "tenant-b", steps=1, seed=4)
    samples = _samples(seed=5)
    for adapter in ADAPTERS:
        got = restored.policy(adapter).compute_logprobs(samples)
        want = backend.policy(adapter).compute_logprobs(samples)
        torch.testing.assert_close(torch.tensor(sum(got, [])), torch.tensor(sum(want, [])))


def test_lora_config_is_checked() -> None:
    with pytest.raises(ValidationError, match='needs backend = "torch"'):
        TrainerConfig.model_validate({"backend": "megatron", "lora": {"adapters": ["tenant-a"]}})
    with pytest.raises(ValidationError, match="is not an adapter name"):
        LoraConfig(adapters=("Tenant A",))
    with pytest.raises(ValidationError, match="more than once"):
        LoraConfig(adapters=("x1", "x1"))
    assert TrainerConfig().adapters == ()


def test_target_modules_that_match_nothing_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="target_modules"):
        _backend(tiny_model_dir, target_modules=("no_such_proj",))
