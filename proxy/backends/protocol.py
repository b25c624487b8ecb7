"""SGLang's native HTTP API: the one declaration of the backend wire format.

Every piece that speaks SGLang's API uses these pydantic models: the proxy's
client (:mod:`proxima.proxy.backends.sglang`), the embedded engine
(:mod:`proxima.proxy.embedded.app`), the fake SGLang
(:mod:`proxima.proxy.testing.fake_sglang`) and the bench simulator. Field
names, defaults and shapes are SGLang 0.5.23's own (``sglang/api/v1``, its
JSON contract; ``tests/proxy/backends/test_sglang_contract.py`` checks the bodies the
proxy sends against SGLang's own decoder).

Requests are strict: an unknown key is an error (the servers answer 400).
SGLang itself rejects unknown ``sampling_params`` keys ("unknown field `seed`,
expected one of ...") and ignores unknown top-level keys; ours reject both, so
a misspelt field never passes silently. Replies are lenient (SGLang adds
fields from release to release).

Streaming ``/generate`` answers Server-Sent Events ``data: {GenerateResponse}``
ending with ``data: [DONE]``. SGLang's default stream chunks are cumulative
(all ``output_ids`` and ``output_token_logprobs`` so far); with
``--incremental-streaming-output`` they carry only the new tokens. The client
accepts both (see ``SGLangClient.generate_stream``).

To add a sampling option, add a field to :class:`SamplingParams` with SGLang's
name and default; the engine, the fake and the client then accept it.

LoRA adapters (SGLang launched with ``--enable-lora``; ``http_server.py``,
``managers/tokenizer_control_mixin.py``, ``lora/lora_registry.py``,
``lora/lora_manager.py``):

- ``POST /load_lora_adapter {lora_name, lora_path, pinned}`` and ``POST
  /unload_lora_adapter {lora_name}`` answer :class:`LoRAUpdateResponse`
  (``success``, ``error_message``, ``loaded_adapters``: name -> path), HTTP
  400 when ``success`` is false: LoRA not enabled, a name already loaded, a
  path without ``adapter_config.json``, a rank over ``--max-lora-rank``, an
  unload of a name not loaded.
- An unload first unregisters the name (new requests cannot use it), then
  waits until every request running with it has finished before it answers:
  it blocks while such a request runs, so abort those first.
- ``/generate`` names the adapter in ``lora_path`` (the *name* it was loaded
  under, despite the field's name). A name never loaded is refused before any
  token, as 400 ``{"error": {"message": ...}}`` or, streamed, one ``data:
  {"error": {...}}`` event then ``[DONE]``; a name that was loaded and then
  unloaded is loaded again from its old path first (SGLang's reload of an
  evicted adapter), so never send a name after unloading it.
- Loaded adapters are listed by ``GET /v1/models``: one card per adapter
  (``id`` the name, ``root`` the path, ``parent`` the served model) after
  the base model's card.

On the backend an adapter version is loaded under :func:`lora_name`
(``tenant-a@v3``): one name per version, so a new version loads beside the
old one.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax), as in SGLang."""

_STRICT = ConfigDict(extra="forbid")
_LENIENT = ConfigDict(extra="allow")

ADAPTER_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""What an adapter (a policy other than the base) may be called."""

_LORA_NAME = re.compile(r"^(?P<adapter>[a-z0-9][a-z0-9_-]{0,63})@v(?P<version>0|[1-9][0-9]*)$")


def lora_name(adapter: str, version: int) -> str:
    """The name version ``version`` of ``adapter`` is loaded under on a backend: ``tenant-a@v3``."""
    if not ADAPTER_NAME_PATTERN.match(adapter):
        raise ValueError(f"bad adapter name {adapter!r}: must match {ADAPTER_NAME_PATTERN.pattern}")
    if version < 0:
        raise ValueError(f"bad adapter version {version}: must be >= 0")
    return f"{adapter}@v{version}"


def parse_lora_name(name: str) -> tuple[str, int]:
    """The inverse of :func:`lora_name`: ``"tenant-a@v3"`` -> ``("tenant-a", 3)``."""
    match = _LORA_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a Proxima LoRA name (<adapter>@v<version>)")
    return match["adapter"], int(match["version"])


class SamplingParams(BaseModel):
    """Per-request sampling options (SGLang's ``sampling_params``)."""

    model_config = _STRICT

    max_new_tokens: int = Field(128, ge=0, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    stop: str | list[str] | None = Field(None, description="Stop strings (cut from `text`).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    ignore_eos: bool = Field(False, description="Do not stop at the model's eos tokens.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from `text`.")
    sampling_seed: int | None = Field(None, description="Seed of this request's sampler.")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from a logit per earlier occurrence."
    )
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from a logit once its token occurred."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> value added to its logit."
    )
    # The grammar the output must follow (at most one; SGLang compiles it with xgrammar).
    json_schema: str | None = Field(None, description='A JSON schema; "$$ANY$$": any JSON.')
    regex: str | None = Field(None, description="A regular expression the output matches.")
    ebnf: str | None = Field(None, description="An EBNF grammar (rule `root`) of the output.")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag (JSON).")

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        grammars = (self.json_schema, self.regex, self.ebnf, self.structural_tag)
        if sum(1 for g in grammars if g) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        return self

    @property
    def is_greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty strings dropped)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class GenerateRequest(BaseModel):
    """Body of ``POST /generate`` (one prompt; SGLang's batched form is not used)."""

    model_config = _STRICT

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, description="Top alternatives per output token.")
    logprob_start_len: int = -1
    rid: str | None = None
    stream: bool = False
    lora_path: str | None = Field(
        None, description="The loaded LoRA adapter's name (not a path); None: the base model."
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    def wire(self, *, stream: bool) -> dict[str, Any]:
        """The JSON body to send (unset optional fields left out, as SGLang's defaults).

        ``input_ids`` goes in as the list it is: dumping tens of thousands of ids through
        the model costs milliseconds a turn of a long session, for a plain copy.
        """
        body = self.model_dump(exclude_none=True, exclude={"input_ids"})
        if self.input_ids is not None:
            body = {"input_ids": self.input_ids, **body}
        body["stream"] = stream
        return body


class FinishReason(BaseModel):
    """``meta_info.finish_reason``: ``stop`` (matched), ``length``, or ``abort``.

    An abort with a ``status_code`` is an error the scheduler reports in the
    stream (e.g. a prompt over its input limit); an abort without one is an
    interruption (``/abort_request``, ``/pause_generation``).
    """

    model_config = _LENIENT

    type: Literal["stop", "length", "abort"] | str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @property
    def is_error(self) -> bool:
        """An abort that carries an HTTP status: the request failed, do not resume it."""
        return self.type == "abort" and self.status_code is not None


class MetaInfo(BaseModel):
    model_config = _LENIENT

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    # [[logprob | null, token_id, token_text | null], ...]; orjson writes -inf/NaN as null.
    output_token_logprobs: list[list[Any]] | None = None
    # per output token: [[logprob | null, token_id, text], ...] for the top-k alternatives
    output_top_logprobs: list[list[list[Any]] | None] | None = None


class GenerateResponse(BaseModel):
    model_config = _LENIENT

    text: str | None = None
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo


class AbortRequestBody(BaseModel):
    """Body of ``POST /abort_request``; SGLang matches ``rid`` as a prefix of request ids."""

    model_config = _STRICT

    rid: str = ""
    abort_all: bool = False


class PauseGenerationBody(BaseModel):
    """Body of ``POST /pause_generation``."""

    model_config = _STRICT

    mode: Literal["abort", "in_place", "retract"] = "abort"


class UpdateWeightsFromDiskBody(BaseModel):
    """Body of ``POST /update_weights_from_disk``."""

    model_config = _STRICT

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsResponse(BaseModel):
    """Reply of ``POST /update_weights_from_disk`` (HTTP 400 when ``success`` is false).

    ``num_paused_requests`` is a list (one count per data-parallel rank) when
    SGLang runs with ``--dp-size > 1``.
    """

    model_config = _LENIENT

    success: bool
    message: str = ""
    num_paused_requests: int | list[int] = 0


class ModelInfo(BaseModel):
    """Reply of ``GET /model_info`` (``/get_model_info`` is SGLang's deprecated alias)."""

    model_config = _LENIENT

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str | None = None
    max_context_length: int | None = None


class StatusResponse(BaseModel):
    """Reply of ``/pause_generation`` and ``/continue_generation``."""

    model_config = _LENIENT

    message: str
    status: str = "ok"


class LoadLoRAAdapterBody(BaseModel):
    """Body of ``POST /load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``)."""

    model_config = _STRICT

    lora_name: str = Field(description="The name requests use (``lora_path`` of /generate).")
    lora_path: str = Field(description="A peft adapter directory.")
    pinned: bool = Field(False, description="Keep it in the adapter memory pool (SGLang).")


class UnloadLoRAAdapterBody(BaseModel):
    """Body of ``POST /unload_lora_adapter`` (SGLang's ``UnloadLoRAAdapterReqInput``)."""

    model_config = _STRICT

    lora_name: str


class LoRAUpdateResponse(BaseModel):
    """Reply of ``/load_lora_adapter`` and ``/unload_lora_adapter`` (SGLang's
    ``LoRAUpdateOutput``; HTTP 400 when ``success`` is false).

    ``loaded_adapters`` maps every loaded name to its path after the call; it is
    null when the call was refused before reaching the scheduler (LoRA not
    enabled, an unload of an unknown name). ``error_message`` is ``""`` on success.
    """

    model_config = _LENIENT

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """The body SGLang sends: the whole ``LoRAUpdateOutput``, its IPC fields (``rid``,
        ``http_worker_ipc``) null over HTTP."""
        return {"rid": None, "http_worker_ipc": None, **self.model_dump()}


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``: the base model, or a loaded adapter (``parent`` set)."""

    model_config = _LENIENT

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Reply of ``GET /v1/models``."""

    model_config = _LENIENT

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- weights over a process group (SGLang's ``update_weights_from_distributed`` family) ----
#
# ``POST /init_weights_update_group`` joins the server's workers to a torch process group
# whose rank 0 is the trainer (ranks ``rank_offset .. rank_offset + tp_size - 1``; it blocks
# until every rank joined). ``POST /begin_weight_update``, one ``POST
# /update_weights_from_distributed`` per bucket (each receives its tensors by
# ``broadcast(src=0)`` in the listed order, or as one flat uint8 buffer when ``load_format`` is
# ``"flattened_bucket"``, then loads them), ``POST /end_weight_update``. Each answers
# :class:`WeightSyncResponse`, HTTP 400 when ``success`` is false (SGLang's
# ``io_struct.py`` ``*ReqInput`` structs; the http_server routes).


class InitWeightsUpdateGroupBody(BaseModel):
    """Body of ``POST /init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    model_config = _STRICT

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="The server's first rank; rank 0 is the trainer.")
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupBody(BaseModel):
    """Body of ``POST /destroy_weights_update_group``."""

    model_config = _STRICT

    group_name: str = "weight_update_group"


class BeginWeightUpdateBody(BaseModel):
    """Body of ``POST /begin_weight_update``: opens the session the bucket updates run in."""

    model_config = _STRICT

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateBody(BaseModel):
    """Body of ``POST /end_weight_update`` (no fields): closes the session."""

    model_config = _STRICT


class UpdateWeightsFromDistributedBody(BaseModel):
    """Body of ``POST /update_weights_from_distributed``: one bucket of tensors, received by
    broadcast from rank 0 in the listed order and loaded at once (SGLang's
    ``UpdateWeightsFromDistributedReqInput``). ``weight_version`` is set only on a push's
    last bucket: the version a backend reports changes when the whole push has arrived."""

    model_config = _STRICT

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedBody:
        if not self.names or not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must be non-empty and of one length")
        return self


class WeightSyncResponse(BaseModel):
    """Reply of the weight-group routes above (HTTP 400 when ``success`` is false)."""

    model_config = _LENIENT

    success: bool
    message: str = ""
