"""Proxy settings: one validated ``Settings`` object built at start-up.

Each field is declared once, here, with its default and its description, and
can come from three places (the first that gives it wins):

1. a flag of ``proxima serve``: ``--<field>`` with dashes (``--max-staleness 4``);
   a list's flag is its singular, repeated (``--backend URL --backend URL``); a
   switch has its ``--no-`` form (``--no-record-production``);
2. an environment variable ``PROXIMA_<FIELD>`` (``PROXIMA_ADMIN_TOKEN``; a list as
   JSON, ``PROXIMA_BACKENDS='["http://a:30000"]'``);
3. a TOML file given with ``proxima serve --config FILE``, keyed by field name
   (``max_staleness = 4``, ``backends = ["http://a:30000"]``).

The flags are generated from the fields (``add_arguments``), so their help is the
description below and their default is the field's.
"""

from __future__ import annotations

import argparse
import tomllib
import types
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "PROXIMA_"

# The values of the ``--config`` file while ``Settings.load`` builds the settings.
_file_values: ContextVar[dict[str, Any] | None] = ContextVar("settings_file", default=None)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    model: Path = Field(
        description="HF model directory: its tokenizer and chat template render prompts; "
        "the embedded engine serves it when no --backend is given."
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    db: str = Field("sqlite:///proxima.db", description="Trajectory store SQLAlchemy URL.")
    backends: list[str] = Field(
        default_factory=list,
        description="SGLang-protocol backend URLs. Empty: start the embedded CPU engine.",
    )
    production_backends: list[str] = Field(
        default_factory=list,
        description="SGLang-protocol backends of the production deployment (production keys, "
        "a pinned version). Empty and no --production-engine: production follows the trainer.",
    )
    production_engine: bool = Field(
        False, description="Start a second embedded engine for the production deployment."
    )
    canary_backends: list[str] = Field(
        default_factory=list,
        description="Backends of the production canary. With --production-engine the canary's "
        "embedded engine starts on the first canary promotion instead.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for /admin and session creation. Unset: those routes "
        "answer 401 (nobody can open training sessions).",
    )
    served_model_name: str | None = Field(
        None, description="Model name listed by /v1/models; default: the model directory's name."
    )
    public_base_url: str | None = Field(
        None, description="Base URL handed to agents in new sessions (default http://host:port/v1)."
    )
    tool_parser: str | None = Field(
        None,
        description="Tool-call parser (hermes, llama3_json, none); default: detected "
        "from the chat template.",
    )
    tool_fallback: Literal["hermes"] | None = Field(
        None,
        description="For a chat template that does not render tools (SmolLM2's): write a "
        "request's tools into the system prompt in this format (its calls are parsed by the "
        "tool parser of the same name); completions record it in sampling['tool_format']. "
        "Unset: a request with tools to such a model is a 400. Ignored when the template "
        "renders tools itself.",
    )
    signing_key: SecretStr | None = Field(
        None,
        description="Key that signs the reasoning handed to clients (Responses "
        "encrypted_content, Messages thinking signatures); the same on every replica. "
        "Default: derived from the admin token, else random per process.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="Reasoning parser (qwen3, deepseek-r1, none): splits a thinking model's "
        "reasoning from its answer; default: detected from the chat template.",
    )
    context_length: int | None = Field(
        None,
        ge=16,
        description="Context window; default: the model config's max_position_embeddings.",
    )
    default_max_tokens: int = Field(
        1024,
        ge=1,
        description="Output cap of a request that sends none (max_tokens, max_output_tokens), "
        "on every surface, capped by what the context leaves; completions record it with "
        "sampling['max_tokens_default']. Codex CLI sends none: a reply that never ends stops "
        "here instead of holding the harness until the context is full.",
    )
    max_tokens_limit: int = Field(32768, ge=1, description="Largest max_tokens accepted.")
    clamp_max_tokens: bool = Field(
        False,
        description="A max_tokens larger than the context leaves (or than max_tokens_limit) "
        "is lowered to what is left, instead of a 400. For harnesses that send a fixed "
        "max_tokens (Claude Code: 32000) to a model with a smaller context; the recorded "
        "sampling settings hold the clamped value.",
    )
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per request) accepted.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body.")
    train_batch_size: int = Field(
        8, ge=1, description="Trainer batch size B (sessions per step), for the staleness rule."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="eta: admit a training session only while "
        "N < (version + eta + 1) * B. Unset: no staleness gate.",
    )
    max_open_sessions: int = Field(
        1024, ge=1, description="Most training sessions open at once (429 beyond)."
    )
    record_production: bool = Field(
        True, description="Record traffic of production keys whose recording is on."
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="CORS origins; empty: CORS off."
    )
    key_cache_seconds: float = Field(
        5.0,
        ge=0,
        description="How long a key's owner is cached per process; a key revoked with "
        "`proxima keys revoke` stops working within this time (0: every request reads the "
        "store).",
    )
    private_observability: bool = Field(
        False,
        description="Require the admin token for /metrics and serve no /docs, /redoc or "
        "/openapi.json (for a proxy reachable beyond loopback).",
    )
    access_log: bool = Field(
        True,
        description="The request log: one line per HTTP request at info level (logger "
        "proxima.access: method, route, status, latency, session, policy, tokens, and an "
        "error's message); --no-access-log turns it off.",
    )
    opentelemetry: bool = Field(
        False,
        description="FastAPI's native OpenTelemetry per request (a span, metrics and logs) "
        "when a global OpenTelemetry provider is configured (opentelemetry-instrument). Off, "
        "no request pays for looking for a provider (about 2 percent of the CPU of a short streamed "
        "request).",
    )
    health_check_interval: float = Field(
        5.0, gt=0, description="Seconds between backend health probes."
    )
    http_header_timeout: float = Field(
        20.0,
        gt=0,
        description="Seconds a client has, from a request head's first byte, to send the "
        "whole head (request line and headers); a slower one (slowloris) is answered 408 "
        "and disconnected.",
    )
    http_idle_timeout: int = Field(
        75,
        ge=1,
        description="Seconds a connection may stay silent outside a request (from its "
        "opening, or from its last response) before it is closed. Keep it above the idle "
        "expiry of the clients' connection pools (5 s for httpx and the OpenAI SDK).",
    )
    engines: int = Field(
        1,
        ge=1,
        description="Embedded training engines when no --backend is given: separate processes, "
        "each with its own copy of the model and its share of half the CPUs as threads, "
        "behind the pool like SGLang servers (sessions stick to one). On a CPU machine whose "
        "trainer waits while the rollouts run, a second engine uses the idle core.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Proxy processes serving the one port, to use every core of a host. They "
        "share the store (SQLite or PostgreSQL) and follow it as replicas do: one truth about "
        "versions, admission and sessions, whichever worker takes a turn. The embedded "
        "engines are started once and shared by the workers.",
    )
    engine_max_running_requests: int = Field(
        32, ge=1, description="Embedded engine: requests decoded together in one batch."
    )
    enable_lora: bool = Field(
        False,
        description="Embedded engines: serve LoRA adapters (SGLang's --enable-lora), so that "
        "sessions, production keys and pushes of an adapter are served. External --backend "
        "servers need their own --enable-lora.",
    )
    max_loras_per_batch: int = Field(
        8,
        ge=1,
        description="Embedded engines with --enable-lora: most distinct adapters in one "
        "batch (SGLang's flag); a request of one more waits for a slot.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="Embedded engines with --enable-lora: refuse to load an adapter of a "
        "higher rank (SGLang's flag). Unset: any rank.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments (the flags), then the environment, then the ``--config`` file."""
        sources = (init_settings, env_settings, dotenv_settings, file_secret_settings)
        file_values = _file_values.get()
        if file_values:
            return (*sources, InitSettingsSource(settings_cls, init_kwargs=file_values))
        return sources

    @classmethod
    def load(cls, flags: Mapping[str, Any], config_file: Path | None = None) -> Settings:
        """The settings from ``flags`` (field name -> value), the environment and
        ``config_file`` (TOML), in that order of precedence.

        Raises ``pydantic.ValidationError`` for a bad value and ``ValueError`` for a
        file that cannot be read or names a setting that does not exist.
        """
        token = _file_values.set(read_settings_file(config_file) if config_file else None)
        try:
            return cls(**flags)
        finally:
            _file_values.reset(token)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not (self.model / "config.json").exists():
            raise ValueError(
                f"--model {self.model}: no config.json there; pass an HF model directory"
            )
        return self

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        from proxima.proxy.rendering.reasoning import known_reasoning_parsers

        if name is not None and name not in known_reasoning_parsers():
            known = ", ".join(known_reasoning_parsers())
            raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}")
        return name

    @model_validator(mode="after")
    def _check_deployments(self) -> Settings:
        if self.production_backends and self.production_engine:
            raise ValueError("give --production-backend or --production-engine, not both")
        if self.workers > 1 and self.production_engine:
            raise ValueError(
                "--workers with --production-engine: a canary's engine would be started by "
                "every worker; give the production deployment --production-backend URLs"
            )
        if self.canary_backends and not (self.production_backends or self.production_engine):
            raise ValueError(
                "--canary-backend needs a production deployment "
                "(--production-backend or --production-engine)"
            )
        return self

    @property
    def separate_production(self) -> bool:
        return bool(self.production_backends) or self.production_engine

    @model_validator(mode="after")
    def _default_name(self) -> Settings:
        if not self.served_model_name:
            self.served_model_name = self.model.resolve().name
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name

    def base_url(self, bound_port: int | None = None) -> str:
        if self.public_base_url:
            return self.public_base_url.rstrip("/")
        return f"http://{self.host}:{bound_port or self.port}/v1"


def read_settings_file(path: Path) -> dict[str, Any]:
    """A ``--config`` file's settings; every key must name a field of ``Settings``."""
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise ValueError(
            f"--config {path}: no such setting: {', '.join(unknown)} (settings are named as "
            "in `proxima serve --help`, with underscores: max_staleness, backends, ...)"
        )
    return values


# ------------------------------------------------------------------------ flags


def flag_dest(name: str) -> str:
    """The argparse destination of field ``name``'s flag: a list's is its singular."""
    field = Settings.model_fields[name]
    return name[:-1] if _is_list(field) and name.endswith("s") else name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``Settings`` field: type, choices, help and default from the field.

    Every flag defaults to ``None`` (not given), so the environment, the file and the
    field's own default fill what no flag sets (``flags_of``).
    """
    for name, field in Settings.model_fields.items():
        dest = flag_dest(name)
        flag = "--" + dest.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": _help(name, field)}
        annotation = _unwrap_optional(field.annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif _is_list(field):
            kwargs.update(action="append", metavar="URL")
        elif get_origin(annotation) is Literal:
            kwargs["choices"] = list(get_args(annotation))
        else:
            kwargs["type"] = _ARG_TYPES.get(annotation, str)
            metavar = {Path: "DIR", int: "N", float: "SECONDS"}.get(annotation)
            if metavar is not None:
                kwargs["metavar"] = metavar
        parser.add_argument(flag, **kwargs)


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a command line gave (field name -> value), for ``Settings.load``."""
    given = {name: getattr(args, flag_dest(name), None) for name in Settings.model_fields}
    return {name: value for name, value in given.items() if value is not None}


def flag_name(name: str) -> str:
    """Field ``name``'s flag as typed (``--backend`` for ``backends``)."""
    return "--" + flag_dest(name).replace("_", "-")


_ARG_TYPES: dict[Any, Any] = {int: int, float: float, str: str, Path: Path, SecretStr: str}


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_list(field: FieldInfo) -> bool:
    return get_origin(_unwrap_optional(field.annotation)) is list


def _help(name: str, field: FieldInfo) -> str:
    text = (field.description or "").replace("%", "%%")
    if _is_list(field):
        text += " Repeat the flag for several."
    env = ENV_PREFIX + name.upper()
    if field.is_required():
        return f"{text} Required (or {env})."
    default = field.get_default(call_default_factory=True)
    if default is None or default == []:
        # The description says what an unset value does.
        return f"{text} Env {env}."
    return f"{text} Default: {default!r}; env {env}."
