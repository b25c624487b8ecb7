"""Structured outputs and forced tool calls: canonical request fields -> one backend grammar.

Every API surface translates its own fields into the canonical chat request
(OpenAI's shapes), and this module turns those into at most one of SGLang's
grammar sampling parameters, which the backend enforces by constrained
decoding (``proxy/embedded/grammar.py`` for the embedded engine; SGLang's
xgrammar backend for SGLang):

================================================  ==========================================
canonical request                                 grammar
================================================  ==========================================
``response_format`` ``{"type": "text"}`` / none   none
``response_format`` ``json_object``               ``json_schema`` ``{"type": "object"}``
``response_format`` ``json_schema`` (``schema``)  ``json_schema`` (the schema)
``tool_choice`` ``required``                      ``structural_tag``: one or more calls (one
                                                  if ``parallel_tool_calls`` is false) of
                                                  any tool, arguments per its ``parameters``
``tool_choice`` a named function                  ``structural_tag``: exactly one call of it
``tool_choice`` ``auto`` with a response format   ``structural_tag``: calls *or* the JSON
================================================  ==========================================

Translations of the other APIs: Responses ``text.format`` is a
``response_format``; Anthropic ``tool_choice`` ``any`` is ``required`` and
``{"type": "tool", "name": ...}`` is a named function.

A forced tool call is written in the model's own tool-call format, the one
its chat template renders and the tool parser reads back (``hermes``:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
``llama3_json``: ``{"name": ..., "parameters": {...}}`` separated by ``; ``),
so a constrained reply is parsed, recorded and re-rendered like any other.

The grammar is recorded with the completion it constrained (:meth:`Grammar.record`,
``CompletionRecord.grammar``): the backend reports logprobs of the masked,
renormalised distribution it sampled from, and the trainer recomputes them by
replaying the grammar over the recorded tokens with the same masking rules
(``trainer/constrained.py``). The rules are the backend's: the embedded engine's
(``proxima-engine``: ``proxy/embedded/grammar.py``, special tokens never allowed,
``tojson`` whitespace) or SGLang's xgrammar backend's (``sglang``: xgrammar's own
tokenizer detection, any JSON whitespace), which differ in what they allow.

Every grammar is compiled here once, tokenizer-free, so a schema xgrammar
cannot handle is a 400 naming the parameter, never a backend failure; so is a
schema with constraints xgrammar would silently not enforce (SGLang's rule:
``unenforceable_schema_reason``).

Bounds: compiling a grammar takes time that grows fast with the schema's
nesting (a schema 400 arrays deep compiles for seconds) and with its enums.
A schema nested deeper than ``MAX_SCHEMA_DEPTH``, with more than
``MAX_ENUM_VALUES`` enum and const values in all, or longer than
``MAX_SCHEMA_CHARS`` as JSON is a 400 before anything is compiled; the check
compile runs off the event loop (:func:`checked_output_grammar`, in a thread:
xgrammar releases the GIL), and one that takes longer than
``COMPILE_TIMEOUT_S`` is a 400 as well.

String lengths: xgrammar 0.2.7 writes a ``minLength``/``maxLength`` string as
any characters but quote, backslash and line breaks, so other control
characters (invalid in JSON) get through. Such a string is sent as the
equivalent ``pattern`` ``^[^\x00-\x1f"\\]{min,max}$`` instead: the output is
always valid JSON of the right length, at the price of no escapes (no quote
or backslash) inside length-limited strings. A length that is not an integer
in ``[0, 2**31 - 1]`` (``null``, ``"abc"``, ``2.7``, ``-1``), or a
``minLength`` above the ``maxLength``, is a 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from proxima.proxy.embedded.schema_rules import unenforceable_schema_reason, xgrammar_message
from proxima.proxy.errors import BadRequest
from proxima.proxy.tools import ToolChoice

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
GrammarRules = Literal["proxima-engine", "sglang"]
"""Whose masking rules a backend applies to a grammar (see the module docstring)."""
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
MAX_JSON_WHITESPACE = 1
"""Most consecutive whitespace characters inside constrained tool-call arguments: ``tojson``
(what templates write calls with) never puts more than one space between JSON tokens, and a
small model sampled at temperature 1 otherwise emits runs of blanks until ``max_tokens``."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in one schema (as JSON)."""
MAX_ENUM_VALUES = 1000
"""Most ``enum`` values (each ``const`` counts one) in one schema, OpenAI's own bound."""
MAX_SCHEMA_CHARS = 512 * 1024
"""Longest schema, or all of a request's tool schemas together, as JSON."""
MAX_STRING_LENGTH = 2**31 - 1
"""Largest ``minLength`` / ``maxLength``."""
COMPILE_TIMEOUT_S = 10.0
"""Longest a request's grammar may take to compile (off the event loop)."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """One backend grammar: SGLang's sampling parameter name and its value."""

    kind: GrammarKind
    value: str
    param: str = field(default="response_format", compare=False)
    """The request field it enforces (``response_format`` or ``tool_choice``), named by a
    backend's refusal of it."""

    def sampling_fields(self) -> dict[str, str]:
        """The ``sampling_params`` entry that carries it (e.g. ``{"json_schema": "..."}``)."""
        return {self.kind: self.value}

    def record(self, rules: GrammarRules) -> dict[str, str]:
        """What a completion's record keeps of it: enough for the trainer to replay the mask."""
        return {"kind": self.kind, "value": self.value, "rules": rules}


@dataclass(frozen=True, slots=True)
class _CallFormat:
    """How a parser's format writes one call: ``begin(name)``, the arguments, ``end``."""

    prefix: str
    arguments_key: str
    end: str
    separator: str

    def begin(self, name: str) -> str:
        return f'{self.prefix}{{"name": {json.dumps(name)}, "{self.arguments_key}": '


_CALL_FORMATS = {
    "hermes": _CallFormat("<tool_call>\n", "arguments", "}\n</tool_call>", "\n"),
    "llama3_json": _CallFormat("", "parameters", "}", "; "),
}


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for; None for text.

    ``json_object`` is any JSON object; ``json_schema`` without a ``schema``
    also means any object (as OpenAI treats it).
    """
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest(
                "response_format json_schema needs a 'json_schema' object with a 'schema'.",
                param="response_format",
            )
        schema = spec.get("schema", JSON_OBJECT_SCHEMA)
        if not isinstance(schema, dict | bool):
            raise BadRequest(
                "response_format.json_schema.schema must be a JSON schema object.",
                param="response_format",
            )
        return schema if isinstance(schema, dict) else {}
    raise BadRequest(
        f"Unknown response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'.",
        param="response_format",
    )


def enforceable_schema(schema: Any, param: str) -> Any:
    """``schema`` with string lengths as patterns; a 400 if it is past the bounds, has
    lengths that are not lengths, or if xgrammar cannot enforce it."""
    reason = schema_bounds_reason(schema)
    if reason is not None:
        raise BadRequest(f"The {param} cannot be enforced: the JSON schema {reason}.", param=param)
    reason = unenforceable_schema_reason(schema)
    if reason is not None:
        raise BadRequest(
            f"The {param} cannot be enforced: the JSON schema at {reason}.", param=param
        )
    try:
        return _lengths_as_patterns(schema, "")
    except ValueError as exc:
        raise BadRequest(
            f"The {param} cannot be enforced: the JSON schema at {exc}.", param=param
        ) from None


def _nodes(schema: Any) -> Iterator[tuple[Any, int]]:
    """Every value in a JSON document with its depth (containers count), without recursion."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def schema_bounds_reason(schema: Any) -> str | None:
    """Why ``schema`` is past the bounds that keep compiling it fast (None when within)."""
    enum_values = 0
    for node, depth in _nodes(schema):
        if depth > MAX_SCHEMA_DEPTH:
            return f"is nested too deep: more than {MAX_SCHEMA_DEPTH} levels of objects and arrays"
        if isinstance(node, dict):
            enum = node.get("enum")
            enum_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
    if enum_values > MAX_ENUM_VALUES:
        return f"has {enum_values} enum values; at most {MAX_ENUM_VALUES} are allowed in all"
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_CHARS:
        return f"is {size} characters long as JSON; at most {MAX_SCHEMA_CHARS} are allowed"
    return None


def _length(node: dict[str, Any], keyword: str, pointer: str) -> int | None:
    value = node.get(keyword)
    if keyword not in node:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STRING_LENGTH:
        raise ValueError(
            f"{pointer or '/'}: {keyword} must be an integer from 0 to {MAX_STRING_LENGTH}, "
            f"not {json.dumps(value)[:40]}"
        )
    return value


def _lengths_as_patterns(node: Any, pointer: str) -> Any:
    """A copy of a schema (any JSON) where length-limited strings carry a pattern instead.

    ``ValueError`` (with the JSON pointer) for a length that is not a length.
    """
    if isinstance(node, list):
        return [_lengths_as_patterns(v, f"{pointer}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {k: _lengths_as_patterns(v, f"{pointer}/{k}") for k, v in node.items()}
    lengths = ("minLength" in out or "maxLength" in out) and out.get("type") == "string"
    if lengths and "pattern" not in out and "format" not in out:
        low, high = _length(out, "minLength", pointer), _length(out, "maxLength", pointer)
        if low is not None and high is not None and low > high:
            raise ValueError(f"{pointer or '/'}: minLength {low} is above maxLength {high}")
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low or 0},{"" if high is None else high}}}$'
    return out


def _tool_schemas(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema (an empty object when none is given)."""
    schemas = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters")
        schemas[function["name"]] = enforceable_schema(
            parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}},
            "tool_choice",
        )
    return schemas


def _calls_format(
    call: _CallFormat, schemas: dict[str, dict[str, Any]], *, single: bool
) -> dict[str, Any]:
    tags = [
        {
            "type": "tag",
            "begin": call.begin(name),
            "content": {
                "type": "json_schema",
                "json_schema": schema,
                "max_whitespace_cnt": MAX_JSON_WHITESPACE,
            },
            "end": call.end,
        }
        for name, schema in schemas.items()
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": call.separator,
        "at_least_one": True,
        "stop_after_first": single,
    }


@dataclass(frozen=True, slots=True)
class ReasoningFirst:
    """A thinking model's reasoning, left unconstrained before the constrained answer.

    ``opened``: the prompt already opened the reasoning (the reply starts
    inside it); otherwise the reply may open it with ``start`` or answer at
    once. Either way the answer follows the ``end`` marker and the blank line
    the template writes after it.
    """

    start: str
    end: str
    opened: bool

    def wrap(self, answer: dict[str, Any]) -> dict[str, Any]:
        think = {
            "type": "tag",
            "begin": "" if self.opened else self.start,
            "content": {"type": "any_text"},
            "end": self.end,
        }
        gap = {"type": "const_string", "value": "\n\n"}
        thought = {"type": "sequence", "elements": [think, gap, answer]}
        return thought if self.opened else {"type": "or", "elements": [thought, answer]}


def output_grammar(
    *,
    response_format: dict[str, Any] | None,
    tool_choice: ToolChoice,
    tools: Sequence[dict[str, Any]] | None,
    tool_parser: str,
    parallel_tool_calls: bool | None = None,
    reasoning: ReasoningFirst | None = None,
) -> Grammar | None:
    """The grammar that enforces a canonical chat request's output, or None if unconstrained.

    Raises :class:`BadRequest` (param ``response_format`` or ``tool_choice``)
    for a schema that cannot be enforced, or a forced tool call with a tool
    parser that has no call format (``none``). With ``reasoning``, the
    constraint starts after the reasoning closes: thinking is not constrained.
    """
    schema = response_format_schema(response_format)
    if schema is not None:
        schema = enforceable_schema(schema, "response_format")
    forced = tool_choice.mode in ("required", "function")
    if not forced and not (schema is not None and tool_choice.mode == "auto" and tools):
        if schema is None:
            return None
        if reasoning is not None:
            answer = {"type": "json_schema", "json_schema": schema}
            tag = {"type": "structural_tag", "format": reasoning.wrap(answer)}
            return _checked(Grammar("structural_tag", json.dumps(tag)), "response_format")
        return _checked(Grammar("json_schema", json.dumps(schema)), "response_format")
    call = _CALL_FORMATS.get(tool_parser)
    if call is None:
        raise BadRequest(
            f"tool_choice '{tool_choice.mode}' cannot be enforced: the server's tool parser "
            f"'{tool_parser}' has no tool-call format.",
            param="tool_choice",
        )
    schemas = _tool_schemas(tools or [])
    if tool_choice.mode == "function":
        assert tool_choice.function_name is not None
        schemas = {tool_choice.function_name: schemas[tool_choice.function_name]}
    single = tool_choice.mode == "function" or parallel_tool_calls is False
    fmt = _calls_format(call, schemas, single=single)
    if not forced:  # auto with a response format: call tools, or answer in the format
        assert schema is not None
        answer = {"type": "json_schema", "json_schema": schema}
        fmt = {"type": "or", "elements": [fmt, answer]}
    if reasoning is not None:
        fmt = reasoning.wrap(fmt)
    param = "tool_choice" if forced else "response_format"
    return _checked(
        Grammar("structural_tag", json.dumps({"type": "structural_tag", "format": fmt})), param
    )


async def checked_output_grammar(
    *,
    response_format: dict[str, Any] | None,
    tool_choice: ToolChoice,
    tools: Sequence[dict[str, Any]] | None,
    tool_parser: str,
    parallel_tool_calls: bool | None = None,
    reasoning: ReasoningFirst | None = None,
    timeout: float = COMPILE_TIMEOUT_S,
) -> Grammar | None:
    """:func:`output_grammar` off the event loop, within ``timeout`` seconds (else a 400).

    An unconstrained request (no response format, no forced call) is answered
    at once, on the loop.
    """
    kind = (response_format or {}).get("type", "text")
    forced = tool_choice.mode in ("required", "function")
    if not forced and (response_format is None or kind == "text"):
        return None
    build = asyncio.to_thread(
        output_grammar,
        response_format=response_format,
        tool_choice=tool_choice,
        tools=tools,
        tool_parser=tool_parser,
        parallel_tool_calls=parallel_tool_calls,
        reasoning=reasoning,
    )
    try:
        return await asyncio.wait_for(build, timeout)
    except TimeoutError:
        param = "tool_choice" if forced else "response_format"
        raise BadRequest(
            f"The {param} cannot be enforced: its grammar took more than {timeout:g} s to "
            "compile; simplify the JSON schema.",
            param=param,
        ) from None


def _checked(grammar: Grammar, param: str) -> Grammar:
    """``grammar`` after compiling it once without a tokenizer; a 400 if xgrammar refuses it."""
    if len(grammar.value) > MAX_SCHEMA_CHARS:
        raise BadRequest(
            f"The {param} cannot be enforced: its grammar is {len(grammar.value)} characters "
            f"long; at most {MAX_SCHEMA_CHARS} are allowed (all tool schemas together).",
            param=param,
        )
    import xgrammar as xgr  # torch and transformers come with it: loaded on first use

    try:
        if grammar.kind == "json_schema":
            xgr.Grammar.from_json_schema(grammar.value, any_whitespace=True)
        else:
            xgr.Grammar.from_structural_tag(grammar.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise BadRequest(
            f"The {param} cannot be enforced: {xgrammar_message(exc)}", param=param
        ) from exc
    return replace(grammar, param=param)
