"""``proxima trainer``: run the background trainer against a proxy and its store.

    proxima trainer --proxy URL --db URL --model DIR [--config FILE] [--admin-token T]
                    [--output-dir DIR] [--trainer-id ID] [--max-steps N] [--no-progress]
                    [--warm-start PLAN]

Flags override the config file's ``connection`` and ``loop`` sections; the
admin token may also come from ``PROXIMA_ADMIN_TOKEN``. The first SIGINT or
SIGTERM stops the trainer cleanly (the current step is finished or
abandoned, claims are released, a checkpoint is written); a second SIGINT
interrupts at once.

Exit status: 0 after a clean stop, 1 when the run failed (recovery refused,
the proxy rejected a push, ...), 2 for an invalid configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxima.trainer.config import TrainerConfig, load_config
from pydantic import ValidationError

if TYPE_CHECKING:
    from proxima.trainer.sft import WarmStartPlan

logger = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "PROXIMA_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's flags (shared with the ``proxima`` CLI's ``trainer`` subcommand)."""
    parser.add_argument(
        "--proxy",
        help="base URL of the proxy, e.g. http://127.0.0.1:8000; a fleet: its load balancer's "
        "URL, or the replicas' URLs separated by commas",
    )
    parser.add_argument("--db", help="SQLAlchemy URL of the proxy's trajectory store")
    parser.add_argument("--model", type=Path, help="HF model directory of the initial policy")
    parser.add_argument("--config", type=Path, help="trainer config file (.toml, .json, .yaml)")
    parser.add_argument(
        "--admin-token", help=f"the proxy's admin token (default: ${ADMIN_TOKEN_ENV})"
    )
    parser.add_argument("--output-dir", type=Path, help="weights, checkpoints and train_log.jsonl")
    parser.add_argument(
        "--trainer-id", help="claim sessions under this id (stable across restarts)"
    )
    parser.add_argument("--max-steps", type=int, help="stop after N steps")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar or console lines"
    )
    parser.add_argument(
        "--warm-start",
        type=Path,
        help="a warm start's plan (JSON, proxima.trainer.sft): take its supervised steps on the "
        "sessions it keeps, push one version and exit",
    )


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser (``python -m proxima.trainer.cli``)."""
    parser = argparse.ArgumentParser(
        prog="proxima trainer",
        description="Train on finished, rewarded sessions and push new weights to the proxy.",
    )
    parser.add_argument("--log-level", default="info", help="logging level (default: info)")
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """The config file (or defaults) with the flags applied; raises ``ValidationError``."""
    base = load_config(args.config) if args.config else TrainerConfig()
    # Only what the file sets: settings left unset stay unset (batch_size and max_staleness
    # then come from the proxy, proxima.trainer.proxy_settings).
    data: dict[str, Any] = base.model_dump(exclude_unset=True)
    connection = data.setdefault("connection", {})
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        connection["admin_token"] = token
    for key, value in (("proxy_url", args.proxy), ("db_url", args.db), ("model_dir", args.model)):
        if value is not None:
            connection[key] = value
    for key, value in (("trainer_id", args.trainer_id), ("max_steps", args.max_steps)):
        if value is not None:
            data.setdefault("loop", {})[key] = value
    if args.output_dir is not None:
        data["output_dir"] = args.output_dir
    return TrainerConfig.model_validate(data)


def run(args: argparse.Namespace) -> int:
    """Run the trainer for parsed arguments; the exit status."""
    # torch, transformers and the store load here, not when `proxima` builds its parser.
    from proxima.proxy.errors import ProximaError
    from proxima.trainer.proxy_settings import ProxySettingsError
    from proxima.trainer.weights import RecoveryError, WeightPushError

    try:
        cfg = config_from_args(args)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"proxima trainer: invalid configuration: {exc}", file=sys.stderr)
        return 2
    missing = cfg.connection.missing()
    if missing:
        flags = {"proxy_url": "--proxy", "db_url": "--db", "model_dir": "--model"}
        print("proxima trainer: missing " + ", ".join(flags[m] for m in missing), file=sys.stderr)
        return 2
    try:
        warm = None
        if getattr(args, "warm_start", None) is not None:
            from proxima.trainer.sft import WarmStartPlan

            warm = WarmStartPlan.read(args.warm_start)
        asyncio.run(_run_until_signal(cfg, progress=not args.no_progress, warm=warm))
    except (RecoveryError, WeightPushError, ProximaError, ProxySettingsError) as exc:
        print(f"proxima trainer: {exc}", file=sys.stderr)
        return 1
    return 0


async def _run_until_signal(
    cfg: TrainerConfig, *, progress: bool, warm: WarmStartPlan | None = None
) -> int:
    """Run with SIGINT/SIGTERM setting the stop event (a second SIGINT interrupts)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def request_stop(signum: int) -> None:
        logger.warning("%s received: stopping after the current step", signal.Signals(signum).name)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C raises KeyboardInterrupt

    from proxima.trainer.run import run_trainer

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)
    return await run_trainer(cfg, stop_event=stop, console=progress, warm=warm)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``proxima trainer ...`` (or ``python -m proxima.trainer.cli ...``)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
