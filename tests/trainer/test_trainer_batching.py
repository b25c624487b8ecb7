"""Dynamic micro-batching, packing, packed logprobs, and micro-batch/full-batch equivalence."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from proxima.trainer.batching import fixed_micro_batches, pack, plan_micro_batches, unpack
from proxima.trainer.logprobs import (
    VARLEN_SDPA,
    block_causal_mask,
    forward_logprobs,
    use_varlen_attention,
)
from proxima.trainer.loss import PPOStats, decoupled_ppo_loss, token_logprobs
from proxima.trainer.samples import Sample
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.trainer.closeness import assert_grads_close

VOCAB = 263  # tiny model's vocabulary


# --------------------------------------------------------------------------- planning


def test_plan_best_fit_by_hand() -> None:
    # budget 10, lengths [1, 8, 6, 3, 3]; visit longest first: 8(i1), 6(i2), 3(i3), 3(i4), 1(i0)
    #   8 -> new mb0 (room 2)
    #   6 -> no fit -> new mb1 (room 4)
    #   3 -> mb1 is the only fit -> mb1 (room 1)
    #   3 -> no fit -> new mb2 (room 7)
    #   1 -> fits mb0 (2), mb1 (1), mb2 (7): least room is mb1 -> mb1 (room 0)
    # (first-fit would have put the 1 into mb0)
    assert plan_micro_batches([1, 8, 6, 3, 3], 10, 1) == [[1], [2, 3, 0], [4]]


def test_plan_opens_min_mbs_before_filling() -> None:
    # budget 100 fits everything in one, but min_mbs=3 opens one per longest sequence first:
    # 40 -> mb0, 30 -> mb1, 20 -> mb2, then 10 -> least room that fits = mb0 (60 left)
    assert plan_micro_batches([10, 20, 30, 40], 100, 3) == [[3, 0], [2], [1]]
    assert plan_micro_batches([10, 20], 100, 5) == [[1], [0]]  # fewer sequences than min_mbs


@pytest.mark.parametrize("seed", range(5))
def test_plan_properties(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(300, 1000)
    min_mbs = rng.randint(1, 4)
    plan = plan_micro_batches(lengths, budget, min_mbs)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))  # each index once
    assert all(sum(lengths[i] for i in mb) <= budget for mb in plan)  # budget respected
    assert len(plan) >= min(min_mbs, len(lengths))
    assert all(mb for mb in plan)  # no empty micro-batch
    # a new micro-batch is only opened when needed: at most one is less than half full
    assert sum(sum(lengths[i] for i in mb) <= budget / 2 for mb in plan) <= max(1, min_mbs)


def test_plan_rejects_a_sequence_over_budget() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 has 5000 tokens.*max_tokens_per_mb=4096"):
        plan_micro_batches([10, 5000], 4096)
    with pytest.raises(ValueError, match="min_mbs"):
        plan_micro_batches([10], 100, 0)


def test_fixed_micro_batches_equal_counts() -> None:
    assert fixed_micro_batches([5] * 7, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert fixed_micro_batches([5, 6], 4) == [[0], [1]]
    assert fixed_micro_batches([], 2) == []


# --------------------------------------------------------------------------- packing


def _sample(input_ids: list[int], prompt_len: int, *, seed: int = 0, temp: float = 1.0) -> Sample:
    rng = random.Random(seed)
    n = len(input_ids)
    mask = [0] * prompt_len + [1] * (n - prompt_len)
    return Sample(
        session_id=f"s{seed}",
        group_id="g",
        input_ids=input_ids,
        loss_mask=mask,
        behav_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask],
        versions=[7 if m else -1 for m in mask],
        advantages=[rng.uniform(-1, 1) if m else 0.0 for m in mask],
        temperature=temp,
    )


def test_pack_shifts_targets_per_sequence() -> None:
    a = _sample([10, 11, 12], 1, seed=1, temp=0.5)
    b = _sample([20, 21], 1, seed=2)
    packed = pack([a, b])
    assert packed.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert packed.cu_seqlens.tolist() == [0, 3, 5]
    assert packed.seq_lens == [3, 2]
    # next token within each sequence; a sequence's last position has no target
    assert packed.targets.tolist() == [11, 12, 0, 21, 0]
    assert packed.loss_mask.tolist() == [1, 1, 0, 1, 0]
    assert packed.behav_logprobs.tolist() == pytest.approx(
        [a.behav_logprobs[1], a.behav_logprobs[2], 0.0, b.behav_logprobs[1], 0.0]
    )
    assert packed.versions.tolist() == [7, 7, -1, 7, -1]
    assert packed.temperatures.tolist() == [0.5, 0.5, 0.5, 1.0, 1.0]
    assert packed.num_loss_tokens == 3 and packed.num_tokens == 5 and packed.num_sequences == 2
    assert packed.prox_logprobs is None
    # unpack undoes the shift: token j of sample s gets the value at position j - 1
    values = torch.arange(5, dtype=torch.float32)
    assert unpack(packed, values) == [[0.0, 0.0, 1.0], [0.0, 3.0]]


def test_pack_rejects_a_trained_first_token() -> None:
    with pytest.raises(ValueError, match="first token"):
        pack([_sample([1, 2], 0)])


def test_use_varlen_attention_switches_the_model(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir, "sdpa")
    use_varlen_attention(model)
    assert model.config._attn_implementation == VARLEN_SDPA
    with torch.no_grad():
        out = forward_logprobs(model, pack([_sample([1, 2, 3], 1), _sample([4, 5], 1)]))
    assert out.shape == (5,) and torch.isfinite(out).all()


def test_block_causal_mask_by_hand() -> None:
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


# --------------------------------------------------------------------------- with the tiny model

LENGTHS = [5, 300, 37, 150, 12, 260, 80, 9]


def _load(path: Path, attn: str = "sdpa") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32
    )
    model.eval()  # no dropout; gradients still flow
    return model


def _random_samples(lengths: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        samples.append(_sample(ids, max(1, n // 3), seed=seed * 100 + k, temp=(0.7, 1.0)[k % 2]))
    return samples


def _per_sequence_logprobs(model: PreTrainedModel, sample: Sample) -> torch.Tensor:
    """Reference: the sequence alone, no packing. (L,) target-aligned, last entry 0."""
    ids = torch.tensor(sample.input_ids)[None]  # (1, L)
    logits = model(input_ids=ids, use_cache=False).logits[0]  # (L, V)
    logprobs = token_logprobs(logits[:-1], ids[0, 1:], sample.temperature)  # (L-1,)
    return torch.cat([logprobs, logprobs.new_zeros(1)])  # (L,)


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN_SDPA])
def test_packed_logprobs_equal_per_sequence(tiny_model_dir: Path, attn: str) -> None:
    model = _load(tiny_model_dir, attn)
    samples = _random_samples(LENGTHS)
    packed = pack(samples)
    with torch.no_grad():
        packed_lp = forward_logprobs(model, packed)  # (T,)
        reference = torch.cat([_per_sequence_logprobs(model, s) for s in samples])  # (T,)
    valid = torch.ones_like(packed.loss_mask, dtype=torch.bool)
    valid[packed.cu_seqlens[1:] - 1] = False  # last position of each sequence has no target
    # Another matmul shape, another summation order: |logprob| ~5 with float32 noise ~1e-6; a
    # token attending across sequences moves it by > 1e-2.
    torch.testing.assert_close(packed_lp[valid], reference[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", VARLEN_SDPA])
def test_micro_batched_step_equals_full_batch(tiny_model_dir: Path, attn: str) -> None:
    """Loss and gradients: several packed micro-batches (global token normaliser, accumulated
    grads) == one pass over the whole batch, for sequences of 5..300 tokens."""
    model = _load(tiny_model_dir, attn)
    samples = _random_samples(LENGTHS, seed=1)
    # Proximal/behaviour logprobs near the model's own, spread so that some tokens clip and
    # some exceed the importance-weight cap.
    g = torch.Generator().manual_seed(2)
    with_prox = []
    for s in samples:
        with torch.no_grad():
            own = _per_sequence_logprobs(model, s)  # (L,) target-aligned
        token_aligned = torch.cat([own.new_zeros(1), own[:-1]])  # (L,)
        prox = token_aligned + 0.2 * torch.randn(s.num_tokens, generator=g)
        behav = prox + 0.6 * torch.randn(s.num_tokens, generator=g)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        with_prox.append(
            dataclasses.replace(
                s,
                prox_logprobs=torch.where(mask, prox, 0.0).tolist(),
                behav_logprobs=torch.where(mask, behav, 0.0).tolist(),
            )
        )
    total = sum(s.num_loss_tokens for s in with_prox)
    kwargs = {"eps_clip": 0.2, "eps_clip_high": 0.28, "importance_weight_cap": 2.0}

    def step(micro_batches: list[list[int]]) -> tuple[float, dict[str, torch.Tensor], PPOStats]:
        model.zero_grad(set_to_none=True)
        loss_sum, stats = 0.0, []
        for mb in micro_batches:
            packed = pack([with_prox[i] for i in mb])
            logprobs = forward_logprobs(model, packed)  # (T_mb,)
            assert packed.prox_logprobs is not None
            loss, st = decoupled_ppo_loss(
                logprobs, packed.prox_logprobs, packed.behav_logprobs, packed.advantages,
                packed.loss_mask, total_loss_tokens=total, **kwargs,
            )  # fmt: skip
            loss.backward()  # gradients accumulate across micro-batches
            loss_sum += loss.item()
            stats.append(st)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss_sum, grads, PPOStats.merge(stats)

    plan = plan_micro_batches([s.num_tokens for s in with_prox], max_tokens_per_mb=320, min_mbs=2)
    assert len(plan) >= 3
    full_loss, full_grads, full_stats = step([list(range(len(with_prox)))])
    mb_loss, mb_grads, mb_stats = step(plan)

    assert full_stats.clip_fraction.item() > 0 and full_stats.masked_tokens.item() > 0
    # Same kernels, other packing: float32 summation-order noise is ~1e-7 of terms of size ~1,
    # and the token mean can sit near 0, so the absolute bound is 1e-4 (~1000x margin).
    assert mb_loss == pytest.approx(full_loss, rel=1e-4, abs=1e-4)
    assert full_grads.keys() == mb_grads.keys() and len(full_grads) > 0
    assert_grads_close(mb_grads, full_grads)
    for key, value in full_stats.as_dict().items():
        assert mb_stats.as_dict()[key] == pytest.approx(value, abs=1e-4), key


def test_loss_tokens_only_gives_the_same_logprobs_and_gradients(tiny_model_dir: Path) -> None:
    """Projecting to the vocabulary at loss tokens only (``logits_to_keep``) changes nothing
    the loss sees: same logprobs there, zeros elsewhere, same gradients."""
    model = _load(tiny_model_dir, VARLEN_SDPA)
    packed = pack(_random_samples(LENGTHS, seed=3))
    mask = packed.loss_mask > 0  # (T,)
    assert mask.any() and not mask.all()
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))  # (T,)

    def run(loss_tokens_only: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logprobs = forward_logprobs(model, packed, loss_tokens_only=loss_tokens_only)  # (T,)
        (logprobs * advantages * packed.loss_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), grads

    full, full_grads = run(False)
    kept, kept_grads = run(True)
    torch.testing.assert_close(kept[mask], full[mask], atol=1e-4, rtol=0)  # see above
    assert kept[~mask].eq(0.0).all()
    assert kept_grads.keys() == full_grads.keys() and len(full_grads) > 0
    assert_grads_close(kept_grads, full_grads)
