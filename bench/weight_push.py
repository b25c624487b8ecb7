"""Benchmark: getting a new weight version to the backends, by disk and by broadcast.

Default run (``bench/_push_compare.py``): for the demo model (SmolLM2-135M-Instruct,
prepared into ``.cache/models`` as ``make demo`` does) and a randomly initialised Qwen2 with
Qwen2.5-0.5B's shapes (494M parameters, built here from a config), ``proxima serve`` with
two embedded engines (``--engines 2``) and, in this process, the trainer's side with the
model in float32. The two arms push to the same proxy in alternation, two warm-up rounds
then ``--pushes`` rounds, so other load on the machine hits both alike:

- disk: the version exported (HF safetensors, fsynced, atomic, as the trainer does), then
  ``POST /admin/weights`` and every engine loads the exported directory;
- broadcast: ``BroadcastWeightSink`` straight from the model's tensors (nothing written or
  read on disk), the trainer rank 0 of a gloo group with both engines, ``--bucket-mb``
  buckets, the next filled while one is on the wire; the engines receive into spare
  buffers and swap the tensors in.

Each push's wall time is export (disk only) + transfer + load, until every engine serves it,
broken down (the proxy's own time with generation paused; the trainer's fill and wire time;
each engine's receive, screen and swap). Each push is a line of
a ``weight_push-TIME.jsonl`` file in ``bench/results/`` with the commit and the load average. The last
line is ``weight push: disk X ms, broadcast Y ms (0.5B model)`` (medians).

``--share``: what share of the trainer's step wall time goes to weight sync (export + push,
target <= 3%) in a short real run: ``proxima serve`` on a random Qwen2 (``--hidden``,
``--layers``), agents on concurrent OpenAI SDK clients (one chat completion each, rewarded
by its vowels), and ``run_trainer`` running ``--steps`` steps here; from the trainer's time
split in ``train_log.jsonl``, also as a share of its busy time (without waiting for data).

Run: ``.venv/bin/python bench/weight_push.py [--pushes 3] [--models smollm2,0.5b]
[--bucket-mb 512]`` (512: the trainer's default, ``[trainer.weights] bucket_mb``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402
from proxima.trainer.config import TrainerConfig  # noqa: E402
from proxima.trainer.log import read_log  # noqa: E402
from proxima.trainer.run import run_trainer  # noqa: E402

logger = logging.getLogger("bench.weight_push")

TARGET_SHARE = 0.03


def agent(proxy: LiveProxy, group: str, max_tokens: int) -> None:
    """One agent run: a chat completion, a reward, finish."""
    session = proxy.new_session(group_id=group)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    reply = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Write a word with many vowels."}],
        max_tokens=max_tokens,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    text = reply.choices[0].message.content or ""
    reward = sum(ch in "aeiou" for ch in text.lower()) / max(len(text), 1)
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    base = f"{proxy.url}/rl/sessions/{session['session_id']}"
    httpx.post(f"{base}/reward", json={"reward": reward}, headers=headers).raise_for_status()
    httpx.post(f"{base}/finish", headers=headers).raise_for_status()


def rollouts(proxy: LiveProxy, args: argparse.Namespace, stop: threading.Event) -> int:
    """Run agents on ``args.clients`` concurrent clients until ``stop``; sessions finished."""
    done = 0
    lock = threading.Lock()

    def worker(index: int) -> None:
        nonlocal done
        n = 0
        while not stop.is_set():
            group = f"c{index}-g{n // args.group_size}"
            try:
                agent(proxy, group, args.max_tokens)
            except (httpx.HTTPError, OSError) as exc:
                if not stop.is_set():
                    logger.warning("agent failed: %r", exc)
                continue
            n += 1
            with lock:
                done += 1

    with ThreadPoolExecutor(max_workers=args.clients) as pool:
        for index in range(args.clients):
            pool.submit(worker, index)
    return done


def summarize(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Totals over the pushed steps of the run."""
    pushed = [s for s in steps if s["pushed"]]
    total = sum(s["times"]["total"] for s in pushed)
    wait = sum(s["times"]["wait"] for s in pushed)
    sync = sum(s["times"]["weight_sync"] for s in pushed)
    return {
        "steps": len(pushed),
        "wall_s": total,
        "busy_s": total - wait,
        "wait_s": wait,
        "prox_s": sum(s["times"]["prox"] for s in pushed),
        "train_s": sum(s["times"]["train"] for s in pushed),
        "export_s": sum(s["times"]["export"] for s in pushed),
        "push_s": sum(s["times"]["push"] for s in pushed),
        "sync_s": sync,
        "proxy_update_median_s": statistics.median(s["times"]["proxy_update"] for s in pushed),
        "proxy_update_max_s": max(s["times"]["proxy_update"] for s in pushed),
        "share_of_wall": sync / total if total else 0.0,
        "share_of_busy": sync / (total - wait) if total > wait else 0.0,
        "tokens": sum(s["tokens"] for s in pushed),
    }


def share_main(argv: list[str] | None = None) -> int:
    """The ``--share`` run: weight sync as a share of the trainer's step time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="model layers")
    parser.add_argument("--steps", type=int, default=5, help="trainer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sessions per step")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per group")
    parser.add_argument("--clients", type=int, default=8, help="concurrent agent clients")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per completion")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="proxima-bench-push-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(
            work / "model", hidden_size=args.hidden, num_layers=args.layers
        )
        size_mb = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        proxy = LiveProxy(
            model_dir,
            db_url=f"sqlite:///{work / 'store.db'}",
            log_path=work / "serve.log",
            extra_args=["--train-batch-size", str(args.batch_size)],  # the trainer reads B here
        )
        proxy.start()
        stop = threading.Event()
        sessions: dict[str, int] = {}
        producer = threading.Thread(
            target=lambda: sessions.update(done=rollouts(proxy, args, stop)), daemon=True
        )
        try:
            producer.start()
            cfg = TrainerConfig.model_validate(
                {
                    "output_dir": str(work / "trainer"),
                    "optim": {"lr": 1e-4},
                    "loop": {"poll_interval_s": 0.1, "max_steps": args.steps},
                    "connection": {
                        "proxy_url": proxy.url,
                        "db_url": proxy.db_url,
                        "model_dir": str(model_dir),
                        "admin_token": proxy.admin_token,
                    },
                }
            )
            started = time.monotonic()
            asyncio.run(run_trainer(cfg, console=False))
            run_s = time.monotonic() - started
        finally:
            stop.set()
            producer.join(timeout=120)
            proxy.stop()
        steps = [e for e in read_log(cfg.output_dir) if e["event"] == "step"]

    s = summarize(steps)
    print(
        f"model: Qwen2 hidden={args.hidden} layers={args.layers} ({size_mb:.1f} MiB safetensors); "
        f"{args.clients} clients, batch {args.batch_size}, {args.max_tokens} tokens/completion"
    )
    print(
        f"run: {s['steps']:.0f} steps in {run_s:.1f}s (incl. trainer start-up); "
        f"{sessions.get('done', 0)} sessions generated; {s['tokens']:.0f} tokens trained"
    )
    print(
        f"step time {s['wall_s']:.2f}s = wait {s['wait_s']:.2f}s + prox {s['prox_s']:.2f}s + "
        f"train {s['train_s']:.2f}s + export {s['export_s']:.2f}s + push {s['push_s']:.2f}s"
    )
    print(
        f"weight sync (export + push): {s['sync_s']:.2f}s = {100 * s['share_of_wall']:.2f}% of "
        f"trainer step wall time (target <= {100 * TARGET_SHARE:.0f}%), "
        f"{100 * s['share_of_busy']:.2f}% of busy time (wall minus waiting for data)"
    )
    print(
        f"proxy-side weight update: median {s['proxy_update_median_s']:.3f}s, "
        f"max {s['proxy_update_max_s']:.3f}s per push"
    )
    return 0 if s["share_of_wall"] <= TARGET_SHARE else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--share" in argv:
        return share_main([a for a in argv if a != "--share"])
    from _push_compare import compare_main  # noqa: PLC0415 (torch, only for this run)

    return compare_main(argv)


if __name__ == "__main__":
    sys.exit(main())
