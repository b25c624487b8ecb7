"""Logit transforms applied before sampling: penalties, grammar masks, logit bias.

In SGLang's order (``SamplingBatchInfo.apply_logits_bias``), on the raw logits,
before temperature:

1. frequency / presence penalties (OpenAI's definition)::

       logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty

   where ``c[j]`` counts token ``j`` among the tokens generated so far (the
   prompt does not count);
2. the grammar mask: tokens the request's grammar forbids get ``-inf``;
3. ``logit_bias``: ``logit[j] += bias[j]`` (a forbidden token stays ``-inf``).

The sampler then draws from, and reports logprobs of, the transformed
distribution, as SGLang does. The proxy marks such completions
(``sampling["logit_transforms"]``). A grammar's mask the trainer replays (the
grammar is recorded with the completion), so it recomputes these very logprobs
and trains the tokens (``trainer/constrained.py``); penalties and bias it does
not, and leaves those completions out of the loss (``trainer/logit_transforms.py``).

Rows without any transform are left untouched, so an unconstrained request
samples the same tokens whatever batch it shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from proxima.proxy.backends.protocol import SamplingParams
from proxima.proxy.embedded.grammar import RowGrammar, apply_grammar_masks


def has_penalties(params: SamplingParams) -> bool:
    """Whether the request asks for frequency or presence penalties."""
    return params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor, output_ids: Sequence[int], params: SamplingParams
) -> None:
    """Frequency and presence penalties on one row, in place. Shape: logits ``(V,)``."""
    if not output_ids:
        return
    ids = torch.tensor(output_ids, dtype=torch.long)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]]  # (V,)
    counts = counts.to(logits.dtype)
    # logit[j] -= c[j] * alpha_frequency + 1[c[j] > 0] * alpha_presence
    logits -= counts * params.frequency_penalty + (counts > 0).to(logits.dtype) * (
        params.presence_penalty
    )


def apply_logit_bias(logits: torch.Tensor, bias: dict[str, float]) -> None:
    """Add ``bias[token id]`` to one row, in place. Shape: logits ``(V,)``."""
    ids = torch.tensor([int(k) for k in bias], dtype=torch.long)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype)
    logits.index_add_(0, ids, values)


def transform_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    grammars: Sequence[RowGrammar | None],
) -> torch.Tensor:
    """Apply every row's penalties, grammar mask and logit bias. Shape: logits ``(B, V)``.

    Returns float32 logits (a copy when any row is transformed; the input
    otherwise).
    """
    logits = logits.float()
    rows = [
        i
        for i, p in enumerate(params)
        if has_penalties(p) or p.logit_bias or grammars[i] is not None
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        if has_penalties(params[i]):
            apply_penalties(logits[i], outputs[i], params[i])
    apply_grammar_masks(logits, grammars)
    for i in rows:
        bias = params[i].logit_bias
        if bias:
            apply_logit_bias(logits[i], bias)
    return logits
