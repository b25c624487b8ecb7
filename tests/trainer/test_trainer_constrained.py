"""Grammar-constrained completions: the masked logprob by hand, the replay, and the engine.

The hand table uses logits ``z = log [1, 2, 3, 4]``, so ``softmax(z) = [0.1, 0.2, 0.3, 0.4]``
and every masked, tempered distribution is a ratio of small integers (or their powers).
Tolerances: float32 logs and sums of O(1) values round to ~1e-7 and another summation order
moves them by a few of those; 1e-5 is ~100x that, while a missing renormalisation moves a
value by ``log Z``, 0.1 or more here. The engine check
compares float32 computations of one model by two code paths (a batched KV-cached decode
and a packed forward): 1e-4, as the trainer's live fidelity test.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xgrammar as xgr
from proxima.proxy.embedded.app import create_engine_app
from proxima.proxy.rendering.structured import Grammar, output_grammar
from proxima.proxy.store.records import CompletionRecord, SessionKind, SessionRecord, SessionStatus
from proxima.proxy.tools import ToolChoice
from proxima.trainer.backends import build_backend
from proxima.trainer.batching import pack
from proxima.trainer.config import AdvantageConfig, TrainerConfig
from proxima.trainer.constrained import (
    GrammarMask,
    GrammarReplay,
    masked_token_logprobs,
    replayable,
    unpack_bitmask,
)
from proxima.trainer.samples import Sample, build_samples
from transformers import AutoTokenizer

LOG = math.log
T0 = datetime(2026, 1, 1, tzinfo=UTC)
Z = torch.tensor([LOG(1.0), LOG(2.0), LOG(3.0), LOG(4.0)])  # softmax: 0.1 0.2 0.3 0.4
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
SCHEMA = {
    "type": "object",
    "properties": {"sure": {"type": "boolean"}, "unit": {"enum": ["cm", "m"]}},
    "required": ["sure", "unit"],
    "additionalProperties": False,
}

# allowed tokens, temperature, target -> log q(y | s) by hand
HAND_TABLE = [
    ({0, 1, 2, 3}, 1.0, 3, LOG(0.4)),  # nothing masked: the plain log-softmax
    ({1, 3}, 1.0, 3, LOG(0.4 / 0.6)),  # Z = 0.2 + 0.4
    ({1, 3}, 1.0, 1, LOG(0.2 / 0.6)),
    ({1, 3}, 0.5, 3, LOG(16 / 20)),  # T = 0.5 squares the odds: 4^2 / (2^2 + 4^2)
    ({0, 1, 2}, 2.0, 0, -LOG(1 + math.sqrt(2) + math.sqrt(3))),  # T = 2: square roots
    ({2}, 1.0, 2, 0.0),  # a forced token: probability 1 under every weight
    ({0, 1}, 1.0, 3, -math.inf),  # a target the mask forbids
]


def _allowed(tokens: set[int]) -> torch.Tensor:
    return torch.tensor([[v in tokens for v in range(4)]])  # (1, V)


@pytest.mark.parametrize(("allowed", "temperature", "target", "expected"), HAND_TABLE)
def test_hand_computed_masked_logprobs(
    allowed: set[int], temperature: float, target: int, expected: float
) -> None:
    value = masked_token_logprobs(
        Z[None], torch.tensor([target]), torch.tensor([temperature]), _allowed(allowed)
    )
    if math.isinf(expected):
        assert value.item() == -math.inf
    else:
        assert value.item() == pytest.approx(expected, abs=1e-5)


def test_importance_weight_is_one_on_the_masked_distribution_and_z_off_it() -> None:
    # The engine reports b = log q = log(0.4 / 0.6) for token 3 under the mask {1, 3}. The
    # trainer's masked p equals it at the same weights (w = 1); the plain log-softmax
    # log 0.4 would give w = exp(p - b) = Z = 0.6 on every such token.
    behaviour = LOG(0.4 / 0.6)
    masked = masked_token_logprobs(Z[None], torch.tensor([3]), torch.ones(1), _allowed({1, 3}))
    plain = torch.log_softmax(Z, dim=-1)[3]
    assert math.exp(masked.item() - behaviour) == pytest.approx(1.0, abs=1e-5)
    assert math.exp(plain.item() - behaviour) == pytest.approx(0.6, abs=1e-5)


@pytest.mark.parametrize(
    ("allowed", "temperature", "target", "expected_grad"),
    [
        # d log q(y) / dz = (onehot(y) - q) / T on the allowed tokens, 0 elsewhere
        ({1, 3}, 1.0, 3, [0.0, -1 / 3, 0.0, 1 / 3]),
        ({1, 3}, 0.5, 3, [0.0, -0.2 / 0.5, 0.0, 0.2 / 0.5]),
        ({2}, 1.0, 2, [0.0, 0.0, 0.0, 0.0]),  # forced: no gradient
    ],
)
def test_hand_computed_gradient_flows_only_through_allowed_logits(
    allowed: set[int], temperature: float, target: int, expected_grad: list[float]
) -> None:
    logits = Z.clone()[None].requires_grad_()
    value = masked_token_logprobs(
        logits, torch.tensor([target]), torch.tensor([temperature]), _allowed(allowed)
    )
    value.sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad[0], torch.tensor(expected_grad), atol=1e-5, rtol=0)


def test_unpacked_bitmask_is_the_mask_xgrammar_applies() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=generator)
    logits = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    torch.testing.assert_close(unpack_bitmask(bitmask, vocab), logits == 0)


# --------------------------------------------------------------------------- records, samples


def _session() -> SessionRecord:
    return SessionRecord(
        id="s",
        kind=SessionKind.TRAIN,
        status=SessionStatus.CLAIMED,
        group_id=None,
        data_id=None,
        metadata={},
        reward=1.0,
        created_at=T0,
    )


def _record(
    prompt: list[int],
    output: list[int],
    logprobs: list[float],
    *,
    temperature: float = 1.0,
    grammar: Grammar | None = None,
    transforms: list[str] | None = None,
    rules: str = "proxima-engine",
) -> CompletionRecord:
    sampling: dict[str, Any] = {"temperature": temperature}
    if grammar is not None:
        sampling["logit_transforms"] = [f"grammar:{grammar.kind}"]
    if transforms is not None:
        sampling["logit_transforms"] = transforms
    return CompletionRecord(
        id="c",
        session_id="s",
        parent_id=None,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs,
        output_versions=[0] * len(output),
        finish_reason="stop",
        created_at=T0 + timedelta(minutes=1),
        sampling=sampling,
        grammar=None if grammar is None else {**grammar.record("proxima-engine"), "rules": rules},
    )


REGEX = Grammar("regex", "(yes|no)")


@pytest.mark.parametrize(
    ("transforms", "with_grammar", "constrained", "trained"),
    [
        (None, True, True, True),  # a grammar alone, recorded: loss tokens
        (None, True, False, False),  # the backend cannot mask (megatron): context
        (["grammar:regex", "logit_bias"], True, True, False),  # a bias too: context
        (["grammar:regex"], False, True, False),  # recorded before 0009: no grammar, context
    ],
)
def test_which_constrained_completions_train(
    transforms: list[str] | None, with_grammar: bool, constrained: bool, trained: bool
) -> None:
    record = _record([1, 2], [3, 4], [-0.1, -0.2], grammar=REGEX, transforms=transforms)
    if not with_grammar:
        record = dataclasses.replace(record, grammar=None)
    samples = build_samples([(_session(), [record])], AdvantageConfig(), constrained=constrained)
    assert replayable(record) is (with_grammar and transforms is None)
    if trained:
        (sample,) = samples
        assert sample.loss_mask == [0, 0, 1, 1]
        assert [(s.start, s.end) for s in sample.constraints] == [(2, 4)]
    else:
        assert samples == []


def test_pack_places_each_mask_on_the_position_that_predicts_its_token() -> None:
    def sample(n: int, mask: GrammarMask | None) -> Sample:
        return Sample(
            session_id="s",
            group_id="g",
            input_ids=list(range(n)),
            loss_mask=[0] + [1] * (n - 1),
            behav_logprobs=[0.0] * n,
            versions=[0] * n,
            advantages=[1.0] * n,
            temperature=1.0,
            grammar_mask=mask,
        )

    rows = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    packed = pack([sample(4, None), sample(6, GrammarMask((3, 4), rows))])
    # the second sequence starts at 4; its token j is predicted at 4 + j - 1
    assert packed.grammar_positions is not None and packed.grammar_bitmask is not None
    assert packed.grammar_positions.tolist() == [6, 7]
    torch.testing.assert_close(packed.grammar_bitmask, rows)


def test_replay_allows_each_recorded_token_and_refuses_a_foreign_one(tiny_model_dir: Path) -> None:
    replay = GrammarReplay(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # the engine's stops: config, generation config and tokenizer; SGLang's: the two configs
    assert replay.eos_token_ids == replay.sglang_eos_token_ids == {end, endoftext}
    grammar = REGEX.record("proxima-engine")
    tokens = [*tokenizer.encode("no"), end]
    bitmask = replay.bitmask(grammar, tokens)
    assert bitmask is not None and bitmask.shape[0] == len(tokens)
    allowed = unpack_bitmask(bitmask, replay.vocab_size)
    assert allowed[0].nonzero().squeeze(-1).tolist() == sorted(tokenizer.encode("ny"))
    assert allowed[1].nonzero().squeeze(-1).tolist() == tokenizer.encode("o")
    assert end in allowed[2].nonzero().squeeze(-1).tolist()  # complete: only the stops
    assert not allowed[2, tokenizer.encode("x")[0]]
    assert replay.bitmask(grammar, tokenizer.encode("maybe")) is None
    # a span that does not replay leaves the loss; the sample keeps its other tokens
    bad = _record([1, 2], tokenizer.encode("maybe"), [-0.1] * 5, grammar=REGEX)
    (sample,) = build_samples([(_session(), [bad])], AdvantageConfig(), constrained=True)
    assert replay.attach([sample]) == []


def test_the_record_names_whose_mask_to_replay(tiny_model_dir: Path) -> None:
    # The engine writes JSON with tojson's whitespace only; SGLang's backend (default flags)
    # allows any whitespace. After '{' the engine's mask holds the quote alone, SGLang's also
    # blanks: the same tokens replay under both, with different masks (so different log q).
    replay = GrammarReplay(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    tokens = tokenizer.encode('{"sure": true, "unit": "m"}')
    masks = {}
    for rules in ("proxima-engine", "sglang"):
        bitmask = replay.bitmask({**grammar.record("proxima-engine"), "rules": rules}, tokens)
        assert bitmask is not None, rules
        masks[rules] = unpack_bitmask(bitmask, replay.vocab_size)
    quote, blank, newline = (tokenizer.encode(c)[0] for c in ('"', " ", "\n"))
    assert masks["proxima-engine"][1].nonzero().squeeze(-1).tolist() == [quote]
    assert masks["sglang"][1][[quote, blank, newline]].tolist() == [True, True, True]


# --------------------------------------------------------------------------- the engine


async def _engine_replies(
    model_dir: Path, prompt: list[int], grammar: Grammar, temperatures: list[float]
) -> AsyncIterator[dict[str, Any]]:
    app = create_engine_app(model_dir, num_threads=1)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e", timeout=60) as c:
            for seed, temperature in enumerate(temperatures):
                params = {"temperature": temperature, "max_new_tokens": 80, "sampling_seed": seed}
                body = {"input_ids": prompt, "return_logprob": True}
                reply = await c.post(
                    "/generate",
                    json={**body, "sampling_params": {**params, **grammar.sampling_fields()}},
                )
                assert reply.status_code == 200, reply.text
                yield {"temperature": temperature, **reply.json()}


@pytest.mark.parametrize(
    "grammar",
    [
        output_grammar(
            response_format=None,
            tool_choice=ToolChoice("required"),
            tools=[WEATHER_TOOL],
            tool_parser="hermes",
        ),
        output_grammar(
            response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            tool_choice=ToolChoice("auto"),
            tools=None,
            tool_parser="hermes",
        ),
    ],
    ids=["forced_tool_call", "json_schema"],
)
async def test_trainer_masked_logprobs_equal_the_engine_sampled_ones(
    tiny_model_dir: Path, grammar: Grammar | None
) -> None:
    assert grammar is not None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.encode("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")
    backend = build_backend(TrainerConfig(), tiny_model_dir)
    replay = GrammarReplay(tiny_model_dir)
    async for reply in _engine_replies(tiny_model_dir, prompt, grammar, [1.0, 0.7, 0.0]):
        behaviour = [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
        record = _record(
            prompt,
            reply["output_ids"],
            behaviour,
            temperature=reply["temperature"],
            grammar=grammar,
        )
        (sample,) = build_samples([(_session(), [record])], AdvantageConfig(), constrained=True)
        (masked_sample,) = replay.attach([sample])
        n = len(prompt)
        masked = backend.compute_logprobs([masked_sample])[0][n:]
        plain = backend.compute_logprobs([dataclasses.replace(sample, constraints=())])[0][n:]
        worst = max(abs(m - b) for m, b in zip(masked, behaviour, strict=True))
        assert worst < 1e-4, (reply["temperature"], worst)
        # the plain log-softmax is far off: the grammar's mask carries real mass
        assert max(abs(p - b) for p, b in zip(plain, behaviour, strict=True)) > 0.5
