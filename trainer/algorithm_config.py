"""Typed configuration of how the trainer learns: the PPO objective, returns and
advantages, micro-batching and the optimiser.

Sections of :class:`proxima.trainer.config.TrainerConfig` (which re-exports them), on
the base every trainer config section shares, :class:`StrictSection`: unknown keys
are errors, and combinations that cannot work are rejected with a message that says
what to change.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_EPS_CLIP = 0.2


class StrictSection(BaseModel):
    """Base of all config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class PPOConfig(StrictSection):
    """Decoupled PPO objective (AReaL, Fu et al. 2025, eq. 5)."""

    eps_clip: float = Field(
        DEFAULT_EPS_CLIP,
        gt=0.0,
        description="Lower clip range: the ratio pi_theta / pi_prox is clipped below at 1 - eps_clip.",
    )
    eps_clip_high: float = Field(
        DEFAULT_EPS_CLIP,
        gt=0.0,
        description=(
            "Upper clip range: the ratio is clipped above at 1 + eps_clip_high "
            "(DAPO's clip-higher when larger than eps_clip). Defaults to eps_clip when omitted."
        ),
    )
    importance_weight_cap: float | None = Field(
        5.0,
        description=(
            "Tokens whose behaviour importance weight exp(prox - behav) exceeds this cap are "
            "masked out of the loss (they still count in the normaliser). None disables the cap."
        ),
    )
    decoupled: bool = Field(
        True,
        description=(
            "True: recompute proximal logprobs with the weights before the step (decoupled PPO). "
            "False: use the behaviour logprobs as proximal ones (prox = behav), i.e. standard PPO."
        ),
    )
    ppo_minibatches: int = Field(
        1,
        ge=1,
        description="Number of minibatch updates (optimizer steps) per training step; each "
        "minibatch is a disjoint slice of the step's sessions.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_eps_clip_high(cls, data: Any) -> Any:
        """Fill ``eps_clip_high`` from ``eps_clip`` when it is omitted or null."""
        if isinstance(data, dict) and data.get("eps_clip_high") is None:
            data = {**data, "eps_clip_high": data.get("eps_clip", DEFAULT_EPS_CLIP)}
        return data

    @model_validator(mode="after")
    def _check(self) -> PPOConfig:
        if self.eps_clip >= 1.0:
            raise ValueError(
                f"ppo.eps_clip={self.eps_clip} clips the ratio below at {1 - self.eps_clip} <= 0, "
                "which disables the lower clip; set eps_clip in (0, 1), e.g. 0.2"
            )
        if self.importance_weight_cap is not None and self.importance_weight_cap < 1.0:
            raise ValueError(
                f"ppo.importance_weight_cap={self.importance_weight_cap} is below 1 and would mask "
                "on-policy tokens (weight exactly 1); set it >= 1 (e.g. 5.0) or null to disable"
            )
        return self


class AdvantageConfig(StrictSection):
    """Returns and group-relative advantages (see ``proxima.trainer.samples``)."""

    discount: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Discount gamma across the turns of a session: G_t = r_t + gamma * G_{t+1}.",
    )
    baseline: Literal["group_mean", "leave_one_out", "none"] = Field(
        "group_mean",
        description=(
            "Baseline subtracted from every turn's return G_t: the group's mean return over every "
            "(session, turn), each session weighing 1 in total (1/T_i per turn; group_mean, "
            "GRPO when every session has one turn), the same mean without the session itself "
            "(leave_one_out, RLOO), or no baseline (none). See proxima.trainer.advantages."
        ),
    )
    normalize_std: bool = Field(
        True,
        description="Divide advantages by the group's (population) std of every (session, turn) "
        "return G_t, session-weighted as the baseline (1/T_i per turn); a group whose returns "
        "all tie gets zero advantage.",
    )
    ungrouped: Literal["batch", "alone"] = Field(
        "batch",
        description=(
            "Sessions without a group_id (production traffic): batch pools all of a batch's "
            "ungrouped sessions into one group, a batch-level baseline; alone keeps each a group "
            "of one, which gives zero advantage unless its turns' returns differ."
        ),
    )
    zero_signal: Literal["refill", "filter", "skip", "keep"] = Field(
        "refill",
        description=(
            "Samples whose advantages are all zero (a group whose returns tie): refill drops a "
            "claimed group with nothing to train as soon as it is claimed and claims others in "
            "its place, so every step trains batch_size sessions with signal (DAPO's dynamic "
            "sampling; the dropped sessions return their places under the proxy's staleness "
            "admission, so the replacements are generated by the current policy); filter "
            "leaves them out of the loss and its token mean without refilling, and takes no "
            "optimizer step and pushes no version when nothing is left (the step trains fewer "
            "sessions, and the admission lets the rollout run ahead of the trainer by the "
            "dropped sessions); skip trains the batch as is but takes no step when every advantage is zero; "
            "keep always steps (AdamW momentum then moves the weights on a zero gradient)."
        ),
    )
    refill_limit: int | None = Field(
        None,
        ge=1,
        description=(
            "With zero_signal = refill: the most sessions the screen may drop toward one step. "
            "Once that many are dropped, the step trains the sessions with signal it holds "
            "(fewer than batch_size, or none: then it takes no optimizer step and pushes no "
            "version, as filter does). None: refill until the batch is full. A task the policy "
            "has solved leaves few groups with signal (at 99% success 8 runs tie 92% of the "
            "time), and an unbounded refill then samples hundreds of sessions for one step."
        ),
    )
    sample_mode: Literal["chain", "individual"] = Field(
        "chain",
        description=(
            "chain: completions that token-exactly extend their parent are packed into one "
            "sequence (one forward pass per conversation path). individual: one sequence per "
            "completion."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.baseline == "none" and self.normalize_std:
            raise ValueError(
                "advantage.normalize_std=true needs a baseline: dividing raw returns by the group "
                "std does not centre them; set advantage.baseline to group_mean or leave_one_out, "
                "or set normalize_std to false"
            )
        return self


class BatchingConfig(StrictSection):
    """Dynamic micro-batching (AReaL algorithm 1)."""

    max_tokens_per_mb: int = Field(
        8192,
        ge=1,
        description="Token budget of one packed micro-batch. Every sequence must fit on its "
        "own; a longer one is reported at run time with its length.",
    )
    min_mbs: int = Field(
        1,
        ge=1,
        description="Minimum number of micro-batches per minibatch (the megatron backend raises it "
        "to the number of data-parallel replicas).",
    )


class OptimConfig(StrictSection):
    """AdamW optimiser and gradient handling."""

    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, description="Clip the global gradient L2 norm to this value; None disables clipping."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"optim.betas={self.betas}: both betas must be in [0, 1), e.g. [0.9, 0.999]"
            )
        if self.grad_clip is not None and self.grad_clip <= 0.0:
            raise ValueError(
                f"optim.grad_clip={self.grad_clip}: set a positive max norm (e.g. 1.0) or null to disable"
            )
        return self
