"""``MegatronBackend``: a megatron-core GPTModel's forward logprobs and AdamW step.

``forward_logprobs`` and ``train_step`` with tensor and data parallelism
under ``torchrun`` (world = tensor parallel x data parallel; gradients summed
over the data-parallel group, clipped by the global norm, then AdamW:
``proxima.trainer.backends.base`` builds the optimizer and clips). Packed
inputs (several sequences in one row, ``position_ids`` restarting at 0) are
run as a padded batch of their sequences, because the local attention has no
variable-length (THD) kernel and megatron's RoPE ignores ``position_ids``.
The model comes from ``model``, its weights from ``convert``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from proxima.trainer.backends.base import build_optimizer, clip_grad_norm, read_hf_state_dict
from proxima.trainer.backends.megatron.compat import (
    cpu_device_shim,
    cuda_available,
    init_distributed,
    init_model_parallel,
)
from proxima.trainer.backends.megatron.convert import export_hf, load_hf_weights, to_hf_state_dict
from proxima.trainer.backends.megatron.model import (
    MegatronParallelConfig,
    build_gpt_model,
    model_shape,
)
from proxima.trainer.batching import PackedBatch
from proxima.trainer.config import OptimConfig
from proxima.trainer.loss import token_logprobs
from torch import Tensor
from transformers import AutoConfig

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class _Segment:
    row: int
    start: int
    end: int  # exclusive

    @property
    def length(self) -> int:
        return self.end - self.start


def split_segments(position_ids: Tensor) -> list[_Segment]:
    """Sequences in a (possibly packed) ``(B, T)`` batch: each starts where its position is 0.

    Positions must count ``0, 1, 2, ...`` within each sequence; anything else
    (left padding, offsets) is rejected rather than silently mis-rotated.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (B, T), got shape {tuple(position_ids.shape)}")
    segments: list[_Segment] = []
    positions = position_ids.cpu()
    for row in range(positions.shape[0]):
        starts = torch.nonzero(positions[row] == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError(f"position_ids row {row} must start at 0 (no left padding)")
        bounds = [*starts, positions.shape[1]]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            expected = torch.arange(end - start)
            if not torch.equal(positions[row, start:end], expected):
                raise ValueError(
                    f"position_ids row {row}[{start}:{end}] must count 0..{end - start - 1} "
                    "within each packed sequence"
                )
            segments.append(_Segment(row=row, start=start, end=end))
    return segments


def causal_attention_mask(length: int, device: torch.device) -> Tensor:
    """megatron's mask convention: True where attention is blocked. Shape (1, 1, L, L)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[
        None, None
    ]


def unpack_rows(
    input_ids: Tensor, position_ids: Tensor, temperature: float | Tensor
) -> tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor], float | Tensor]:
    """Packed rows ``(B, T)`` as a right-padded batch of their sequences ``(N, L)``.

    Returns the padded ids, the ``(row, column)`` of each target in the
    ``(B, T - 1)`` output and its ``(segment, column)`` in the padded batch
    (index tuples for ``index_put`` / indexing), and the temperature per
    padded target (``temperature`` itself when a float; padding gets 1).
    """
    device = input_ids.device
    segments = split_segments(position_ids)
    longest = max(s.length for s in segments)
    padded = input_ids.new_zeros(len(segments), longest)  # (N, L), right-padded
    for n, s in enumerate(segments):
        padded[n, : s.length] = input_ids[s.row, s.start : s.end]
    # (row, column) in the output and (segment, column) in the padded batch, per target.
    out_rows: list[int] = []
    out_cols: list[int] = []
    seg_idx: list[int] = []
    seg_cols: list[int] = []
    for n, s in enumerate(segments):
        count = s.length - 1
        out_rows += [s.row] * count
        out_cols += range(s.start, s.end - 1)
        seg_idx += [n] * count
        seg_cols += range(count)
    index = (
        torch.tensor(out_rows, device=device),
        torch.tensor(out_cols, device=device),
    )
    seg_index = (
        torch.tensor(seg_idx, device=device),
        torch.tensor(seg_cols, device=device),
    )
    seg_temperature: float | Tensor = temperature
    if isinstance(temperature, Tensor):
        seg_temperature = torch.ones(len(segments), longest - 1, device=device)
        seg_temperature = seg_temperature.index_put(seg_index, temperature[index])
    return padded, index, seg_index, seg_temperature


# --------------------------------------------------------------------------- backend

StatsT = TypeVar("StatsT")
ObjT = TypeVar("ObjT")
LossFn = Callable[..., tuple[Tensor, StatsT]]
"""``loss_fn(logprobs, **loss_inputs) -> (loss, stats)``; losses are summed over micro-batches."""


@dataclass
class MicroBatch:
    """One forward/backward pass of a training step.

    ``loss_inputs`` are passed to the loss function as keyword arguments
    (e.g. ``advantages``, ``behav_logprobs``, ``prox_logprobs``, ``loss_mask``,
    each shaped like the logprobs, ``(B, T - 1)``).
    """

    input_ids: Tensor  # (B, T)
    position_ids: Tensor | None = None  # (B, T); None: one sequence per row
    temperature: float | Tensor = 1.0  # float or broadcastable to (B, T - 1)
    loss_inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_packed(cls, packed: PackedBatch) -> MicroBatch:
        """A trainer micro-batch as one packed row, with the PPO loss inputs.

        ``loss_inputs`` match :func:`proxima.trainer.loss.decoupled_ppo_loss`'s tensor
        arguments (``prox_logprobs`` None when the batch carries none: the loss
        then takes them from the training pass, see ``proxima.trainer.loss``). The
        packed row's last target slot is dropped: it ends a sequence, so its
        ``loss_mask`` is 0.
        """
        prox = None if packed.prox_logprobs is None else packed.prox_logprobs[None, :-1]
        return cls(
            input_ids=packed.input_ids[None],  # (1, T)
            position_ids=packed.position_ids[None],  # (1, T)
            temperature=packed.temperatures[None, :-1],  # (1, T-1)
            loss_inputs={
                "prox_logprobs": prox,
                "behav_logprobs": packed.behav_logprobs[None, :-1],
                "advantages": packed.advantages[None, :-1],
                "loss_mask": packed.loss_mask[None, :-1],
            },
        )


@dataclass
class TrainStepResult(Generic[StatsT]):
    """What one optimizer step reports."""

    loss: float  # sum over this replica's micro-batches of the losses returned by loss_fn
    grad_norm: float  # global L2 norm of the gradient before clipping
    stats: list[StatsT]  # loss_fn's stats, one per micro-batch, in order


class MegatronBackend:
    """A megatron-core GPTModel with the trainer's backend interface.

    Under ``torchrun`` every process constructs one; ranks sharing a
    tensor-parallel group must be fed the same micro-batches, data-parallel
    replicas different ones (possibly none). Gradients are summed over the
    data-parallel group (losses are normalised globally) and clipped by the
    global norm before each AdamW step, so every replica takes the same step.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        optim: OptimConfig | None = None,
        parallel: MegatronParallelConfig | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.optim_config = optim or OptimConfig()
        self.parallel = parallel or MegatronParallelConfig()
        self.dist_env = init_distributed()
        if cuda_available():
            # The current device is per thread, and the trainer loop builds and runs
            # the backend on its compute thread, not where the process group was made.
            torch.cuda.set_device(self.dist_env.local_rank)
        world = self.dist_env.world_size
        model_parallel = self.parallel.tensor_parallel * self.parallel.pipeline_parallel
        if world % model_parallel:
            raise ValueError(
                f"world size {world} is not a multiple of tensor_parallel * pipeline_parallel = "
                f"{model_parallel}: the world is model-parallel groups of {model_parallel} times "
                f"data-parallel replicas; launch a multiple of {model_parallel} processes (e.g. "
                f"torchrun --nproc-per-node {model_parallel}) or change [megatron] tensor_parallel"
            )
        init_model_parallel(
            tensor_parallel=self.parallel.tensor_parallel,
            pipeline_parallel=self.parallel.pipeline_parallel,
            seed=self.parallel.seed,
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cuda_available()
            else torch.device("cpu")
        )
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.shape = model_shape(self.hf_config, self.parallel)
        self.model = build_gpt_model(
            self.hf_config,
            self.parallel,
            gradient_checkpointing=self.optim_config.gradient_checkpointing,
        )
        load_hf_weights(
            self.model, read_hf_state_dict(self.model_dir), self.hf_config, self.parallel
        )
        self.optimizer = build_optimizer(self.model.parameters(), self.optim_config)
        logger.info(
            "megatron backend ready",
            extra={
                "model_dir": str(self.model_dir),
                "tensor_parallel": self.parallel.tensor_parallel,
                "data_parallel": parallel_state.get_data_parallel_world_size(),
                "device": str(self.device),
            },
        )

    # ------------------------------------------------------------------ forward

    def _run(self, input_ids: Tensor) -> Tensor:
        """Logits of right-aligned, unpacked sequences. (N, L) -> (N, L, V) over the real vocab."""
        mask = causal_attention_mask(input_ids.shape[1], self.device)  # (1, 1, L, L)
        # megatron's learned-position path is unused with RoPE; rotary angles are 0..L-1.
        position_ids = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        with cpu_device_shim():
            logits: Tensor = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask
            )  # (N, L, V_padded)
        return logits[..., : self.shape.vocab_size]  # (N, L, V)

    def _logprobs(
        self, input_ids: Tensor, position_ids: Tensor | None, temperature: float | Tensor
    ) -> Tensor:
        """Next-token logprobs with the autograd graph (if grad is enabled). (B, T) -> (B, T-1)."""
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        if isinstance(temperature, Tensor):
            temperature = torch.broadcast_to(temperature.to(self.device), (batch, length - 1))
        single = position_ids is None or torch.equal(
            position_ids.cpu(), torch.arange(length).expand(batch, length)
        )
        if single:
            logits = self._run(input_ids)  # (B, T, V)
            return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)  # (B, T-1)

        assert position_ids is not None
        padded, index, seg_index, seg_temperature = unpack_rows(
            input_ids, position_ids, temperature
        )
        logits = self._run(padded)  # (N, L, V)
        seg_logprobs = token_logprobs(logits[:, :-1], padded[:, 1:], seg_temperature)  # (N, L-1)
        # The last token of a packed sequence has no next token: its slot stays 0.
        out = seg_logprobs.new_zeros(batch, length - 1)  # (B, T-1)
        return out.index_put(index, seg_logprobs[seg_index])

    def forward_packed_logprobs(
        self, packed: PackedBatch, temperature: float | Tensor | None = None
    ) -> Tensor:
        """Logprobs of a packed micro-batch's ``targets``, like ``proxima.trainer.logprobs.forward_logprobs``.

        Shape: ``(T,)`` float32 on CPU, aligned with ``packed.targets``; a
        sequence's last position is 0 (it has no target). ``temperature``
        overrides ``packed.temperatures`` (float or ``(T,)``).
        """
        temps = packed.temperatures if temperature is None else temperature
        if isinstance(temps, Tensor):
            temps = torch.broadcast_to(temps, packed.input_ids.shape)[None, :-1]  # (1, T-1)
        logprobs = self.forward_logprobs(
            packed.input_ids[None], packed.position_ids[None], temps
        )  # (1, T-1)
        return F.pad(logprobs[0], (0, 1))  # (T,)

    def forward_logprobs(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        temperature: float | Tensor = 1.0,
    ) -> Tensor:
        """Log-probabilities of each next token under ``softmax(logits / temperature)``.

        Shape: ``input_ids`` ``(B, T)``; ``position_ids`` ``(B, T)`` or None (one
        sequence per row); packed rows restart positions at 0 for each
        sequence. Returns ``(B, T - 1)`` float32 on CPU, where ``[b, t]`` is
        ``log p(input_ids[b, t + 1] | prefix)``; slots whose next token starts a
        new packed sequence are 0.
        """
        self.model.eval()
        with torch.no_grad():
            return self._logprobs(input_ids, position_ids, temperature).float().cpu()

    # ------------------------------------------------------------------ training

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn[StatsT]
    ) -> TrainStepResult[StatsT]:
        """One AdamW step over ``micro_batches`` (gradients accumulate across them).

        ``loss_fn(logprobs, **mb.loss_inputs)`` gets logprobs ``(B, T - 1)`` with
        grad and returns ``(loss, stats)``; the step minimises the sum of the
        micro-batch losses (normalise inside the loss, e.g. by the global token
        count of the whole step across data-parallel replicas, as
        ``proxima.trainer.loss.decoupled_ppo_loss`` does with ``total_loss_tokens``).
        Gradients are then summed over data-parallel replicas.

        Under data parallelism a replica may get no micro-batch (fewer
        sequences than replicas): it still joins the gradient all-reduce with
        zero gradients and takes the same optimizer step; its ``stats`` are
        empty and its ``loss`` 0.
        """
        if not micro_batches and self.data_parallel_size == 1:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        stats: list[StatsT] = []
        for mb in micro_batches:
            logprobs = self._logprobs(mb.input_ids, mb.position_ids, mb.temperature)  # (B, T-1)
            inputs = {
                k: v.to(self.device) if isinstance(v, Tensor) else v
                for k, v in mb.loss_inputs.items()
            }
            loss, mb_stats = loss_fn(logprobs, **inputs)
            with cpu_device_shim():
                loss.backward()
            total_loss += float(loss.detach())
            stats.append(mb_stats)
        sum_data_parallel_grads(self.model)
        grad_norm = clip_grad_norm(
            self.model.parameters(),
            self.optim_config.grad_clip,
            norm=model_parallel_grad_norm(self.model),
        )
        self.optimizer.step()
        return TrainStepResult(loss=total_loss, grad_norm=grad_norm, stats=stats)

    # ------------------------------------------------------------------ data parallel

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model: ``world / (tensor_parallel * pipeline_parallel)``."""
        size: int = parallel_state.get_data_parallel_world_size()
        return size

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica; ranks of one tensor-parallel group share it."""
        rank: int = parallel_state.get_data_parallel_rank()
        return rank

    def all_gather_data_parallel(self, obj: ObjT) -> list[ObjT]:
        """Every replica's ``obj`` (picklable, tensors on the CPU), in replica order.

        Collective over the data-parallel group, on megatron's gloo copy of it,
        so objects travel through the CPU on GPU machines too.
        """
        if self.data_parallel_size == 1:
            return [obj]
        out: list[Any] = [None] * self.data_parallel_size
        dist.all_gather_object(out, obj, group=parallel_state.get_data_parallel_group_gloo())
        return out

    # ------------------------------------------------------------------ export

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """Current weights as an HF checkpoint state dict (collective over the TP group)."""
        return to_hf_state_dict(self.model, self.hf_config, self.parallel)

    def export_hf(
        self, out_dir: str | Path, tokenizer_dir: str | Path | None = None
    ) -> Path | None:
        """Write an HF checkpoint for the inference backends; see :func:`export_hf`."""
        return export_hf(
            self.model, self.hf_config, tokenizer_dir or self.model_dir, out_dir, self.parallel
        )


def model_parallel_grad_norm(model: torch.nn.Module) -> float:
    """Global gradient L2 norm over the model-parallel group.

    Parameters replicated across tensor-parallel ranks (norms) are counted
    once, on TP rank 0 (megatron's ``param_is_not_tensor_parallel_duplicate``).
    """
    device = next(model.parameters()).device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for param in model.parameters():
        if param.grad is not None and param_is_not_tensor_parallel_duplicate(param):
            squares = squares + param.grad.float().pow(2).sum()
    model_parallel_group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(squares, group=model_parallel_group)
    return float(squares.sqrt())


def sum_data_parallel_grads(model: torch.nn.Module) -> None:
    """Sum the gradients over data-parallel replicas (one flat all-reduce).

    A sum, not a mean: each replica's loss is already normalised by the
    whole step's token count, so the sum is the gradient of the global
    loss, the same as one process running every micro-batch. A parameter
    with no gradient here (a replica without micro-batches) contributes
    zeros, so every replica reduces the same flat size; afterwards every
    parameter has a gradient (one that no replica reached gets zeros, so
    AdamW still applies its weight decay to it).
    """
    if parallel_state.get_data_parallel_world_size() == 1:
        return
    params = list(model.parameters())
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
