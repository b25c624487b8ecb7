"""The grammar and logit-transform modules on their own: bitmasks, penalties, logit bias."""

from __future__ import annotations

import json
import math

import pytest
import torch
from proxima.proxy.backends.protocol import SamplingParams
from proxima.proxy.embedded.grammar import (
    ANY_JSON,
    GrammarCompiler,
    GrammarSpec,
    InvalidGrammarError,
    apply_grammar_masks,
    grammar_of,
)
from proxima.proxy.embedded.logits import apply_penalties, transform_logits
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()
VOCAB = len(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
IM_START = TOKENIZER.convert_tokens_to_ids("<|im_start|>")
ENDOFTEXT = TOKENIZER.convert_tokens_to_ids("<|endoftext|>")
TOOL_CALL = TOKENIZER.convert_tokens_to_ids("<tool_call>")


def byte_id(char: str) -> int:
    """The id of a one-byte token of the tiny byte-level tokenizer."""
    [token] = TOKENIZER.encode(char)
    return int(token)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, VOCAB, [IM_END, ENDOFTEXT])


def allowed(compiler: GrammarCompiler, spec: GrammarSpec, text: str = "") -> set[int]:
    """Ids the grammar allows after ``text`` (fed byte by byte), read from a masked row."""
    row = compiler.matcher(compiler.compile(spec), [IM_END])
    for token in TOKENIZER.encode(text):
        row.accept(token)
    logits = torch.zeros(1, VOCAB)
    apply_grammar_masks(logits, [row])
    return {i for i in range(VOCAB) if logits[0, i] == 0.0}


def test_grammar_of_takes_at_most_one() -> None:
    assert grammar_of() is None
    assert grammar_of(regex="", ebnf=None) is None  # empty means unset, as in SGLang
    assert grammar_of(regex="a+") == GrammarSpec("regex", "a+")
    with pytest.raises(ValueError, match="Only one of json_schema, regex, ebnf"):
        grammar_of(regex="a", json_schema="{}")


def test_special_tokens_never_allowed_inside_a_json_string(compiler: GrammarCompiler) -> None:
    # Inside a string any printable byte may follow, but no chat marker: xgrammar would
    # otherwise treat "<|im_start|>" as ordinary text of a byte-level vocabulary.
    inside = allowed(compiler, GrammarSpec("json_schema", json.dumps({"type": "string"})), '"ab')
    assert byte_id("x") in inside and byte_id('"') in inside
    assert IM_START not in inside and ENDOFTEXT not in inside and IM_END not in inside
    assert byte_id("\n") not in inside  # a raw control character is not valid JSON
    # The added, non-special "<tool_call>" token is text: allowed where its bytes are.
    assert TOOL_CALL in inside


def test_complete_grammar_allows_only_the_request_stop_tokens(compiler: GrammarCompiler) -> None:
    # The model's eos tokens always end a complete grammar; the request's stop ids as well.
    assert allowed(compiler, GrammarSpec("regex", "(yes|no)"), "yes") == {IM_END, ENDOFTEXT}
    assert allowed(compiler, GrammarSpec("regex", "(yes|no)")) == {byte_id("y"), byte_id("n")}
    row = compiler.matcher(compiler.compile(GrammarSpec("regex", "a")), [IM_START])
    row.accept(byte_id("a"))
    row.accept(IM_START)  # a request stop id also ends it
    assert row.is_terminated


def test_grammar_terminates_after_a_stop_token(compiler: GrammarCompiler) -> None:
    row = compiler.matcher(compiler.compile(GrammarSpec("ebnf", 'root ::= "ok"')), [IM_END])
    for token in [byte_id("o"), byte_id("k")]:
        row.accept(token)
    assert not row.is_terminated
    row.accept(IM_END)
    assert row.is_terminated
    without_stops = compiler.matcher(compiler.compile(GrammarSpec("ebnf", 'root ::= "ok"')), [])
    without_stops.accept(byte_id("o"))
    without_stops.accept(byte_id("k"))
    assert not without_stops.is_terminated
    without_stops.accept(ENDOFTEXT)  # the model's other eos token
    assert without_stops.is_terminated


def test_rejected_token_raises(compiler: GrammarCompiler) -> None:
    row = compiler.matcher(compiler.compile(GrammarSpec("regex", "a")), [IM_END])
    with pytest.raises(RuntimeError, match="not allowed"):
        row.accept(byte_id("b"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "objec"}'), 'Unsupported type "objec"'),
        (GrammarSpec("json_schema", "{not json"), "Failed to compile json_schema grammar"),
        (GrammarSpec("ebnf", "root ::= missing_rule"), "Failed to compile ebnf grammar"),
        (GrammarSpec("regex", "(unclosed"), "Failed to compile regex grammar"),
        (GrammarSpec("structural_tag", '{"type": "nope"}'), "Failed to compile structural_tag"),
    ],
)
def test_invalid_grammars_raise_a_clear_error(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(InvalidGrammarError, match=message) as info:
        compiler.compile(spec)
    assert ".cc:" not in str(info.value)  # xgrammar's source location is stripped


def test_any_json_is_sglangs_builtin_json(compiler: GrammarCompiler) -> None:
    # "$$ANY$$" admits any JSON value, arrays at the root included.
    assert byte_id("[") in allowed(compiler, GrammarSpec("json_schema", ANY_JSON))


def test_batched_masks_leave_unconstrained_rows_untouched(compiler: GrammarCompiler) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    row = compiler.matcher(compiler.compile(GrammarSpec("regex", "(yes|no)")), [IM_END])
    apply_grammar_masks(logits, [None, row, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == sorted([byte_id("y"), byte_id("n")])
    assert torch.equal(logits[1, kept], before[1, kept])  # allowed logits are not changed


def test_penalties_hand_computed() -> None:
    logits = torch.zeros(5)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    apply_penalties(logits, [1, 3, 3, 3], params)
    # token 1: 1 * 0.5 + 1.0 = 1.5; token 3: 3 * 0.5 + 1.0 = 2.5; others unpenalised.
    assert logits.tolist() == pytest.approx([0.0, -1.5, 0.0, -2.5, 0.0])
    negative = torch.zeros(5)
    apply_penalties(negative, [2], SamplingParams(presence_penalty=-2.0))
    assert negative.tolist() == pytest.approx([0.0, 0.0, 2.0, 0.0, 0.0])  # encourages repeats


def test_transform_order_penalties_mask_then_bias(compiler: GrammarCompiler) -> None:
    y, n, q = byte_id("y"), byte_id("n"), byte_id("q")
    logits = torch.zeros(2, VOCAB)
    row = compiler.matcher(compiler.compile(GrammarSpec("regex", "(yes|no)")), [IM_END])
    params = [
        SamplingParams(logit_bias={str(n): 3.0, str(q): 50.0}, presence_penalty=1.0),
        SamplingParams(),
    ]
    out = transform_logits(logits, params, [[y, y], []], [row, None])
    assert out[0, y] == pytest.approx(-1.0)  # penalised (present), allowed
    assert out[0, n] == pytest.approx(3.0)  # biased, allowed
    assert out[0, q] == -math.inf  # the bias cannot lift a forbidden token
    assert torch.equal(out[1], logits[1])  # the plain row is untouched
    assert torch.equal(logits, torch.zeros(2, VOCAB))  # the input is not modified


def test_plain_batch_is_passed_through() -> None:
    logits = torch.randn(2, VOCAB)
    out = transform_logits(logits, [SamplingParams(), SamplingParams()], [[1], [2]], [None, None])
    assert out is logits


def _accepts(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    row = compiler.matcher(compiler.compile(spec), [IM_END])
    return all(row.try_accept(token) for token in TOKENIZER.encode(text))


def test_json_schema_whitespace_is_the_templates_tojson(compiler: GrammarCompiler) -> None:
    # Chat templates write JSON with tojson (json.dumps' separators): a constrained reply may
    # only be written that way, so a model at temperature 1 cannot fill its budget with blanks.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
        "required": ["city", "days"],
    }
    spec = GrammarSpec("json_schema", json.dumps(schema))
    value = {"city": "Paris", "days": [1, 2]}
    assert _accepts(compiler, spec, json.dumps(value))
    for other in ('{"city":"Paris","days":[1,2]}', '{ "city": "Paris", "days": [1, 2]}'):
        assert json.loads(other) == value and not _accepts(compiler, spec, other)
    assert not _accepts(compiler, spec, '{"city": \t"Paris"')


def test_forced_call_arguments_take_one_blank_at_most(compiler: GrammarCompiler) -> None:
    from proxima.proxy.rendering.structured import output_grammar
    from proxima.proxy.tools import ToolChoice

    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    forced = output_grammar(
        response_format=None,
        tool_choice=ToolChoice("required"),
        tools=[tool],
        tool_parser="hermes",
        parallel_tool_calls=None,
    )
    assert forced is not None and forced.kind == "structural_tag"
    spec = GrammarSpec("structural_tag", forced.value)
    head = '<tool_call>\n{"name": "f", "arguments": '
    assert _accepts(compiler, spec, head + '{"a": 1}')
    assert not _accepts(compiler, spec, head + '{"a":  1}')
    assert not _accepts(compiler, spec, head + '{"a":\r \t1}')
