"""Request and response schemas of the HTTP API (not ORM models).

OpenAI clients send fields we do not act on (``store``, ``metadata``,
``parallel_tool_calls``...): requests allow extra fields, and the fields that
change what is generated are validated with limits that give clear 400s.

Integers are bounded as OpenAI bounds them (``seed`` a signed 64-bit integer;
``top_k``, an extension, a 32-bit one): an integer no backend can read is a
400, never a failure to write the backend request. Types are strict, as
OpenAI's are: ``max_tokens: true``, ``stream: "yes"`` or
a prompt ``[true, false]`` are 400s, not coerced (an int is still a valid
float). Every string of every request body must be valid Unicode: a lone
UTF-16 surrogate (JSON ``"\ud800"``, which Python's JSON parser accepts) can
be neither tokenized nor stored, so it is a 400 naming the field
(``messages[0].content``). Identifiers that the store keeps in indexed text
columns (``group_id``, ``data_id``, ``user``, weight paths) may not contain
NUL either, and are at most 200 characters, as their columns are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from proxima.proxy.errors import BadRequest
from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.rendering.unicode import InvalidString, check_unicode
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_ID_LENGTH = 200
"""Longest ``group_id``, ``data_id``, ``user`` or ``X-Session-Id`` (their columns' width)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""``seed``'s range, as OpenAI's API bounds it (a signed 64-bit integer)."""
MAX_TOP_K = 2**31 - 1
"""Largest ``top_k`` (a 32-bit integer; any k past the vocabulary keeps every token)."""


OPENAI_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A function tool's name in OpenAI's APIs (Chat Completions, Responses)."""
ANTHROPIC_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""A client tool's name in Anthropic's Messages API."""


def check_tool_names(named: Iterable[tuple[str, Any]], pattern: re.Pattern[str]) -> None:
    """Each ``(param, name)`` a name that ``pattern`` matches whole, and no name twice.

    A tool's name is written into the prompt and into a forced call's grammar
    (``<tool_call>{"name": ...}``): a name holding markup (``</tool_call>``)
    would let a constrained reply end a call where the parser does not.
    Raises ``InvalidString`` naming the parameter.
    """
    seen: set[str] = set()
    for param, name in named:
        if not isinstance(name, str) or pattern.fullmatch(name) is None:
            shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
            raise InvalidString(
                f"Invalid value for '{param}': {shown!a} is not a tool name; names match "
                f"'^{pattern.pattern}$'.",
                param=param,
            )
        if name in seen:
            raise InvalidString(
                f"Invalid value for '{param}': tool names must be unique, and {name!r} is "
                "given twice.",
                param=param,
            )
        seen.add(name)


def check_listed_tool_names(
    tools: list[dict[str, Any]] | None, kinds: tuple[str | None, ...], pattern: re.Pattern[str]
) -> None:
    """The names of a request's ``tools`` whose ``type`` is one of ``kinds``, checked by
    :func:`check_tool_names`; a bad one is a 400 naming ``tools[i].name``."""
    named = (
        (f"tools[{i}].name", tool.get("name"))
        for i, tool in enumerate(tools or [])
        if isinstance(tool, dict) and tool.get("type") in kinds
    )
    try:
        check_tool_names(named, pattern)
    except InvalidString as exc:
        raise BadRequest(str(exc), param=exc.param) from None


MAX_STOP_SEQUENCES = 16
"""Most stop sequences a request may give (OpenAI's limit; Anthropic's has none)."""


def check_stop_sequences(stop: list[str]) -> None:
    """At most :data:`MAX_STOP_SEQUENCES`, none empty: ``ValueError`` saying which rule."""
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
    if any(not s for s in stop):
        raise ValueError("stop sequences must be non-empty")


def check_identifier(value: str | None, param: str) -> str | None:
    """``value`` unless it holds NUL (text columns cannot store it): ``InvalidString``."""
    if value is not None and "\x00" in value:
        raise InvalidString(
            f"Invalid value for '{param}': it contains a NUL character.", param=param
        )
    return value


class OpenBody(BaseModel):
    """Extra fields allowed, types strict (an OpenAI request body's sub-objects)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StrictBody(BaseModel):
    """A request body: strict types, and valid Unicode in every string (see the module doc)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data, "")
        return data


class CreateSessionRequest(OpenBody, StrictBody):
    group_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    data_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    metadata: dict[str, Any] | None = None
    # The policy the session generates with and trains: a LoRA adapter's name, or null
    # (absent) for the base model. Any valid name may start sessions before its first push:
    # its version 0 is the base weights with no adapter (a freshly initialised LoRA adds 0).
    adapter: str | None = None

    @field_validator("group_id", "data_id")
    @classmethod
    def _ids(cls, v: str | None, info: Any) -> str | None:
        return check_identifier(v, info.field_name)

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, v: str | None) -> str | None:
        return check_adapter(v)


class CreateSessionResponse(BaseModel):
    session_id: str
    api_key: str
    base_url: str


class RewardRequest(StrictBody):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    completion_id: str | None = None


class FinishRequest(StrictBody):
    model_config = ConfigDict(extra="forbid")

    status: Literal["finished", "failed"] = "finished"


MAX_GROUP_TIMEOUT_S = 3600.0
"""Longest a weight-update group's rendezvous, or one bucket of a broadcast push, may wait."""


class BroadcastBucket(StrictBody):
    """One bucket of a broadcast push: the tensors the trainer broadcasts, in order."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)

    @model_validator(mode="after")
    def _aligned(self) -> BroadcastBucket:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have one length")
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes must not have negative dimensions")
        return self


class BroadcastPush(StrictBody):
    """How a broadcast push's weights travel: over the open group ``group_name``."""

    model_config = ConfigDict(extra="forbid")

    group_name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    buckets: list[BroadcastBucket] = Field(min_length=1)
    load_format: Literal["flattened_bucket"] | None = "flattened_bucket"
    timeout_s: float = Field(60.0, gt=0.0, le=MAX_GROUP_TIMEOUT_S)


class WeightGroupRequest(StrictBody):
    """``POST /admin/weights/group``: open a weight-update group; the trainer is rank 0."""

    model_config = ConfigDict(extra="forbid")

    group_name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    backend: Literal["gloo", "nccl"] = "nccl"
    world_size: int = Field(ge=2, le=2**20)
    timeout_s: float = Field(60.0, gt=0.0, le=MAX_GROUP_TIMEOUT_S)

    @field_validator("group_name", "master_address")
    @classmethod
    def _no_nul(cls, v: str, info: ValidationInfo) -> str:
        check_identifier(v, str(info.field_name))
        return v


class WeightsRequest(StrictBody):
    model_config = ConfigDict(extra="forbid")

    # Per-token versions are stored as int32.
    version: int = Field(ge=0, le=2**31 - 1)
    # The version's HF directory: loaded by every backend (a disk push), or, with
    # ``broadcast``, recorded and loaded only by a backend that rejoins later.
    path: str = Field(min_length=1)
    # A LoRA adapter's version (a peft directory at ``path``); absent: the full weights.
    adapter: str | None = None
    # The full weights sent by the trainer over its weight-update group (not read from disk).
    broadcast: BroadcastPush | None = None

    @field_validator("adapter")
    @classmethod
    def _adapter(cls, v: str | None) -> str | None:
        return check_adapter(v)

    @model_validator(mode="after")
    def _broadcast_is_for_full_weights(self) -> WeightsRequest:
        if self.broadcast is not None and self.adapter is not None:
            raise InvalidString(
                "An adapter is pushed from its peft directory; 'broadcast' is for the full "
                "weights only.",
                param="broadcast",
            )
        return self

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        check_identifier(v, "path")
        return v
