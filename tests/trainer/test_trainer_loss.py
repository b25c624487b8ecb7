"""Decoupled PPO loss: hand-computed values, reduction to standard PPO, the cap.

The tolerances cover float32 rounding of a handful of operations on O(1) values:
the hand batch's logs and sums round to ~1e-7, and ``exp``'s last ulp may differ
between CPUs' vector paths, so a loss is within a few 1e-7 of its hand value. The
bounds are 1e-5 (over 10x that), while any error in the rule (a clip side, the cap,
the normaliser) moves these values by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch
from proxima.trainer.loss import PPOStats, decoupled_ppo_loss, token_logprobs

LOG = math.log


def _hand_batch() -> dict[str, torch.Tensor]:
    """Five tokens; the last one is not a loss token and holds garbage.

    token  A   ratio=exp(l-p)  w=exp(p-b)
    a     +1   1.5             2.0
    b     -1   0.5             1.0
    c     +2   0.5             0.5
    d     -2   1.5             1.0
    e      5   e^30            e^40   (loss_mask 0)
    """
    behav = torch.tensor([-2.0, -1.0, -3.0, -1.5, -50.0])
    prox = behav + torch.tensor([LOG(2.0), 0.0, LOG(0.5), 0.0, 40.0])
    logprobs = (
        prox + torch.tensor([LOG(1.5), LOG(0.5), LOG(0.5), LOG(1.5), 30.0])
    ).requires_grad_()
    return {
        "logprobs": logprobs,
        "prox_logprobs": prox,
        "behav_logprobs": behav,
        "advantages": torch.tensor([1.0, -1.0, 2.0, -2.0, 5.0]),
        "loss_mask": torch.tensor([1, 1, 1, 1, 0]),
    }


def test_hand_computed_loss_clips_both_sides_and_handles_negative_advantages() -> None:
    batch = _hand_batch()
    loss, stats = decoupled_ppo_loss(
        **batch, eps_clip=0.2, eps_clip_high=0.28, importance_weight_cap=None, total_loss_tokens=4
    )
    # clip range [0.8, 1.28]; pg1 = -A*r, pg2 = -A*clip(r), loss_tok = w * max(pg1, pg2)
    # a: pg1 = -1.5, pg2 = -1.28 -> -1.28 (clipped above, A > 0);   w=2   -> -2.56
    # b: pg1 =  0.5, pg2 =  0.8  ->  0.8  (clipped below, A < 0);   w=1   ->  0.8
    # c: pg1 = -1.0, pg2 = -1.6  -> -1.0  (r < 0.8 but A > 0: kept); w=0.5 -> -0.5
    # d: pg1 =  3.0, pg2 =  2.56 ->  3.0  (r > 1.28 but A < 0: kept); w=1  ->  3.0
    # sum = -2.56 + 0.8 - 0.5 + 3.0 = 0.74; / 4 tokens = 0.185
    assert loss.item() == pytest.approx(0.185, abs=1e-5)
    assert stats.clip_fraction.item() == pytest.approx(0.5)  # a and b
    assert stats.loss_tokens.item() == 4
    assert stats.masked_tokens.item() == 0
    assert stats.importance_weight_mean.item() == pytest.approx((2 + 1 + 0.5 + 1) / 4, rel=1e-5)
    assert stats.importance_weight_max.item() == pytest.approx(2.0, rel=1e-5)
    # k3 = (r - 1) - log r: r=1.5 -> 0.5 - 0.405465 = 0.094535; r=0.5 -> -0.5 + 0.693147 = 0.193147
    assert stats.approx_kl.item() == pytest.approx((0.094535 + 0.193147) / 2, abs=1e-5)

    loss.backward()
    # d loss_tok / d l = -w * A * r on unclipped tokens, 0 on clipped ones; / 4 tokens:
    # a, b: 0;  c: -0.5 * 2 * 0.5 / 4 = -0.125;  d: -1 * -2 * 1.5 / 4 = 0.75;  e: masked, 0
    expected = torch.tensor([0.0, 0.0, -0.125, 0.75, 0.0])
    torch.testing.assert_close(batch["logprobs"].grad, expected, atol=1e-5, rtol=0)


def test_global_normaliser_scales_the_loss() -> None:
    loss, _ = decoupled_ppo_loss(
        **_hand_batch(), eps_clip=0.2, eps_clip_high=0.28, total_loss_tokens=8
    )
    assert loss.item() == pytest.approx(0.74 / 8, abs=1e-5)


def test_capped_tokens_contribute_nothing_and_get_zero_gradient() -> None:
    batch = _hand_batch()
    # Flip a's advantage to -1: r = 1.5 is then unclipped (pg1 = 1.5 > pg2 = 1.28) and, uncapped,
    # a would contribute w * 1.5 = 3.0 to the sum and -w * A * r / 4 = 0.75 to its gradient.
    batch["advantages"][0] = -1.0
    uncapped, _ = decoupled_ppo_loss(**batch, eps_clip=0.2, eps_clip_high=0.28, total_loss_tokens=4)
    assert uncapped.item() == pytest.approx((3.0 + 3.3) / 4, abs=1e-5)
    (grad_uncapped,) = torch.autograd.grad(uncapped, batch["logprobs"])
    assert grad_uncapped[0].item() == pytest.approx(0.75, abs=1e-5)

    loss, stats = decoupled_ppo_loss(
        **batch, eps_clip=0.2, eps_clip_high=0.28, importance_weight_cap=1.5, total_loss_tokens=4
    )
    # token a has w = 2 > 1.5: masked. Remaining 0.8 - 0.5 + 3.0 = 3.3, still over 4 tokens.
    assert loss.item() == pytest.approx(3.3 / 4, abs=1e-5)
    assert stats.masked_tokens.item() == 1
    assert stats.masked_fraction.item() == pytest.approx(0.25)
    assert stats.clip_fraction.item() == pytest.approx(1 / 3)  # b among the kept b, c, d
    loss.backward()
    assert batch["logprobs"].grad[0].item() == 0.0


def test_huge_weights_on_capped_or_masked_tokens_leave_loss_and_grad_finite() -> None:
    logprobs = torch.tensor([-1.0, -1.0, 80.0], requires_grad=True)
    behav = torch.tensor([-1.0, -500.0, -1.0])  # token 1: w = exp(499) = inf in float32
    loss, stats = decoupled_ppo_loss(
        logprobs,
        torch.tensor([-1.0, -1.0, -1.0]),
        behav,
        torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([1, 1, 0]),  # token 2: ratio exp(81) overflows, but it is not a loss token
        eps_clip=0.2,
        importance_weight_cap=5.0,
        total_loss_tokens=2,
    )
    loss.backward()
    # only token 0 counts: w = 1, r = 1, A = 1 -> -1 / 2
    assert loss.item() == pytest.approx(-0.5, rel=1e-5)
    assert torch.isfinite(logprobs.grad).all()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 0.0, 0.0]))
    assert stats.masked_tokens.item() == 1


def test_prox_equal_behav_is_standard_clipped_ppo() -> None:
    g = torch.Generator().manual_seed(0)
    shape = (3, 7)  # (B, T) padded layout
    behav = -torch.rand(shape, generator=g) * 3
    logprobs = (behav + 0.4 * torch.randn(shape, generator=g)).requires_grad_()
    advantages = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    loss, stats = decoupled_ppo_loss(
        logprobs, behav, behav, advantages, mask,
        eps_clip=0.2, importance_weight_cap=5.0, total_loss_tokens=int(mask.sum()),
    )  # fmt: skip
    # Schulman et al. 2017 eq. 7, token mean: -mean(min(r A, clip(r, 0.8, 1.2) A))
    r = torch.exp(logprobs - behav)
    surrogate = torch.min(r * advantages, torch.clamp(r, 0.8, 1.2) * advantages)
    expected = -(surrogate * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    assert stats.importance_weight_mean.item() == pytest.approx(1.0, rel=1e-5)
    assert stats.masked_tokens.item() == 0
    loss.backward()
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_on_policy_start_has_unit_ratio_and_zero_kl() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0, 0.5]), torch.ones(3),
        eps_clip=0.2, total_loss_tokens=3,
    )  # fmt: skip
    # r = 1 everywhere: loss = -mean(A) = -(1 - 1 + 0.5) / 3
    assert loss.item() == pytest.approx(-0.5 / 3, rel=1e-5)
    assert stats.approx_kl.item() == 0.0
    assert stats.clip_fraction.item() == 0.0


def test_missing_prox_is_the_current_policy_detached() -> None:
    """prox None (one minibatch per step): p = l.detach(), the same loss, gradient and stats as
    passing that tensor, while the importance weight still uses the recorded behaviour b."""
    batch = _hand_batch()
    del batch["prox_logprobs"]
    kwargs = {"eps_clip": 0.2, "importance_weight_cap": 4.0, "total_loss_tokens": 4}
    logp = batch.pop("logprobs")
    given_logp = logp.detach().clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(logp, None, **batch, **kwargs)
    given, given_stats = decoupled_ppo_loss(given_logp, given_logp.detach(), **batch, **kwargs)
    loss.backward()
    given.backward()
    # The loss is ~0 here (see below): rel alone would ask for the same bits; abs bounds the
    # float32 rounding of its four weighted terms (~3 ulps of 3.0) in any summation order.
    assert loss.item() == pytest.approx(given.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(logp.grad, given_logp.grad)
    assert stats.as_dict() == pytest.approx(given_stats.as_dict(), rel=1e-5, abs=1e-7)
    # ratio 1 everywhere; w = exp(l - b) = 3.0, 0.5, 0.25, 1.5 on a-d (none above the cap 4):
    # loss = -(3*1 + 0.5*(-1) + 0.25*2 + 1.5*(-2)) / 4 = -0.0
    assert loss.item() == pytest.approx(0.0, abs=1e-5)
    assert stats.approx_kl.item() == 0.0


def test_stats_merge_is_token_weighted() -> None:
    batch = _hand_batch()
    kwargs = {"eps_clip": 0.2, "eps_clip_high": 0.28, "total_loss_tokens": 4}
    full_loss, full = decoupled_ppo_loss(**batch, **kwargs)
    parts = [
        decoupled_ppo_loss(**{k: v[sl] for k, v in batch.items()}, **kwargs)[1]
        for sl in (slice(0, 1), slice(1, 5))
    ]
    merged = PPOStats.merge(parts)
    for key, value in full.as_dict().items():
        assert merged.as_dict()[key] == pytest.approx(value, abs=1e-5), key


def test_shape_mismatch_and_empty_normaliser_are_rejected() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="advantages has shape"):
        decoupled_ppo_loss(x, x, x, torch.zeros(4), x, eps_clip=0.2, total_loss_tokens=1)
    with pytest.raises(ValueError, match="total_loss_tokens"):
        decoupled_ppo_loss(x, x, x, x, x, eps_clip=0.2, total_loss_tokens=0)


def test_token_logprobs_matches_tempered_log_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)  # (B, T, V)
    targets = torch.randint(0, 11, (2, 5), generator=g)  # (B, T)
    out = token_logprobs(logits, targets, 0.7)  # (B, T)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, expected)
    # per-token temperatures (T,) on a packed row
    temps = torch.tensor([1.0, 1.0, 0.5, 0.5, 2.0])
    out = token_logprobs(logits[0], targets[0], temps)
    expected = torch.log_softmax(logits[0] / temps[:, None], dim=-1).gather(-1, targets[0, :, None])
    torch.testing.assert_close(out, expected[:, 0])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, 0.0)
