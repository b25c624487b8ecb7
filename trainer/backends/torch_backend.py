"""The PPO backend interface, its torch implementation, and megatron behind the same interface.

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
  recovery and checkpoints (``proxima.trainer.weights``).

:class:`TorchBackend` runs an HF ``AutoModelForCausalLM`` in float32 on the CPU
or one GPU with the exact packed attention of ``proxima.trainer.logprobs``.
:class:`MegatronPPOBackend` drives ``MegatronBackend`` (megatron-core, one
process or tensor x data parallel under torchrun; its optimizer step does the
backward/clip/step of the loop above) through the same interface; under data
parallelism each replica runs its share of every minibatch's micro-batches
(:func:`assign_to_replicas`) and the gradients are summed.
:func:`build_backend` picks by ``cfg.backend``. Both share the minibatch
split, the micro-batch plan and the loss, so on the same batch they compute
the same loss.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from proxima.trainer.batching import (
    PackedBatch,
    fixed_micro_batches,
    pack,
    plan_micro_batches,
    unpack,
)
from proxima.trainer.config import BatchingConfig, OptimConfig, PPOConfig, TrainerConfig
from proxima.trainer.logprobs import forward_logprobs, use_varlen_attention
from proxima.trainer.loss import PPOStats, decoupled_ppo_loss
from proxima.trainer.samples import Sample
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM

logger = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- torch


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first GPU when there is one, else CPU; otherwise ``torch.device(device)``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; set device = cpu")
    return resolved


class TorchBackend:
    """An HF causal LM in float32 with AdamW, on the CPU or one GPU.

    The model runs with ``proxima_varlen_sdpa`` attention (exact packed
    sequences, see ``proxima.trainer.logprobs``). Dropout should be 0 in the model
    config (HF's default for Qwen2/Llama): proximal and current logprobs are
    then the same function of the weights, so the first minibatch starts at
    ``ratio = 1`` exactly.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        ppo: PPOConfig,
        batching: BatchingConfig,
        optim: OptimConfig,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.ppo = ppo
        self.batching = batching
        self.optim_config = optim
        self.device = resolve_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.to(self.device)
        use_varlen_attention(self.model)
        if optim.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
        )
        logger.info(
            "torch backend ready",
            extra={"model_dir": str(self.model_dir), "device": str(self.device)},
        )

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Token-aligned logprobs of each sample with the current weights (no grad).

        Computed at loss tokens only (the generated ones, where PPO reads them);
        every other entry is 0.0.
        """
        self.model.eval()
        with torch.no_grad():
            return logprobs_by_sample(
                samples,
                self.batching,
                lambda packed: forward_logprobs(
                    self.model, packed.to(self.device), loss_tokens_only=True
                ),
            )

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """``ppo.ppo_minibatches`` AdamW steps (see the module docstring)."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self.model.train()
        stats: list[PPOStats] = []
        losses: list[Tensor] = []
        grad_norms: list[float] = []
        minibatches = split_minibatches(samples, self.ppo.ppo_minibatches)
        for k, minibatch in enumerate(minibatches):
            total_loss_tokens = sum(s.num_loss_tokens for s in minibatch)
            loss_fn = ppo_loss_fn(self.ppo, total_loss_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            mb_stats = []
            for indices in micro_batches(minibatch, self.batching):
                packed = pack([minibatch[i] for i in indices]).to(self.device)
                logprobs = forward_logprobs(self.model, packed, loss_tokens_only=True)  # (T,)
                loss, loss_stats = loss_fn(logprobs, **loss_inputs(packed, first_minibatch=k == 0))
                loss.backward()  # micro-batch losses sum to the minibatch token mean
                mb_stats.append(loss_stats)
            grad_norms.append(self._clip_grad_norm())
            self.optimizer.step()
            merged = PPOStats.merge(mb_stats)
            losses.append(merged.loss)
            stats.extend(mb_stats)
        self.optimizer.zero_grad(set_to_none=True)
        return _step_stats(stats, losses, grad_norms)

    def _clip_grad_norm(self) -> float:
        """Global L2 gradient norm before clipping; clipped to ``optim.grad_clip`` when set."""
        max_norm = self.optim_config.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm if max_norm is not None else float("inf")
        )
        return float(norm)

    def export_hf(self, out_dir: Path) -> None:
        """``save_pretrained`` (safetensors; tied weights stored once) plus tokenizer files."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out_dir)

    def load_hf_weights(self, model_dir: Path) -> None:
        """Load every ``*.safetensors`` file of ``model_dir`` into the model (all weights needed)."""
        state: dict[str, Tensor] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(file), device=str(self.device)))
        if not state:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files")
        result = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if self.model.config.tie_word_embeddings:
            tied.add("lm_head.weight")
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{model_dir} does not match the model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state (tensors stay on their device)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model and optimizer state saved by :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _step_stats(stats: list[PPOStats], losses: list[Tensor], grad_norms: list[float]) -> StepStats:
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


# --------------------------------------------------------------------------- megatron


class MegatronPPOBackend:
    """:class:`PPOBackend` over ``MegatronBackend`` (megatron-core GPTModel).

    One process (CPU with gloo, or one GPU), or one per rank under
    ``torchrun``: world = ``tensor_parallel`` x data-parallel replicas
    (pipeline parallel 1). Under torchrun every rank holds one of these and
    every call must be made on every rank with the same arguments (the
    trainer loop's rank 0 broadcasts them); each replica then runs its share
    of the micro-batches (ranks of one tensor-parallel group the same share),
    and every rank returns the whole result. :meth:`state_dict` gathers
    replica 0's tensor-parallel shards on rank 0 (the replicas are identical).
    """

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig) -> None:
        from proxima.trainer.backends.megatron_backend import (
            MegatronBackend,
            MegatronParallelConfig,
        )

        self.model_dir = Path(model_dir)
        self.ppo = cfg.ppo
        self.batching = cfg.batching
        torch.manual_seed(cfg.seed)
        parallel = MegatronParallelConfig(
            tensor_parallel=cfg.megatron.tensor_parallel,
            pipeline_parallel=cfg.megatron.pipeline_parallel,
            seed=cfg.seed,
            make_vocab_size_divisible_by=cfg.megatron.make_vocab_size_divisible_by,
        )
        # Refuses a world size that is not a multiple of tensor_parallel * pipeline_parallel.
        self.megatron = MegatronBackend(self.model_dir, optim=cfg.optim, parallel=parallel)

    def _my_share(self, samples: Sequence[Sample], plan: list[list[int]]) -> list[list[int]]:
        """The micro-batches of ``plan`` this data-parallel replica runs (all of them at DP 1)."""
        costs = [sum(samples[i].num_tokens for i in indices) for indices in plan]
        share = assign_to_replicas(costs, self.megatron.data_parallel_size)
        return [plan[j] for j in share[self.megatron.data_parallel_rank]]

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Token-aligned logprobs of each sample with the current weights (no grad).

        Under data parallelism each replica computes its share of the
        micro-batches and the replicas exchange them: every rank returns all.
        """
        plan = micro_batches(samples, self.batching, replicas=self.megatron.data_parallel_size)
        mine = logprobs_of(
            samples, self._my_share(samples, plan), self.megatron.forward_packed_logprobs
        )
        found: dict[int, list[float]] = {}
        for replica in self.megatron.all_gather_data_parallel(mine):
            found.update(replica)
        return in_input_order(found, len(samples))

    def train_step(self, samples: Sequence[Sample]) -> StepStats:
        """One ``MegatronBackend.train_step`` (backward, clip, AdamW) per minibatch.

        Each minibatch is planned into at least one micro-batch per
        data-parallel replica and dealt out by tokens; each replica
        back-propagates its share with the loss normalised by the whole
        minibatch's loss tokens, and ``MegatronBackend`` sums the gradients
        over replicas, so the step equals one process running the minibatch.
        A replica left without micro-batches steps with zero gradients. The
        returned stats merge every replica's (the loss summed over them), the
        same on every rank.
        """
        from proxima.trainer.backends.megatron_backend import MicroBatch

        if not samples:
            raise ValueError("train_step needs at least one sample")
        minibatches = split_minibatches(samples, self.ppo.ppo_minibatches)
        for k, minibatch in enumerate(minibatches):  # on every rank, before any collective
            for sample in minibatch:
                loss_inputs_allowed(sample.prox_logprobs is not None, first_minibatch=k == 0)
        stats: list[PPOStats] = []
        losses: list[Tensor] = []
        grad_norms: list[float] = []
        replicas = self.megatron.data_parallel_size
        for minibatch in minibatches:
            total_loss_tokens = sum(s.num_loss_tokens for s in minibatch)
            plan = micro_batches(minibatch, self.batching, replicas=replicas)
            packs = [pack([minibatch[i] for i in mb]) for mb in self._my_share(minibatch, plan)]
            result = self.megatron.train_step(
                [MicroBatch.from_packed(p) for p in packs], ppo_loss_fn(self.ppo, total_loss_tokens)
            )
            gathered = self.megatron.all_gather_data_parallel(
                (result.loss, [_to_cpu(s) for s in result.stats])
            )
            grad_norms.append(result.grad_norm)  # the global norm: the same on every replica
            losses.append(torch.tensor(sum(loss for loss, _ in gathered)))
            stats.extend(s for _, replica_stats in gathered for s in replica_stats)
        return _step_stats(stats, losses, grad_norms)

    def export_hf(self, out_dir: Path) -> None:
        """HF checkpoint from the megatron weights (``MegatronBackend.export_hf``; rank 0 writes)."""
        self.megatron.export_hf(out_dir, tokenizer_dir=self.model_dir)

    def load_hf_weights(self, model_dir: Path) -> None:
        """Convert an HF safetensors directory into the megatron model (each rank its shard)."""
        from proxima.trainer.backends.megatron_backend import load_hf_weights, read_hf_state_dict

        load_hf_weights(
            self.megatron.model,
            read_hf_state_dict(model_dir),
            self.megatron.hf_config,
            self.megatron.parallel,
        )

    def state_dict(self) -> dict[str, Any]:
        """Model tensors (no ``_extra_state``) and optimizer state.

        Under torchrun: collective; rank 0 gets ``{"ranks": [state of
        tensor-parallel rank t, ...]}`` (on the CPU), the other ranks an empty
        dict. Data-parallel replicas hold the same weights and optimizer
        state, so only replica 0's shards are kept.
        """
        model = {k: v for k, v in self.megatron.model.state_dict().items() if isinstance(v, Tensor)}
        state = {"model": model, "optimizer": self.megatron.optimizer.state_dict()}
        if self.megatron.dist_env.world_size == 1:
            return state
        from megatron.core import parallel_state
        from proxima.trainer.backends.megatron_compat import gather_objects

        mine = None
        if self.megatron.data_parallel_rank == 0:
            mine = (parallel_state.get_tensor_model_parallel_rank(), _to_cpu(state))
        gathered = gather_objects(mine)
        if gathered is None:
            return {}
        shards = sorted((shard for shard in gathered if shard is not None), key=lambda s: s[0])
        return {"ranks": [shard_state for _, shard_state in shards]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (each rank takes its tensor-parallel shard).

        A checkpoint loads into any run with the same ``tensor_parallel``,
        whatever its number of data-parallel replicas.
        """
        from megatron.core import parallel_state

        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        shards = state.get("ranks", [state])  # one process saves its state bare
        if len(shards) != tp_size:
            raise ValueError(
                f"checkpoint holds {len(shards)} tensor-parallel shard(s) (saved with "
                f"tensor_parallel = {len(shards)}), this run has tensor_parallel = {tp_size} "
                f"(world size {self.megatron.dist_env.world_size}): resume with [megatron] "
                f"tensor_parallel = {len(shards)} and a multiple of {len(shards)} processes"
            )
        state = shards[parallel_state.get_tensor_model_parallel_rank()]
        result = self.megatron.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"checkpoint does not match the megatron model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )
        self.megatron.optimizer.load_state_dict(state["optimizer"])


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU (dicts, lists and dataclasses walked)."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _to_cpu(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def build_backend(cfg: TrainerConfig, model_dir: str | Path) -> PPOBackend:
    """The backend ``cfg.backend`` names, loaded from ``model_dir``."""
    if cfg.backend == "megatron":
        return MegatronPPOBackend(model_dir, cfg)
    return TorchBackend(
        model_dir,
        ppo=cfg.ppo,
        batching=cfg.batching,
        optim=cfg.optim,
        device=cfg.device,
        seed=cfg.seed,
    )
