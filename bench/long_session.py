"""One long agent session through the proxy: per-turn cost and storage against context size.

A coding agent's session grows every turn: the client sends the whole conversation
again (system prompt, tools, every earlier reply and tool output) plus what is new.
This bench plays one such session against ``proxima serve --backend`` in front of the
fake SGLang server (``bench/_bench_backend.py``, replies are printable text so they go
back into the conversation as an agent would send them):

- a system prompt and about 4 KB of tool definitions, then ``--turns`` turns, each
  adding ``--tool-tokens`` tokens of tool output (a user message) and generating
  ``--gen-tokens`` tokens (streamed ``/v1/chat/completions``, recorded in SQLite);
- after each turn, the same prompt ids (read back from the store) go straight to the
  backend's ``/generate`` (streamed, same ``max_new_tokens``), twice: the mean is the
  direct baseline (request bodies of both arms are encoded before their clocks start);
- a turn's added latency is its proxy latency minus its direct latency; the added p50
  at a context size is the median over the ``--band`` turns whose prompts are nearest
  to it (8k, 32k and 64k tokens by default);
- storage: the SQLite database's used pages once the proxy has stopped (WAL
  checkpointed), per token of the final context (last prompt plus its output).

The tiny test tokenizer is byte-level (one token per byte), so token counts are byte
counts of the rendered conversation. Ends with
``long session: added p50 8k A ms, 32k B ms, 64k C ms; store S bytes per context token``.

    .venv/bin/python bench/long_session.py               # 100 turns, about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from proxima.proxy.serving import free_port  # noqa: E402
from proxima.proxy.store.store import Store  # noqa: E402
from proxima.proxy.testing.live import LiveProxy  # noqa: E402
from proxima.proxy.testing.tiny_model import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from proxy_overhead import host_line, wait_http  # noqa: E402

WORDS = [
    "src",
    "tests",
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "error",
    "file",
    "line",
    "path",
    "config",
    "build",
    "assert",
    "patch",
    "diff",
    "commit",
    "module",
    "function",
    "result",
    "status",
    "output",
    "index",
    "cache",
    "None",
]
REPLY_TEXT = "I will read the failing test and then patch the module it imports. "


def tools(size: int) -> list[dict]:
    """Tool definitions totalling about ``size`` bytes of JSON."""
    rng = random.Random(1)
    out: list[dict] = []
    while len(json.dumps(out)) < size:
        i = len(out)
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": " ".join(rng.choice(WORDS) for _ in range(50)),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string", "description": "file to act on"},
                            "text": {"type": "string", "description": "what to write"},
                        },
                        "required": ["path"],
                    },
                },
            }
        )
    return out


def tool_output(rng: random.Random, size: int) -> str:
    words: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:size]


async def read_chat(
    http: httpx.AsyncClient, url: str, body: dict, key: str
) -> tuple[float, str, str]:
    """One streamed chat turn: (seconds, completion id, reply text). The body is encoded
    before the clock starts, as for the direct call."""
    payload = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    parts: list[str] = []
    cid = ""
    t0 = time.perf_counter()
    async with http.stream("POST", url, content=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"chat answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            cid = chunk.get("id", cid)
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return time.perf_counter() - t0, cid, "".join(parts)


async def read_generate(http: httpx.AsyncClient, url: str, ids: list[int], tokens: int) -> float:
    """One streamed ``/generate`` read to its end; seconds (the body encoded beforehand)."""
    payload = json.dumps(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            "return_logprob": True,
            "stream": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    t0 = time.perf_counter()
    async with http.stream("POST", url, content=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}")
        async for _ in resp.aiter_lines():
            pass
    return time.perf_counter() - t0


def store_bytes(db: Path) -> int:
    """Bytes of the database's used pages, after its WAL is checkpointed into it."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        conn.close()
    return (pages - free) * page_size


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="proxima-long-"))
    print(host_line())
    model = build_tiny_model(work / "tiny", max_position_embeddings=131072)
    tokenizer = build_tiny_tokenizer()
    script = tokenizer.encode(REPLY_TEXT, add_special_tokens=False)
    port = free_port()
    backend = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "_bench_backend.py"), "--port", str(port),
         "--script", ",".join(map(str, script))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    backend_url = f"http://127.0.0.1:{port}"
    db = work / "store.db"
    proxy = LiveProxy(
        model, db_url=f"sqlite:///{db}", extra_args=["--backend", backend_url],
        log_path=work / "serve.log",
    )  # fmt: skip
    rng = random.Random(0)
    tool_list = tools(args.tools_bytes)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. " + tool_output(rng, 400)},
        {"role": "user", "content": "Fix the failing cache test."},
    ]
    # (prompt tokens, proxy s, direct s, proxy process CPU s)
    turns: list[tuple[int, float, float, float]] = []
    final_context = 0
    try:
        wait_http(backend_url + "/model_info", backend, 60)
        proxy.start()
        assert proxy.proc is not None
        proxy_proc = psutil.Process(proxy.proc.pid)
        store = await Store.open(f"sqlite:///{db}")
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(proxy.url + "/rl/sessions", json={}, headers=proxy.admin_headers())
            key = r.json()["api_key"]
            for turn in range(args.turns):
                body = {
                    "model": proxy.model_name,
                    "messages": messages,
                    "tools": tool_list,
                    "max_tokens": args.gen_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                cpu0 = cpu_seconds(proxy_proc)
                seconds, cid, text = await read_chat(
                    http, proxy.base_url + "/chat/completions", body, key
                )
                cpu = cpu_seconds(proxy_proc) - cpu0
                record = await store.get_completion(completion_id=cid)
                assert record is not None, cid
                # The direct call with the same ids, twice (the mean): its own noise halves.
                generate_url = backend_url + "/generate"
                direct = statistics.mean(
                    [
                        await read_generate(http, generate_url, record.prompt_ids, args.gen_tokens)
                        for _ in range(2)
                    ]
                )
                turns.append((len(record.prompt_ids), seconds, direct, cpu))
                final_context = len(record.prompt_ids) + len(record.output_ids)
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": tool_output(rng, args.tool_tokens)})
                if (turn + 1) % 10 == 0:
                    print(
                        f"turn {turn + 1}: {len(record.prompt_ids)} prompt tokens, proxy "
                        f"{seconds * 1000:.1f} ms, direct {direct * 1000:.1f} ms",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
        await store.close()
    finally:
        proxy.stop()
        backend.terminate()
        backend.wait(10)
    size = store_bytes(db)
    report(args, turns, size, final_context)


def cpu_seconds(proc: psutil.Process) -> float:
    """CPU seconds of the process's live threads, to the nanosecond where Linux reports
    it (``/proc/PID/task/*/schedstat``); else user+system in clock ticks."""
    task = Path(f"/proc/{proc.pid}/task")
    if not task.is_dir():
        times = proc.cpu_times()
        return times.user + times.system
    total = 0
    for tid in os.listdir(task):
        try:
            total += int((task / tid / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return total / 1e9


def report(args: argparse.Namespace, turns: list[tuple[int, float, float, float]], size: int,
           final_context: int) -> None:  # fmt: skip
    print(
        f"\nlong session: {len(turns)} turns, {args.tool_tokens} tokens of tool output and "
        f"{args.gen_tokens} generated per turn, {args.tools_bytes} bytes of tools"
    )
    print(f"{'context':>8}{'turns':>7}{'prompt tokens':>16}{'proxy p50':>11}{'direct p50':>12}"
          f"{'added p50':>11}{'proxy CPU p50':>15}")  # fmt: skip
    added: dict[int, float] = {}
    for target in args.at:
        band = sorted(turns, key=lambda t: abs(t[0] - target))[: args.band]
        lo, hi = min(t[0] for t in band), max(t[0] for t in band)
        added[target] = statistics.median((t[1] - t[2]) * 1000 for t in band)
        print(
            f"{target // 1024:>7}k{len(band):>7}{f'{lo}-{hi}':>16}"
            f"{statistics.median(t[1] for t in band) * 1000:>11.2f}"
            f"{statistics.median(t[2] for t in band) * 1000:>12.2f}{added[target]:>11.2f}"
            f"{statistics.median(t[3] for t in band) * 1000:>15.2f}"
        )
    print("(ms; added = a turn's proxy latency minus its direct /generate latency with the same")
    print(f" ids, median over the {args.band} turns nearest each context size; proxy CPU = the")
    print(" proxy process's user+system time during the turn, which a loaded host stretches less")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f" than latency; load average {load} (1/5/15 min) at the end)")
    per_token = size / final_context
    print(f"store: {size} bytes in SQLite for {final_context} tokens of final context")
    a, b, c = (added[t] for t in args.at)
    labels = [f"{t // 1024}k" for t in args.at]
    print(
        f"long session: added p50 {labels[0]} {a:.1f} ms, {labels[1]} {b:.1f} ms, "
        f"{labels[2]} {c:.1f} ms; store {per_token:.0f} bytes per context token"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--tool-tokens", type=int, default=600)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--tools-bytes", type=int, default=4096)
    p.add_argument("--band", type=int, default=9, help="turns per context size")
    p.add_argument("--at", type=int, nargs=3, default=[8192, 32768, 65536])
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
