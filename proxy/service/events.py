"""The events of one generation, shared by every API surface.

The driver (``proxima.proxy.service.driver``) produces them; a response
builder turns them into its API's wire format. A stream is::

    Delta*  (any choice, in arrival order)
    Finish  (one per choice, only after every choice is committed to the store)
    Done    (usage and the policy version, once)

or it stops at a ``Failed`` (after which nothing follows). A non-streaming
request gets the same ``Finish`` records at once, in a ``Completion``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxima.proxy.errors import ProximaError
from proxima.proxy.rendering.reasoning import ReasoningDelta
from proxima.proxy.tools import ContentDelta, ParsedOutput, ToolCallDelta

# A piece of a reply: reasoning, content text, or a piece of a tool call.
Part = ReasoningDelta | ContentDelta | ToolCallDelta


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's text and logprob, with its top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of the completion tokens, those of the reasoning

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of choice ``index``: the text or calls that became final, and logprobs.

    ``parts`` may be empty (text held back: a partial character or a
    possible stop string); ``logprobs`` is None unless they were asked for.
    """

    index: int
    parts: list[Part]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """Choice ``index`` is finished and durable.

    ``text`` is the whole reply text, ``parsed`` its content and tool calls
    (None for text prompts), ``tail`` what the stream had not released yet
    (empty outside streams), ``logprobs`` every token's (non-streaming
    requests that asked for them).
    """

    index: int
    finish_reason: str
    text: str
    parsed: ParsedOutput | None
    output_tokens: int
    tail: list[Part] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did


@dataclass(frozen=True, slots=True)
class Done:
    usage: Usage
    policy_version: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation failed after the response started; ``error`` says how."""

    error: ProximaError


Event = Delta | Finish | Done | Failed


@dataclass(frozen=True, slots=True)
class Completion:
    """A non-streaming generation: every choice, finished and durable."""

    choices: list[Finish]
    usage: Usage
    policy_version: int
