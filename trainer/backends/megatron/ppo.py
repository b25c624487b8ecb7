"""``MegatronPPOBackend``: megatron-core behind the trainer's backend interface.

It drives ``MegatronBackend`` (``proxima.trainer.backends.megatron.backend``:
one process or tensor x data parallel under torchrun; its optimizer step does
the backward/clip/step of a minibatch) with the plan every backend shares
(``proxima.trainer.backends.base``). Under data parallelism each replica runs
its share of every minibatch's micro-batches (``assign_to_replicas``) and the
gradients are summed. megatron-core itself is imported on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from proxima.trainer.backends.base import (
    StepStats,
    assign_to_replicas,
    check_loaded_keys,
    in_input_order,
    logprobs_of,
    loss_inputs_allowed,
    micro_batches,
    ppo_loss_fn,
    read_hf_state_dict,
    split_minibatches,
    step_stats,
)
from proxima.trainer.batching import pack
from proxima.trainer.config import TrainerConfig
from proxima.trainer.loss import PPOStats
from proxima.trainer.samples import Sample
from torch import Tensor


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
        from proxima.trainer.backends.megatron.backend import MegatronBackend
        from proxima.trainer.backends.megatron.model import MegatronParallelConfig

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
        from proxima.trainer.backends.megatron.backend import MicroBatch

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
        return step_stats(stats, losses, grad_norms)

    def export_hf(self, out_dir: Path) -> None:
        """HF checkpoint from the megatron weights (``MegatronBackend.export_hf``; rank 0 writes)."""
        self.megatron.export_hf(out_dir, tokenizer_dir=self.model_dir)

    def load_hf_weights(self, model_dir: Path) -> None:
        """Convert an HF safetensors directory into the megatron model (each rank its shard)."""
        from proxima.trainer.backends.megatron.convert import load_hf_weights

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
        from proxima.trainer.backends.megatron.compat import gather_objects

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
        check_loaded_keys(
            result,
            what="checkpoint does not match the megatron model",
            ignore=lambda k: k.endswith("._extra_state"),
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
