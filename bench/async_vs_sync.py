"""Benchmark: asynchronous RL (staleness + interruptible generation) against synchronous RL.

A simulated cluster, real control plane:

- generator: ``bench/_sim.py``, an SGLang-protocol server with ``--max-running``
  decode slots, each decoding at ``--tokens-per-s`` (a throughput model; it
  measures its own busy slot-seconds);
- the real proxy (``proxima serve`` via :class:`proxy.process.ProxyProcess`,
  ``--backend`` = the simulator, ``--max-staleness``, ``--train-batch-size``);
- the real :class:`trainer.rollout.RolloutController`, driving an async agent
  that makes one chat completion (OpenAI SDK, ``ignore_eos``) whose
  ``max_tokens`` is drawn from a capped lognormal (a long tail), reward 1;
- a timing-model trainer: claim ``--batch-size`` sessions from the store,
  sleep ``--step-s-per-1k`` seconds per 1k trained tokens (prompt + output),
  push version ``i + 1`` through ``POST /admin/weights``, mark the sessions
  trained (a claimed session older than ``i - eta`` is dropped and replaced,
  as the real trainer does).

Configurations, on the same work (``--steps`` trainer steps of ``--batch-size``
sessions, the same length distribution):

1. ``sync``: ``max_staleness 0``; the controller runs one batch per step and
   starts it only after the push; the trainer waits for the whole batch.
   The simulator runs in ``drain`` mode (no interruption; nothing is in flight
   at a push anyway).
2. ``async``: ``max_staleness 4``; the controller runs continuously (the
   proxy's staleness gate admits sessions); weight pushes abort in-flight
   generations in the simulator (``/pause_generation``, ``abort`` mode) and the
   proxy resumes them with the new weights.
3. ``async-noint``: ``max_staleness 4`` as 2, but the simulator ignores
   ``/pause_generation`` and ``/abort_request {abort_all}``:
   ``/update_weights_from_disk`` waits until every in-flight request finished
   with the old weights (``--noint-mode drain``, SGLang's model-update lock),
   or lets them go on with the old version while new requests get the new one
   (``--noint-mode swap``, an optimistic bound).

Wall time runs from the first session to the last push. Effective training
tokens/s = trained tokens / wall. Generator utilization = busy slot-seconds /
(slots x wall), measured in the simulator.

Run: ``.venv/bin/python bench/async_vs_sync.py`` (about 4 minutes);
scale with ``--steps``, ``--batch-size``, ``--tokens-per-s``, ``--max-running``,
``--median-tokens``, ``--step-s-per-1k``; ``--configs sync,async`` to pick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.engine_process import free_port  # noqa: E402
from proxy.process import ProxyProcess  # noqa: E402
from proxy.store.records import SessionStatus  # noqa: E402
from proxy.store.store import Store  # noqa: E402
from proxy.testing.tiny_model import build_tiny_model  # noqa: E402
from trainer.rollout import RolloutController  # noqa: E402

ADMIN = "bench-admin-token"
TARGET_RATIO = 3.0


# --------------------------------------------------------------------------- workload


def lengths(args: argparse.Namespace, n_items: int) -> list[list[int]]:
    """``max_tokens`` of every run: per item, one per group member (seeded, same for all configs)."""
    rng = random.Random(args.seed)
    mu = math.log(args.median_tokens)
    return [
        [max(args.min_tokens, min(args.max_tokens_cap, int(rng.lognormvariate(mu, args.sigma))))
         for _ in range(args.group_size)]
        for _ in range(n_items)
    ]


class Agent:
    """One chat completion of the item's next drawn length; reward 1."""

    def __init__(self, model: str):
        self.model = model
        self.taken: dict[str, int] = {}

    async def __call__(self, data: dict[str, Any]) -> float:
        k = self.taken.get(data["id"], 0)
        self.taken[data["id"]] = k + 1
        max_tokens = data["lengths"][k % len(data["lengths"])]
        client = AsyncOpenAI(base_url=data["base_url"], api_key=data["api_key"], max_retries=0,
                             timeout=600)
        try:
            await client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": f"Solve task {data['id']}."}],
                max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True},
            )
        finally:
            await client.close()
        return 1.0


# --------------------------------------------------------------------------- cluster


@dataclass
class Result:
    name: str
    wall_s: float = 0.0
    trained_tokens: int = 0
    trained_output_tokens: int = 0
    step_s: list[float] = field(default_factory=list)
    wait_s: float = 0.0  # trainer waiting for a batch
    push_s: float = 0.0  # trainer blocked in POST /admin/weights
    util_slots: float = 0.0
    util_any: float = 0.0
    generated_tokens: int = 0
    aborts: int = 0
    dropped: int = 0  # claimed sessions too stale to train (oldest version < i - eta)
    multi_version: int = 0  # trained completions holding tokens of several versions
    max_staleness_seen: int = 0
    sessions_started: int = 0
    waits_429: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0


def start_sim(args: argparse.Namespace, port: int, interrupt: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(ROOT / "bench" / "_sim.py"), "--port", str(port),
           "--tokens-per-s", str(args.tokens_per_s), "--max-running", str(args.max_running),
           "--interrupt", interrupt, "--chunk-tokens", str(args.chunk_tokens)]
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("simulator did not start")


async def trainer_loop(args: argparse.Namespace, store: Store, proxy: ProxyProcess, res: Result,
                       eta: int) -> None:
    """Claim a batch, 'train' (sleep by tokens), push version i + 1, mark trained.

    As the real trainer does (DESIGN.md, "Staleness control"), a claimed session whose
    oldest token version is below ``i - eta`` is dropped (marked DROPPED, counted) and
    replaced by another claim.
    """
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=600) as http:
        for step in range(args.steps):
            t0 = time.monotonic()
            batch: list[tuple[Any, list[Any]]] = []
            while len(batch) < args.batch_size:
                got = await store.claim_sessions(limit=args.batch_size - len(batch), trainer_id="bench")
                stale = []
                for s in got:
                    comps = await store.list_completions(session_id=s.id)
                    versions = [v for c in comps for v in c.output_versions]
                    if versions and min(versions) < step - eta:
                        stale.append(s.id)
                    else:
                        batch.append((s, comps))
                if stale:
                    res.dropped += len(stale)
                    await store.mark_sessions(session_ids=stale, status=SessionStatus.DROPPED)
                if len(batch) < args.batch_size:
                    await asyncio.sleep(args.poll_s)
            t1 = time.monotonic()
            res.wait_s += t1 - t0
            tokens = 0
            for _, comps in batch:
                for c in comps:
                    tokens += len(c.prompt_ids) + len(c.output_ids)
                    res.trained_output_tokens += len(c.output_ids)
                    versions = set(c.output_versions)
                    if len(versions) > 1:
                        res.multi_version += 1
                    if versions:
                        res.max_staleness_seen = max(res.max_staleness_seen, step - min(versions))
            res.trained_tokens += tokens
            await asyncio.sleep(args.step_s_per_1k * tokens / 1000)
            t2 = time.monotonic()
            r = await http.post(f"{proxy.url}/admin/weights", headers=headers,
                                json={"version": step + 1, "path": f"/sim/weights/v{step + 1}"})
            r.raise_for_status()
            res.push_s += time.monotonic() - t2
            await store.mark_sessions(session_ids=[s.id for s, _ in batch], status=SessionStatus.TRAINED,
                                      trained_version=step + 1)
            res.step_s.append(time.monotonic() - t0)


async def drive(args: argparse.Namespace, name: str, eta: int, proxy: ProxyProcess, sim_url: str,
                model: str, items: list[dict[str, Any]]) -> Result:
    res = Result(name)
    store = await Store.open(proxy.db_url)
    agent = Agent(model)
    per_step_items = args.batch_size // args.group_size
    async with httpx.AsyncClient(timeout=30) as http:
        s0 = (await http.get(f"{sim_url}/sim_stats")).json()
        t0 = time.monotonic()
        try:
            if name == "sync":
                # One pass per step, started only after the previous push.
                ctrl = RolloutController(proxy.url, ADMIN, agent, group_size=args.group_size,
                                         max_concurrency=args.batch_size)
                train = asyncio.create_task(trainer_loop(args, store, proxy, res, eta))
                for step in range(args.steps):
                    chunk = items[step * per_step_items:(step + 1) * per_step_items]
                    await ctrl.run(chunk)
                    res.sessions_started += ctrl.progress.sessions_started
                    res.waits_429 += ctrl.progress.waits_429
                    while len(res.step_s) <= step and not train.done():
                        await asyncio.sleep(args.poll_s)
                await train
            else:
                ctrl = RolloutController(proxy.url, ADMIN, agent, group_size=args.group_size,
                                         max_concurrency=args.rollout_concurrency)
                rollout = asyncio.create_task(ctrl.run(items))
                train = asyncio.create_task(trainer_loop(args, store, proxy, res, eta))
                done, _ = await asyncio.wait({rollout, train}, return_when=asyncio.FIRST_COMPLETED)
                if train not in done:
                    rollout.result()  # raises what stopped the rollout
                await train
                res.sessions_started = ctrl.progress.sessions_started
                res.waits_429 = ctrl.progress.waits_429
                ctrl.stop()
                # Past the measurement: runs still in flight are cancelled; their shielded
                # /finish calls may then hit the stopping proxy. Don't print those.
                loop = asyncio.get_running_loop()
                default = loop.get_exception_handler()

                def quiet(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
                    if not isinstance(ctx.get("exception"), httpx.HTTPError):
                        (default or lp.default_exception_handler.__func__)(lp, ctx)  # type: ignore[attr-defined]

                loop.set_exception_handler(quiet)
                rollout.cancel()
                await asyncio.gather(rollout, return_exceptions=True)
            res.wall_s = res_wall = time.monotonic() - t0
            s1 = (await http.get(f"{sim_url}/sim_stats")).json()
        finally:
            await store.close()
    slots = args.max_running if args.max_running > 0 else max(1, args.rollout_concurrency)
    # The stats window (s1.t - s0.t) is a little longer than the trainer's wall; use the sim's.
    window = s1["t"] - s0["t"] or res_wall
    res.util_slots = (s1["slot_seconds"] - s0["slot_seconds"]) / (slots * window)
    res.util_any = (s1["any_busy_seconds"] - s0["any_busy_seconds"]) / window
    res.generated_tokens = s1["generated_tokens"] - s0["generated_tokens"]
    res.aborts = s1["aborts"] - s0["aborts"]
    return res


def run_config(args: argparse.Namespace, name: str, model_dir: Path, work: Path) -> Result:
    interrupt = {"sync": "drain", "async": "abort", "async-noint": args.noint_mode}[name]
    eta = 0 if name == "sync" else args.max_staleness
    cdir = work / name
    cdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sim = start_sim(args, port, interrupt, cdir / "sim.log")
    sim_url = f"http://127.0.0.1:{port}"
    proxy = ProxyProcess(model_dir, db_url=f"sqlite:///{cdir / 'store.db'}", admin_token=ADMIN,
                         log_path=cdir / "serve.log",
                         extra_args=["--backend", sim_url, "--max-staleness", str(eta),
                                     "--train-batch-size", str(args.batch_size)],
                         env={"PROXIMA_MAX_OPEN_SESSIONS": "4096"})
    n_items = (args.steps + args.max_staleness + 4) * args.batch_size // args.group_size
    items = [{"id": f"task{i}", "lengths": ls} for i, ls in enumerate(lengths(args, n_items))]
    try:
        proxy.start()
        return asyncio.run(asyncio.wait_for(
            drive(args, name, eta, proxy, sim_url, proxy.model_name, items), args.config_timeout_s))
    finally:
        proxy.stop()
        sim.terminate()
        try:
            sim.wait(15)
        except subprocess.TimeoutExpired:
            sim.kill()


# --------------------------------------------------------------------------- report


def table(results: dict[str, Result], args: argparse.Namespace) -> str:
    names = list(results)
    rows: list[tuple[str, list[str]]] = [
        ("wall time (s)", [f"{results[n].wall_s:.1f}" for n in names]),
        ("trained tokens", [f"{results[n].trained_tokens}" for n in names]),
        ("  of which output", [f"{results[n].trained_output_tokens}" for n in names]),
        ("effective train tok/s", [f"{results[n].tokens_per_s:.0f}" for n in names]),
        ("generator util (slots)", [f"{results[n].util_slots:.1%}" for n in names]),
        ("generator busy (any)", [f"{results[n].util_any:.1%}" for n in names]),
        ("generated tokens (sim)", [f"{results[n].generated_tokens}" for n in names]),
        ("mean step (s)", [f"{sum(results[n].step_s) / max(1, len(results[n].step_s)):.2f}" for n in names]),
        ("trainer waiting (s)", [f"{results[n].wait_s:.1f}" for n in names]),
        ("trainer in push (s)", [f"{results[n].push_s:.1f}" for n in names]),
        ("aborted requests", [f"{results[n].aborts}" for n in names]),
        ("dropped as too stale", [f"{results[n].dropped}" for n in names]),
        ("multi-version completions", [f"{results[n].multi_version}" for n in names]),
        ("max staleness trained", [f"{results[n].max_staleness_seen}" for n in names]),
        ("sessions started", [f"{results[n].sessions_started}" for n in names]),
        ("429 waits", [f"{results[n].waits_429}" for n in names]),
    ]
    if "sync" in results:
        base = results["sync"].tokens_per_s
        rows.append(("ratio vs sync (tok/s)",
                     [f"{results[n].tokens_per_s / base:.2f}x" if base else "-" for n in names]))
    w = max(len(r[0]) for r in rows)
    cw = max(12, *(len(n) + 2 for n in names))
    lines = [" " * w + "".join(n.rjust(cw) for n in names)]
    lines += [label.ljust(w) + "".join(v.rjust(cw) for v in vals) for label, vals in rows]
    lines.append("")
    if "sync" in results and "async" in results and results["sync"].tokens_per_s:
        ratio = results["async"].tokens_per_s / results["sync"].tokens_per_s
        verdict = "meets" if ratio >= TARGET_RATIO else "below"
        lines.append(f"async/sync effective throughput: {ratio:.2f}x "
                     f"({verdict} target {TARGET_RATIO:.1f}x; AReaL reports 2.77x)")
    if "async" in results and "async-noint" in results and results["async-noint"].tokens_per_s:
        gain = results["async"].tokens_per_s / results["async-noint"].tokens_per_s
        lines.append(f"interruption's own gain (async / async-noint[{args.noint_mode}]): {gain:.2f}x")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="sync,async,async-noint")
    p.add_argument("--steps", type=int, default=6, help="trainer steps per configuration")
    p.add_argument("--batch-size", type=int, default=16, help="sessions per trainer step (B)")
    p.add_argument("--group-size", type=int, default=4, help="sessions per dataset item")
    p.add_argument("--max-staleness", type=int, default=4, help="eta of the async configurations")
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="decode rate per request")
    p.add_argument("--max-running", type=int, default=16, help="generator decode slots (0 = unlimited)")
    p.add_argument("--rollout-concurrency", type=int, default=32,
                   help="agent runs in flight in the async configurations")
    p.add_argument("--chunk-tokens", type=int, default=8, help="tokens per backend stream chunk")
    p.add_argument("--median-tokens", type=float, default=150.0, help="median max_tokens (lognormal)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (tail weight)")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens-cap", type=int, default=1000, help="cap of the drawn max_tokens")
    p.add_argument("--step-s-per-1k", type=float, default=0.6,
                   help="trainer step cost, seconds per 1k trained tokens")
    p.add_argument("--noint-mode", choices=["drain", "swap"], default="drain",
                   help="what 'no interruption' means for a weight update (see _sim.py)")
    p.add_argument("--poll-s", type=float, default=0.05, help="trainer claim poll interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-timeout-s", type=float, default=300.0)
    p.add_argument("--work-dir", type=Path, default=None, help="keep stores and logs here")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.batch_size % args.group_size:
        p.error("--batch-size must be a multiple of --group-size")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="proxima-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(work / "tiny-qwen2")
    gen_peak = args.max_running * args.tokens_per_s if args.max_running > 0 else float("inf")
    print(f"steps={args.steps} B={args.batch_size} group={args.group_size} eta={args.max_staleness} "
          f"decode={args.tokens_per_s:g} tok/s/request x {args.max_running} slots (peak {gen_peak:g} tok/s) "
          f"lengths~lognormal(median {args.median_tokens:g}, sigma {args.sigma:g}, cap {args.max_tokens_cap}) "
          f"train={args.step_s_per_1k:g} s/1k tok; work dir {work}", flush=True)
    results: dict[str, Result] = {}
    for name in [n.strip() for n in args.configs.split(",") if n.strip()]:
        t = time.monotonic()
        results[name] = run_config(args, name, model_dir, work)
        r = results[name]
        print(f"[{name}] wall {r.wall_s:.1f}s, {r.tokens_per_s:.0f} trained tok/s, "
              f"util {r.util_slots:.0%} (config incl. startup {time.monotonic() - t:.0f}s)", flush=True)
    print()
    print(table(results, args))
    if args.json:
        args.json.write_text(json.dumps({n: {**vars(r), "tokens_per_s": r.tokens_per_s}
                                         for n, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
