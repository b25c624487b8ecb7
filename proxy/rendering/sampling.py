"""``Sampling``: how one request's tokens are drawn, from the canonical request to the backend.

One type carries the sampling settings the whole way:

1. a surface writes what its request asks (``Sampling.asked``: OpenAI's
   defaults for what it leaves out, ``max_tokens`` None for the server's);
2. ``service.prepare`` completes it (``dataclasses.replace``): the completion
   budget in ``max_tokens``, the logprob alternatives to report, the logit
   bias checked against the vocabulary, the grammar of a constrained reply, a
   reasoning budget, the decoder that finds stop strings across interruptions;
3. the generation loop (``proxima.proxy.service.generation``) sends it as SGLang's
   ``sampling_params`` on each backend attempt (:meth:`Sampling.wire`, with
   what is left of the budget).

The backend's wire schema (``proxima.proxy.backends.protocol.SamplingParams``)
is the only other shape: SGLang's own field names and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxima.proxy.backends.protocol import SamplingParams

if TYPE_CHECKING:
    from proxima.proxy.rendering.structured import Grammar


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    """At most ``limit`` tokens of reasoning, then ``close_ids`` are forced.

    ``is_open(output_ids)`` says whether a reply still reasons (it opened its
    reasoning and has not closed it). A reply cut at ``limit`` while reasoning
    gets the closing marker appended (as serving engines do with a thinking
    budget) and goes on generating its answer from there.
    """

    limit: int
    close_ids: list[int]
    is_open: Callable[[list[int]], bool]


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling settings of one request (every choice of it draws the same way)."""

    n: int = 1
    max_tokens: int | None = None
    """Asked: the request's completion budget, None for the server's default; once
    prepared, the tokens each choice may generate (:attr:`max_new_tokens`)."""
    max_tokens_default: bool = False
    """Prepared: the request sent no budget, so ``max_tokens`` is the server's
    ``default_max_tokens`` (capped by the context); recorded as such."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: every token
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string) -> added to its logit
    top_logprobs: int = 0  # alternatives per token the backend reports
    grammar: Grammar | None = None
    reasoning_budget: ReasoningBudget | None = None
    decode: Callable[[list[int]], str] | None = None
    """Text of token ids: stop strings that straddle an interruption are found on it."""

    @classmethod
    def asked(
        cls,
        *,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        ignore_eos: bool = False,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[str, float] | None = None,
    ) -> Sampling:
        """What a request asks, None meaning OpenAI's default (``top_k`` 0 or None: off)."""
        return cls(
            n=n,
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=-1 if top_k in (None, 0) else int(top_k),
            min_p=min_p or 0.0,
            stop=list(stop),
            seed=seed,
            ignore_eos=ignore_eos,
            frequency_penalty=frequency_penalty or 0.0,
            presence_penalty=presence_penalty or 0.0,
            logit_bias=logit_bias,
        )

    @property
    def max_new_tokens(self) -> int:
        """The tokens each choice may generate (``max_tokens`` once ``service.prepare`` set it)."""
        assert self.max_tokens is not None, "a prepared request's max_tokens is set"
        return self.max_tokens

    def wire(self, remaining: int) -> SamplingParams:
        """SGLang's ``sampling_params`` for an attempt that may generate ``remaining`` tokens."""
        return SamplingParams(
            max_new_tokens=remaining,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids or None,
            ignore_eos=self.ignore_eos,
            sampling_seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.logit_bias or None,
            **(self.grammar.sampling_fields() if self.grammar is not None else {}),
        )

    @property
    def logit_transforms(self) -> list[str]:
        """What changes the sampled distribution beyond temperature and truncation.

        The backend reports logprobs of the transformed distribution; recorded with
        each completion. The trainer recomputes a grammar's (it replays the recorded
        grammar: ``trainer/constrained.py``), not the others' (``trainer/samples.py``).
        """
        transforms = []
        if self.grammar is not None:
            transforms.append(f"grammar:{self.grammar.kind}")
        if self.logit_bias:
            transforms.append("logit_bias")
        if self.frequency_penalty:
            transforms.append("frequency_penalty")
        if self.presence_penalty:
            transforms.append("presence_penalty")
        return transforms

    def record(self) -> dict[str, Any]:
        """The settings as recorded with each completion."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            **({"min_p": self.min_p} if self.min_p else {}),
            "max_tokens": self.max_tokens,
            # The request sent none: the server's default output cap applied.
            **({"max_tokens_default": True} if self.max_tokens_default else {}),
            "seed": self.seed,
            "stop": self.stop,
            # Grammar / logit_bias / penalties: the transformed distribution's logprobs.
            **({"logit_transforms": self.logit_transforms} if self.logit_transforms else {}),
        }
