"""Dynamic micro-batching (AReaL, Fu et al. 2025, algorithm 1) and sequence packing.

A minibatch of variable-length sequences is split into micro-batches whose
*token* count stays under a budget, instead of a fixed number of sequences
padded to the longest one. Each micro-batch is packed into one 1-D row with no
padding; ``position_ids`` restart at 0 for every sequence and attention is
block-diagonal causal (see ``proxima.trainer.logprobs``).

Micro-batching never changes the gradient: the loss of each micro-batch is its
token sum divided by the *global* number of loss tokens (``proxima.trainer.loss``), so
accumulated gradients equal those of one full-batch pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from .samples import Sample

_V = TypeVar("_V", int, float)


def plan_micro_batches(
    lengths: Sequence[int], max_tokens_per_mb: int, min_mbs: int = 1
) -> list[list[int]]:
    """Assign sequences to micro-batches under a token budget (AReaL algorithm 1).

    Sequences are visited longest first. Each goes into the micro-batch with the
    *least* room left among those it fits in (best fit); a new micro-batch is
    opened while fewer than ``min_mbs`` exist or when none has room.

    Args:
        lengths: token count of each sequence, ``(N,)``.
        max_tokens_per_mb: token budget of one micro-batch.
        min_mbs: minimum number of micro-batches (fewer only if ``N < min_mbs``).

    Returns:
        Micro-batches as lists of indices into ``lengths``, in the order they were
        opened; within one, indices in placement order (non-increasing length).
        Every index appears exactly once.

    Raises:
        ValueError: a sequence is longer than ``max_tokens_per_mb`` (the message
            names it and says which setting to raise), or invalid arguments.
    """
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
    if min_mbs < 1:
        raise ValueError(f"min_mbs must be >= 1, got {min_mbs}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, stable
    if order and lengths[order[0]] > max_tokens_per_mb:
        i = order[0]
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, more than batching.max_tokens_per_mb="
            f"{max_tokens_per_mb}; raise max_tokens_per_mb to at least {lengths[i]} "
            "(or cap the agent's context length)"
        )
    micro_batches: list[list[int]] = []
    room: list[int] = []  # tokens left in each micro-batch
    for i in order:
        n = lengths[i]
        best = -1
        if len(micro_batches) >= min_mbs:
            for j, r in enumerate(room):  # best fit: least room that still fits
                if n <= r and (best < 0 or r < room[best]):
                    best = j
        if best < 0:
            micro_batches.append([])
            room.append(max_tokens_per_mb)
            best = len(micro_batches) - 1
        micro_batches[best].append(i)
        room[best] -= n
    return micro_batches


def fixed_micro_batches(lengths: Sequence[int], n: int) -> list[list[int]]:
    """Baseline: split sequences, in their given order, into ``n`` equal-count micro-batches.

    Sizes differ by at most one; no token budget is enforced. With padded batching
    each micro-batch costs ``len(mb) * max(lengths in mb)`` tokens.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    count = len(lengths)
    n = min(n, count)
    if n == 0:
        return []
    bounds = [k * count // n for k in range(n + 1)]  # chunk k is [bounds[k], bounds[k+1])
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n)]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Sequences of one micro-batch concatenated into one row of ``T`` tokens, no padding.

    Target-aligned fields: position ``i`` predicts ``targets[i]``, the next token of
    the same sequence; a sequence's last position has no next token (target 0,
    ``loss_mask`` 0). ``loss_mask``, ``behav_logprobs``, ``prox_logprobs``,
    ``advantages`` and ``versions`` describe ``targets``.
    """

    input_ids: Tensor  # (T,) int64
    position_ids: Tensor  # (T,) int64, 0..L_s-1 for each sequence s
    cu_seqlens: Tensor  # (S+1,) int32, sequence s is input_ids[cu[s]:cu[s+1]]
    targets: Tensor  # (T,) int64, next token within the sequence (0 at a sequence's end)
    loss_mask: Tensor  # (T,) float32, 1 where targets[i] is a trained token
    behav_logprobs: Tensor  # (T,) float32
    advantages: Tensor  # (T,) float32
    versions: Tensor  # (T,) int64, -1 where not trained
    temperatures: Tensor  # (T,) float32, sampling temperature of each position's sequence
    prox_logprobs: Tensor | None = None  # (T,) float32 when every sample carries them
    # Grammar-constrained targets (``proxima.trainer.constrained``): their positions (G,)
    # int64 and the tokens allowed at each (G, ceil(V / 32)) int32; None when there are none.
    grammar_positions: Tensor | None = None
    grammar_bitmask: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """T, tokens in the packed row (all real, no padding)."""
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        """S, sequences in the micro-batch."""
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_loss_tokens(self) -> int:
        """Trained tokens in the micro-batch."""
        return int(self.loss_mask.sum())

    @property
    def seq_lens(self) -> list[int]:
        """Length of each sequence."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str) -> PackedBatch:
        """Copy every tensor to ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            behav_logprobs=self.behav_logprobs.to(device),
            advantages=self.advantages.to(device),
            versions=self.versions.to(device),
            temperatures=self.temperatures.to(device),
            prox_logprobs=None if self.prox_logprobs is None else self.prox_logprobs.to(device),
            grammar_positions=_to(self.grammar_positions, device),
            grammar_bitmask=_to(self.grammar_bitmask, device),
        )


def _to(tensor: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if tensor is None else tensor.to(device)


def _shift(values: Sequence[_V], fill: _V) -> list[_V]:
    """Token-aligned (L,) -> target-aligned (L,): entry i describes token i+1."""
    shifted = list(values[1:])
    shifted.append(fill)
    return shifted


def pack(samples: Sequence[Sample]) -> PackedBatch:
    """Concatenate samples into one :class:`PackedBatch` (next-token targets per sequence)."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    with_prox = [s.prox_logprobs is not None for s in samples]
    if any(with_prox) and not all(with_prox):
        raise ValueError("either every sample or none carries prox_logprobs")
    input_ids: list[int] = []
    position_ids: list[int] = []
    targets: list[int] = []
    loss_mask: list[float] = []
    behav: list[float] = []
    prox: list[float] = []
    adv: list[float] = []
    versions: list[int] = []
    temperatures: list[float] = []
    grammar_positions: list[int] = []
    grammar_rows: list[Tensor] = []
    cu_seqlens = [0]
    for s in samples:
        n = s.num_tokens
        if n == 0:
            raise ValueError(f"empty sample in session {s.session_id}")
        input_ids += s.input_ids
        position_ids += range(n)
        targets += _shift(s.input_ids, 0)
        # The first token is never predicted (no previous position in its sequence); a sample
        # whose first token is trained would silently lose it, so reject that.
        if s.loss_mask[0]:
            raise ValueError(f"sample of session {s.session_id}: the first token cannot be trained")
        loss_mask += _shift(s.loss_mask, 0)
        behav += _shift(s.behav_logprobs, 0.0)
        adv += _shift(s.advantages, 0.0)
        versions += _shift(s.versions, -1)
        if s.prox_logprobs is not None:
            prox += _shift(s.prox_logprobs, 0.0)
        temperatures += [s.temperature] * n
        if s.constraints:
            raise ValueError(
                f"sample of session {s.session_id}: its grammar masks were never replayed "
                "(proxima.trainer.constrained.GrammarReplay.attach)"
            )
        if s.grammar_mask is not None:  # token j is predicted at position j - 1
            grammar_positions += [cu_seqlens[-1] + j - 1 for j in s.grammar_mask.positions]
            grammar_rows.append(s.grammar_mask.bitmask)
        cu_seqlens.append(cu_seqlens[-1] + n)
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.tensor(position_ids, dtype=torch.long),
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(loss_mask, dtype=torch.float32),
        behav_logprobs=torch.tensor(behav, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.long),
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        prox_logprobs=torch.tensor(prox, dtype=torch.float32) if all(with_prox) else None,
        grammar_positions=torch.tensor(grammar_positions, dtype=torch.long)
        if grammar_rows
        else None,
        grammar_bitmask=torch.cat(grammar_rows) if grammar_rows else None,
    )


def unpack(packed: PackedBatch, values: Tensor) -> list[list[float]]:
    """Inverse of the target shift: per-position values ``(T,)`` -> per-sample token-aligned lists.

    Entry ``j`` of sample ``s`` is ``values[cu[s] + j - 1]`` (the value computed at the
    position that predicts token ``j``) and 0.0 for ``j = 0``; e.g. proximal logprobs
    from :func:`proxima.trainer.logprobs.forward_logprobs`, to store on ``Sample.prox_logprobs``.
    """
    if values.shape != packed.input_ids.shape:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, expected {tuple(packed.input_ids.shape)}"
        )
    flat = values.detach().float().cpu().tolist()
    cu = packed.cu_seqlens.tolist()
    return [[0.0, *flat[cu[s] : cu[s + 1] - 1]] for s in range(len(cu) - 1)]
