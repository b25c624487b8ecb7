"""What every training backend shares: the interface, the step's plan, optimizer, clipping, HF weights.

A training backend owns the model and its optimizer and offers what one
training step of ``proxima.trainer.loop`` needs (:class:`PPOBackend`):

- ``compute_logprobs(samples)``: per-sample token logprobs with the current
  weights, no grad (the proximal logprobs of decoupled PPO);
- ``train_step(samples)``: ``ppo.ppo_minibatches`` optimizer steps, each over
  a disjoint slice of the step's sessions::

      for minibatch in split_minibatches(samples):
          N = loss tokens of the minibatch
          for packed in plan_micro_batches -> pack:          # token budget per micro-batch
              l = logprobs(packed)                           # with grad, sampling temperature
              loss_mb = decoupled_ppo_loss(l, p, b, A, mask, total_loss_tokens=N)
              loss_mb.backward()                             # grads accumulate: sum = batch mean
          clip_grad_norm(grad_clip); AdamW step

- ``export_hf(out_dir)``: an HF safetensors checkpoint (config, weights,
  tokenizer) the inference backends load;
- ``load_hf_weights(model_dir)``, ``state_dict()`` / ``load_state_dict()``:
  recovery and checkpoints (``proxima.trainer.weights``);
- optionally ``hf_tensors()`` (:class:`InMemoryWeights`): the model's tensors by HF name,
  which a broadcast push sends straight from memory (the torch backend has them).

The implementations (``torch_backend.TorchBackend``,
``megatron.MegatronPPOBackend``; ``proxima.trainer.backends.build_backend``
picks one) share this module's minibatch split, micro-batch plan, loss inputs,
optimizer construction, gradient clipping and HF weight reading and key
checks, so on the same batch they compute the same loss and take the same step.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from proxima.trainer.batching import (
    PackedBatch,
    fixed_micro_batches,
    pack,
    plan_micro_batches,
    unpack,
)
from proxima.trainer.config import BatchingConfig, OptimConfig, PPOConfig
from proxima.trainer.loss import PPOStats, decoupled_ppo_loss
from proxima.trainer.samples import Sample
from safetensors.torch import load_file
from torch import Tensor

LossFn = Callable[..., tuple[Tensor, PPOStats]]
"""``loss_fn(logprobs, *, prox_logprobs, behav_logprobs, advantages, loss_mask)``."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------- interface


@dataclass(frozen=True)
class StepStats:
    """What one ``train_step`` reports.

    ``ppo`` merges the loss statistics of every micro-batch of every minibatch
    (token-weighted); its ``loss`` is the *mean* of the minibatch losses (each
    minibatch loss is a token mean over that minibatch).
    """

    ppo: PPOStats
    grad_norms: list[float]  # global gradient norm before clipping, one per minibatch
    micro_batches: int  # forward/backward passes over all minibatches

    @property
    def minibatches(self) -> int:
        """Optimizer steps taken."""
        return len(self.grad_norms)

    def as_dict(self) -> dict[str, float]:
        """Python numbers for logging."""
        return {
            **self.ppo.as_dict(),
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
            "grad_norm_max": max(self.grad_norms),
            "minibatches": float(self.minibatches),
            "micro_batches": float(self.micro_batches),
        }


class PPOBackend(Protocol):
    """What ``proxima.trainer.loop`` needs from a training backend."""

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Token-aligned logprobs of each sample at its temperature, no grad.

        Needed at the loss tokens (entry 0 is never one); a backend may leave 0.0
        at the other positions.
        """
        ...

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """PPO minibatch updates over samples that carry ``prox_logprobs``."""
        ...

    def export_hf(self, out_dir: Path) -> None:
        """Write config, safetensors weights and tokenizer files into ``out_dir``."""
        ...

    def load_hf_weights(self, model_dir: Path) -> None:
        """Replace the model weights by those of an HF safetensors directory."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


@runtime_checkable
class InMemoryWeights(Protocol):
    """A backend whose model's tensors are HF's, by HF name, in this process."""

    def hf_tensors(self) -> Iterable[tuple[str, Any]]:
        """The model's tensors by HF name (tied ones under each name), as they are now."""
        ...


# --------------------------------------------------------------------------- shared step logic


def split_minibatches(samples: Sequence[Sample], n: int) -> list[list[Sample]]:
    """Split samples into ``n`` disjoint minibatches along session boundaries.

    Sessions (in order of first appearance) are cut into ``n`` contiguous
    slices of equal count (sizes differ by at most one); all samples of one
    session land in the same minibatch. Fewer sessions than ``n`` give fewer
    (never empty) minibatches.
    """
    sessions: dict[str, list[Sample]] = {}
    for sample in samples:
        sessions.setdefault(sample.session_id, []).append(sample)
    groups = list(sessions.values())
    slices = fixed_micro_batches([len(g) for g in groups], n)
    return [[s for i in indices for s in groups[i]] for indices in slices]


def micro_batches(
    samples: Sequence[Sample], batching: BatchingConfig, *, replicas: int = 1
) -> list[list[int]]:
    """Dynamic micro-batch plan of ``samples`` (indices into it) under the token budget.

    At least ``max(batching.min_mbs, replicas)`` micro-batches (fewer only with
    fewer samples), so each of ``replicas`` data-parallel replicas gets one
    (AReaL raises ``min_mbs`` to the data-parallel size the same way).
    """
    return plan_micro_batches(
        [s.num_tokens for s in samples],
        batching.max_tokens_per_mb,
        max(batching.min_mbs, replicas),
    )


def assign_to_replicas(costs: Sequence[int], replicas: int) -> list[list[int]]:
    """Deal items (micro-batches, costed in tokens) to data-parallel replicas, balancing cost.

    Largest first, each to the replica with the least cost so far (the lowest
    index on ties; greedy LPT scheduling). A function of ``costs`` alone, so
    every rank computes the same assignment. Returns, per replica, its item
    indices in ascending order; a replica gets none when there are fewer items
    than replicas.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    loads = [0] * replicas
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(replicas), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += costs[i]
    return [sorted(share) for share in shares]


def ppo_loss_fn(ppo: PPOConfig, total_loss_tokens: int) -> LossFn:
    """The decoupled PPO loss of ``ppo`` normalised by a minibatch's loss-token count."""
    return functools.partial(
        decoupled_ppo_loss,
        eps_clip=ppo.eps_clip,
        eps_clip_high=ppo.eps_clip_high,
        importance_weight_cap=ppo.importance_weight_cap,
        total_loss_tokens=total_loss_tokens,
    )


def loss_inputs_allowed(has_prox: bool, *, first_minibatch: bool) -> None:
    """Raise unless the proximal logprobs are present or may come from the training pass."""
    if not has_prox and not first_minibatch:
        raise ValueError(
            "train_step with ppo_minibatches > 1 needs samples with prox_logprobs (recompute "
            "them with compute_logprobs, or set them to the behaviour logprobs for standard PPO)"
        )


def loss_inputs(packed: PackedBatch, *, first_minibatch: bool) -> dict[str, Tensor | None]:
    """Keyword tensors of :func:`ppo_loss_fn` for a packed micro-batch, shape ``(T,)``.

    Samples without ``prox_logprobs`` are allowed in the first minibatch of a
    step only: its weights are still those before the step, so the loss takes
    the proximal logprobs from the training forward pass itself.
    """
    loss_inputs_allowed(packed.prox_logprobs is not None, first_minibatch=first_minibatch)
    return {
        "prox_logprobs": packed.prox_logprobs,
        "behav_logprobs": packed.behav_logprobs,
        "advantages": packed.advantages,
        "loss_mask": packed.loss_mask,
    }


def logprobs_by_sample(
    samples: Sequence[Sample],
    batching: BatchingConfig,
    forward: Callable[[PackedBatch], Tensor],
) -> list[list[float]]:
    """Run ``forward`` (packed ``(T,)`` logprobs, no grad) over micro-batches; back in input order."""
    found = logprobs_of(samples, micro_batches(samples, batching), forward)
    return in_input_order(found, len(samples))


def logprobs_of(
    samples: Sequence[Sample],
    plan: Sequence[Sequence[int]],
    forward: Callable[[PackedBatch], Tensor],
) -> dict[int, list[float]]:
    """Token-aligned logprobs of the samples in ``plan``'s micro-batches, by sample index."""
    out: dict[int, list[float]] = {}
    for indices in plan:
        packed = pack([samples[i] for i in indices])
        values = forward(packed)  # (T,)
        out.update(zip(indices, unpack(packed, values), strict=True))
    return out


def in_input_order(found: dict[int, list[float]], count: int) -> list[list[float]]:
    """``found[0], ..., found[count - 1]``; raises if the plan left a sample out."""
    missing = [i for i in range(count) if i not in found]
    if missing:
        raise RuntimeError(f"micro-batch plan left out samples {missing}")
    return [found[i] for i in range(count)]


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer and generation-config files of an HF directory (those present)."""
    for name in TOKENIZER_FILES:
        path = src / name
        if path.is_file() and not (dst / name).exists():
            shutil.copyfile(path, dst / name)


def step_stats(stats: list[PPOStats], losses: list[Tensor], grad_norms: list[float]) -> StepStats:
    merged = PPOStats.merge(stats)
    mean_loss = torch.stack(losses).mean()
    return StepStats(
        ppo=PPOStats(
            loss=mean_loss,
            loss_tokens=merged.loss_tokens,
            masked_tokens=merged.masked_tokens,
            clip_fraction=merged.clip_fraction,
            importance_weight_mean=merged.importance_weight_mean,
            importance_weight_max=merged.importance_weight_max,
            approx_kl=merged.approx_kl,
        ),
        grad_norms=grad_norms,
        micro_batches=len(stats),
    )


# --------------------------------------------------------------------------- optimizer


def build_optimizer(params: Iterable[Tensor], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` with the configured learning rate, betas and weight decay."""
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
    )


def clip_grad_norm(
    params: Iterable[Tensor], max_norm: float | None, *, norm: float | None = None
) -> float:
    """The global L2 gradient norm before clipping; gradients scaled to ``max_norm`` when set.

    ``norm``: the norm when the caller computed it itself (megatron counts
    each tensor-parallel shard once over the model-parallel group); otherwise
    the norm of these parameters' gradients. Clipping is torch's
    (``clip_grad_norm_``'s scale ``max_norm / (norm + 1e-6)``, at most 1).
    """
    with_grad = [p for p in params if p.grad is not None]
    if norm is None:
        norm = float(
            torch.nn.utils.get_total_norm([p.grad for p in with_grad if p.grad is not None])
        )
    if max_norm is not None and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, torch.tensor(norm))
    return norm


# --------------------------------------------------------------------------- HF weights


def read_hf_state_dict(model_dir: str | Path, device: str = "cpu") -> dict[str, Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded), on ``device``."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors checkpoint files")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device=device))
    return state


def check_loaded_keys(result: Any, *, what: str, ignore: Callable[[str], bool]) -> None:
    """Raise unless ``load_state_dict(strict=False)``'s ``result`` matched every key.

    ``ignore(key)``: missing keys that are expected (tied weights, megatron's
    ``_extra_state``). The message names ``what`` and the first keys of each kind.
    """
    missing = [k for k in result.missing_keys if not ignore(k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{what}: missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )
