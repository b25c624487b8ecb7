"""Typed trainer configuration.

One pydantic model per concern, composed by :class:`TrainerConfig`. Every field
carries a ``description``; combinations that cannot work are rejected when the
config is built, with a message that says what to change. Unknown keys are
rejected too (``extra="forbid"``), so a typo in a config file fails loudly
instead of silently falling back to a default.

Temperature: the trainer never has a temperature setting of its own. Proximal
and current logprobs are recomputed at the temperature each completion was
sampled with (``CompletionRecord.sampling["temperature"]``, default 1.0), so
that ``behav``, ``prox`` and current logprobs are all log-probabilities of the
same tempered distribution ``softmax(logits / T)``; mixing temperatures would
bias the importance weight ``exp(prox - behav)`` (see ``proxima.trainer.loss``).

The sections that say how the trainer learns (``ppo``, ``advantage``, ``batching``,
``optim``) live in ``proxima.trainer.algorithm_config`` and are importable from here;
this module holds the rest (model layout, LoRA, loop, connection), the whole
:class:`TrainerConfig`, and the reading of config files.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from proxima.trainer.algorithm_config import (
    DEFAULT_EPS_CLIP,
    AdvantageConfig,
    BatchingConfig,
    OptimConfig,
    PPOConfig,
    StrictSection,
)
from proxima.trainer.tracking import TrackingConfig
from proxima.trainer.weights_config import WeightsConfig
from pydantic import Field, SecretStr, field_validator, model_validator

RETRY_WINDOW_S = 120.0
"""How long the trainer and the rollout retry a retryable failure (``proxima.trainer.retry``):
a PostgreSQL restart, an engine restart and a proxy's failover all fit in it."""

__all__ = [
    "ADAPTER_NAME",
    "DEFAULT_EPS_CLIP",
    "AdvantageConfig",
    "BatchingConfig",
    "ConnectionConfig",
    "LoopConfig",
    "LoraConfig",
    "MegatronConfig",
    "OptimConfig",
    "PPOConfig",
    "StrictSection",
    "TrainerConfig",
    "load_config",
    "load_raw_config",
]


class MegatronConfig(StrictSection):
    """How the megatron backend lays the model out (``backend = "megatron"``).

    The random seed is :attr:`TrainerConfig.seed`;
    ``proxima.trainer.backends.megatron.MegatronPPOBackend`` turns this section
    into megatron's ``MegatronParallelConfig``.
    """

    tensor_parallel: int = Field(
        1, ge=1, description="Tensor-parallel size; must divide the KV heads and the FFN width."
    )
    pipeline_parallel: int = Field(
        1, ge=1, description="Pipeline-parallel size; only 1 is supported by the megatron backend."
    )
    make_vocab_size_divisible_by: int = Field(
        128,
        ge=1,
        description="The embedding is padded to a multiple of this times tensor_parallel.",
    )

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        if self.pipeline_parallel != 1:
            raise ValueError(
                f"megatron.pipeline_parallel={self.pipeline_parallel}: the megatron backend runs "
                "without pipeline parallelism; set pipeline_parallel = 1 and use tensor_parallel"
            )
        return self


ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""An adapter's name (the proxy's policies use the same rule; the base model has none)."""


class LoraConfig(StrictSection):
    """LoRA adapters trained on one frozen base (``[trainer.lora]``; torch backend, peft).

    Each adapter is a policy of its own: it trains only on its own sessions,
    keeps its own AdamW state and version sequence (1, 2, ...), and is pushed
    as a peft directory. No adapters: full fine-tuning of the base model.
    Hu et al. 2021: ``W x + (alpha / rank) * B A x`` with ``A`` random, ``B``
    zero at the start, so a new adapter starts as the base model exactly.
    """

    adapters: tuple[str, ...] = Field(
        (),
        description="Names of the adapters to train (each matches ^[a-z0-9][a-z0-9_-]{0,63}$); "
        "empty: full fine-tuning of the base model.",
    )
    rank: int = Field(8, ge=1, description="LoRA rank r of every adapter.")
    alpha: float = Field(
        16.0, gt=0.0, description="LoRA alpha: the update B A x is scaled by alpha / rank."
    )
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Names of the linear modules that get an adapter (peft's target_modules), "
        "e.g. the attention projections q_proj, k_proj, v_proj, o_proj of Llama/Qwen.",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input while training. 0 (the default) keeps the "
        "training pass a deterministic function of the weights, as the decoupled loss assumes "
        "when the proximal logprobs come from that pass.",
    )

    @field_validator("adapters")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not ADAPTER_NAME.match(name):
                raise ValueError(
                    f"lora.adapters: {name!r} is not an adapter name; use lower-case letters, "
                    "digits, '-' and '_' (first a letter or digit), at most 64 characters"
                )
        duplicates = sorted({n for n in value if value.count(n) > 1})
        if duplicates:
            raise ValueError(f"lora.adapters names {duplicates} more than once")
        return value


class LoopConfig(StrictSection):
    """The training loop around the store and the proxy (``proxima.trainer.loop``)."""

    trainer_id: str = Field(
        "proxima-trainer",
        min_length=1,
        description=(
            "Name this trainer claims sessions under. Keep it stable across restarts: sessions a "
            "crashed run with the same id still holds are released at start-up. Two trainers on "
            "one database need different ids."
        ),
    )
    poll_interval_s: float = Field(
        1.0, gt=0.0, description="Seconds between store polls while waiting for a full batch."
    )
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps of this run; None runs until stopped."
    )
    push_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Timeout of one POST /admin/weights (the proxy loads the weights on every "
        "backend before answering).",
    )
    session_kinds: tuple[Literal["train", "production"], ...] = Field(
        ("train", "production"),
        min_length=1,
        description="Kinds of sessions to train on: rollout-controller sessions (train) and "
        "recorded production traffic (production).",
    )
    retry_window_s: float = Field(
        RETRY_WINDOW_S,
        ge=0.0,
        description="Seconds a retryable failure is retried before the trainer gives up: the "
        "proxy answering 502/503/504 or 429 with Retry-After, a connection error, the store out "
        "of reach (a PostgreSQL restart, an engine restart). 0: no retry.",
    )


class ConnectionConfig(StrictSection):
    """Where the trainer finds the proxy, the store and the initial model (CLI flags override)."""

    proxy_url: str | None = Field(
        None,
        description="Base URL of the proxy, e.g. http://127.0.0.1:8000 (--proxy); for a fleet "
        "of replicas on one database, their load balancer's URL or several replica URLs "
        "separated by commas (tried in turn: a push through any one reaches them all).",
    )
    db_url: str | None = Field(
        None, description="SQLAlchemy URL of the trajectory store the proxy writes (--db)."
    )
    model_dir: Path | None = Field(
        None, description="HF model directory of the initial policy, version 0 (--model)."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Admin bearer token of the proxy (--admin-token or PROXIMA_ADMIN_TOKEN).",
    )

    @field_validator("proxy_url", mode="before")
    @classmethod
    def _proxy_urls(cls, value: Any) -> Any:
        """One URL, or several (a list, or comma-separated): each an http(s) base URL."""
        if value is None:
            return None
        parts = value if isinstance(value, list) else str(value).split(",")
        urls = [str(u).strip().rstrip("/") for u in parts if str(u).strip()]
        if not urls:
            raise ValueError("proxy_url is empty")
        for url in urls:
            if not url.startswith(("http://", "https://")) or "://" in url.split("://", 1)[1]:
                raise ValueError(
                    f"proxy_url {url!r} is not an http(s) base URL (several replicas: "
                    "separate their URLs with commas)"
                )
        return ",".join(urls)

    @property
    def proxy_urls(self) -> list[str]:
        """The proxy URLs to try, in order (empty when unset)."""
        return self.proxy_url.split(",") if self.proxy_url else []

    def missing(self) -> list[str]:
        """Names of the settings a run needs but that are unset (admin_token is optional)."""
        return [
            name for name in ("proxy_url", "db_url", "model_dir") if getattr(self, name) is None
        ]


class TrainerConfig(StrictSection):
    """The whole trainer configuration."""

    ppo: PPOConfig = Field(default_factory=PPOConfig, description="Decoupled PPO objective.")
    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="Returns and advantages."
    )
    batching: BatchingConfig = Field(
        default_factory=BatchingConfig, description="Dynamic micro-batching."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimiser.")
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Megatron layout (backend = megatron)."
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters (none: full fine-tuning)."
    )
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Training loop.")
    connection: ConnectionConfig = Field(
        default_factory=ConnectionConfig, description="Proxy, store and initial model."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment trackers (TensorBoard, MLflow, W&B) that get every step's "
        "metrics and sample rollouts (proxima.trainer.tracking).",
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig,
        description="How full-weight versions reach the backends (disk or broadcast).",
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="Sessions per training step (B in the staleness rule). Declared by the "
        "proxy (proxima serve --train-batch-size): the trainer takes the proxy's; a different "
        "value set here is refused (proxima.trainer.proxy_settings).",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="eta: generated tokens whose policy version is below current_version - eta "
        "are not trained (see stale_rule); 0 is synchronous RL. Declared by the proxy when it "
        "runs with --max-staleness (the trainer takes it; a different value here is refused); "
        "otherwise this value bounds what the trainer trains.",
    )
    stale_rule: Literal["token", "sample"] = Field(
        "token",
        description="How max_staleness is enforced on the trainer side. token: tokens older "
        "than current_version - eta leave the loss, the rest of their sample trains (a "
        "completion interrupted by several pushes keeps its recent tokens). sample: a sample "
        "with any trained token older than the bound is dropped whole (biased against long "
        "outputs).",
    )
    production_max_staleness: int | None = Field(
        None,
        ge=0,
        description="Staleness bound of recorded production samples (they carry the pinned "
        "production version, often many versions behind). None: any staleness; the decoupled "
        "importance weights, capped by ppo.importance_weight_cap, correct for it.",
    )
    production_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Most share of a batch's sessions that may be production sessions (the rest "
        "are rollout sessions). None: no limit, oldest first whatever their kind.",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Save a full checkpoint every N steps; 0 disables checkpoints."
    )
    keep_versions: int = Field(
        2, ge=1, description="Number of exported weight versions kept on disk."
    )
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Training backend: HF model + AdamW (torch) or megatron-core."
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?|auto)$",
        description="Torch device for the torch backend: cpu, cuda, cuda:N or auto.",
    )
    output_dir: Path = Field(
        Path("proxima-trainer"), description="Directory for exported weights and checkpoints."
    )
    seed: int = Field(0, description="Random seed (torch, python).")

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.batch_size < self.ppo.ppo_minibatches:
            raise ValueError(
                f"batch_size={self.batch_size} is smaller than ppo.ppo_minibatches="
                f"{self.ppo.ppo_minibatches}: some minibatches would be empty; raise batch_size "
                "or lower ppo_minibatches"
            )
        if self.lora.adapters and self.backend == "megatron":
            # megatron-core 0.16.1 has no LoRA/PEFT layers (its "lora" ranks are MLA's
            # low-rank projections, part of the architecture); adapters live in NeMo.
            raise ValueError(
                f'lora.adapters={list(self.lora.adapters)} needs backend = "torch": the megatron '
                "backend trains full weights only (megatron-core 0.16 has no LoRA layers); set "
                'backend = "torch" to train adapters, or remove lora.adapters'
            )
        return self

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapters this trainer trains (empty: full fine-tuning)."""
        return self.lora.adapters


def load_config(path: str | Path) -> TrainerConfig:
    """Load a :class:`TrainerConfig` from a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file.

    YAML needs PyYAML (imported lazily); JSON and TOML use the standard library.
    Validation errors are pydantic ``ValidationError`` with the field path.
    """
    return TrainerConfig.model_validate(load_raw_config(path))


def load_raw_config(path: str | Path) -> Any:
    """The parsed content of a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` config file."""
    path = Path(path)
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    data: Any
    if suffix == ".json":
        data = json.loads(text)
    elif suffix == ".toml":
        data = tomllib.loads(text)
    elif suffix in {".yaml", ".yml"}:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - pyyaml ships with the dev environment
            raise ValueError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); or use JSON/TOML"
            ) from exc
        data = yaml.safe_load(text)
    else:
        raise ValueError(
            f"{path}: unknown config format {suffix!r}; use .json, .toml, .yaml or .yml"
        )
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level of a config file must be a mapping")
    return data
