"""Torch backend: PPO steps move the weights and lower the loss; packing never changes results."""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest
import torch
from proxima.trainer.backends.base import split_minibatches
from proxima.trainer.backends.torch_backend import TorchBackend
from proxima.trainer.config import BatchingConfig, OptimConfig, PPOConfig
from proxima.trainer.loss import token_logprobs
from proxima.trainer.samples import Sample
from torch import Tensor
from transformers import AutoModelForCausalLM

from tests.trainer.closeness import assert_grads_close

TEMPERATURE = 0.8


def _backend(model_dir: Path, **overrides: object) -> TorchBackend:
    options: dict = {
        "ppo": PPOConfig(eps_clip=0.5, eps_clip_high=5.0),
        "batching": BatchingConfig(max_tokens_per_mb=256),
        "optim": OptimConfig(lr=2e-3, grad_clip=None),
    }
    options.update(overrides)
    return TorchBackend(model_dir, **options)


def _samples(count: int = 6, seed: int = 0) -> list[Sample]:
    """Random sequences: a prompt then generated tokens with advantage +1 or -1 by session."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt, generated = rng.randint(3, 10), rng.randint(4, 16)
        n = prompt + generated
        mask = [0] * prompt + [1] * generated
        advantage = 1.0 if i % 2 == 0 else -1.0
        samples.append(
            Sample(
                session_id=f"s{i}",
                group_id="g",
                input_ids=[rng.randrange(256) for _ in range(n)],
                loss_mask=mask,
                behav_logprobs=[-5.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[advantage * m for m in mask],
                temperature=TEMPERATURE,
            )
        )
    return samples


def _with_prox(backend: TorchBackend, samples: list[Sample]) -> list[Sample]:
    prox = backend.compute_logprobs(samples)
    return [dataclasses.replace(s, prox_logprobs=p) for s, p in zip(samples, prox, strict=True)]


def test_compute_logprobs_equals_each_sequence_alone(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir, batching=BatchingConfig(max_tokens_per_mb=40, min_mbs=2))
    samples = _samples()
    got = backend.compute_logprobs(samples)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for sample, values in zip(samples, got, strict=True):
        ids = torch.tensor([sample.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (L, V)
        expected = token_logprobs(logits[:-1], ids[0, 1:], TEMPERATURE)  # (L-1,)
        assert values[0] == 0.0 and len(values) == sample.num_tokens
        # Computed at the loss (generated) tokens only; 0.0 at prompt tokens.
        trained = torch.tensor(sample.loss_mask[1:]) > 0  # (L-1,)
        got_values = torch.tensor(values[1:])
        assert trained.any() and not trained.all()
        # Packed and alone run different matmul shapes (another summation order): |logprob| ~5,
        # float32 noise ~1e-6; a sequence attending across the pack moves them by > 1e-2.
        torch.testing.assert_close(got_values[trained], expected[trained], atol=1e-4, rtol=0)
        assert got_values[~trained].eq(0.0).all()


def test_train_step_moves_weights_and_lowers_the_loss(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    batch = _with_prox(backend, _samples())  # prox fixed at the initial policy
    losses = [backend.train_step(batch).ppo.loss.item() for _ in range(5)]
    # At the first step ratio == 1 exactly, so the loss is -mean(w * A) over loss tokens.
    assert losses == sorted(losses, reverse=True), losses
    assert losses[-1] < losses[0] - 0.05
    changed = [k for k, v in backend.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) == len(before)


def _record_grads(backend: TorchBackend) -> list[dict[str, Tensor]]:
    """The gradients each optimizer step of ``backend`` is given (after clipping), by name."""
    steps: list[dict[str, Tensor]] = []
    names = {id(p): name for name, p in backend.model.named_parameters()}

    def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps.append({names[id(p)]: p.grad.clone() for p in params if p.grad is not None})

    backend.optimizer.register_step_pre_hook(record)
    return steps


def test_micro_batching_does_not_change_the_update(tiny_model_dir: Path) -> None:
    """One micro-batch or four: the same loss and the same gradients reach AdamW.

    Compared before the optimizer (see tests/trainer/closeness.py for why not after) at
    tolerances of summation order; a micro-batch normalised by its own token count, or one
    left out, changes the gradients by percents.
    """
    one = _backend(tiny_model_dir, batching=BatchingConfig(max_tokens_per_mb=512))
    many = _backend(tiny_model_dir, batching=BatchingConfig(max_tokens_per_mb=30, min_mbs=3))
    grads_one, grads_many = _record_grads(one), _record_grads(many)
    batch = _with_prox(one, _samples())
    a, b = one.train_step(batch), many.train_step(batch)
    assert a.micro_batches == 1 and b.micro_batches >= 3
    # Same model and kernels, only the packing differs: the token-mean loss (a few hundred
    # float32 terms of size ~1) moves by ~1e-7 with the summation order, and the mean can sit
    # near 0 (normalised advantages), so the bound is absolute too: 1e-4 leaves ~1000x margin.
    assert a.ppo.loss.item() == pytest.approx(b.ppo.loss.item(), rel=1e-4, abs=1e-4)
    assert a.grad_norms[0] == pytest.approx(b.grad_norms[0], rel=1e-4)
    assert len(grads_one) == len(grads_many) == 1
    assert len(grads_one[0]) == len(list(one.model.parameters()))
    assert_grads_close(grads_many[0], grads_one[0])


def test_minibatches_split_sessions_and_step_once_each(tiny_model_dir: Path) -> None:
    samples = _samples(count=5)
    samples.append(dataclasses.replace(samples[0]))  # a second sequence of session s0
    slices = split_minibatches(samples, 2)
    # 5 sessions in 2 slices of 2 and 3 sessions; both sequences of s0 stay together.
    assert [[s.session_id for s in mb] for mb in slices] == [["s0", "s0", "s1"], ["s2", "s3", "s4"]]
    backend = _backend(tiny_model_dir, ppo=PPOConfig(ppo_minibatches=2))
    stats = backend.train_step(_with_prox(backend, samples))
    assert stats.minibatches == 2 and all(g > 0 for g in stats.grad_norms)
    assert stats.ppo.loss_tokens.item() == sum(s.num_loss_tokens for s in samples)


def test_grad_clip_and_export_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = _backend(tiny_model_dir, optim=OptimConfig(lr=1e-3, grad_clip=1e-3))
    stats = backend.train_step(_with_prox(backend, _samples()))
    assert stats.grad_norms[0] > 1e-3  # reported before clipping
    backend.export_hf(tmp_path / "v1")
    assert (tmp_path / "v1" / "tokenizer.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32)
    # Bitwise: safetensors stores the float32 values as they are.
    for (name, p), q in zip(backend.model.named_parameters(), exported.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=0, rtol=0, msg=name)
    fresh = _backend(tiny_model_dir)
    fresh.load_hf_weights(tmp_path / "v1")
    restored = fresh.model.state_dict()
    for key, value in backend.model.state_dict().items():
        assert torch.equal(restored[key], value), key
    assert fresh.model.lm_head.weight.data_ptr() == fresh.model.model.embed_tokens.weight.data_ptr()


def test_state_dict_round_trip_restores_the_optimizer(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir)
    batch = _with_prox(backend, _samples())
    backend.train_step(batch)
    state = copy.deepcopy(backend.state_dict())  # what a checkpoint round trip gives
    twin = _backend(tiny_model_dir)
    twin.load_state_dict(state)
    a, b = backend.train_step(batch), twin.train_step(batch)
    # Bitwise: the same ops on the same inputs in one process, in the same order.
    assert a.ppo.loss.item() == b.ppo.loss.item()
    for p, q in zip(backend.model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_one_minibatch_takes_prox_from_its_own_forward_pass(tiny_model_dir: Path) -> None:
    """Samples without prox_logprobs: the first (only) minibatch uses the training pass's own
    detached logprobs, which equal a separate no-grad pass at the same weights."""
    recomputed = _backend(tiny_model_dir)
    own_pass = _backend(tiny_model_dir)
    grads_recomputed, grads_own = _record_grads(recomputed), _record_grads(own_pass)
    samples = _samples()
    with_prox = recomputed.train_step(_with_prox(recomputed, samples))
    without = own_pass.train_step(samples)
    # a separate no-grad pass vs the same pass detached: float32 noise only (see above)
    assert without.ppo.loss.item() == pytest.approx(with_prox.ppo.loss.item(), rel=1e-4, abs=1e-4)
    # ratio = exp(l - prox) is 1 exactly without prox; with the recomputed one it is 1 to a few
    # ulps (the no-grad pass may round differently). Their KL is ~1e-14 in exact arithmetic, but
    # the float32 k3 term (ratio - 1) - log(ratio) keeps exp's rounding near 1 (an ulp of 1 is
    # 1.2e-7, and exp's last ulps differ by CPU): bounded at 1e-6.
    assert without.ppo.approx_kl.item() == pytest.approx(0.0, abs=1e-6)
    assert_grads_close(grads_own[0], grads_recomputed[0])


def test_later_minibatches_need_recomputed_prox(tiny_model_dir: Path) -> None:
    backend = _backend(tiny_model_dir, ppo=PPOConfig(ppo_minibatches=2))
    with pytest.raises(ValueError, match="ppo_minibatches > 1 needs samples with prox_logprobs"):
        backend.train_step(_samples())
