"""``proxy_overhead.py``'s results: each arm's figures at each length, the tables and the summary.

An ``ArmResult`` is one arm at one stream length, pooled over the rounds. The per-token
CPU of a process is the slope of its CPU per request between the shortest and the longest
length: ``(cpu(L_long) - cpu(L_short)) / (L_long - L_short)``, what one more streamed
token costs it, without the per-request work (routing, prompt, recording).
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field
from typing import Any


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds), in milliseconds."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


@dataclass
class ArmResult:
    name: str
    baseline: str | None
    tokens: int
    sequential: list[float] = field(default_factory=list)  # every round's, pooled
    throughputs: list[float] = field(default_factory=list)  # one per round
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # concurrent runs, summed
    requests: int = 0  # concurrent requests, all rounds
    events: int = 0  # server-sent data events their streams held (before [DONE])
    host_busy: list[float] = field(default_factory=list)  # one per round

    @property
    def throughput(self) -> float:
        return statistics.median(self.throughputs)

    def cpu_ms(self, role: str) -> float:
        """CPU milliseconds per request of ``role`` (client, backend, middle) under load."""
        return self.cpu_seconds[role] * 1000 / self.requests

    def round_record(
        self, round_no: int, seq: list[float], cpu: dict[str, float]
    ) -> dict[str, Any]:
        """One round of this arm, as a line of the raw results."""
        return {
            "kind": "round",
            "round": round_no,
            "arm": self.name,
            "tokens": self.tokens,
            "seq_p50_ms": pct(seq, 0.5),
            "seq_p95_ms": pct(seq, 0.95),
            "req_per_s": self.throughputs[-1],
            "host_busy": self.host_busy[-1],
            "events_per_request": self.events / self.requests,
            "cpu_s": cpu,
        }


def per_token_us(short: ArmResult, long: ArmResult, role: str) -> float | None:
    """Microseconds of ``role``'s CPU per streamed token (module docstring)."""
    if role not in short.cpu_seconds or role not in long.cpu_seconds:
        return None
    return (long.cpu_ms(role) - short.cpu_ms(role)) * 1000 / (long.tokens - short.tokens)


def table(results: list[ArmResult], args: argparse.Namespace, tokens: int) -> None:
    """The table of one stream length."""
    by_name = {r.name: r for r in results}
    backends = "one fake backend" if args.backends == 1 else f"{args.backends} fake backends"
    print(f"\nproxy overhead: {tokens} streamed tokens per request, {backends}")
    print(
        f"{'arm':<18}{'seq p50':>9}{'added':>8}{'seq p95':>9}{'added':>8}"
        f"{'req/s @' + str(args.concurrency):>12}{'vs direct':>10}"
        f"{'CPU ms/req: client':>20}{'backend':>9}{'middle':>8}{'host busy':>11}"
        f"{'events/req':>11}"
    )
    for r in results:
        base = by_name.get(r.baseline) if r.baseline else None
        add50 = f"{pct(r.sequential, 0.5) - pct(base.sequential, 0.5):8.2f}" if base else f"{'':>8}"
        add95 = (
            f"{pct(r.sequential, 0.95) - pct(base.sequential, 0.95):8.2f}" if base else f"{'':>8}"
        )
        ratio = f"{r.throughput / base.throughput:10.2f}" if base else f"{'':>10}"
        middle = f"{r.cpu_ms('middle'):8.2f}" if "middle" in r.cpu_seconds else f"{'':>8}"
        print(
            f"{r.name:<18}{pct(r.sequential, 0.5):9.2f}{add50}{pct(r.sequential, 0.95):9.2f}{add95}"
            f"{r.throughput:12.0f}{ratio}{r.cpu_ms('client'):20.2f}{r.cpu_ms('backend'):9.2f}"
            f"{middle}{statistics.median(r.host_busy):10.0%}{r.events / r.requests:11.1f}"
        )


def report(
    results: dict[int, list[ArmResult]],
    args: argparse.Namespace,
    recorded: int,
    expected: int,
) -> dict[str, Any]:
    """Print every length's table, the per-token CPU and the summary line; returns the
    summary as a record for the raw results."""
    lengths = sorted(results)
    for tokens in lengths:
        table(results[tokens], args, tokens)
    print("(ms; 'added' is against the arm's direct baseline: direct for relay and proxima,")
    print(" direct-openai for litellm; req/s is the median of the rounds; CPU is each process's")
    print(" (and its children's) user+system time per request in the concurrent runs, host busy")
    print(f" the median share of all {os.cpu_count()} cores busy in them; {args.rounds} rounds,")
    print(" arms and lengths interleaved; events/req: the data events of a stream, tokens")
    print(" per event being tokens / events)")
    print(f"proxima recorded {recorded} completions (expected {expected})")
    first = {r.name: r for r in results[lengths[0]]}
    last = {r.name: r for r in results[lengths[-1]]}
    summary: dict[str, Any] = {"kind": "summary", "recorded": recorded, "expected": expected}
    if len(lengths) > 1:
        print(f"CPU per streamed token ({lengths[0]} -> {lengths[-1]} tokens), us:")
        print(f"{'arm':<18}{'client':>9}{'backend':>9}{'middle':>9}")
        per_token: dict[str, dict[str, float | None]] = {}
        for name, long in last.items():
            if name not in first:
                continue
            row = {role: per_token_us(first[name], long, role) for role in long.cpu_seconds}
            per_token[name] = row
            cells = "".join(
                f"{row[r]:9.1f}" if row.get(r) is not None else f"{'':>9}"
                for r in ("client", "backend", "middle")
            )
            print(f"{name:<18}{cells}")
        summary["per_token_us"] = per_token
    if "litellm" in first:
        lite, lite_base, proxima, direct = (
            first["litellm"], first["direct-openai"], first["proxima"], first["direct"],
        )  # fmt: skip
        ours = pct(proxima.sequential, 0.5) - pct(direct.sequential, 0.5)
        theirs = pct(lite.sequential, 0.5) - pct(lite_base.sequential, 0.5)
        print(f"sequential added p50: proxima {ours:.2f} ms (recording), litellm {theirs:.2f} ms "
              f"(not recording): {ours / theirs:.2f}x")  # fmt: skip
    summary_line(first, last, lengths, summary)
    for name in first:
        if name.startswith("proxima@"):
            ab_line(first, last, lengths, name)
        if name.startswith("proxima x"):
            summary["workers"] = workers_line(results, name)
    return summary


def summary_line(
    first: dict[str, ArmResult],
    last: dict[str, ArmResult],
    lengths: list[int],
    summary: dict[str, Any],
) -> None:
    """``proxy overhead: sequential added p50 X ms; throughput ratio R16; 256 tokens R256;
    per-token CPU proxima U us vs relay V us`` (the first ratio at the shortest length)."""
    added = pct(first["proxima"].sequential, 0.5) - pct(first["direct"].sequential, 0.5)
    ratios = {
        arms["proxima"].tokens: arms["proxima"].throughput / arms["direct"].throughput
        for arms in (first, last)
    }
    summary.update(added_p50_ms=added, ratios={str(n): r for n, r in ratios.items()})
    line = (
        f"proxy overhead: sequential added p50 {added:.1f} ms; "
        f"throughput ratio {ratios[lengths[0]]:.2f}"
    )
    if len(lengths) > 1:
        u = per_token_us(first["proxima"], last["proxima"], "middle")
        v = per_token_us(first["relay"], last["relay"], "middle")
        summary.update(proxima_us_per_token=u, relay_us_per_token=v)
        line += (
            f"; {lengths[-1]} tokens {ratios[lengths[-1]]:.2f}; "
            f"per-token CPU proxima {u:.1f} us vs relay {v:.1f} us"
        )
    print(line)


def ab_line(
    first: dict[str, ArmResult], last: dict[str, ArmResult], lengths: list[int], other: str
) -> None:
    """Proxima against the same proxy at another commit: CPU per request at each length and
    per token (negative: the working tree spends less)."""
    parts = []
    for arms in (first, last) if len(lengths) > 1 else (first,):
        new, old = arms["proxima"], arms[other]
        change = new.cpu_ms("middle") / old.cpu_ms("middle") - 1
        parts.append(
            f"{new.tokens} tokens {old.cpu_ms('middle'):.2f} -> {new.cpu_ms('middle'):.2f} ms "
            f"CPU/request ({change:+.0%}), req/s {new.throughput / old.throughput:.2f}x"
        )
    if len(lengths) > 1:
        u_old = per_token_us(first[other], last[other], "middle")
        u_new = per_token_us(first["proxima"], last["proxima"], "middle")
        assert u_old is not None and u_new is not None
        parts.append(f"per token {u_old:.1f} -> {u_new:.1f} us")
    print(f"A/B proxima vs {other}: " + "; ".join(parts))


def workers_line(results: dict[int, list[ArmResult]], many: str) -> dict[str, float]:
    """``proxima xN`` (N worker processes on one port) against the one process, at each
    length: req/s side by side and their ratio, and CPU per request (all workers and the
    parent together). Returns the ratios by length, for the raw results."""
    parts, ratios = [], {}
    for tokens in sorted(results):
        arms = {r.name: r for r in results[tokens]}
        one, n = arms["proxima"], arms[many]
        ratios[str(tokens)] = n.throughput / one.throughput
        parts.append(
            f"{tokens} tokens {n.throughput:.0f} vs {one.throughput:.0f} req/s "
            f"({n.throughput / one.throughput:.2f}x), CPU {n.cpu_ms('middle'):.2f} vs "
            f"{one.cpu_ms('middle'):.2f} ms/request"
        )
    print(f"workers: {many} vs one process: " + "; ".join(parts))
    return ratios
