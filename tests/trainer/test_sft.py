"""The warm start's supervised loss (``proxima.trainer.sft``): its gradient is that of the mean
negative log-likelihood of the kept tokens, at temperature 1 and free of grammar masks."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from proxima.trainer.config import BatchingConfig, OptimConfig
from proxima.trainer.constrained import ConstrainedSpan
from proxima.trainer.logprobs import use_varlen_attention
from proxima.trainer.samples import Sample
from proxima.trainer.sft import WarmStartPlan, sft_backward, sft_loss, sft_steps, unconstrained
from transformers import AutoModelForCausalLM

from tests.trainer.closeness import assert_grads_close


def _samples(count: int = 5, seed: int = 0) -> list[Sample]:
    """Random sequences (a prompt, generated tokens, another prompt part, generated tokens)
    sampled at 0.7: the loss must ignore that temperature."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        parts = [rng.randint(2, 6), rng.randint(3, 9), rng.randint(1, 4), rng.randint(2, 6)]
        mask = [m for k, n in enumerate(parts) for m in [k % 2] * n]
        samples.append(
            Sample(
                session_id=f"s{i}",
                group_id=f"g{i}",
                input_ids=[rng.randrange(256) for _ in mask],
                loss_mask=mask,
                behav_logprobs=[-2.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[0.0] * len(mask),  # a group of rewards 1: no PPO signal
                temperature=0.7,
            )
        )
    return samples


def _model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_varlen_attention(model)
    return model


def test_sft_loss_is_the_token_mean_negative_log_likelihood() -> None:
    logprobs = torch.tensor([-9.0, -1.0, -2.0, -50.0, -3.0], requires_grad=True)
    mask = torch.tensor([0, 1, 1, 0, 1])
    loss = sft_loss(logprobs, mask, total_loss_tokens=6)  # this micro-batch: 3 of 6 tokens
    assert loss.item() == pytest.approx(6.0 / 6, rel=1e-5)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == pytest.approx([0.0, -1 / 6, -1 / 6, 0.0, -1 / 6], abs=1e-6)
    with pytest.raises(ValueError, match="at least one loss token"):
        sft_loss(logprobs, mask, total_loss_tokens=0)


def test_sft_gradient_is_minus_the_gradient_of_mean_log_p(tiny_model_dir: Path) -> None:
    """Packed in several micro-batches, the accumulated gradient equals autograd's of
    ``-mean log p`` over every loss token, each sequence run alone at temperature 1."""
    samples = _samples()
    model = _model(tiny_model_dir)
    loss = sft_backward(model, samples, BatchingConfig(max_tokens_per_mb=40), torch.device("cpu"))
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = _model(tiny_model_dir)
    terms = []
    for s in samples:
        ids = torch.tensor([s.input_ids])
        logp = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), dim=-1)
        taken = logp.gather(-1, ids[0, 1:, None])[:, 0]  # log p(token i+1 | tokens <= i)
        terms.append(taken[torch.tensor(s.loss_mask[1:]).bool()])
    expected_loss = -torch.cat(terms).mean()
    expected_loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert loss == pytest.approx(expected_loss.item(), rel=1e-4)
    assert_grads_close(packed_grads, grads)


def test_sft_steps_lower_the_loss_and_grammar_spans_are_dropped(tiny_model_dir: Path) -> None:
    span = ConstrainedSpan(start=3, end=6, grammar={"type": "json_schema"})
    samples = _samples(3)
    samples[0] = dataclasses.replace(samples[0], constraints=(span,))
    free = unconstrained(samples)
    assert all(s.constraints == () and s.grammar_mask is None for s in free)
    model = _model(tiny_model_dir)
    losses = sft_steps(
        model,
        free,
        steps=4,
        lr=3e-3,
        optim=OptimConfig(grad_clip=1.0),
        batching=BatchingConfig(max_tokens_per_mb=64),
        device=torch.device("cpu"),
    )
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses


def test_plan_keeps_only_its_own_sessions(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"sessions": ["a", "b"], "keep": ["b"], "steps": 2, "lr": 0.001}')
    assert WarmStartPlan.read(path).keep == ["b"]
    path.write_text('{"sessions": ["a"], "keep": ["c"]}')
    with pytest.raises(ValueError, match="not among its sessions"):
        WarmStartPlan.read(path)
