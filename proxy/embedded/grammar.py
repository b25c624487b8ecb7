"""Constrained decoding for the engine: SGLang's grammar parameters, compiled with xgrammar.

A request may carry one of SGLang's grammar sampling parameters (all strings):

- ``json_schema``: a JSON schema (``"$$ANY$$"`` means any JSON value, as in SGLang);
- ``regex``: a regular expression the whole output must match;
- ``ebnf``: a GBNF/EBNF grammar whose ``root`` rule the output must match;
- ``structural_tag``: an xgrammar structural tag (JSON), e.g. tool calls of
  fixed functions with arguments that follow their schemas.

xgrammar (the library SGLang itself uses, same version pin) compiles it
against the tokenizer once per distinct grammar (cached), and a
``GrammarMatcher`` per request tracks where in the grammar the output is.
Before each sampling step the matcher writes the set of allowed next tokens
into a token bitmask row; disallowed logits become ``-inf``. When the grammar
is complete only the stop tokens are allowed; once one is sampled (or the
grammar admits nothing else) the request stops.

Special tokens (``<|im_start|>`` ...) are never allowed inside a grammar: the
tokenizer's special ids are given to xgrammar as empty strings, which it
treats as special. xgrammar's own detection misses them for tokenizers whose
specials were added to a plain byte-level BPE.

JSON whitespace: a ``json_schema`` grammar allows exactly the serialisation
chat templates write with ``tojson`` (Python's ``json.dumps`` defaults: ``", "``
between items, ``": "`` after keys, nothing else), so a constrained reply stays
in the distribution the model was trained on and cannot spend its budget on
runs of blanks at temperature 1. Structural tags (forced tool calls) carry
their own bound, ``max_whitespace_cnt`` (``proxy/rendering/structured.py``: one
whitespace character between JSON tokens).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import xgrammar as xgr
from proxima.proxy.embedded.schema_rules import unenforceable_schema_reason, xgrammar_message
from transformers import PreTrainedTokenizerBase

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "ebnf", "structural_tag")
ANY_JSON = "$$ANY$$"
"""SGLang's ``json_schema`` value for "any JSON value"."""
TOJSON_SEPARATORS = (", ", ": ")
"""The item and key separators of ``tojson`` (``json.dumps``' defaults)."""


class InvalidGrammarError(ValueError):
    """The grammar does not compile (bad schema, regex or EBNF)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One grammar sampling parameter: which kind and its text."""

    kind: GrammarKind
    value: str


def grammar_of(
    *,
    json_schema: str | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    structural_tag: str | None = None,
) -> GrammarSpec | None:
    """The request's grammar, or None; ``ValueError`` when more than one is set.

    Empty strings mean unset, as in SGLang.
    """
    given = [
        GrammarSpec(kind, value)
        for kind, value in zip(
            GRAMMAR_KINDS, (json_schema, regex, ebnf, structural_tag), strict=True
        )
        if value
    ]
    if len(given) > 1:
        raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    return given[0] if given else None


def tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens marked special.

    ``vocab_size`` is the model's (the logits' width), which may exceed the
    tokenizer's; ids without a token are never allowed.
    """
    stops = sorted(set(stop_token_ids))
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            vocab[index] = token
    for index in tokenizer.all_special_ids:
        if index < vocab_size:
            vocab[index] = ""  # empty = special for xgrammar: never inside a grammar
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=detected.add_prefix_space,
    )


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer; results are cached by xgrammar.

    Thread-safe: the event loop compiles (so a bad grammar is a 400 at
    submission), the worker thread only uses compiled grammars.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar; :class:`InvalidGrammarError` with xgrammar's message."""
        try:
            with self._lock:
                return self._compile(spec)
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
            raise InvalidGrammarError(
                f"Failed to compile {spec.kind} grammar: {xgrammar_message(exc)}"
            ) from exc

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            if spec.value == ANY_JSON:
                return self._compiler.compile_builtin_json_grammar()
            reason = unenforceable_schema_reason(json.loads(spec.value))
            if reason is not None:
                raise ValueError(f"the JSON schema at {reason}")
            return self._compiler.compile_json_schema(
                spec.value, any_whitespace=False, separators=TOJSON_SEPARATORS
            )
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.value)
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.value)
        return self._compiler.compile_structural_tag(spec.value)

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int]) -> RowGrammar:
        """A fresh per-request matcher at the start of ``compiled``.

        Once the grammar is complete only stop tokens are allowed: the model's
        eos tokens (even with ``ignore_eos``: a finished grammar admits nothing
        else) and the request's ``stop_token_ids``. The eos tokens must stay in
        the set: xgrammar treats a stop token dropped by an override as an
        ordinary empty token, which it would then allow inside strings.
        """
        stops = sorted(set(self.info.stop_token_ids) | set(stop_token_ids))
        if stops:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        else:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return RowGrammar(matcher, self.vocab_size)


class RowGrammar:
    """One request's position in its grammar (used by the worker thread only)."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; ``RuntimeError`` if the mask should have excluded it."""
        if not self.try_accept(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the request's grammar")

    def try_accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (nothing changes) if the grammar forbids it.

        That happens only when the grammar allows no token at all (a schema no
        output satisfies, such as a ``$ref`` to itself): every logit was
        masked, and the sampler drew from nothing.
        """
        return bool(self._matcher.accept_token(token_id))


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[RowGrammar | None]) -> None:
    """Set the logits of tokens a row's grammar forbids to ``-inf``, in place.

    Shape: logits ``(B, V)``; ``grammars[i]`` is row ``i``'s grammar or None
    (unconstrained rows are left exactly as they are).
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab_size = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)  # (B, ceil(V / 32)) int32
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
