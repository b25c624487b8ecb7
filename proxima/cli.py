"""The ``proxima`` command line: one entry point for the proxy, engine, store and keys.

This is the one module that may see both ``proxy`` and ``trainer``; trainer
commands import lazily so the proxy never depends on the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from proxima.proxy.logs import configure_logging

T = TypeVar("T")


def _add_db(p: argparse.ArgumentParser) -> None:
    from proxima.proxy.config import Settings

    default = Settings.model_fields["db"].default
    p.add_argument(
        "--db",
        default=os.environ.get("PROXIMA_DB", default),
        help=f"SQLAlchemy URL of the trajectory store (default: PROXIMA_DB, else {default})",
    )


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from proxima.proxy.config import ENV_PREFIX, Settings, flag_name, flags_of
    from proxima.proxy.embedded.startup import start_engines
    from proxima.proxy.rendering.context_length import ContextLengthMismatch, check_context_length
    from proxima.proxy.serving import bind_socket, proxy_config

    try:
        settings = Settings.load(flags_of(args), args.config)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            if err["type"] == "missing" and loc in Settings.model_fields:
                print(
                    f"proxima serve: {flag_name(loc)} is required "
                    f"(or {ENV_PREFIX}{loc.upper()}, or {loc} in --config)",
                    file=sys.stderr,
                )
                continue
            print(f"proxima serve: {loc}: {err['msg']}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the --config file
        print(f"proxima serve: {exc}", file=sys.stderr)
        return 2
    try:
        check_context_length(settings)
    except ContextLengthMismatch as exc:
        print(f"proxima serve: context_length: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:  # N processes on the port (proxima/workers.py)
        from proxima.workers import serve_workers

        return serve_workers(
            settings, log_level=args.log_level, json_logs=args.log_format == "json"
        )
    sock = bind_socket(settings.host, settings.port)
    bound_port = sock.getsockname()[1]
    # The engines import torch and load the model (seconds) while this process imports the app.
    engines = start_engines(settings)
    try:
        from proxima.proxy.app import create_app

        app = create_app(settings, bound_port=bound_port, engines=engines)
    except BaseException:
        engines.stop()
        raise
    print(
        f"proxima: serving {settings.model_name} on http://{settings.host}:{bound_port}/v1",
        flush=True,
    )
    # The structured log handler configured above stays; idle and header deadlines.
    config = proxy_config(
        app,
        header_timeout=settings.http_header_timeout,
        idle_timeout=settings.http_idle_timeout,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _engine(args: argparse.Namespace) -> int:
    from proxima.proxy.embedded.app import run_engine

    run_engine(
        args.model,
        host=args.host,
        port=args.port,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        enable_lora=args.enable_lora,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank,
        num_threads=args.num_threads,
    )
    return 0


def _db(args: argparse.Namespace) -> int:
    from proxima.proxy.store import migrate

    if args.db_command == "upgrade":
        migrate.upgrade(args.db, args.revision)
    elif args.db_command == "downgrade":
        migrate.downgrade(args.db, args.revision)
    print(f"{args.db}: at revision {migrate.current_revision(args.db) or 'base'}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from proxima.proxy.auth import PRODUCTION_KEY_PREFIX, hash_key, new_key
    from proxima.proxy.store import migrate
    from proxima.proxy.store.store import Store

    async def run() -> int:
        await migrate.ensure_schema(args.db)
        store = await Store.open(args.db)
        try:
            if args.keys_command == "create":
                key = new_key(PRODUCTION_KEY_PREFIX)
                rec = await store.create_api_key(
                    name=args.name,
                    key_hash=hash_key(key),
                    record=not args.no_record,
                    adapter=args.adapter,
                )
                print(f"id: {rec.id}\nname: {rec.name}\nrecord: {rec.record}\nkey: {key}")
                if rec.adapter is not None:
                    print(f"adapter: {rec.adapter}")
                print("Store the key now: only its hash is kept.", file=sys.stderr)
            elif args.keys_command == "list":
                for rec in await store.list_api_keys():
                    state = "revoked" if rec.revoked_at else "active"
                    print(
                        f"{rec.id}\t{rec.name}\trecord={rec.record}\t{state}\t{rec.created_at:%Y-%m-%d %H:%M}"
                    )
            else:
                rec = await store.revoke_api_key(key_id=args.key_id)
                print(f"revoked {rec.id} ({rec.name})")
        finally:
            await store.close()
        return 0

    return asyncio.run(run())


def _production(args: argparse.Namespace) -> int:
    import json

    import httpx

    if not args.admin_token:
        print(
            "proxima production: --admin-token (or PROXIMA_ADMIN_TOKEN) is required",
            file=sys.stderr,
        )
        return 2
    query = {"adapter": args.adapter} if args.adapter else None
    if args.production_command == "promote":
        body: dict[str, object] = {"version": args.version, "require_eval": args.require_eval}
        if args.adapter:
            body["adapter"] = args.adapter
            query = None
        if (args.canary is None) != (args.fraction is None):
            print("proxima production promote: --canary W needs --fraction F", file=sys.stderr)
            return 2
        if args.canary is not None:
            body["canary"] = {"version": args.canary, "fraction": args.fraction}
        method, path = "POST", "/admin/production"
    elif args.production_command == "rollback":
        method, path, body = "POST", "/admin/production/rollback", {}
    elif args.production_command == "versions":
        method, path, body = "GET", "/admin/versions", {}
    else:
        method, path, body = "GET", "/admin/production", {}
    try:
        resp = httpx.request(
            method,
            args.proxy.rstrip("/") + path,
            json=body if method == "POST" else None,
            params=query,
            headers={"Authorization": f"Bearer {args.admin_token}"},
            timeout=args.timeout,
        )
    except httpx.HTTPError as exc:
        print(f"proxima production: {args.proxy}: {exc}", file=sys.stderr)
        return 1
    if resp.is_error:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        print(
            f"proxima production {args.production_command}: {resp.status_code}: {message}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0


def _add_production(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("production", help="promote, canary, roll back the production deployment")
    psub = p.add_subparsers(dest="production_command", required=True)
    q = psub.add_parser("promote", help="serve version V to production keys")
    q.add_argument("version", type=int)
    q.add_argument("--canary", type=int, default=None, metavar="W", help="canary version")
    q.add_argument(
        "--fraction", type=float, default=None, metavar="F", help="share of sessions on W"
    )
    q.add_argument(
        "--require-eval",
        action="store_true",
        help="refuse V if its eval score is below the production version's",
    )
    psub.add_parser("rollback", help="back to the version promoted before the current one")
    psub.add_parser("status", help="current version, canary, history")
    psub.add_parser("versions", help="registered versions, eval scores, who serves which")
    for q in psub.choices.values():
        q.add_argument(
            "--proxy",
            default=os.environ.get("PROXIMA_PROXY", "http://127.0.0.1:8000"),
            help="proxy URL (default: %(default)s)",
        )
        q.add_argument(
            "--admin-token",
            default=os.environ.get("PROXIMA_ADMIN_TOKEN"),
            help="admin token (or PROXIMA_ADMIN_TOKEN)",
        )
        q.add_argument(
            "--timeout", type=float, default=600.0, help="seconds (loading weights takes time)"
        )
        q.add_argument(
            "--adapter",
            default=None,
            metavar="NAME",
            help="act on this LoRA adapter's production (default: the base model's)",
        )
    p.set_defaults(func=_production)


def _trainer(args: argparse.Namespace) -> int:
    from proxima.trainer.cli import run

    trainer_db_from_env(args)
    return run(args)


def trainer_db_from_env(args: argparse.Namespace) -> None:
    """``proxima trainer``'s store: ``--db``, else the config file's ``connection.db_url``,
    else ``PROXIMA_DB``, so that a URL holding a password need not be on a command line
    (where ``ps`` shows it to every user of the host)."""
    url = os.environ.get("PROXIMA_DB")
    if args.db is not None or not url:
        return
    if args.config is not None:
        from proxima.trainer.config import load_config

        try:
            if load_config(args.config).connection.db_url:
                return
        except (ValueError, OSError):
            return  # the trainer reports the file's error
    args.db = url


def _add_trainer(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Imported lazily where it runs; the flags themselves are the trainer's own.
    from proxima.trainer.cli import add_arguments

    p = sub.add_parser("trainer", help="train on rewarded sessions and push weights to the proxy")
    add_arguments(p)
    p.set_defaults(func=_trainer)


def _run_stoppable(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM (``kill``, ``timeout``, ``docker stop``, a job
    scheduler) stops it the way Ctrl-C does: ``main`` is cancelled, so the proxy, its engines
    and the trainer it started are stopped (the trainer finishes or abandons its step and
    releases its claims), then ``KeyboardInterrupt`` is raised; a second SIGTERM raises it at
    once. The task is cancelled directly, not through SIGINT: a run started in the background
    by a shell (``nohup proxima train ... &``) ignores SIGINT, and SIGTERM must still stop it."""

    async def stoppable() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        stopping = False

        def on_sigterm() -> None:
            nonlocal stopping
            if stopping:
                raise KeyboardInterrupt  # out of the loop, as a second Ctrl-C
            stopping = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            return await main
        except asyncio.CancelledError:
            if stopping:
                raise KeyboardInterrupt from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(stoppable())


def _train(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from proxima.trainer.pipeline.config import load_run_config
    from proxima.trainer.pipeline.train import eval_only, train
    from proxima.trainer.tracking import TrackingUnavailable

    try:
        cfg = load_run_config(args.config)
    except (ValidationError, ValueError, OSError) as exc:
        print(
            f"proxima {args.command}: invalid configuration {args.config}: {exc}", file=sys.stderr
        )
        return 2
    if args.output_dir is not None:
        cfg.output_dir = args.output_dir
    if args.command == "eval":
        if args.proxy is not None:
            cfg.proxy.url = args.proxy
        if args.admin_token is not None:
            cfg.proxy.admin_token = args.admin_token
        try:
            _run_stoppable(eval_only(cfg, args.version, adapter=args.adapter))
        except ValueError as exc:
            print(f"proxima eval: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.steps is not None:
        cfg.steps = args.steps
    try:
        _run_stoppable(train(cfg, progress=not args.no_progress))
    except TrackingUnavailable as exc:
        print(f"proxima train: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "proxima train: stopped; the same command resumes the run from what the trainer "
            f"saved in {cfg.output_dir / 'trainer'} (its last pushed weights, and its "
            "checkpoint where trainer.checkpoint_every is set)",
            file=sys.stderr,
        )
        return 130
    return 0


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``proxima serve``: the proxy's settings as flags."""
    from proxima.proxy.config import add_arguments as add_settings_arguments

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible proxy (and the embedded engine)",
        description="Every setting below also comes from its environment variable or from "
        "--config; a flag wins over the environment, which wins over the file.",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file of settings, keyed by name with underscores (max_staleness = 4)",
    )
    add_settings_arguments(p)
    p.set_defaults(func=_serve)


def _add_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``proxima engine``: the embedded CPU engine alone."""
    from proxima.proxy.config import Settings

    p = sub.add_parser("engine", help="run the embedded CPU engine alone (SGLang's native API)")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=Settings.model_fields["engine_max_running_requests"].default,
        help="requests decoded together in one batch (default: %(default)s)",
    )
    p.add_argument("--weight-version", default="0")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=Settings.model_fields["max_loras_per_batch"].default,
        help="distinct adapters in one batch (default: %(default)s)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None, help="refuse higher ranks")
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: half the CPUs)"
    )
    p.set_defaults(func=_engine)


def _add_train_and_eval(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``proxima train`` and ``proxima eval``: a run config and its overrides."""
    for name, text in (
        ("train", "one command: proxy + engine, rollouts of your agent, trainer, eval"),
        ("eval", "held-out accuracy of the configured model through the proxy"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--config", type=Path, required=True, help="run config (.toml, .json, .yaml)"
        )
        p.add_argument("--output-dir", type=Path, default=None, help="override output_dir")
        if name == "eval":
            p.add_argument(
                "--version",
                type=int,
                default=None,
                help="evaluate this registered version of a running proxy and record its score",
            )
            p.add_argument(
                "--adapter",
                default=None,
                metavar="NAME",
                help="evaluate this LoRA adapter (with --version: that version of it; its "
                "score gates `proxima production promote V --adapter NAME --require-eval`)",
            )
            p.add_argument("--proxy", default=None, help="running proxy URL (overrides proxy.url)")
            p.add_argument(
                "--admin-token",
                default=os.environ.get("PROXIMA_ADMIN_TOKEN"),
                help="admin token of that proxy (or PROXIMA_ADMIN_TOKEN)",
            )
        if name == "train":
            p.add_argument("--steps", type=int, default=None, help="override steps")
            p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.set_defaults(func=_train)


def _add_db_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``proxima db upgrade|downgrade|current``: the store's migrations."""
    p = sub.add_parser("db", help="trajectory store schema (Alembic migrations)")
    dsub = p.add_subparsers(dest="db_command", required=True)
    for name, default in (("upgrade", "head"), ("downgrade", "base"), ("current", None)):
        q = dsub.add_parser(name)
        _add_db(q)
        if default is not None:
            q.add_argument("revision", nargs="?", default=default)
    p.set_defaults(func=_db)


def _add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``proxima keys create|list|revoke``: production API keys."""
    _add_export(sub)

    p = sub.add_parser("keys", help="production API keys")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    q = ksub.add_parser("create")
    q.add_argument("--name", required=True)
    q.add_argument("--no-record", action="store_true", help="do not record this key's traffic")
    q.add_argument(
        "--adapter",
        default=None,
        metavar="NAME",
        help="the LoRA adapter this key is served by (default: the base model)",
    )
    _add_db(q)
    q = ksub.add_parser("list")
    _add_db(q)
    q = ksub.add_parser("revoke")
    q.add_argument("key_id")
    _add_db(q)
    p.set_defaults(func=_keys)


_EXPORT_FILTERS = ("run", "group", "adapter", "status", "kind", "reward_min", "reward_max",
                   "version", "since", "until")  # fmt: skip


def _export(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from proxima.proxy.inspector.queries import FilterError, parse_filter
    from proxima.trainer.config import load_config
    from proxima.trainer.export import ExportUnavailable, export

    params = {n: str(getattr(args, n)) for n in _EXPORT_FILTERS if getattr(args, n) is not None}
    try:
        selected = parse_filter(params)
    except FilterError as exc:
        print(f"proxima export: --{exc.field.replace('_', '-')}: {exc.message}", file=sys.stderr)
        return 2
    advantage = None
    if args.trainer_config is not None:
        try:
            advantage = load_config(args.trainer_config).advantage
        except (ValidationError, ValueError, OSError) as exc:
            print(f"proxima export: --trainer-config: {exc}", file=sys.stderr)
            return 2
    try:
        done = asyncio.run(
            export(
                args.db,
                selected,
                args.output,
                fmt=args.format,
                advantage=advantage,
                page_size=args.page_size,
            )
        )
    except (ExportUnavailable, OSError) as exc:
        print(f"proxima export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {done.sessions} sessions ({done.completions} completions) to {done.path}")
    return 0


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="sessions of the store to Parquet or a Hugging Face dataset, a row per completion",
        description="Writes the sessions the filters select (all by default), oldest first, one "
        "row per completion: token ids, logprobs, versions, loss mask, messages, tools, rewards, "
        "returns and advantages (docs/reference.md, 'Export').",
    )
    _add_db(p)
    p.add_argument(
        "--output", "-o", type=Path, required=True, help="file (parquet) or new directory (hf)"
    )
    p.add_argument(
        "--format",
        choices=["parquet", "hf"],
        default="parquet",
        help="parquet: one file (datasets.load_dataset('parquet', data_files=FILE) reads it); "
        "hf: a datasets dataset directory (datasets.load_from_disk; needs datasets)",
    )
    p.add_argument(
        "--run", help="the rollout pass (a session's metadata.rollout; groups end in @RUN)"
    )
    p.add_argument("--group", help="one group_id")
    p.add_argument("--adapter", help="a LoRA adapter's sessions (':base': the base model's)")
    p.add_argument("--status", help="open, finished, failed, claimed, trained or dropped")
    p.add_argument("--kind", help="train or production")
    p.add_argument("--reward-min", type=float, help="session reward at least this")
    p.add_argument("--reward-max", type=float, help="session reward at most this")
    p.add_argument(
        "--version",
        type=int,
        help="sessions opened while V was their policy's newest version (the inspector's filter)",
    )
    p.add_argument("--since", help="opened at or after this time (ISO 8601; UTC unless given)")
    p.add_argument("--until", help="opened before this time")
    p.add_argument(
        "--trainer-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the trainer's config: its [advantage] section computes the advantages "
        "(default: the trainer's defaults)",
    )
    p.add_argument("--page-size", type=int, default=500, help="sessions read and written at a time")
    p.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxima",
        description="Train unmodified LLM agents with "
        "asynchronous RL through an OpenAI-compatible proxy.",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="json",
        choices=["json", "text"],
        help="json: one structured object per line (default); text: for humans",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_engine(sub)
    _add_trainer(sub)
    _add_production(sub)
    _add_train_and_eval(sub)
    _add_db_commands(sub)
    _add_keys(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, json_logs=args.log_format == "json")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
