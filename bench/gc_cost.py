"""The garbage collector's share of the proxy's CPU under load, at each set of thresholds.

One ``proxima serve`` per setting (``--thresholds a,b,c``, repeatable; ``proxy`` is the
proxy's own ``GC_THRESHOLDS``), one fake backend, ``--concurrency`` streams of ``--tokens``
tokens over 200 sessions. ``bench/_gc_probe`` times every collection inside the proxy
(``gc.callbacks``); after a warm-up, a window of ``--seconds`` gives per request: the
process's CPU, the collector's (by generation), the passes, and the longest pause in the
window. Settings alternate over ``--rounds``. Raw lines go to ``--out`` (JSON lines).

    .venv/bin/python bench/gc_cost.py --thresholds 700,10,10 --thresholds proxy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import proxy_overhead as po  # noqa: E402
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model  # noqa: E402


def _probe(folder: Path, pid: int, *, counted: bool = False) -> dict[str, Any]:
    """The probe's next report (``counted``: the first with the oldest generation's size)."""
    time.sleep(0.6)  # one more report than the last event
    deadline = time.monotonic() + 10
    while True:
        row: dict[str, Any] = json.loads((folder / f"gc_{pid}.json").read_text())
        if not counted or "oldest_objects" in row or time.monotonic() > deadline:
            return row
        time.sleep(0.1)


async def one_window(args: argparse.Namespace, work: Path, setting: str) -> dict[str, Any]:
    port = free_port()
    backend = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "_bench_backend.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = Path(tempfile.mkdtemp(dir=work))
    env = {
        "GC_PROBE_DIR": str(probe),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "_gc_probe"),
                                       os.environ.get("PYTHONPATH", "")]),
        **({} if setting == "proxy" else {"GC_THRESH": setting}),
    }  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proxy = LiveProxy(
        work / "tiny", db_url=f"sqlite:///{probe / 'store.db'}", env=env,
        extra_args=["--backend", url], log_path=probe / "serve.log",
    )  # fmt: skip
    client = po.Client("wire", args.concurrency)
    try:
        po.wait_http(url + "/model_info", backend, 60)
        proxy.start()
        assert proxy.proc is not None
        keys = await po.session_keys(client, proxy, 200)
        fn = po.chat_arm(client, proxy.base_url, keys, proxy.model_name, args.tokens)
        await po.run_load(fn, 2 * args.concurrency, args.concurrency)  # warm-up
        pid = proxy.proc.pid
        (probe / f"reset_{pid}").touch()
        before, t0, n = _probe(probe, pid), time.monotonic(), 0
        while time.monotonic() - t0 < args.seconds:
            await po.run_load(fn, 2 * args.concurrency, args.concurrency)
            n += 2 * args.concurrency
        elapsed = time.monotonic() - t0
        (probe / f"count_{pid}").touch()  # and the oldest generation's size
        after = _probe(probe, pid, counted=True)
    finally:
        await client.aclose()
        proxy.stop()
        backend.terminate()
    gc_us = [(a - b) * 1e6 / n for a, b in zip(after["gc_cpu"], before["gc_cpu"], strict=True)]
    return {
        "setting": setting,
        "thresholds": after["thresholds"],
        "requests": n,
        "req_per_s": n / elapsed,
        "cpu_us_per_request": (after["process_cpu"] - before["process_cpu"]) * 1e6 / n,
        "gc_us_per_request": sum(gc_us),
        "gc_us_by_generation": gc_us,
        "passes": [a - b for a, b in zip(after["passes"], before["passes"], strict=True)],
        "longest_pause_ms": [x * 1000 for x in after["longest"]],
        "oldest_generation_objects": after.get("oldest_objects"),
    }


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="proxima-gc-"))
    build_tiny_model(work / "tiny")
    print(po.host_line())
    rows: list[dict[str, Any]] = [{"kind": "run", "host": po.host_line(),
                                   "commit": po.git_commit(), "args": vars(args)}]  # fmt: skip
    for r in range(args.rounds):
        for setting in args.thresholds:
            row = await one_window(args, work, setting)
            rows.append({"round": r + 1, **row})
            g0, g1, g2 = row["gc_us_by_generation"]
            print(
                f"{setting:>14} {tuple(row['thresholds'])}: {row['req_per_s']:.0f} req/s, "
                f"CPU {row['cpu_us_per_request']:.0f} us/request, collector "
                f"{row['gc_us_per_request']:.0f} us ({g0:.0f}/{g1:.0f}/{g2:.0f} by generation), "
                f"passes {'/'.join(str(p) for p in row['passes'])}, longest pause "
                f"{'/'.join(f'{x:.0f}' for x in row['longest_pause_ms'])} ms",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"raw results: {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--thresholds", action="append", help="a,b,c or 'proxy' (repeatable)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / f"gc_cost-{stamp}.jsonl"))
    args = p.parse_args()
    args.thresholds = args.thresholds or ["700,10,10", "proxy"]
    import uvloop

    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
