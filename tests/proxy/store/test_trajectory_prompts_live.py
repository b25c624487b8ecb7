"""A trajectory read back holds exactly the prompts that were generated from.

``proxima serve`` in front of the fake SGLang server, which keeps every ``/generate``
body: one session plays a chat chain, ``n = 2`` branches, an edit of history, an
Anthropic Messages turn and a Responses turn continuing the same conversation, and
token-id completions extending it; ``GET /rl/sessions/{id}`` then returns, for every
completion, the very ids its backend request carried (the store keeps only what each
completion adds to its parent and rebuilds the rest), on SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store.database import create_engine
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model, build_tiny_tokenizer
from sqlalchemy import text


def _chat(proxy: LiveProxy, key: str, messages: list[dict[str, Any]], n: int = 1) -> list[str]:
    body = {"model": proxy.model_name, "messages": messages, "max_tokens": 6, "n": n}
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return [c["message"]["content"] for c in r.json()["choices"]]


async def test_every_recorded_prompt_is_the_generated_one(db_url: str, tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    script = tokenizer.encode("fine, next step. ", add_special_tokens=False)
    fake = FakeBackend(record_bodies=True, script=script, vocab_size=len(tokenizer))
    model = build_tiny_model(tmp_path / "tiny")
    with ThreadedServer(create_fake_app(fake)) as backend:
        proxy = LiveProxy(
            model, db_url=db_url, extra_args=["--backend", backend.url],
            log_path=tmp_path / "serve.log",
        )  # fmt: skip
        proxy.start()
        try:
            session = proxy.new_session()
            key, sid = session["api_key"], session["session_id"]
            auth = {"Authorization": f"Bearer {key}"}
            task = [
                {"role": "system", "content": "You fix bugs."},
                {"role": "user", "content": "Fix the test."},
            ]
            (a1,) = _chat(proxy, key, task)
            turn2 = [
                *task,
                {"role": "assistant", "content": a1},
                {"role": "user", "content": "out 1"},
            ]
            b0, b1 = _chat(proxy, key, turn2, n=2)  # two branches of one request
            turn3 = [
                *turn2,
                {"role": "assistant", "content": b1},
                {"role": "user", "content": "out 2"},
            ]
            (c1,) = _chat(proxy, key, turn3)  # continues the second branch
            edited = [*turn2[:-1], {"role": "user", "content": "out 1, edited"}]
            _chat(proxy, key, edited)  # an edit of history: extends the first turn only
            # The same conversation continued through Anthropic's Messages API ...
            anthropic = [{"role": m["role"], "content": m["content"]} for m in turn3[1:]] + [
                {"role": "assistant", "content": c1},
                {"role": "user", "content": "out 3"},
            ]
            r = httpx.post(
                proxy.base_url + "/messages",
                json={"model": proxy.model_name, "max_tokens": 6, "system": "You fix bugs.",
                      "messages": anthropic},
                headers=auth, timeout=60,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            d1 = "".join(block["text"] for block in r.json()["content"] if block["type"] == "text")
            # ... then through the Responses API, twice (the second by previous_response_id).
            responses_input = [
                *turn3,
                {"role": "assistant", "content": c1},
                {"role": "user", "content": "out 3"},
                {"role": "assistant", "content": d1},
                {"role": "user", "content": "out 4"},
            ]
            r = httpx.post(
                proxy.base_url + "/responses",
                json={"model": proxy.model_name, "input": responses_input,
                      "max_output_tokens": 16},
                headers=auth, timeout=60,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            r = httpx.post(
                proxy.base_url + "/responses",
                json={"model": proxy.model_name, "previous_response_id": r.json()["id"],
                      "input": "out 5", "max_output_tokens": 16},
                headers=auth, timeout=60,
            )  # fmt: skip
            assert r.status_code == 200, r.text
            # Token-id completions extending the latest turn, twice.
            for _ in range(2):
                last = proxy.trajectory(sid)["completions"][-1]
                prompt = [*last["prompt_ids"], *last["output_ids"], *tokenizer.encode("go on")]
                r = httpx.post(
                    proxy.base_url + "/completions",
                    json={"model": proxy.model_name, "prompt": prompt, "max_tokens": 6},
                    headers=auth, timeout=60,
                )  # fmt: skip
                assert r.status_code == 200, r.text
            trajectory = proxy.trajectory(sid)
        finally:
            proxy.stop()
    generated = {body["rid"].rsplit("-", 1)[0]: body["input_ids"] for body in fake.bodies}
    completions = trajectory["completions"]
    assert len(completions) == 10 == len(generated)
    for c in completions:
        assert c["prompt_ids"] == generated[c["id"]], c["id"]
    by_id = {c["id"]: c for c in completions}
    # Every turn after the first extended an earlier one, token-exactly.
    for c in completions[1:]:
        parent = by_id[c["parent_id"]]
        assert c["prompt_ids"][: len(parent["prompt_ids"])] == parent["prompt_ids"]
    assert [m["content"] for m in completions[4]["request_messages"]][-1] == "out 1, edited"
    assert completions[4]["parent_id"] == completions[0]["id"]
    # And the rows hold only what each turn added.
    engine = create_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    text("SELECT id, prompt_prefix, length(prompt_ids) FROM completions")
                )
            ).all()
    finally:
        await engine.dispose()
    stored = {cid: (prefix, size) for cid, prefix, size in rows}
    for c in completions[1:]:
        prefix, size = stored[c["id"]]
        assert prefix > 0 and size == 4 * (len(c["prompt_ids"]) - prefix)
