"""``proxima train``'s warm start (``[warm_start]``): the run's own successes, learnt before PPO.

Between the evaluation "before" (the base model, as the rollouts will run it) and the PPO steps,
with ``warm_start.sessions`` above 0:

1. the agent runs once on each of the first ``sessions`` train items, with the rollout's item
   fields updated by ``warm_start.item_fields`` (the tool demo forces its first call:
   ``first_tool_choice = "required"``) at ``warm_start.temperature``; every run is a proxy
   session, recorded as usual;
2. the runs whose reward reached ``min_reward`` are kept, and a trainer process
   (``proxima trainer --warm-start FILE``, ``proxima.trainer.sft``) takes ``steps``
   supervised steps on them (negative log-likelihood of their generated tokens, free of the
   grammar they were decoded under), pushes the next version and marks the runs TRAINED
   (kept) or DROPPED (the rest);
3. with ``evaluate``, held-out accuracy is measured again (the warm start's own effect); the
   PPO steps then start from the pushed version, with the rollout's own item fields.

The "before" figure is the base model's, so a run's gain counts the warm start; the line
``warm start: K of N runs kept, S supervised steps (loss A -> B); held-out after it X%`` and
``<output_dir>/warm_start.json`` (runs, kept, losses, version, the scores after it, seconds)
tell its share.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from proxima.trainer.pipeline.config import TrainRunConfig
from proxima.trainer.pipeline.evaluation import Accuracy
from proxima.trainer.pipeline.plots import read_events
from proxima.trainer.pipeline.policies import Policy, rollout_controller, rollout_fields
from proxima.trainer.pipeline.processes import RunProxy, start_trainer
from proxima.trainer.sft import WarmStartPlan, write_plan


@dataclass
class WarmStart:
    """What the warm start did: its runs, those kept, the trainer's event, accuracy after."""

    runs: int
    kept: int
    mean_reward: float | None
    event: dict[str, Any] = field(default_factory=dict)
    after: Accuracy | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        test = None if self.after is None else self.after.test
        after = None if test is None else {**test.as_dict(), "headline": test.headline}
        return {
            "runs": self.runs,
            "kept": self.kept,
            "mean_reward": self.mean_reward,
            "losses": self.event.get("losses"),
            "version": self.event.get("version"),
            "after": after,
            "seconds": round(self.seconds, 1),
        }

    def line(self) -> str:
        """``warm start: 14 of 16 runs kept, 8 supervised steps (loss 0.91 -> 0.12); held-out
        first-try accuracy after it 60.0%``."""
        losses = self.event.get("losses") or []
        steps = (
            f", {len(losses)} supervised steps (loss {losses[0]:.3f} -> {losses[-1]:.3f})"
            if losses
            else ", nothing learnt"
        )
        after = "" if self.after is None else f"; held-out after it {self.after.test.headline:.1%}"
        return f"warm start: {self.kept} of {self.runs} runs kept{steps}{after}"


async def run_warm_start(cfg: TrainRunConfig, run: RunProxy, policy: Policy) -> WarmStart | None:
    """Steps 1-3 of the module docstring; None when ``warm_start.sessions`` is 0."""
    ws = cfg.warm_start
    if not ws.sessions:
        return None
    started = time.monotonic()
    one_run = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": 1})})
    controller = rollout_controller(one_run, run.url, run.token, run.model_name, policy)
    fields = {**rollout_fields(cfg, policy), **ws.item_fields}
    if ws.temperature is not None:
        fields["temperature"] = ws.temperature
    items = [
        {**item, **fields, "id": f"{item.get('id')}@warm"}
        for item in policy.items.train[: ws.sessions]
    ]
    report = await controller.run(items)
    keep = [
        r.session_id
        for r in report.runs
        if r.status == "finished" and r.reward is not None and r.reward >= ws.min_reward
    ]
    plan = WarmStartPlan(
        sessions=[r.session_id for r in report.runs], keep=keep, steps=ws.steps, lr=ws.lr
    )
    path = cfg.output_dir / "warm_start_plan.json"
    write_plan(path, plan)
    trainer = start_trainer(cfg, run, extra_args=["--warm-start", str(path.resolve())])
    code = trainer.wait()
    if code != 0:
        raise RuntimeError(
            f"the warm start's trainer exited with {code}; see {cfg.output_dir / 'trainer.log'}"
        )
    events = read_events(policy.log_path(cfg), "warm_start")
    result = WarmStart(
        runs=len(report.runs),
        kept=len(keep),
        mean_reward=report.mean_reward,
        event=events[-1] if events else {},
    )
    if ws.evaluate:
        result.after = await run.evaluate_both(
            policy.items, agent=policy.agent, fields=policy.fields
        )
    result.seconds = time.monotonic() - started
    (cfg.output_dir / "warm_start.json").write_text(json.dumps(result.as_dict(), indent=2))
    print(result.line(), flush=True)
    return result
