"""Next-token selection for one batch row, with the logprob the trainer needs.

The recorded logprob is ``log_softmax(logits / T)`` at the chosen token: the
distribution the token was drawn from *before* top-p / top-k / min-p
truncation (what SGLang reports, and what the trainer recomputes with the same
temperature). Greedy rows use ``T = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxy.engine.schemas import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One chosen token with its logprob and, if asked for, the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[float, int]] | None


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row. Shape: logits ``(B, V)``, temperatures ``(B,)``."""
    return torch.log_softmax(logits / temperatures.unsqueeze(-1), dim=-1)  # (B, V)


def effective_temperature(params: SamplingParams) -> float:
    """The temperature logprobs are computed with (1.0 for greedy requests)."""
    return 1.0 if params.is_greedy else params.temperature


def truncated_probs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p truncation (unnormalised). Shape ``(V,)``."""
    probs = logprobs.exp()  # (V,)
    vocab = probs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def choose_token(
    logits: torch.Tensor,
    logprobs: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    top_logprobs_num: int = 0,
) -> SampledToken:
    """Pick the next token of one row from its raw logits and scaled logprobs, both ``(V,)``.

    Greedy rows take the argmax of the raw logits, exactly as HF's greedy search.
    """
    if params.is_greedy:
        token_id = int(torch.argmax(logits))
    else:
        probs = truncated_probs(logprobs, params)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    top: list[tuple[float, int]] | None = None
    if top_logprobs_num > 0:
        values, ids = torch.topk(logprobs, min(top_logprobs_num, logprobs.shape[-1]))
        top = [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
    return SampledToken(token_id=token_id, logprob=float(logprobs[token_id]), top_logprobs=top)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded if ``seed`` is given, else from OS entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
