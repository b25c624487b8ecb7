"""The warm start's supervised steps: negative log-likelihood on recorded sessions, then a push.

``proxima train``'s ``[warm_start]`` (``proxima.trainer.pipeline.warm_start``) records agent runs
through the proxy as usual, keeps those whose reward reached a threshold and hands their ids to a
trainer process (``proxima trainer --warm-start FILE``, :class:`WarmStartPlan`). That process
starts like any trainer (recovery, the backend at the pushed version), then :func:`warm_start`:

1. claims the plan's sessions (they are the only finished ones in the store at that point; any
   other claimed by the same query is released untouched);
2. builds their samples as the PPO step does (``chain`` sequences, generated tokens as loss
   tokens, constrained completions included) and takes ``steps`` AdamW steps on
   :func:`sft_loss`, the token mean of ``-log p`` over the loss tokens of every kept session
   (one step: the whole set, micro-batched; a fresh AdamW at the plan's ``lr``). The logprobs are
   the trainer's own packed forward pass (``proxima.trainer.logprobs.forward_logprobs``) at
   temperature 1 and **without** grammar masks: a turn the engine decoded under a tool-call
   grammar is learnt as the free model's output, which is the point of the warm start (under
   the mask the forced tokens have probability 1 and no gradient);
3. exports and pushes the weights as the next version and marks the kept sessions TRAINED into
   it and the plan's other sessions DROPPED (so no later PPO step claims them, and only the kept
   ones count against the proxy's staleness capacity); with no session kept nothing is pushed.

It logs a ``warm_start`` event (sessions kept, loss per step, the version pushed) to
``train_log.jsonl``; step records stay the PPO steps'.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from proxima.proxy.store import SessionStatus
from proxima.trainer.backends.base import build_optimizer, clip_grad_norm, micro_batches
from proxima.trainer.batching import pack
from proxima.trainer.config import BatchingConfig, OptimConfig
from proxima.trainer.logprobs import forward_logprobs
from proxima.trainer.samples import Sample, build_samples, drop_too_long, without_invalid
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

if TYPE_CHECKING:
    from proxima.trainer.loop import Trainer


class WarmStartPlan(BaseModel):
    """What ``proxima trainer --warm-start FILE`` reads (JSON)."""

    model_config = ConfigDict(extra="forbid")

    sessions: list[str] = Field(description="Every session the warm start recorded.")
    keep: list[str] = Field(description="The ones to learn from (a subset of sessions).")
    steps: int = Field(4, ge=1, description="Supervised AdamW steps over the kept sessions.")
    lr: float = Field(1e-4, gt=0, description="Their learning rate.")

    @classmethod
    def read(cls, path: Path) -> WarmStartPlan:
        plan = cls.model_validate_json(path.read_text())
        extra = set(plan.keep) - set(plan.sessions)
        if extra:
            raise ValueError(f"warm start: kept sessions not among its sessions: {sorted(extra)}")
        return plan


def sft_loss(logprobs: Tensor, loss_mask: Tensor, total_loss_tokens: int) -> Tensor:
    """``-sum(log p over loss tokens) / total_loss_tokens``: summed over micro-batches, the token
    mean of the negative log-likelihood of the whole set. Shapes ``(T,)``."""
    if total_loss_tokens < 1:
        raise ValueError("sft_loss needs at least one loss token")
    kept = torch.where(loss_mask.bool(), logprobs.float(), torch.zeros_like(logprobs.float()))
    return -kept.sum() / total_loss_tokens


def unconstrained(samples: Sequence[Sample]) -> list[Sample]:
    """The samples with no grammar to replay: logprobs of the free model (module docstring)."""
    return [dataclasses.replace(s, constraints=(), grammar_mask=None) for s in samples]


def sft_backward(
    model: Any, samples: Sequence[Sample], batching: BatchingConfig, device: torch.device
) -> float:
    """Accumulate the gradient of :func:`sft_loss` over all ``samples`` (micro-batched, at
    temperature 1, whatever each sample was sampled at) into ``model``'s ``.grad``; the loss."""
    total = sum(s.num_loss_tokens for s in samples)
    loss_sum = 0.0
    for indices in micro_batches(samples, batching):
        packed = pack([samples[i] for i in indices]).to(device)
        logprobs = forward_logprobs(model, packed, temperature=1.0, loss_tokens_only=True)
        loss = sft_loss(logprobs, packed.loss_mask, total)
        loss.backward()  # the micro-batches' losses sum to the token mean of the whole set
        loss_sum += float(loss.detach())
    return loss_sum


def sft_steps(
    model: Any,
    samples: Sequence[Sample],
    *,
    steps: int,
    lr: float,
    optim: OptimConfig,
    batching: BatchingConfig,
    device: torch.device,
) -> list[float]:
    """``steps`` AdamW steps (``optim``'s betas, weight decay and clipping at ``lr``) of
    :func:`sft_loss` over all ``samples``; the loss of each step (before its update)."""
    if not samples:
        raise ValueError("sft_steps needs at least one sample")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, optim.model_copy(update={"lr": lr}))
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(sft_backward(model, samples, batching, device))
        clip_grad_norm(params, optim.grad_clip)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


async def warm_start(trainer: Trainer, plan: WarmStartPlan) -> dict[str, Any]:
    """Steps 1-3 of the module docstring on a started trainer; the ``warm_start`` event's fields."""
    store, cfg = trainer.store, trainer.cfg
    trainer_id = trainer.state.trainer_id
    started = time.monotonic()
    claimed = await store.claim_sessions(limit=len(plan.sessions), trainer_id=trainer_id)
    ours = {s.id: s for s in claimed if s.id in set(plan.sessions)}
    kept = [ours[i] for i in plan.keep if i in ours]
    batch = [(s, await store.list_completions(session_id=s.id)) for s in kept]
    samples = build_samples(
        without_invalid(batch, trainer._vocab_size), cfg.advantage, constrained=True
    )
    samples, too_long = drop_too_long(unconstrained(samples), cfg.batching.max_tokens_per_mb)
    trained_ids = list(dict.fromkeys(s.session_id for s in samples))
    dropped = [i for i in ours if i not in set(trained_ids)]
    await store.mark_sessions(session_ids=dropped, status=SessionStatus.DROPPED)
    fields: dict[str, Any] = {
        "sessions": len(plan.sessions),
        "kept": len(trained_ids),
        "samples": len(samples),
        "loss_tokens": sum(s.num_loss_tokens for s in samples),
        "too_long": too_long,
        "version": trainer.state.version,
    }
    if samples:
        backend = trainer.backend
        model = getattr(backend, "model", None)
        if model is None:
            raise ValueError("the warm start trains the torch backend's model (backend = 'torch')")
        trainer._weights_ahead = True  # never checkpointed before the push
        fields["losses"] = await trainer._compute(
            lambda: sft_steps(
                model,
                samples,
                steps=plan.steps,
                lr=plan.lr,
                optim=cfg.optim,
                batching=cfg.batching,
                device=getattr(backend, "device", torch.device("cpu")),
            )
        )
        new_version = trainer.state.version + 1
        await trainer._export_and_push(new_version, trained_ids)
        await trainer._consume(trained_ids, new_version)
        fields["version"] = new_version
    await store.release_claims(trainer_id=trainer_id)  # any other session claimed above
    fields["seconds"] = round(time.monotonic() - started, 1)
    trainer.log.event("warm_start", **fields)
    return fields


def write_plan(path: Path, plan: WarmStartPlan) -> None:
    """Write ``plan`` where ``proxima trainer --warm-start`` reads it."""
    path.write_text(json.dumps(plan.model_dump(), indent=2))
