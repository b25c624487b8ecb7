"""``proxima train`` and ``proxima eval``: one command from dataset to trained policy.

``train`` starts (or connects to) the proxy with its engine, measures held-out
accuracy, then runs the rollout controller (the user's unmodified agent over
the training items, ``group_size`` sessions each) and the trainer side by
side until ``steps`` PPO steps are done, showing a progress bar per step,
updating a reward-curve PNG, and finally copies the last policy to
``<output_dir>/final`` (an HF directory) and measures held-out accuracy again:

    held-out accuracy: 23.0% -> 41.0%; unseen phrasings: 18.0% -> 30.0%

The second figure (with ``data.unseen_items`` or ``data.unseen_file``) is the
accuracy on held-out problems asked in wordings no train item uses: a policy
that learned the arithmetic gains there too, one that fitted the train
prompt's template does not.

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
``output_dir``. See ``agents_examples/demo.toml``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.server_process import ProxyProcess
from proxima.trainer.log import LOG_FILE, policy_home
from proxima.trainer.pipeline.config import (
    DataSection,
    EvalSection,
    ModelSection,
    TrainRunConfig,
)
from proxima.trainer.pipeline.tracking import RunTrackers, discard, start_trackers
from proxima.trainer.rollout.agents import resolve_agent
from proxima.trainer.rollout.controller import RolloutController

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- parts


def resolve_model_dir(section: ModelSection) -> Path:
    if section.path == "smollm2":
        from proxima.trainer.pipeline.demo_model import prepare_smollm2

        return prepare_smollm2(section.cache_dir)
    path = Path(section.path)
    if not (path / "config.json").exists():
        raise ValueError(f"model.path {path}: no config.json there; give an HF model directory")
    return path


@dataclass(frozen=True, slots=True)
class Items:
    """A run's items: train, held-out, and held-out in unseen phrasings (may be empty)."""

    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    unseen: list[dict[str, Any]]


def load_items(data: DataSection) -> Items:
    if data.source == "arithmetic":
        from proxima.agents_examples.datasets import arithmetic_splits

        splits = arithmetic_splits(
            difficulty=data.difficulty,
            n_train=data.train_items,
            n_test=data.test_items,
            seed=data.seed,
            n_unseen=data.unseen_items,
        )
        return Items(splits["train"], splits["test"], splits.get("unseen", []))
    from proxima.agents_examples.datasets import read_jsonl

    train = list(read_jsonl(Path(data.source)))
    test = list(read_jsonl(data.test_file)) if data.test_file else []
    unseen = list(read_jsonl(data.unseen_file)) if data.unseen_file else []
    return Items(train, test, unseen)


async def evaluate(
    agent: str,
    items: list[dict[str, Any]],
    *,
    base_url: str,
    api_key: str,
    model: str,
    section: EvalSection,
    fields: dict[str, Any],
) -> float:
    """Mean reward of ``agent`` on ``items``, served unrecorded (admin key: no session)."""
    fn = resolve_agent(agent)
    chosen = items[: section.items] if section.items else items
    slots = asyncio.Semaphore(section.max_concurrency)

    async def one(item: dict[str, Any]) -> float:
        data = {
            **item,
            **fields,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "temperature": section.temperature,
        }
        async with slots:
            result = fn(data)
            if asyncio.iscoroutine(result):
                result = await result
        return float(result if not isinstance(result, dict) else result.get("final", 0.0))

    rewards = await asyncio.gather(*(one(i) for i in chosen))
    return sum(rewards) / max(1, len(rewards))


async def _cycle(
    items: list[dict[str, Any]], fields: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """Train items forever (epochs), each epoch's items tagged so group ids stay unique."""
    epoch = 0
    while True:
        for item in items:
            yield {**item, **fields, "id": f"{item.get('id')}@{epoch}"}
        epoch += 1


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if record.get("event", "step") == "step":
            records.append(record)
    return records


def curve_points(records: list[dict[str, Any]]) -> tuple[list[int], list[float], list[int]]:
    """x (1, 2, ... one per trainer step, in log order), the mean train reward of each step,
    and the x of the steps that pushed no version (their ``step`` repeats the one before)."""
    steps = list(range(1, len(records) + 1))
    rewards = [float(r.get("reward_mean") or 0.0) for r in records]
    idle = [x for x, r in zip(steps, records, strict=True) if not r.get("pushed", True)]
    return steps, rewards, idle


def plot_rewards(
    records: list[dict[str, Any]],
    path: Path,
    *,
    before: float | None = None,
    after: float | None = None,
    unseen_before: float | None = None,
    unseen_after: float | None = None,
) -> None:
    """Reward curve (mean reward per step and its moving average) as a PNG, with held-out accuracy
    (in the train phrasing and, when given, in unseen phrasings) before and after.

    One point per trainer step, in order: a step whose batch had no signal trains
    nothing and pushes no version (its record repeats the version), so the x axis
    counts steps, not versions, and such steps are drawn as hollow markers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards, idle = curve_points(records)
    window = 3
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    (line,) = ax.plot(steps, rewards, marker="o", alpha=0.5, label="train reward (mean per step)")
    if idle:
        ax.plot(
            idle,
            [rewards[x - 1] for x in idle],
            linestyle="none",
            marker="o",
            markerfacecolor="white",
            color=line.get_color(),
            label="step without signal (no update, no new version)",
        )
    ax.plot(steps, smooth, linewidth=2, label=f"moving average ({window} steps)")
    for value, color, style, label in (
        (before, "gray", "--", "held-out accuracy before"),
        (after, "green", "--", "held-out accuracy after"),
        (unseen_before, "gray", ":", "unseen phrasings before"),
        (unseen_after, "purple", ":", "unseen phrasings after"),
    ):
        if value is not None:
            ax.axhline(value, color=color, linestyle=style, label=f"{label} ({value:.0%})")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


class _Run:
    """The proxy this run uses: started here, or given by URL."""

    def __init__(self, cfg: TrainRunConfig, model_dir: Path, *, lora: bool = False):
        self.cfg = cfg
        self.model_dir = model_dir
        self.lora = lora  # the started proxy's engine serves LoRA adapters
        self.token = cfg.proxy.admin_token or secrets.token_urlsafe(24)
        out = cfg.output_dir
        self.db = cfg.proxy.db or f"sqlite:///{(out / 'store.db').resolve()}"
        self.proxy: ProxyProcess | None = None
        self.url = cfg.proxy.url.rstrip("/") if cfg.proxy.url else ""
        self.model_name = cfg.proxy.served_model_name or model_dir.resolve().name

    def start(self) -> None:
        if self.url:
            return
        t = self.cfg.trainer
        args = [
            "--max-staleness",
            str(t.max_staleness),
            "--train-batch-size",
            str(t.batch_size),
            "--served-model-name",
            self.model_name,
            "--engines",
            str(self.cfg.proxy.engines),
        ]
        if self.lora:
            args.append("--enable-lora")
        kw: dict[str, Any] = {"port": self.cfg.proxy.port} if self.cfg.proxy.port else {}
        self.proxy = ProxyProcess(
            self.model_dir,
            db_url=self.db,
            admin_token=self.token,
            extra_args=args,
            log_path=(self.cfg.output_dir / "proxy.log").resolve(),
            **kw,
        )
        self.proxy.start(timeout=600)
        self.url = self.proxy.url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()

    def policy_model(self, version: int | None = None, adapter: str | None = None) -> str:
        """The model name that asks for a policy: ``<model>``, ``<model>:<adapter>``, and
        with ``version`` that registered version of it (``...@v<version>``, admin token)."""
        name = self.model_name if adapter is None else f"{self.model_name}:{adapter}"
        return name if version is None else f"{name}@v{version}"

    async def evaluate(
        self,
        items: list[dict[str, Any]],
        version: int | None = None,
        *,
        adapter: str | None = None,
        agent: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> float:
        """Held-out accuracy of the served policy on ``items`` (the ``eval`` section's settings).

        With ``version``, the agents ask for ``<model>@v<version>``: the proxy serves
        them from the deployment that serves that registered version. With
        ``adapter``, the policy is that adapter (``<model>:<adapter>``). ``agent`` and
        ``fields``: a tenant's own (default: the ``rollout`` section's).
        """
        return await evaluate(
            agent or self.cfg.rollout.agent,
            items,
            base_url=self.url + "/v1",
            api_key=self.token,
            model=self.policy_model(version, adapter),
            section=self.cfg.eval,
            fields=dict(self.cfg.rollout.item_fields if fields is None else fields),
        )

    async def evaluate_both(
        self,
        items: Items,
        version: int | None = None,
        *,
        adapter: str | None = None,
        agent: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> tuple[float, float | None]:
        """Held-out accuracy on ``items.test`` and on ``items.unseen`` (None without any), side
        by side (one engine batch serves both sets)."""
        kw: dict[str, Any] = {"adapter": adapter, "agent": agent, "fields": fields}
        if not items.unseen:
            return await self.evaluate(items.test, version, **kw), None
        test, unseen = await asyncio.gather(
            self.evaluate(items.test, version, **kw), self.evaluate(items.unseen, version, **kw)
        )
        return test, unseen


def _scored(section: EvalSection, items: list[dict[str, Any]]) -> int:
    return min(section.items, len(items)) if section.items else len(items)


@dataclass(frozen=True)
class Policy:
    """What one run trains: the base model, or one tenant's LoRA adapter
    (``[[rollout.tenants]]``), with the agent, items and item fields of its rollouts."""

    adapter: str | None
    agent: str
    items: Items
    fields: dict[str, Any]

    @property
    def prefix(self) -> str:
        """What starts each of its printed lines: nothing for the base, ``"<adapter>: "``."""
        return "" if self.adapter is None else f"{self.adapter}: "

    def log_path(self, cfg: TrainRunConfig) -> Path:
        """Its trainer's step log."""
        return policy_home(cfg.output_dir / "trainer", self.adapter) / LOG_FILE

    def curve_path(self, cfg: TrainRunConfig) -> Path:
        name = "reward_curve.png" if self.adapter is None else f"reward_curve_{self.adapter}.png"
        return cfg.output_dir / name


def run_policies(cfg: TrainRunConfig) -> list[Policy]:
    """The base (no tenants), or one policy per tenant with its own agent and items."""
    r = cfg.rollout
    if not r.tenants:
        return [Policy(None, r.agent, load_items(cfg.data), dict(r.item_fields))]
    return [
        Policy(
            t.adapter,
            t.agent or r.agent,
            load_items(t.data or cfg.data),
            dict(r.item_fields if t.item_fields is None else t.item_fields),
        )
        for t in r.tenants
    ]


def rollout_controller(
    cfg: TrainRunConfig,
    url: str,
    token: str,
    model_name: str,
    policy: Policy | None = None,
) -> RolloutController:
    """The controller of the run's training rollouts (of ``policy``: a tenant's), as its
    ``rollout`` section says."""
    r = cfg.rollout
    return RolloutController(
        url,
        token,
        r.agent if policy is None else policy.agent,
        group_size=r.group_size,
        max_concurrency=r.max_concurrency,
        timeout_s=r.timeout_s,
        model=model_name,
        mode=r.mode,
        ray_address=r.ray_address,
        ray_options=r.ray_options,
        adapter=None if policy is None else policy.adapter,
    )


def _trainer_command(cfg: TrainRunConfig, run: _Run, config_path: Path) -> list[str]:
    return [
        sys.executable,
        *("-m", "proxima.cli", "--log-format", "text", "--log-level", "warning", "trainer"),
        "--proxy",
        run.url,
        "--db",
        run.db,
        "--model",
        str(run.model_dir),
        "--config",
        str(config_path),
        "--output-dir",
        str((cfg.output_dir / "trainer").resolve()),
        "--max-steps",
        str(cfg.steps),
        "--no-progress",
    ]


Accuracy = tuple[float, float | None]  # held-out, and in unseen phrasings (None: no such items)


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
                    before=accuracy[0],
                    unseen_before=accuracy[1],
                )
    for controller in controllers:
        controller.stop()
    return {p.adapter: read_log(p.log_path(cfg)) for p in policies}


def _accuracy_line(
    cfg: TrainRunConfig, policy: Policy, before: Accuracy, after: Accuracy | None = None
) -> str:
    """``held-out accuracy before training: 23.0% (50 items); unseen phrasings: ...`` (before),
    ``held-out accuracy: 23.0% -> 41.0%; unseen phrasings: 18.0% -> 30.0%`` (after)."""
    items = policy.items
    if after is None:
        line = (
            f"{policy.prefix}held-out accuracy before training: {before[0]:.1%} "
            f"({_scored(cfg.eval, items.test)} items)"
        )
        if before[1] is not None:
            line += f"; unseen phrasings: {before[1]:.1%} ({_scored(cfg.eval, items.unseen)} items)"
        return line
    line = f"{policy.prefix}held-out accuracy: {before[0]:.1%} -> {after[0]:.1%}"
    if before[1] is not None and after[1] is not None:
        line += f"; unseen phrasings: {before[1]:.1%} -> {after[1]:.1%}"
    return line


async def train(cfg: TrainRunConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole job; returns the summary (accuracies, steps, paths).

    With ``rollout.tenants`` every tenant's adapter is trained at once (one trainer,
    round-robin, ``steps`` each), on its own agent's sessions; each is evaluated on its
    own held-out items, and the summary holds one entry per tenant under ``tenants``.
    """
    from tqdm import tqdm

    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(cfg.model)
    policies = run_policies(cfg)
    run = _Run(cfg, model_dir, lora=bool(cfg.rollout.tenants))
    trainer_proc: subprocess.Popen[bytes] | None = None
    controllers: list[RolloutController] = []
    trackers: RunTrackers | None = None
    # Imported and opened on a thread while the proxy starts (seconds); refused at once if
    # one is not installed.
    opening = start_trackers(cfg, [p.adapter for p in policies])

    async def evaluate_all() -> dict[str | None, Accuracy]:
        scores = await asyncio.gather(
            *(
                run.evaluate_both(p.items, adapter=p.adapter, agent=p.agent, fields=p.fields)
                for p in policies
            )
        )
        return {p.adapter: score for p, score in zip(policies, scores, strict=True)}

    try:
        started = time.monotonic()
        run.start()
        eval_started = time.monotonic()
        before = await evaluate_all()
        for policy in policies:
            print(_accuracy_line(cfg, policy, before[policy.adapter]), flush=True)
        if opening is not None:
            logs = {p.adapter: p.log_path(cfg) for p in policies}
            trackers = await RunTrackers.ready(opening, logs, run.db)
            for policy in policies:
                trackers.evaluation(policy.adapter, before[policy.adapter])
        train_started = time.monotonic()

        trainer_cfg = cfg.trainer.model_copy(
            update={"output_dir": (cfg.output_dir / "trainer").resolve()}
        )
        config_path = cfg.output_dir / "trainer_config.json"
        # Only what the run config sets: batch_size and max_staleness left unset come from the proxy.
        config_path.write_text(
            trainer_cfg.model_dump_json(indent=2, exclude={"connection"}, exclude_unset=True)
        )
        # A resumed run's log holds its earlier steps: the trainer runs ``steps`` more.
        resumed = {p.adapter: len(read_log(p.log_path(cfg))) for p in policies}
        resumed_steps = sum(resumed.values())
        trainer_log = open(cfg.output_dir / "trainer.log", "ab")  # noqa: SIM115
        env = {**os.environ, "PROXIMA_ADMIN_TOKEN": run.token}
        trainer_proc = subprocess.Popen(
            _trainer_command(cfg, run, config_path),
            env=env,
            stdout=trainer_log,
            stderr=subprocess.STDOUT,
        )

        controllers = [
            rollout_controller(cfg, run.url, run.token, run.model_name, p) for p in policies
        ]
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

        def fields_of(policy: Policy) -> dict[str, Any]:
            fields = {**policy.fields, "temperature": cfg.rollout.temperature}
            if cfg.rollout.seed is not None:
                fields["seed"] = cfg.rollout.seed
            return fields

        rollouts = [
            asyncio.create_task(c.run(_cycle(p.items.train, fields_of(p))))
            for c, p in zip(controllers, policies, strict=True)
        ]
        records = await _follow_training(
            cfg, trainer_proc, controllers, policies, before, on_step, resumed
        )
        if trackers is not None:  # the steps logged after the last look at the logs
            for policy in policies:
                for record in records[policy.adapter][trackers.counts[policy.adapter] :]:
                    await trackers.step(policy.adapter, record)
        train_s = time.monotonic() - train_started
        bar.close()
        reports = [await r for r in rollouts]
        if trainer_proc.returncode != 0:
            raise RuntimeError(
                f"the trainer exited with {trainer_proc.returncode}; see {cfg.output_dir / 'trainer.log'}"
            )

        after_started = time.monotonic()
        after = await evaluate_all()
        if trackers is not None:
            for policy in policies:
                trackers.evaluation(policy.adapter, after[policy.adapter])
        eval_s = (train_started - eval_started) + (time.monotonic() - after_started)
        results = {}
        for policy, report in zip(policies, reports, strict=True):
            mine, accuracy = records[policy.adapter], before[policy.adapter]
            final = _copy_final(cfg, policy.adapter)
            if mine:
                plot_rewards(
                    mine,
                    policy.curve_path(cfg),
                    before=accuracy[0],
                    after=after[policy.adapter][0],
                    unseen_before=accuracy[1],
                    unseen_after=after[policy.adapter][1],
                )
            results[policy.adapter] = {
                "before": accuracy[0],
                "after": after[policy.adapter][0],
                "test_items": _scored(cfg.eval, policy.items.test),
                "unseen_before": accuracy[1],
                "unseen_after": after[policy.adapter][1],
                "unseen_items": _scored(cfg.eval, policy.items.unseen),
                "pushed_steps": sum(1 for r in mine if r.get("pushed", True)),
                "steps": len(mine),
                "final_model": str(final),
                "rollouts": report.summary(),
                "reward_curve": str(policy.curve_path(cfg)),
            }
        steps = sum(len(r) for r in records.values())
        new_steps = steps - resumed_steps
        timing = {
            "max_staleness": cfg.trainer.max_staleness,
            "train_s": round(train_s, 1),
            "seconds_per_step": round(train_s / max(1, new_steps), 1),
            "resumed_steps": resumed_steps,
            "eval_s": round(eval_s, 1),
            "wall_s": round(time.monotonic() - started, 1),
        }
        if cfg.rollout.tenants:
            summary = {"tenants": results, "steps": steps, **timing}
        else:
            summary = {**results[None], **timing}
        (cfg.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        earlier = f", after {resumed_steps} earlier" if resumed_steps else ""
        print(
            f"trained {new_steps} steps{earlier} in {train_s:.0f} s "
            f"({timing['seconds_per_step']} s/step); whole run {timing['wall_s']:.0f} s"
        )
        for policy in policies:
            result = results[policy.adapter]
            print(
                f"{policy.prefix}reward curve: {result['reward_curve']}; "
                f"final model: {result['final_model']}"
            )
        for policy in policies:
            print(
                _accuracy_line(cfg, policy, before[policy.adapter], after[policy.adapter]),
                flush=True,
            )
        return summary
    finally:
        for controller in controllers:
            controller.stop()
        if trainer_proc is not None and trainer_proc.poll() is None:
            trainer_proc.send_signal(signal.SIGINT)  # clean stop: checkpoint, claims released
            try:
                trainer_proc.wait(120)
            except subprocess.TimeoutExpired:
                trainer_proc.kill()
        if trackers is not None:
            await trackers.close()
        elif opening is not None:
            await discard(opening)
        run.stop()


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
    run = _Run(cfg, model_dir, lora=adapter is not None)
    try:
        run.start()
        score, unseen = await run.evaluate_both(items, version, adapter=adapter)
    finally:
        run.stop()
    scored = _scored(cfg.eval, items.test)
    label = "" if version is None else f" of version {version}"
    if adapter is not None:
        label += f" of adapter {adapter}"
    line = f"held-out accuracy{label}: {score:.1%} ({scored} items)"
    if unseen is not None:
        line += f"; unseen phrasings: {unseen:.1%} ({_scored(cfg.eval, items.unseen)} items)"
    print(line)
    if version is not None:
        await _record_eval(run, version, score, scored, adapter=adapter)
    return score


async def _record_eval(
    run: _Run, version: int, score: float, items: int, *, adapter: str | None = None
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
