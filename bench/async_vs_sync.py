"""Benchmark: asynchronous RL (staleness + interruptible generation) against synchronous RL.

A simulated cluster, real control plane:

- generator: ``bench/_sim.py``, an SGLang-protocol server with ``--max-running``
  decode slots and a memory-bound decode model (a request decodes faster when
  fewer run; see its docstring); it measures its own utilization;
- the real proxy (``proxima serve`` via :class:`proxima.proxy.server_process.ProxyProcess`,
  ``--backend`` = the simulator, ``--max-staleness``, ``--train-batch-size``);
- the real :class:`proxima.trainer.rollout.controller.RolloutController`, driving an async agent
  that makes one chat completion (OpenAI SDK, ``ignore_eos``) whose
  ``max_tokens`` is drawn from a capped lognormal (a long tail), reward 1;
- a timing-model trainer that does what ``trainer/loop.py`` does around its
  compute: claim ``--batch-size`` sessions, drop the ones whose oldest token
  is older than ``i - eta`` (marked DROPPED, counted, not replaced), "train"
  the rest (sleep in proportion to their tokens), push version ``i + 1``
  through ``POST /admin/weights``, mark the sessions trained.

Configurations, on the same work (``--steps`` trainer steps of ``--batch-size``
sessions, the same seeded lengths):

1. ``sync``: ``max_staleness 0``; the controller starts a step's batch only
   after the previous push and the trainer waits for the whole batch. The
   simulator runs in ``drain`` mode (nothing is in flight at a push anyway).
2. ``async``: ``max_staleness 4``; the controller runs continuously (the
   proxy's staleness gate admits sessions); a push aborts in-flight generation
   in the simulator (``/pause_generation``, ``abort`` mode) and the proxy
   resumes it with the new weights.
3. ``async-noint``: as 2, but the simulator ignores ``/pause_generation`` and
   ``/abort_request {abort_all}``: ``/update_weights_from_disk`` waits until
   every in-flight request finished with the old weights (``--noint-mode
   drain``, SGLang's model-update lock; what AReaL's ablation of interruptible
   generation compares against), or lets them go on with the old version
   while new requests get the new one (``--noint-mode swap``, an optimistic
   bound). ``async / async-noint`` is interruption's own gain.

The cluster being modelled (defaults; every time is in cluster seconds and the
simulation runs ``--time-scale`` times faster):

- a ~7B reasoning model on H100-class GPUs. ``--tokens-per-s 40``: decode rate
  of each request on a full engine (KV-cache-bound, long contexts);
  ``--decode-speedup 3``: a request decoding alone runs 3x faster (an engine
  step costs ~7 ms of weight reads plus ~18 ms of KV reads when full), so the
  tail of a batch is not as slow as a fixed per-request rate would make it;
- ``--max-running 16`` slots and ``--batch-size 16`` sessions per step (4
  prompts x group 4): the generator holds exactly one batch, so sync runs
  its whole batch at once, its best case. Real batches are larger (hundreds
  to thousands of sequences); a larger batch makes it likelier that sync waits
  on a capped sequence, so this size understates the sync penalty (it is
  what the host can drive: see below);
- output lengths lognormal, median ``--median-tokens 4096``, ``--sigma 1.0``,
  capped at ``--max-tokens-cap 32768`` (mean ~6.4k, ~2% hit the cap): long
  chain-of-thought outputs with a long tail;
- ``--train-speed 1.25``: the trainer trains 1.25x the tokens per second the
  generator makes at its peak (``max_running x tokens_per_s``). Per GPU, a
  training token (forward + backward + proximal-logprob forward, ~8N FLOPs at
  ~40% MFU) costs about half a decoded token's time, and the GPUs are split so
  that the trainer keeps up with a full generator with some headroom (AReaL
  balances rollout and training workers the same way). In the sync run this
  makes training ~30% of a step, generation ~70%, as profiles of synchronous
  long-chain-of-thought RL report (generation 60-90% of a step);
- ``--weight-load-s 5``: the generator takes 5 s to load new weights;
- ``--rollout-concurrency 16``: agent runs in flight in the async
  configurations, one batch (AReaL's default ``max_concurrent_rollouts``).
  More only queues in the generator: every push aborts and requeues the
  queue too, long runs wait longer and more of them end too stale (32 gave
  7 drops in 10 steps where 16 gave 4, and no more tokens/s);
- ``--time-scale 40``: cluster seconds per simulated second. The proxy costs
  ~40 ms of CPU per session plus ~4 us per token; at scale 40 the async run
  opens ~4 sessions/s and uses about half a core (proxy ~30%, simulator ~10%,
  driver ~8%; the table reports them). The proxy's and the controller's
  wall-clock latencies count ``time_scale`` times over in cluster time: the
  async generator utilization was ~96% at scale 20, 92-94% at 40 and 86% at
  80 (the host saturated). 40 costs a few percent against a slower run and
  keeps the default run within 5 minutes. The simulator streams
  incremental chunks (SGLang's ``--incremental-streaming-output``) of
  ``--chunk-tokens 256``: cumulative chunks of 32k-token outputs would cost
  the proxy O(n^2).

Measurements. Wall time runs from the first session to the last push.
Effective training tokens/s = trained tokens (prompt + output) / wall.
Steady state: tokens trained in steps ``w+1..n`` over the time from push
``w`` to push ``n`` (``w = --warmup-steps``), which leaves out the async
pipeline filling up. Generator utilization = tokens generated / (peak rate x
wall); slot occupancy = busy slot-seconds / (slots x wall). Trainer busy =
time in "training" / wall: near 100% means trainer-bound, a generator near
100% means generator-bound.

What limits async with these defaults: it is generator-bound (generator
~94%, trainer busy ~55%), but it trains less than it generates. The trainer
drops a session whose oldest token is older than ``i - eta``; an interrupted
session keeps the version of its first token, so one whose decode spans more
than ``eta`` steps (the ~30k-token ones) is always dropped: ~10% of the
generated tokens. And at the end of a finite run ~1-2 steps' worth of tokens
are finished but untrained or still in flight (the steady-state figure
leaves them out).

Run: ``.venv/bin/python bench/async_vs_sync.py`` (about 5 minutes);
``--configs sync,async`` to pick, ``--steps``, ``--time-scale`` and the
cluster options above to change the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
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

from proxima.proxy.server_process import ProxyProcess  # noqa: E402
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.store.records import SessionStatus  # noqa: E402
from proxima.proxy.store.store import Store  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402
from proxima.trainer.rollout.controller import RolloutController  # noqa: E402

ADMIN = "bench-admin-token"
TARGET_RATIO = 3.0
PROMPT_MARGIN = 1024  # context beyond the length cap, for the prompt


# --------------------------------------------------------------------------- cluster model


@dataclass(frozen=True)
class Timing:
    """The cluster's times in simulated seconds (cluster seconds / time scale)."""

    decode_tokens_per_s: float  # per request, full engine
    train_s_per_token: float
    weight_load_s: float
    peak_tokens_per_s: float  # generator, all slots busy

    @classmethod
    def of(cls, args: argparse.Namespace) -> Timing:
        decode = args.tokens_per_s * args.time_scale
        peak = decode * args.max_running
        return cls(
            decode_tokens_per_s=decode,
            train_s_per_token=1.0 / (args.train_speed * peak),
            weight_load_s=args.weight_load_s / args.time_scale,
            peak_tokens_per_s=peak,
        )


# --------------------------------------------------------------------------- workload


def lengths(args: argparse.Namespace, n_items: int) -> list[list[int]]:
    """``max_tokens`` of every run: per item, one per group member (seeded, same for all configs)."""
    rng = random.Random(args.seed)
    mu = math.log(args.median_tokens)
    return [
        [
            max(args.min_tokens, min(args.max_tokens_cap, int(rng.lognormvariate(mu, args.sigma))))
            for _ in range(args.group_size)
        ]
        for _ in range(n_items)
    ]


class Agent:
    """One chat completion of the item's next drawn length; reward 1.

    One OpenAI client for all runs (a client per run costs ~25 ms of CPU to build,
    which on this host would be the benchmark's own bottleneck); the session key
    goes with each request.
    """

    def __init__(self, model: str):
        self.model = model
        self.taken: dict[str, int] = {}
        self.client: AsyncOpenAI | None = None

    async def __call__(self, data: dict[str, Any]) -> float:
        k = self.taken.get(data["id"], 0)
        self.taken[data["id"]] = k + 1
        max_tokens = data["lengths"][k % len(data["lengths"])]
        if self.client is None:
            self.client = AsyncOpenAI(
                base_url=data["base_url"], api_key="-", max_retries=0, timeout=600
            )
        client = self.client.with_options(base_url=data["base_url"], api_key=data["api_key"])
        await client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": f"Solve task {data['id']}."}],
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return 1.0

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


# --------------------------------------------------------------------------- host CPU


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def host_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot, all cores (Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


# --------------------------------------------------------------------------- cluster


@dataclass
class Result:
    name: str
    wall_s: float = 0.0
    trained_tokens: int = 0
    trained_output_tokens: int = 0
    trained_sessions: int = 0
    step_tokens: list[int] = field(default_factory=list)
    push_t: list[float] = field(default_factory=list)  # end of each step, s since the start
    warmup_steps: int = 0
    train_s: float = 0.0  # trainer "training"
    wait_s: float = 0.0  # trainer waiting for a batch
    push_s: float = 0.0  # trainer blocked in POST /admin/weights
    util_tokens: float = 0.0  # generated tokens / (peak rate x window)
    util_slots: float = 0.0
    generated_tokens: int = 0
    aborts: int = 0
    update_wait_s: float = 0.0  # simulator draining before loads (no-interruption mode)
    dropped: int = 0  # claimed sessions too stale to train (oldest version < i - eta)
    multi_version: int = 0  # trained completions holding tokens of several versions
    max_staleness_seen: int = 0
    sessions_started: int = 0
    waits_429: int = 0
    cpu_proxy_s: float = 0.0
    cpu_sim_s: float = 0.0
    cpu_driver_s: float = 0.0
    host_busy: float = 0.0  # whole host, other work included: busy cores / all cores

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        w = self.warmup_steps
        if w < 1 or len(self.push_t) <= w:
            return self.tokens_per_s
        span = self.push_t[-1] - self.push_t[w - 1]
        return sum(self.step_tokens[w:]) / span if span > 0 else 0.0


def start_sim(
    args: argparse.Namespace, timing: Timing, port: int, interrupt: str, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "_sim.py"),
        "--port",
        str(port),
        "--tokens-per-s",
        str(timing.decode_tokens_per_s),
        "--max-running",
        str(args.max_running),
        "--decode-speedup",
        str(args.decode_speedup),
        "--interrupt",
        interrupt,
        "--chunk-tokens",
        str(args.chunk_tokens),
        "--incremental",
        "--weight-load-s",
        str(timing.weight_load_s),
    ]
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


async def trainer_loop(
    args: argparse.Namespace,
    timing: Timing,
    store: Store,
    proxy: ProxyProcess,
    res: Result,
    eta: int,
    t0: float,
) -> None:
    """Claim a batch, drop what is too stale, 'train' (sleep by tokens), push version i + 1."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=600) as http:
        for step in range(args.steps):
            t_claim = time.monotonic()
            batch: list[tuple[Any, list[Any]]] = []
            while len(batch) < args.batch_size:
                got = await store.claim_sessions(
                    limit=args.batch_size - len(batch), trainer_id="bench"
                )
                for s in got:
                    batch.append((s, await store.list_completions(session_id=s.id)))
                if len(batch) < args.batch_size:
                    await asyncio.sleep(args.poll_s)
            t_train = time.monotonic()
            res.wait_s += t_train - t_claim
            tokens = 0
            trained, stale = [], []
            for s, comps in batch:
                versions = [v for c in comps for v in c.output_versions]
                if versions and min(versions) < step - eta:  # as trainer.samples.filter_stale
                    stale.append(s.id)
                    continue
                trained.append(s.id)
                for c in comps:
                    tokens += len(c.prompt_ids) + len(c.output_ids)
                    res.trained_output_tokens += len(c.output_ids)
                    if len(set(c.output_versions)) > 1:
                        res.multi_version += 1
                    if c.output_versions:
                        res.max_staleness_seen = max(
                            res.max_staleness_seen, step - min(c.output_versions)
                        )
            if stale:
                res.dropped += len(stale)
                await store.mark_sessions(session_ids=stale, status=SessionStatus.DROPPED)
            res.trained_tokens += tokens
            res.trained_sessions += len(trained)
            res.step_tokens.append(tokens)
            await asyncio.sleep(timing.train_s_per_token * tokens)
            t_push = time.monotonic()
            res.train_s += t_push - t_train
            r = await http.post(
                f"{proxy.url}/admin/weights",
                headers=headers,
                json={"version": step + 1, "path": f"/sim/weights/v{step + 1}"},
            )
            r.raise_for_status()
            res.push_s += time.monotonic() - t_push
            await store.mark_sessions(
                session_ids=trained, status=SessionStatus.TRAINED, trained_version=step + 1
            )
            res.push_t.append(time.monotonic() - t0)


async def drive(
    args: argparse.Namespace,
    timing: Timing,
    name: str,
    eta: int,
    proxy: ProxyProcess,
    sim: subprocess.Popen[bytes],
    sim_url: str,
    items: list[dict[str, Any]],
) -> Result:
    res = Result(name, warmup_steps=min(args.warmup_steps, args.steps - 1))
    store = await Store.open(proxy.db_url)
    agent = Agent(proxy.model_name)
    per_step_items = args.batch_size // args.group_size
    assert proxy.proc is not None
    async with httpx.AsyncClient(timeout=30) as http:
        s0 = (await http.get(f"{sim_url}/sim_stats")).json()
        cpu0 = (
            cpu_seconds(proxy.proc.pid),
            cpu_seconds(sim.pid),
            self_cpu_seconds(),
            host_busy_seconds(),
        )
        t0 = time.monotonic()
        try:
            if name == "sync":
                # One pass per step, started only after the previous push.
                ctrl = RolloutController(
                    proxy.url,
                    ADMIN,
                    agent,
                    group_size=args.group_size,
                    max_concurrency=args.batch_size,
                )
                train = asyncio.create_task(trainer_loop(args, timing, store, proxy, res, eta, t0))
                for step in range(args.steps):
                    chunk = items[step * per_step_items : (step + 1) * per_step_items]
                    await ctrl.run(chunk)
                    res.sessions_started += ctrl.progress.sessions_started
                    res.waits_429 += ctrl.progress.waits_429
                    while len(res.push_t) <= step and not train.done():
                        await asyncio.sleep(args.poll_s)
                await train
            else:
                ctrl = RolloutController(
                    proxy.url,
                    ADMIN,
                    agent,
                    group_size=args.group_size,
                    max_concurrency=args.rollout_concurrency,
                )
                rollout = asyncio.create_task(ctrl.run(items))
                train = asyncio.create_task(trainer_loop(args, timing, store, proxy, res, eta, t0))
                done, _ = await asyncio.wait({rollout, train}, return_when=asyncio.FIRST_COMPLETED)
                if train not in done:
                    rollout.result()  # raises what stopped the rollout
                await train
                res.sessions_started = ctrl.progress.sessions_started
                res.waits_429 = ctrl.progress.waits_429
            res.wall_s = time.monotonic() - t0
            s1 = (await http.get(f"{sim_url}/sim_stats")).json()
            cpu1 = (
                cpu_seconds(proxy.proc.pid),
                cpu_seconds(sim.pid),
                self_cpu_seconds(),
                host_busy_seconds(),
            )
            if name != "sync":
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
        finally:
            await agent.close()
            await store.close()
    # The stats window (s1.t - s0.t) is a little longer than the trainer's wall; use the sim's.
    window = s1["t"] - s0["t"] or res.wall_s
    res.generated_tokens = s1["generated_tokens"] - s0["generated_tokens"]
    res.util_tokens = res.generated_tokens / (timing.peak_tokens_per_s * window)
    res.util_slots = (s1["slot_seconds"] - s0["slot_seconds"]) / (args.max_running * window)
    res.aborts = s1["aborts"] - s0["aborts"]
    res.update_wait_s = s1["update_wait_s"] - s0["update_wait_s"]
    res.cpu_proxy_s, res.cpu_sim_s, res.cpu_driver_s = (
        b - a for a, b in zip(cpu0[:3], cpu1[:3], strict=True)
    )
    busy, total = (b - a for a, b in zip(cpu0[3], cpu1[3], strict=True))
    res.host_busy = busy / total if total else 0.0
    return res


def run_config(
    args: argparse.Namespace, timing: Timing, name: str, model_dir: Path, work: Path
) -> Result:
    interrupt = {"sync": "drain", "async": "abort", "async-noint": args.noint_mode}[name]
    eta = 0 if name == "sync" else args.max_staleness
    cdir = work / name
    cdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sim = start_sim(args, timing, port, interrupt, cdir / "sim.log")
    sim_url = f"http://127.0.0.1:{port}"
    proxy = ProxyProcess(
        model_dir,
        db_url=f"sqlite:///{cdir / 'store.db'}",
        admin_token=ADMIN,
        log_path=cdir / "serve.log",
        extra_args=[
            "--backend",
            sim_url,
            "--max-staleness",
            str(eta),
            "--train-batch-size",
            str(args.batch_size),
        ],
        env={"PROXIMA_MAX_OPEN_SESSIONS": "4096"},
    )
    n_items = (args.steps + args.max_staleness + 4) * args.batch_size // args.group_size
    items = [{"id": f"task{i}", "lengths": ls} for i, ls in enumerate(lengths(args, n_items))]
    try:
        proxy.start()
        return asyncio.run(
            asyncio.wait_for(
                drive(args, timing, name, eta, proxy, sim, sim_url, items), args.config_timeout_s
            )
        )
    finally:
        # Measured already: no graceful stop (it would wait for the non-streaming
        # completions still in flight, whose clients were cancelled, to finish).
        proxy.stop(kill=True)
        sim.terminate()
        try:
            sim.wait(15)
        except subprocess.TimeoutExpired:
            sim.kill()


# --------------------------------------------------------------------------- report


def table(results: dict[str, Result], args: argparse.Namespace) -> str:
    names = list(results)
    rs = [results[n] for n in names]
    base = results.get("sync")

    def ratio(get: Any) -> list[str]:
        return [f"{get(r) / get(base):.2f}x" if base and get(base) else "-" for r in rs]

    w = rs[0].warmup_steps if rs else 0
    rows: list[tuple[str, list[str]]] = [
        ("wall time (s)", [f"{r.wall_s:.1f}" for r in rs]),
        ("steps", [f"{len(r.push_t)}" for r in rs]),
        ("trained sessions", [f"{r.trained_sessions}" for r in rs]),
        ("trained tokens", [f"{r.trained_tokens}" for r in rs]),
        ("effective train tok/s", [f"{r.tokens_per_s:.0f}" for r in rs]),
        (
            f"steady tok/s (steps {w + 1}-{args.steps})",
            [f"{r.steady_tokens_per_s:.0f}" for r in rs],
        ),
        ("generator utilization", [f"{r.util_tokens:.1%}" for r in rs]),
        ("  slot occupancy", [f"{r.util_slots:.1%}" for r in rs]),
        ("trainer busy", [f"{r.train_s / r.wall_s:.1%}" if r.wall_s else "-" for r in rs]),
        ("trainer waiting (s)", [f"{r.wait_s:.1f}" for r in rs]),
        ("trainer in push (s)", [f"{r.push_s:.1f}" for r in rs]),
        ("  of which draining (s)", [f"{r.update_wait_s:.1f}" for r in rs]),
        ("generated tokens", [f"{r.generated_tokens}" for r in rs]),
        ("dropped as too stale", [f"{r.dropped}" for r in rs]),
        ("aborted requests", [f"{r.aborts}" for r in rs]),
        ("multi-version completions", [f"{r.multi_version}" for r in rs]),
        ("max staleness trained", [f"{r.max_staleness_seen}" for r in rs]),
        ("sessions started", [f"{r.sessions_started}" for r in rs]),
        ("429 waits", [f"{r.waits_429}" for r in rs]),
        (
            "CPU proxy, sim, driver (%)",
            [
                f"{100 * r.cpu_proxy_s / r.wall_s:.0f}/{100 * r.cpu_sim_s / r.wall_s:.0f}/"
                f"{100 * r.cpu_driver_s / r.wall_s:.0f}"
                if r.wall_s
                else "-"
                for r in rs
            ],
        ),
        ("host busy, all work (%)", [f"{r.host_busy:.0%}" for r in rs]),
        ("ratio vs sync (end to end)", ratio(lambda r: r.tokens_per_s)),
        ("ratio vs sync (steady)", ratio(lambda r: r.steady_tokens_per_s)),
    ]
    lw = max(len(r[0]) for r in rows)
    cw = max(14, *(len(n) + 2 for n in names))
    lines = [" " * lw + "".join(n.rjust(cw) for n in names)]
    lines += [label.ljust(lw) + "".join(v.rjust(cw) for v in vals) for label, vals in rows]
    lines.append("")
    if base and "async" in results and base.tokens_per_s:
        a = results["async"]
        end, steady = (
            a.tokens_per_s / base.tokens_per_s,
            a.steady_tokens_per_s / base.steady_tokens_per_s,
        )
        verdict = "meets" if end >= TARGET_RATIO else "below"
        lines.append(
            f"async/sync effective throughput: {end:.2f}x end to end ({verdict} target "
            f"{TARGET_RATIO:.1f}x; AReaL reports 2.77x), {steady:.2f}x steady state"
        )
    if "async" in results and "async-noint" in results and results["async-noint"].tokens_per_s:
        a, n = results["async"], results["async-noint"]
        lines.append(
            f"interruption's own gain (async / async-noint[{args.noint_mode}]): "
            f"{a.tokens_per_s / n.tokens_per_s:.2f}x end to end, "
            f"{a.steady_tokens_per_s / n.steady_tokens_per_s:.2f}x steady state (AReaL: 1.12-1.17x)"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="sync,async,async-noint")
    p.add_argument("--steps", type=int, default=10, help="trainer steps per configuration")
    p.add_argument(
        "--warmup-steps", type=int, default=3, help="steps left out of the steady-state throughput"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sessions per trainer step (B)")
    p.add_argument("--group-size", type=int, default=4, help="sessions per dataset item")
    p.add_argument("--max-staleness", type=int, default=4, help="eta of the async configurations")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=40.0,
        help="decode rate per request on a full engine, cluster time",
    )
    p.add_argument(
        "--decode-speedup",
        type=float,
        default=3.0,
        help="rate of a request decoding alone / rate on a full engine",
    )
    p.add_argument("--max-running", type=int, default=16, help="generator decode slots")
    p.add_argument(
        "--rollout-concurrency",
        type=int,
        default=16,
        help="agent runs in flight in the async configurations",
    )
    p.add_argument(
        "--median-tokens", type=float, default=4096.0, help="median output length (lognormal)"
    )
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (tail weight)")
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument(
        "--max-tokens-cap", type=int, default=32768, help="cap of the drawn output lengths"
    )
    p.add_argument(
        "--train-speed",
        type=float,
        default=1.25,
        help="trainer tokens/s as a multiple of the generator's peak tokens/s",
    )
    p.add_argument(
        "--weight-load-s",
        type=float,
        default=5.0,
        help="time the generator takes to load new weights, cluster time",
    )
    p.add_argument(
        "--time-scale", type=float, default=40.0, help="cluster seconds per simulated second"
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per backend stream chunk")
    p.add_argument(
        "--noint-mode",
        choices=["drain", "swap"],
        default="drain",
        help="what 'no interruption' means for a weight update (see _sim.py)",
    )
    p.add_argument("--poll-s", type=float, default=0.05, help="trainer claim poll interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-timeout-s", type=float, default=600.0)
    p.add_argument("--work-dir", type=Path, default=None, help="keep stores and logs here")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.batch_size % args.group_size:
        p.error("--batch-size must be a multiple of --group-size")
    if not 1.0 <= args.decode_speedup <= args.max_running:
        p.error("--decode-speedup must be between 1 and --max-running")

    timing = Timing.of(args)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="proxima-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(
        work / "tiny-qwen2", max_position_embeddings=args.max_tokens_cap + PROMPT_MARGIN
    )
    mean_tokens = sum(sum(ls) for ls in lengths(args, 4096)) / (4096 * args.group_size)
    print(
        f"cluster: {args.max_running} slots x {args.tokens_per_s:g} tok/s/request (alone "
        f"x{args.decode_speedup:g}), trainer {args.train_speed:g}x the generator's peak, "
        f"weight load {args.weight_load_s:g}s; lengths lognormal(median {args.median_tokens:g}, "
        f"sigma {args.sigma:g}) capped at {args.max_tokens_cap} (mean {mean_tokens:.0f})",
        flush=True,
    )
    print(
        f"run: steps={args.steps} B={args.batch_size} group={args.group_size} eta={args.max_staleness}; "
        f"time scale {args.time_scale:g}: decode {timing.decode_tokens_per_s:g} tok/s/request, peak "
        f"{timing.peak_tokens_per_s:g} tok/s, train {1e3 * timing.train_s_per_token:.3g} s/1k tok; "
        f"work dir {work}",
        flush=True,
    )
    results: dict[str, Result] = {}
    for name in [n.strip() for n in args.configs.split(",") if n.strip()]:
        t = time.monotonic()
        results[name] = run_config(args, timing, name, model_dir, work)
        r = results[name]
        print(
            f"[{name}] wall {r.wall_s:.1f}s, {r.tokens_per_s:.0f} trained tok/s "
            f"({r.steady_tokens_per_s:.0f} steady), generator {r.util_tokens:.0%}, trainer busy "
            f"{r.train_s / r.wall_s:.0%} (config incl. start-up {time.monotonic() - t:.0f}s)",
            flush=True,
        )
    print()
    print(table(results, args))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    n: {
                        **vars(r),
                        "tokens_per_s": r.tokens_per_s,
                        "steady_tokens_per_s": r.steady_tokens_per_s,
                    }
                    for n, r in results.items()
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
