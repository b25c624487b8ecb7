"""The processes a ``proxima train`` / ``proxima eval`` run starts: the proxy with its engines
(:class:`RunProxy`; or the running one ``proxy.url`` names), and the trainer
(``proxima trainer``, in its own process as in production: its compute never stalls the
agents' event loop), started by :func:`start_trainer` and stopped cleanly by
:func:`stop_trainer` (a checkpoint, claims released)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from proxima.proxy.server_process import ProxyProcess
from proxima.trainer.pipeline.config import TrainRunConfig
from proxima.trainer.pipeline.evaluation import Accuracy, Score, evaluate
from proxima.trainer.pipeline.policies import Items


class RunProxy:
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
        if self.cfg.proxy.tool_fallback:
            args += ["--tool-fallback", self.cfg.proxy.tool_fallback]
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
    ) -> Score:
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
    ) -> Accuracy:
        """Held-out accuracy on ``items.test`` and on ``items.unseen`` (None without any), side
        by side (one engine batch serves both sets)."""
        kw: dict[str, Any] = {"adapter": adapter, "agent": agent, "fields": fields}
        if not items.unseen:
            return Accuracy(await self.evaluate(items.test, version, **kw), None)
        test, unseen = await asyncio.gather(
            self.evaluate(items.test, version, **kw), self.evaluate(items.unseen, version, **kw)
        )
        return Accuracy(test, unseen)


def trainer_command(cfg: TrainRunConfig, run: RunProxy, config_path: Path) -> list[str]:
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


def start_trainer(
    cfg: TrainRunConfig, run: RunProxy, extra_args: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """``proxima trainer`` against ``run``'s proxy (with ``extra_args``), its output appended to
    ``<output_dir>/trainer.log``; its config (``trainer_config.json``) is the run config's
    ``trainer`` section."""
    trainer_cfg = cfg.trainer.model_copy(
        update={"output_dir": (cfg.output_dir / "trainer").resolve()}
    )
    config_path = cfg.output_dir / "trainer_config.json"
    # Only what the run config sets: batch_size and max_staleness left unset come from the proxy.
    config_path.write_text(
        trainer_cfg.model_dump_json(indent=2, exclude={"connection"}, exclude_unset=True)
    )
    trainer_log = open(cfg.output_dir / "trainer.log", "ab")  # noqa: SIM115
    env = {**os.environ, "PROXIMA_ADMIN_TOKEN": run.token}
    return subprocess.Popen(
        [*trainer_command(cfg, run, config_path), *(extra_args or [])],
        env=env,
        stdout=trainer_log,
        stderr=subprocess.STDOUT,
    )


def stop_trainer(trainer: subprocess.Popen[bytes]) -> None:
    """A clean stop of a trainer still running: SIGINT (it checkpoints and releases its
    claims), killed after 120 s."""
    if trainer.poll() is None:
        # A step in progress is finished or abandoned and a checkpoint written: on CPU that can
        # take a minute, so say what the wait is.
        print(
            "stopping the trainer: a step already training is finished and pushed, then a "
            "checkpoint is written (killed after 120 s)",
            file=sys.stderr,
            flush=True,
        )
        trainer.send_signal(signal.SIGINT)  # clean stop: checkpoint, claims released
        try:
            trainer.wait(120)
        except subprocess.TimeoutExpired:
            trainer.kill()
