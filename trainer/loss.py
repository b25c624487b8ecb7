"""Decoupled PPO (AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", eq. 5), as pure functions.

Per generated token, with behaviour logprob ``b`` (recorded by the inference
backend that sampled it), proximal logprob ``p`` (recomputed by the trainer with
the weights before this step) and current logprob ``l`` (with grad)::

    w     = exp(p - b)                                  # behaviour importance weight
    ratio = exp(l - p)                                  # trust-region ratio vs the proximal policy
    loss  = -w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)

The PPO clip (Schulman et al. 2017, eq. 7) is taken around the *proximal*
policy, and the off-policyness of stale rollouts is corrected by ``w``. With
``p = b`` (``w = 1``) this is standard clipped PPO.

Where this departs from the paper:

1. Tokens whose weight ``w`` exceeds ``importance_weight_cap`` are masked out
   (loss and gradient exactly zero) instead of having ``w`` clipped, as in
   AReaL's implementation; they still count in the normaliser.
2. Asymmetric clip ``[1 - eps, 1 + eps_high]`` (DAPO's clip-higher, Yu et al.
   2025); ``eps_high = eps`` is the paper's objective.
3. Token-level mean over the *global* batch: the caller passes the global
   number of loss tokens, so per-micro-batch losses sum to the batch mean and
   micro-batching never changes the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PPOStats:
    """Detached statistics of one loss call (scalar tensors, no graph).

    ``loss_tokens`` is the number of tokens with ``loss_mask = 1`` in the call;
    fractions and means are over those tokens, except ``clip_fraction`` and
    ``approx_kl``, which are over the tokens that survive the cap
    (``loss_tokens - masked_tokens``).
    """

    loss: Tensor  # this call's contribution to the global-batch loss
    loss_tokens: Tensor  # tokens with loss_mask = 1
    masked_tokens: Tensor  # loss tokens masked because w > cap
    clip_fraction: Tensor  # share of kept tokens where the clipped branch is active (no grad)
    importance_weight_mean: Tensor  # mean of w = exp(prox - behav) over loss tokens
    importance_weight_max: Tensor  # max of w over loss tokens
    approx_kl: Tensor  # mean k3 estimator of KL(prox || current) over kept tokens

    @property
    def masked_fraction(self) -> Tensor:
        """Share of loss tokens masked by the importance-weight cap."""
        return self.masked_tokens / self.loss_tokens.clamp(min=1)

    @staticmethod
    def merge(stats: Sequence[PPOStats]) -> PPOStats:
        """Combine the stats of micro-batches of one global batch (token-weighted means).

        ``loss`` is summed (each call already holds its share of the global mean).
        """
        if not stats:
            raise ValueError("merge() needs at least one PPOStats")
        loss_tokens = torch.stack([s.loss_tokens for s in stats]).sum()
        masked = torch.stack([s.masked_tokens for s in stats]).sum()
        kept = torch.stack([s.loss_tokens - s.masked_tokens for s in stats])  # (M,)
        valid = torch.stack([s.loss_tokens for s in stats])  # (M,)

        def weighted(values: list[Tensor], weights: Tensor) -> Tensor:
            return (torch.stack(values) * weights).sum() / weights.sum().clamp(min=1)

        return PPOStats(
            loss=torch.stack([s.loss for s in stats]).sum(),
            loss_tokens=loss_tokens,
            masked_tokens=masked,
            clip_fraction=weighted([s.clip_fraction for s in stats], kept),
            importance_weight_mean=weighted([s.importance_weight_mean for s in stats], valid),
            importance_weight_max=torch.stack([s.importance_weight_max for s in stats]).max(),
            approx_kl=weighted([s.approx_kl for s in stats], kept),
        )

    def as_dict(self) -> dict[str, float]:
        """Python floats for logging."""
        return {
            "loss": float(self.loss),
            "loss_tokens": float(self.loss_tokens),
            "masked_tokens": float(self.masked_tokens),
            "masked_fraction": float(self.masked_fraction),
            "clip_fraction": float(self.clip_fraction),
            "importance_weight_mean": float(self.importance_weight_mean),
            "importance_weight_max": float(self.importance_weight_max),
            "approx_kl": float(self.approx_kl),
        }


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Log-probabilities of ``targets`` under ``softmax(logits / temperature)``.

    Computed as ``logit_y / T - logsumexp(logits / T)`` in float32, which equals
    ``log_softmax(logits / T).gather(-1, y)`` without materialising the
    ``(..., V)`` log-softmax.

    Shape: logits ``(..., V)``, targets ``(...)`` (int64), temperature a float or a
    tensor broadcastable to ``(...)`` (e.g. per-token ``(T,)``) -> ``(...)``.
    """
    if isinstance(temperature, Tensor):
        if bool((temperature <= 0).any()):
            raise ValueError("temperature must be positive")
        temps = temperature.to(logits.device, torch.float32).unsqueeze(-1)  # (..., 1)
        scaled = logits.float() / temps  # (..., V)
    else:
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        scaled = logits.float() / temperature  # (..., V)
    target_logits = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...)
    return target_logits - torch.logsumexp(scaled, dim=-1)  # (...)


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor | None,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    importance_weight_cap: float | None = None,
    total_loss_tokens: int | Tensor,
) -> tuple[Tensor, PPOStats]:
    """Decoupled PPO loss (AReaL eq. 5), summed over tokens and divided by ``total_loss_tokens``.

    Shape: every tensor argument has the same shape, packed ``(T,)`` or padded
    ``(B, T)``; ``loss_mask`` is 1 (or True) on trained tokens. Only
    ``logprobs`` carries a gradient; ``prox_logprobs`` and ``behav_logprobs``
    are treated as constants.

    Args:
        logprobs: ``l``, current-policy logprobs of the taken tokens (with grad).
        prox_logprobs: ``p``, proximal-policy logprobs (pass ``behav_logprobs`` for standard PPO).
            ``None`` when the weights computing ``logprobs`` are the proximal
            policy (the first optimizer step after the proximal logprobs would
            be taken): ``p = logprobs.detach()``, exactly what a separate
            no-grad pass would give, without that pass.
        behav_logprobs: ``b``, behaviour-policy logprobs recorded at sampling time.
        advantages: ``A``, per-token advantages.
        loss_mask: 1 on tokens to train.
        eps_clip: lower clip range, ratio >= 1 - eps_clip.
        eps_clip_high: upper clip range, ratio <= 1 + eps_clip_high (default ``eps_clip``).
        importance_weight_cap: tokens with ``w > cap`` are masked; ``None`` disables.
        total_loss_tokens: number of loss tokens in the *global* batch (all
            micro-batches of the optimizer step), so that summing the returned
            losses over micro-batches gives the global token mean.

    Returns:
        ``(loss, stats)``: scalar loss with grad, and detached :class:`PPOStats`.
    """
    if prox_logprobs is None:
        prox_logprobs = logprobs.detach()
    _check_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, total_loss_tokens)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    prox_logprobs = prox_logprobs.detach().float()  # (*S)
    behav_logprobs = behav_logprobs.detach().float()  # (*S)
    advantages = advantages.detach().float()  # (*S)
    valid = loss_mask.bool()  # (*S)

    # w = exp(p - b): corrects for sampling from the (stale) behaviour policy.
    importance_weight = torch.exp(prox_logprobs - behav_logprobs)  # (*S)
    if importance_weight_cap is not None:
        capped = valid & (importance_weight > importance_weight_cap)  # (*S)
    else:
        capped = torch.zeros_like(valid)
    mask = valid & ~capped  # (*S) tokens that contribute

    # ratio = exp(l - p): the PPO trust region is around the proximal policy.
    # Masked positions get logratio 0 through where() (not a multiply), so whatever sits in
    # the inputs there (padding, huge weights) can put neither inf nor nan into the loss or grad.
    zeros = torch.zeros_like(importance_weight)
    logratio = torch.where(mask, logprobs.float() - prox_logprobs, zeros)  # (*S)
    ratio = torch.exp(logratio)  # (*S)
    pg_loss1 = -advantages * ratio  # (*S)
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)  # (*S)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # (*S) = -min(ratio*A, clip(ratio)*A)
    loss_tok = torch.where(mask, importance_weight, zeros) * pg_loss  # (*S) w * pg_loss
    loss = torch.where(mask, loss_tok, zeros).sum() / total_loss_tokens  # global token mean

    with torch.no_grad():
        clipped = (pg_loss2 > pg_loss1) & mask  # the clipped branch is active: zero gradient
        stats = _ppo_stats(loss, valid, mask, capped, clipped, importance_weight, ratio, logratio)
    return loss, stats


def _check_inputs(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    total_loss_tokens: int | Tensor,
) -> None:
    """:func:`decoupled_ppo_loss`'s inputs: one shape for every tensor, a positive token count."""
    shape = logprobs.shape
    for name, t in (
        ("prox_logprobs", prox_logprobs),
        ("behav_logprobs", behav_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")
    if int(total_loss_tokens) <= 0:
        raise ValueError(f"total_loss_tokens must be positive, got {int(total_loss_tokens)}")


def _ppo_stats(
    loss: Tensor,
    valid: Tensor,
    mask: Tensor,
    capped: Tensor,
    clipped: Tensor,
    importance_weight: Tensor,
    ratio: Tensor,
    logratio: Tensor,
) -> PPOStats:
    """:func:`decoupled_ppo_loss`'s detached statistics (call under ``torch.no_grad``).

    ``valid``: trained tokens; ``mask``: those that contribute (not capped); ``capped``:
    masked by the importance-weight cap; ``clipped``: on the clipped branch.
    """
    zeros = torch.zeros_like(importance_weight)
    n_valid = valid.sum()
    n_kept = mask.sum()
    approx_kl = (ratio - 1.0) - logratio  # k3 estimator of KL(prox || current), >= 0
    w_valid = torch.where(valid, importance_weight, zeros)
    return PPOStats(
        loss=loss.detach(),
        loss_tokens=n_valid,
        masked_tokens=capped.sum(),
        clip_fraction=clipped.sum() / n_kept.clamp(min=1),
        importance_weight_mean=w_valid.sum() / n_valid.clamp(min=1),
        importance_weight_max=w_valid.max() if w_valid.numel() else w_valid.new_zeros(()),
        approx_kl=approx_kl.sum() / n_kept.clamp(min=1),  # 0 where masked
    )
