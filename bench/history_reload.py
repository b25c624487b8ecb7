"""What a worker spends catching up on a session another worker added a turn to.

Workers of ``proxima serve --workers N`` (and replicas on PostgreSQL) check a session's
completion count before each turn; when another process recorded a turn, the cached history
is behind. It used to be read again whole (``Store.list_completions``); now the session's
ids are read in order and only the rows the worker does not hold are read whole and built
(``Store.list_completions_since``). An agent's session that alternates between workers pays
this every turn, so the whole read made a session of n turns cost O(n^2) rows decoded.

This records one session of ``--turns`` completions (each a chained turn whose prompt
extends the last: ``--prompt-tokens`` new prompt tokens and ``--output-tokens`` per turn,
stored as prefixes, as the proxy stores them) in a SQLite store, then times the two reads of
a worker that holds all but the last turn, alternately, and prints the process CPU per read.

    .venv/bin/python bench/history_reload.py
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from proxima.proxy.store import Store, migrate
from proxima.proxy.store.records import CompletionRecord


def _turns(
    session_id: str, turns: int, prompt_tokens: int, output_tokens: int
) -> list[CompletionRecord]:
    out: list[CompletionRecord] = []
    start = datetime(2026, 1, 1, tzinfo=UTC)
    prompt: list[int] = []
    messages: list[dict[str, object]] = []
    parent: CompletionRecord | None = None
    for turn in range(turns):
        prompt = [*prompt, *(parent.output_ids if parent else []), *range(prompt_tokens)]
        reply = {"role": "assistant", "content": f"reply {turn}"}
        messages = [*messages, *([parent.response_message] if parent else []),
                    {"role": "user", "content": f"tool output {turn}"}]  # fmt: skip
        record = CompletionRecord(
            id=f"cmpl-{turn:06d}",
            session_id=session_id,
            parent_id=parent.id if parent else None,
            prompt_ids=prompt,
            output_ids=[turn % 1000] * output_tokens,
            output_logprobs=[-0.5] * output_tokens,
            output_versions=[1] * output_tokens,
            finish_reason="stop",
            created_at=start + timedelta(seconds=turn),
            request_messages=list(messages),
            response_message=reply,
            response_text=str(reply["content"]),
        )
        out.append(record)
        parent = record
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=200, help="new prompt tokens per turn")
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--reads", type=int, default=20, help="reads of each kind, alternated")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'store.db'}"
        await migrate.upgrade_async(url)
        store = await Store.open(url, shared=True)
        try:
            session = await store.create_session(api_key_hash="0" * 64)
            recorded = _turns(session.id, args.turns, args.prompt_tokens, args.output_tokens)
            for i, record in enumerate(recorded):
                parents = {recorded[i - 1].id: recorded[i - 1]} if i else None
                await store.record_completions(completions=[record], parents=parents)
            held = recorded[:-1]

            async def whole() -> list[CompletionRecord] | None:
                return await store.list_completions(session_id=session.id)

            async def since() -> list[CompletionRecord] | None:
                return await store.list_completions_since(session_id=session.id, known=held)

            assert await whole() == await since() == recorded
            cpu = {"whole": 0.0, "since": 0.0}
            for _ in range(args.reads):
                for name, read in (("whole", whole), ("since", since)):
                    t = time.process_time()
                    await read()
                    cpu[name] += time.process_time() - t
        finally:
            await store.close()
    w, s = (1000 * cpu[k] / args.reads for k in ("whole", "since"))
    tokens = args.prompt_tokens + args.output_tokens
    print(
        f"history reload: {args.turns} turns (+{tokens} tokens each), {args.turns - 1} held: "
        f"whole {w:.2f} ms, since {s:.2f} ms CPU per read ({w / s:.1f}x)"
    )


if __name__ == "__main__":
    asyncio.run(main())
