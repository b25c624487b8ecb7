"""``proxima train`` and ``proxima eval``: one command from dataset to trained policy.

``train`` starts (or connects to) the proxy with its engine, measures held-out
accuracy, then runs the rollout controller (the user's unmodified agent over
the training items, ``group_size`` sessions each) and the trainer side by
side until ``steps`` PPO steps are done, showing a progress bar per step,
updating a reward-curve PNG, and finally copies the last policy to
``<output_dir>/final`` (an HF directory) and measures held-out accuracy again,
ending with (``proxima.trainer.pipeline.evaluation``)::

    first answers cut at max_tokens (96): 3.0% -> 0.0% held-out, 4.0% -> 0.0% unseen phrasings
    first-try accuracy: 20.0% -> 44.0%; within two tries: 30.0% -> 52.0%; unseen phrasings (first try): 18.0% -> 34.0%

First-try accuracy is the headline: one answer, no feedback. Success within
the agent's tries (``eval.item_fields``' ``max_turns``) stands beside it. The
unseen-phrasings figure (with ``data.unseen_items`` or ``data.unseen_file``)
is the first-try accuracy on held-out problems asked in wordings no train item
uses: a policy that learned the arithmetic gains there too, one that fitted
the train prompt's template does not. An agent that reports no first try
gets ``held-out accuracy: B -> A; unseen phrasings: B -> A`` (its mean reward).

The trainer runs in its own process (``proxima trainer``), as in production:
its compute never stalls the agents' event loop. Ctrl-C stops everything
cleanly; the trainer leaves a resumable checkpoint in ``<output_dir>/trainer``.

With ``[[rollout.tenants]]`` (and ``[trainer.lora] adapters`` naming the same
adapters) the run trains one LoRA adapter per tenant instead of the base model:
one rollout controller per tenant (its own agent, items and item fields), one
trainer (``steps`` per adapter), accuracy and a reward curve per tenant, each
line printed with the tenant's name, and ``final/<adapter>`` per tenant.

Config (TOML/JSON/YAML) sections: ``model``, ``proxy``, ``data``,
``rollout``, ``eval``, ``trainer`` (a ``TrainerConfig``), plus ``steps`` and
``output_dir``, ``warm_start``. See ``agents_examples/demo.toml``.

This module is the two commands; their parts live beside it in ``proxima.trainer.pipeline``:
``policies`` (the model, the items, a policy per tenant and its rollout controller),
``processes`` (the proxy and the trainer a run starts), ``evaluation`` (held-out accuracy)
and ``plots`` (the step logs and reward curves). The names other code imports from here
(``run_policies``, ``rollout_controller``, ``curve_points``, ``plot_rewards``...) still are.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proxima.proxy.policies.adapters import check_adapter
from proxima.trainer.pipeline.config import TrainRunConfig
from proxima.trainer.pipeline.evaluation import (
    Accuracy,
    Score,
    accuracy_line,
    evaluate,
    scored_items,
    tool_line,
    truncation_line,
)
from proxima.trainer.pipeline.plots import curve_points, plot_rewards, read_log
from proxima.trainer.pipeline.policies import (
    Items,
    Policy,
    load_items,
    resolve_model_dir,
    rollout_controller,
    rollout_fields,
    run_policies,
    train_items,
)
from proxima.trainer.pipeline.processes import RunProxy, start_trainer, stop_trainer
from proxima.trainer.pipeline.tracking import RunTrackers, discard, start_trackers
from proxima.trainer.pipeline.warm_start import run_warm_start
from proxima.trainer.rollout.controller import RolloutController, RolloutReport

__all__ = [
    "Accuracy",
    "Items",
    "Policy",
    "RunProxy",
    "curve_points",
    "eval_only",
    "evaluate",
    "load_items",
    "plot_rewards",
    "read_log",
    "resolve_model_dir",
    "rollout_controller",
    "run_policies",
    "train",
]

# How long a stopped run waits for its runs in flight to finish their sessions.
ABANDON_TIMEOUT_S = 30.0

Records = dict[str | None, list[dict[str, Any]]]  # each policy's step records (None: the base)


async def train(cfg: TrainRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole job; returns the summary (accuracies, steps, paths).

    With ``rollout.tenants`` every tenant's adapter is trained at once (one trainer,
    round-robin, ``steps`` each), on its own agent's sessions; each is evaluated on its
    own held-out items, and the summary holds one entry per tenant under ``tenants``.
    """
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(cfg.model)
    policies = run_policies(cfg)
    run = RunProxy(cfg, model_dir, lora=bool(cfg.rollout.tenants))
    trainer_proc: subprocess.Popen[bytes] | None = None
    controllers: list[RolloutController] = []
    trackers: RunTrackers | None = None
    # Imported and opened on a thread while the proxy starts (seconds); refused at once if
    # one is not installed.
    opening = start_trackers(cfg, [p.adapter for p in policies])
    try:
        started = time.monotonic()
        run.start()
        eval_started = time.monotonic()
        before = await _evaluate_all(run, policies)
        for policy in policies:
            print(accuracy_line(cfg, policy, before[policy.adapter]), flush=True)
            cut = truncation_line(cfg, policy, before[policy.adapter])
            if cut is not None:
                print(cut, flush=True)
        if opening is not None:
            logs = {p.adapter: p.log_path(cfg) for p in policies}
            trackers = await RunTrackers.ready(opening, logs, run.db)
            for policy in policies:
                trackers.evaluation(policy.adapter, before[policy.adapter])
        train_started = time.monotonic()
        await run_warm_start(cfg, run, policies[0])  # [warm_start]: its line, warm_start.json

        # A resumed run's log holds its earlier steps: the trainer runs ``steps`` more.
        resumed = {p.adapter: len(read_log(p.log_path(cfg))) for p in policies}
        trainer_proc = start_trainer(cfg, run)
        controllers = [
            rollout_controller(cfg, run.url, run.token, run.model_name, p) for p in policies
        ]
        records, reports, train_s = await _run_training(
            cfg,
            trainer_proc,
            controllers,
            policies,
            before,
            resumed,
            trackers,
            progress,
            train_started,
        )

        after_started = time.monotonic()
        after = await _evaluate_all(run, policies)
        if trackers is not None:
            for policy in policies:
                trackers.evaluation(policy.adapter, after[policy.adapter])
        eval_s = (train_started - eval_started) + (time.monotonic() - after_started)
        results = {
            p.adapter: _policy_result(
                cfg, p, report, records[p.adapter], before[p.adapter], after[p.adapter]
            )
            for p, report in zip(policies, reports, strict=True)
        }
        new_steps = sum(len(r) for r in records.values()) - sum(resumed.values())
        summary = _summary(cfg, results, new_steps, resumed, train_s, eval_s, started)
        _print_outcome(cfg, policies, results, before, after, summary, new_steps, train_s)
        return summary
    finally:
        for controller in controllers:
            controller.stop()
        if trainer_proc is not None:
            stop_trainer(trainer_proc)
        if trackers is not None:
            await trackers.close()
        elif opening is not None:
            await discard(opening)
        run.stop()


async def _evaluate_all(run: RunProxy, policies: list[Policy]) -> dict[str | None, Accuracy]:
    """Every policy's held-out accuracy, side by side."""
    scores = await asyncio.gather(
        *(
            run.evaluate_both(p.items, adapter=p.adapter, agent=p.agent, fields=p.fields)
            for p in policies
        )
    )
    return {p.adapter: score for p, score in zip(policies, scores, strict=True)}


async def _run_training(
    cfg: TrainRunConfig,
    trainer: subprocess.Popen[bytes],
    controllers: list[RolloutController],
    policies: list[Policy],
    before: dict[str | None, Accuracy],
    resumed: dict[str | None, int],
    trackers: RunTrackers | None,
    progress: bool,
    train_started: float,
) -> tuple[Records, list[RolloutReport], float]:
    """Every policy's rollouts and the trainer side by side until the trainer exits, a progress
    bar counting the steps: each policy's step records, its rollout report, and the seconds
    the training took since ``train_started`` (a ``time.monotonic()``). Raises when the
    trainer failed."""
    from tqdm import tqdm

    resumed_steps = sum(resumed.values())
    bar = tqdm(
        initial=resumed_steps,
        total=resumed_steps + cfg.steps * len(policies),
        desc="PPO steps",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )

    async def on_step(policy: Policy, record: dict[str, Any]) -> None:
        if trackers is not None:
            await trackers.step(policy.adapter, record)
        lag = record.get("staleness") or {}
        postfix = {} if policy.adapter is None else {"adapter": policy.adapter}
        bar.set_postfix(
            **postfix,
            reward=f"{record.get('reward_mean') or 0:.2f}",
            v=record.get("version"),
            stale=max((int(k) for k in lag), default=0),
            tok_s=f"{record.get('tokens_per_s') or 0:.0f}",
        )
        bar.update(1)

    rollouts = [
        asyncio.create_task(c.run(train_items(p.items.train, rollout_fields(cfg, p))))
        for c, p in zip(controllers, policies, strict=True)
    ]
    try:
        records = await _follow_training(
            cfg, trainer, controllers, policies, before, on_step, resumed
        )
    except BaseException:  # a stop (Ctrl-C, SIGTERM) or a failure: end the runs in flight first
        await _abandon_rollouts(controllers, rollouts)
        raise
    if trackers is not None:  # the steps logged after the last look at the logs
        for policy in policies:
            for record in records[policy.adapter][trackers.counts[policy.adapter] :]:
                await trackers.step(policy.adapter, record)
    train_s = time.monotonic() - train_started
    bar.close()
    reports = [await r for r in rollouts]
    if trainer.returncode != 0:
        raise RuntimeError(
            f"the trainer exited with {trainer.returncode}; see {cfg.output_dir / 'trainer.log'}"
        )
    return records, reports, train_s


async def _abandon_rollouts(
    controllers: list[RolloutController], rollouts: list[asyncio.Task[RolloutReport]]
) -> None:
    """No new runs; the runs in flight cancelled, their sessions finished (as failed) while
    the proxy is still up. Left to ``asyncio.run``'s clean-up, each run's shielded finish
    would retry against a stopped proxy for its whole retry window (two minutes)."""
    for controller in controllers:
        controller.stop()
    for rollout in rollouts:
        rollout.cancel()
    await asyncio.wait(rollouts, timeout=ABANDON_TIMEOUT_S)


async def _follow_training(
    cfg: TrainRunConfig,
    trainer: subprocess.Popen[bytes],
    controllers: list[RolloutController],
    policies: list[Policy],
    before: dict[str | None, Accuracy],
    on_step: Callable[[Policy, dict[str, Any]], Awaitable[None]],
    resumed: dict[str | None, int],
) -> dict[str | None, list[dict[str, Any]]]:
    """Until the trainer exits: a progress bar per step and a fresh reward curve per policy
    (``resumed``: the steps each policy's log held before this run, already counted)."""
    seen = dict(resumed)
    while trainer.poll() is None:
        await asyncio.sleep(1.0)
        for policy in policies:
            records = read_log(policy.log_path(cfg))
            for record in records[seen[policy.adapter] :]:
                await on_step(policy, record)
            if len(records) > seen[policy.adapter]:
                seen[policy.adapter] = len(records)
                accuracy = before[policy.adapter]
                plot_rewards(
                    records,
                    policy.curve_path(cfg),
                    before=accuracy.test.headline,
                    unseen_before=_headline(accuracy.unseen),
                )
    for controller in controllers:
        controller.stop()
    return {p.adapter: read_log(p.log_path(cfg)) for p in policies}


def _policy_result(
    cfg: TrainRunConfig,
    policy: Policy,
    report: RolloutReport,
    records: list[dict[str, Any]],
    before: Accuracy,
    after: Accuracy,
) -> dict[str, Any]:
    """One policy's part of the summary; its final model copied out and its reward curve
    drawn with the accuracies before and after."""
    final = _copy_final(cfg, policy.adapter)
    if records:
        plot_rewards(
            records,
            policy.curve_path(cfg),
            before=before.test.headline,
            after=after.test.headline,
            unseen_before=_headline(before.unseen),
            unseen_after=_headline(after.unseen),
        )
    return {
        # the headline: first-try accuracy where the agent reports it, else its mean reward
        "before": before.test.headline,
        "after": after.test.headline,
        "test_items": scored_items(cfg.eval, policy.items.test),
        "unseen_before": _headline(before.unseen),
        "unseen_after": _headline(after.unseen),
        "scores": {
            "before": {"test": before.test.as_dict(), "unseen": _as_dict(before.unseen)},
            "after": {"test": after.test.as_dict(), "unseen": _as_dict(after.unseen)},
        },
        "unseen_items": scored_items(cfg.eval, policy.items.unseen),
        "pushed_steps": sum(1 for r in records if r.get("pushed", True)),
        "steps": len(records),
        "final_model": str(final),
        "rollouts": report.summary(),
        "reward_curve": str(policy.curve_path(cfg)),
    }


def _headline(score: Score | None) -> float | None:
    return None if score is None else score.headline


def _as_dict(score: Score | None) -> dict[str, float | None] | None:
    return None if score is None else score.as_dict()


def _summary(
    cfg: TrainRunConfig,
    results: dict[str | None, dict[str, Any]],
    new_steps: int,
    resumed: dict[str | None, int],
    train_s: float,
    eval_s: float,
    started: float,
) -> dict[str, Any]:
    """The run's summary, written to ``summary.json``: each policy's results (the base's at the
    top level, tenants' under ``tenants``) and the timing of training, per step, evaluation
    and the whole run (``started``: its ``time.monotonic()``)."""
    resumed_steps = sum(resumed.values())
    timing = {
        "max_staleness": cfg.trainer.max_staleness,
        "train_s": round(train_s, 1),
        "seconds_per_step": round(train_s / max(1, new_steps), 1),
        "resumed_steps": resumed_steps,
        "eval_s": round(eval_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if cfg.rollout.tenants:
        summary = {"tenants": results, "steps": new_steps + resumed_steps, **timing}
    else:
        summary = {**results[None], **timing}
    (cfg.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _print_outcome(
    cfg: TrainRunConfig,
    policies: list[Policy],
    results: dict[str | None, dict[str, Any]],
    before: dict[str | None, Accuracy],
    after: dict[str | None, Accuracy],
    summary: dict[str, Any],
    new_steps: int,
    train_s: float,
) -> None:
    """The closing lines: the steps and their time, each policy's reward curve and final
    model, and its held-out accuracy before -> after."""
    resumed_steps = summary["resumed_steps"]
    earlier = f", after {resumed_steps} earlier" if resumed_steps else ""
    print(
        f"trained {new_steps} steps{earlier} in {train_s:.0f} s "
        f"({summary['seconds_per_step']} s/step); whole run {summary['wall_s']:.0f} s"
    )
    for policy in policies:
        result = results[policy.adapter]
        print(
            f"{policy.prefix}reward curve: {result['reward_curve']}; "
            f"final model: {result['final_model']}"
        )
    for policy in policies:
        cut = truncation_line(cfg, policy, before[policy.adapter], after[policy.adapter])
        if cut is not None:
            print(cut)
    for policy in policies:
        print(
            accuracy_line(cfg, policy, before[policy.adapter], after[policy.adapter]),
            flush=True,
        )
    for policy in policies:
        tools = tool_line(policy, before[policy.adapter], after[policy.adapter])
        if tools is not None:
            print(tools, flush=True)


def _copy_final(cfg: TrainRunConfig, adapter: str | None = None) -> Path | None:
    """The policy's last exported version, copied to ``final`` (an adapter's to
    ``final/<adapter>``: peft's directory)."""
    from proxima.trainer.weights import exported_versions, weights_dir

    out = (cfg.output_dir / "trainer").resolve()
    versions = exported_versions(out, adapter)
    if not versions:
        return None
    final = cfg.output_dir / "final"
    if adapter is not None:
        final = final / adapter
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".final-{time.time_ns()}"
    shutil.copytree(weights_dir(out, versions[-1], adapter), tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


async def eval_only(
    cfg: TrainRunConfig, version: int | None = None, *, adapter: str | None = None
) -> float:
    """``proxima eval``: held-out accuracy of the configured model through the proxy.

    With ``version`` (a running proxy: ``proxy.url``), that registered version is
    evaluated and its score recorded in the proxy's registry, where
    ``proxima production promote --require-eval`` compares it with production's.
    With ``adapter``, the policy evaluated (and whose version is scored) is that
    LoRA adapter (``proxima production promote V --adapter NAME --require-eval``).
    """
    if version is not None and not cfg.proxy.url:
        raise ValueError("--version evaluates a version of a running proxy: set proxy.url")
    if adapter is not None:
        check_adapter(adapter)  # ValueError: a clear message for the command line
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(cfg.model)
    items = load_items(cfg.data)
    run = RunProxy(cfg, model_dir, lora=adapter is not None)
    try:
        run.start()
        accuracy = await run.evaluate_both(items, version, adapter=adapter)
    finally:
        run.stop()
    score = accuracy.test.headline
    scored = scored_items(cfg.eval, items.test)
    label = "" if version is None else f" of version {version}"
    if adapter is not None:
        label += f" of adapter {adapter}"
    policy = Policy(None, cfg.rollout.agent, items, dict(cfg.rollout.item_fields))
    line = accuracy_line(cfg, policy, accuracy).replace(" before training", label, 1)
    cut = truncation_line(cfg, policy, accuracy)
    print(line if cut is None else f"{line}\n{cut}")
    (cfg.output_dir / "eval.json").write_text(
        json.dumps({"test": accuracy.test.as_dict(), "unseen": _as_dict(accuracy.unseen)})
    )
    if version is not None:
        await _record_eval(run, version, score, scored, adapter=adapter)
    return score


async def _record_eval(
    run: RunProxy, version: int, score: float, items: int, *, adapter: str | None = None
) -> None:
    import httpx

    body: dict[str, Any] = {"score": score, "items": items, "name": "proxima eval"}
    if adapter is not None:
        body["adapter"] = adapter
    async with httpx.AsyncClient(timeout=60) as http:
        resp = await http.post(
            f"{run.url}/admin/versions/{version}/evals",
            json=body,
            headers={"Authorization": f"Bearer {run.token}"},
        )
    resp.raise_for_status()
