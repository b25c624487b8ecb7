"""A forced tool call trains: through ``proxima serve`` (embedded engine, tiny model) and a
trainer step, its tokens are loss tokens with importance weight 1 at staleness 0.

Tolerance 1e-4 per token, as the trainer's other live fidelity test: the engine's batched,
KV-cached decode and the trainer's packed forward agree to ~1e-6 in float32.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from openai import OpenAI
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.testing.live import LiveProxy
from proxima.trainer.backends import build_backend
from proxima.trainer.batch_claims import trainable_samples
from proxima.trainer.config import TrainerConfig
from proxima.trainer.constrained import GrammarReplay
from proxima.trainer.loop import Trainer
from proxima.trainer.weights import ProxyWeightSink

from tests.trainer.test_trainer_live import trainer_config

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def forced_call_session(proxy: LiveProxy, *, reward: float, seed: int) -> str:
    """One agent run: a ``tool_choice: required`` chat completion, rewarded and finished."""
    session = proxy.new_session(group_id="forced")
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    reply = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=80,
        seed=seed,
    )
    assert reply.choices[0].message.tool_calls or reply.choices[0].finish_reason == "length"
    sid, key = session["session_id"], {"Authorization": f"Bearer {session['api_key']}"}
    httpx.post(
        f"{proxy.url}/rl/sessions/{sid}/reward", json={"reward": reward}, headers=key
    ).raise_for_status()
    httpx.post(f"{proxy.url}/rl/sessions/{sid}/finish", headers=key).raise_for_status()
    return sid


async def test_forced_tool_call_tokens_are_loss_tokens_with_weight_one(
    proxy: LiveProxy, tmp_path: Path
) -> None:
    ids = [forced_call_session(proxy, reward=float(i), seed=i) for i in range(2)]
    cfg = TrainerConfig.model_validate(trainer_config(proxy, tmp_path, batch_size=2))
    store = await Store.open(proxy.db_url)
    try:
        batch = []
        for sid in ids:
            session = await store.get_session(session_id=sid)
            assert session is not None
            batch.append((session, await store.list_completions(session_id=sid)))
        completions = [c for _, cs in batch for c in cs]
        assert [c.grammar["kind"] if c.grammar else None for c in completions] == [
            "structural_tag",
            "structural_tag",
        ]
        generated = sum(len(c.output_ids) for c in completions)

        # What the step trains, at version 0: every generated token is a loss token, and
        # the trainer's masked logprobs are the engine's (w = exp(p - b) = 1).
        samples, removed, _ = trainable_samples(batch, 0, cfg, None)
        assert removed == 0
        samples = GrammarReplay(proxy.model_dir).attach(samples)
        assert sum(s.num_loss_tokens for s in samples) == generated
        backend = build_backend(cfg, proxy.model_dir)
        for sample, prox in zip(samples, backend.compute_logprobs(samples), strict=True):
            for i, trained in enumerate(sample.loss_mask):
                if trained:
                    assert abs(prox[i] - sample.behav_logprobs[i]) < 1e-4, i

        # The live step: the same tokens train, with importance weight 1.
        sink = ProxyWeightSink(proxy.url, admin_token=proxy.admin_token)
        trainer = await Trainer.start(cfg, store=store, sink=sink, console=False)
        try:
            record = await trainer.step()
        finally:
            await trainer.close()
            await sink.aclose()
        assert record is not None and record.pushed and record.version == 1
        assert record.loss_tokens == generated
        assert abs(record.ppo["importance_weight_mean"] - 1.0) < 1e-4
        assert abs(record.ppo["importance_weight_max"] - 1.0) < 1e-4
        for sid in ids:
            session = await store.get_session(session_id=sid)
            assert session is not None and session.status == SessionStatus.TRAINED
    finally:
        await store.close()
