"""Grammar-constrained completions as loss tokens: the policy's logprobs under the engine's mask.

A completion decoded under a grammar (``response_format``, ``tool_choice: required`` or a
named tool, Anthropic ``any``/``tool``) was sampled from the policy ``pi`` masked to the
tokens its grammar allows in each state ``s`` and renormalised. With ``m_s(v) = 1`` on
the allowed tokens, logits ``z`` and sampling temperature ``T``::

    q(y | s) = pi(y | s) m_s(y) / Z(s),     Z(s) = sum_v pi(v | s) m_s(v)
    log q(y | s) = z_y / T - logsumexp_{v : m_s(v) = 1} z_v / T

The backend reports ``b = log q_behav(y | s)``: the embedded engine masks the logits
before its ``log_softmax`` (``proxy/embedded/logits.py``, ``proxy/embedded/sampling.py``),
and SGLang applies the grammar's vocabulary mask to the logits in place before its
sampler computes the logprobs (``apply_logits_bias``, then the sampler's
``log_softmax`` / ``log(softmax)``), so its returned logprobs are post-mask as well.
The trainer computes the proximal and current logprobs ``p``, ``l`` the same way, as
``log q``, under the mask the engine applied: it replays the grammar over the recorded
output tokens with xgrammar (:class:`GrammarReplay`) and writes each position's allowed
set into a token bitmask, which :func:`masked_token_logprobs` applies to the logits.
Then at staleness 0 ``p = b`` and ``w = 1``, and ``grad l = grad z_y / T - E_q[grad z / T]``
is the gradient of the policy that was sampled.

The mask is the backend's: the record names whose rules applied
(``CompletionRecord.grammar["rules"]``). ``proxima-engine`` replays with the engine's
own ``GrammarCompiler`` (special tokens never allowed, ``tojson`` JSON whitespace, the
model's eos tokens as stops); ``sglang`` with SGLang's xgrammar backend's settings at
its default flags (xgrammar's own tokenizer detection, any JSON whitespace, the model
and generation configs' eos tokens as stops). An SGLang server started with other
grammar flags (``--constrained-json-disable-any-whitespace``, a whitespace pattern or
count, strict thinking) masks otherwise than the replay.

Where this departs from the paper (decoupled PPO, ``trainer/loss.py``):

1. The ratios ``w = exp(p - b)`` and ``ratio = exp(l - p)`` of a constrained token are
   ratios of the *constrained* distributions ``q_prox / q_behav`` and ``q / q_prox``: the
   objective is PPO on the policy as it is deployed behind the grammar, not on ``pi``.
   A token the grammar forces (one allowed token) has ``log q = 0`` under every weight:
   ``w = ratio = 1`` and no gradient; it still counts in the token-mean normaliser.
2. A completion whose recorded tokens the replay rejects (the grammar or the rules
   changed, or a backend allowed what the replay does not) cannot have its mask
   recomputed: it is context, as are completions with penalties or ``logit_bias``
   (``trainer/logit_transforms.py``), and completions recorded before the grammar was
   (no ``grammar`` in the record).
3. Only the torch backend (and its LoRA variant) applies the masks; under the megatron
   backend constrained completions stay context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from proxima.proxy.store.records import CompletionRecord

if TYPE_CHECKING:  # torch and xgrammar load on first use: ``samples`` imports this module
    import xgrammar as xgr
    from proxima.proxy.embedded.grammar import RowGrammar
    from torch import Tensor

logger = logging.getLogger(__name__)

RULES = ("proxima-engine", "sglang")
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
_ANY_JSON = "$$ANY$$"


@dataclass(frozen=True, slots=True)
class ConstrainedSpan:
    """A constrained completion's output in a sample: ``input_ids[start:end]``, its grammar."""

    start: int
    end: int
    grammar: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """The allowed next tokens at a sample's constrained tokens.

    ``positions[k]`` is the index in ``input_ids`` of a constrained token and
    ``bitmask[k]`` the tokens the grammar allowed there (xgrammar's layout: token ``i``
    is bit ``i % 32`` of int32 word ``i // 32``). Shape: bitmask ``(K, ceil(V / 32))``.
    """

    positions: tuple[int, ...]
    bitmask: Tensor


class ConstrainedSample(Protocol):
    """What the replay reads of a training sample (``proxima.trainer.samples.Sample``)."""

    @property
    def session_id(self) -> str: ...
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def loss_mask(self) -> list[int]: ...
    @property
    def constraints(self) -> tuple[ConstrainedSpan, ...]: ...

    def with_grammar_mask(self, loss_mask: list[int], mask: GrammarMask | None) -> Self:
        """A copy with ``loss_mask``, ``mask`` as its grammar mask and no spans left."""
        ...


S = TypeVar("S", bound=ConstrainedSample)


def replayable(completion: CompletionRecord) -> bool:
    """Whether a constrained completion's mask can be replayed: its only transform is its
    grammar, and the record holds that grammar with rules the replay knows."""
    transforms = completion.sampling.get("logit_transforms") or []
    grammar = completion.grammar
    return (
        bool(transforms)
        and all(str(t).startswith("grammar:") for t in transforms)
        and isinstance(grammar, Mapping)
        and grammar.get("kind") in KINDS
        and grammar.get("rules") in RULES
        and isinstance(grammar.get("value"), str)
    )


# --------------------------------------------------------------------------- the logprobs


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """xgrammar's int32 token bitmask as booleans. Shape: ``(K, W)`` -> ``(K, vocab_size)``."""
    import torch

    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # (32,)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # (K, W, 32)
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # (K, V)


def masked_token_logprobs(
    logits: Tensor, targets: Tensor, temperature: Tensor, allowed: Tensor
) -> Tensor:
    """``log q(y | s) = z_y / T - logsumexp_{v allowed} z_v / T`` (float32, with grad).

    Shape: logits ``(K, V)``, targets ``(K,)`` int64, temperature ``(K,)``, allowed
    ``(K, V)`` bool -> ``(K,)``. A target the mask forbids gets ``-inf``.
    """
    import torch

    scaled = logits.float() / temperature.to(logits.device, torch.float32).unsqueeze(-1)  # (K, V)
    masked = scaled.masked_fill(~allowed, float("-inf"))  # (K, V)
    target = masked.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (K,)
    return target - torch.logsumexp(masked, dim=-1)  # (K,)


def with_grammar_masks(
    logprobs: Tensor,
    logits: Tensor,
    targets: Tensor,
    grammar: tuple[Tensor | None, Tensor | None],
    temperature: float | Tensor,
    keep: Tensor | None,
) -> Tensor:
    """``logprobs`` ``(T,)`` with every constrained position's entry the masked one.

    ``targets`` ``(T,)`` are a packed micro-batch's and ``grammar`` its
    ``(grammar_positions, grammar_bitmask)`` (``proxima.trainer.batching.PackedBatch``).
    ``logits`` are ``(T, V)``, or ``(K, V)`` at the positions ``keep`` (the loss
    positions); constrained positions outside ``keep`` carry no loss and are left as
    they are. Differentiable through ``logits``.
    """
    import torch

    positions, bitmask = grammar
    if positions is None or bitmask is None or positions.numel() == 0:
        return logprobs
    if keep is None:
        rows = positions
    else:
        row_of = torch.full_like(targets, -1)  # (T,)
        row_of[keep] = torch.arange(keep.numel(), device=keep.device)
        rows = row_of[positions]  # (G,)
        kept = rows >= 0
        rows, positions, bitmask = rows[kept], positions[kept], bitmask[kept]
    temps = torch.broadcast_to(
        torch.as_tensor(temperature, dtype=torch.float32, device=logits.device), targets.shape
    )[positions]  # (G,)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # (G, V)
    values = masked_token_logprobs(logits[rows], targets[positions], temps, allowed)
    return logprobs.index_put((positions,), values)


# --------------------------------------------------------------------------- the replay


class GrammarReplay:
    """Replays recorded grammars over recorded tokens: the mask each token was drawn under.

    Built from the policy's model directory (tokenizer, ``config.json``, eos tokens);
    grammars compile once per rules and text (xgrammar's cache). Not thread-safe: the
    trainer calls it from its compute thread only.
    """

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        self.vocab_size = int(config.get_text_config().vocab_size)
        self.eos_token_ids = eos_token_ids(model_dir, config, self.tokenizer)
        # SGLang's grammar stops: the model config's and generation config's eos, not the
        # tokenizer's (``ModelConfig.hf_eos_token_id``).
        self.sglang_eos_token_ids = eos_token_ids(model_dir, config, None)
        self._compilers: dict[str, Any] = {}

    def bitmask(self, grammar: Mapping[str, Any], output_ids: Sequence[int]) -> Tensor | None:
        """``(len(output_ids), ceil(V / 32))`` int32: the tokens allowed before each output
        token; None when the grammar does not compile or forbids a recorded token."""
        import xgrammar as xgr

        try:
            matcher = self._matcher(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            logger.warning("grammar of a completion does not compile: %s", exc)
            return None
        bitmask = xgr.allocate_token_bitmask(max(len(output_ids), 1), self.vocab_size)
        for i, token in enumerate(output_ids):
            matcher.fill(bitmask, i)
            if not matcher.try_accept(int(token)):
                return None
        return bitmask[: len(output_ids)]

    def _matcher(self, grammar: Mapping[str, Any]) -> RowGrammar:
        """A matcher at the start of ``grammar``, as the backend of its ``rules`` built it."""
        import xgrammar as xgr
        from proxima.proxy.embedded.grammar import GrammarCompiler, GrammarSpec, RowGrammar

        kind, value, rules = grammar["kind"], grammar["value"], grammar["rules"]
        compiler = self._compilers.get(rules)
        if rules == "proxima-engine":
            if compiler is None:
                compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._compilers[rules] = compiler
            # The engine's own matcher: its stops are the eos tokens (the proxy sends no
            # stop_token_ids), allowed once the grammar is complete.
            return compiler.matcher(compiler.compile(GrammarSpec(kind, value)), ())
        if compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(self.sglang_eos_token_ids) or None,
            )
            compiler = xgr.GrammarCompiler(info)
            self._compilers[rules] = compiler
        return RowGrammar(
            xgr.GrammarMatcher(_sglang_compile(compiler, kind, value)), self.vocab_size
        )

    def attach(self, samples: Sequence[S]) -> list[S]:
        """``samples`` with the masks of their constrained spans (``Sample.grammar_mask``).

        A span whose replay fails leaves the loss (mask 0: context, logged); a sample left
        without a loss token is dropped.
        """
        import torch

        out = []
        for sample in samples:
            if not sample.constraints:
                out.append(sample)
                continue
            positions: list[int] = []
            rows: list[Tensor] = []
            loss_mask = list(sample.loss_mask)
            for span in sample.constraints:
                bitmask = self.bitmask(span.grammar, sample.input_ids[span.start : span.end])
                if bitmask is None:
                    logger.warning(
                        "session %s: a constrained completion's grammar does not replay over "
                        "its tokens; trained as context",
                        sample.session_id,
                    )
                    loss_mask[span.start : span.end] = [0] * (span.end - span.start)
                    continue
                positions += range(span.start, span.end)
                rows.append(bitmask)
            if not any(loss_mask):
                continue
            mask = GrammarMask(tuple(positions), torch.cat(rows)) if rows else None
            out.append(sample.with_grammar_mask(loss_mask, mask))
        return out


def _sglang_compile(compiler: xgr.GrammarCompiler, kind: str, value: str) -> xgr.CompiledGrammar:
    """A grammar compiled as SGLang's xgrammar backend compiles it (default server flags)."""
    if kind == "json_schema":
        if value == _ANY_JSON:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(value, any_whitespace=True)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "ebnf":
        return compiler.compile_grammar(value)
    return compiler.compile_structural_tag(value)


def eos_token_ids(model_dir: Path, config: Any, tokenizer: Any | None) -> frozenset[int]:
    """The model's eos tokens as the embedded engine gathers them: the generation
    config's, the model config's and the tokenizer's (the grammar's stop tokens);
    without ``tokenizer``, as SGLang does (the two configs' only)."""
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        sources.append(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
