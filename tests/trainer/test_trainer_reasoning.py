"""A thinking model's completions in training: reasoning tokens are generated tokens.

Hand-computed: a think-then-answer reply is in the loss token for token, the
reasoning included; a second turn whose template dropped the first turn's
reasoning starts its own sequence with the prompt it really had; a reply whose
reasoning a budget closed (forced tokens) is context only.
"""

from __future__ import annotations

import pytest
from proxima.proxy.store.records import CompletionRecord, SessionRecord
from proxima.proxy.testing.tiny_model import build_tiny_tokenizer
from proxima.trainer.config import AdvantageConfig
from proxima.trainer.samples import build_samples

from tests.trainer.records import completion_record, session_record

TOKENIZER = build_tiny_tokenizer(thinking=True)
Q1 = [{"role": "user", "content": "What is 1 plus 2?"}]
REPLY1 = "<think>\n1 plus 2 is 3.\n</think>\n\nThe answer is 3."


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _prompt(messages: list[dict[str, str]]) -> list[int]:
    return _ids(TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _completion(
    cid: str, prompt: list[int], output: list[int], *, minute: int, **sampling: object
) -> CompletionRecord:
    return completion_record(
        cid, prompt, output, minute=minute, version=2, sampling={"temperature": 1.0, **sampling}
    )


def _session(reward: float) -> SessionRecord:
    return session_record(reward=reward)


CFG = AdvantageConfig(discount=0.5, baseline="none", normalize_std=False)


def test_a_think_then_answer_reply_is_all_in_the_loss() -> None:
    prompt, output = _prompt(Q1), [*_ids(REPLY1), TOKENIZER.eos_token_id]
    think, end = TOKENIZER.convert_tokens_to_ids(["<think>", "</think>"])
    assert output[0] == think and end in output  # the markers are generated tokens too
    (sample,) = build_samples([(_session(1.0), [_completion("c1", prompt, output, minute=1)])], CFG)
    n_prompt, n_out = len(prompt), len(output)
    # Hand-computed: 1 (<think>) + 16 ("\n1 plus 2 is 3.\n", a byte a token) + 1 (</think>)
    # + 18 ("\n\nThe answer is 3.") + 1 (<|im_end|>) = 37 generated tokens.
    assert n_out == 37
    assert sample.input_ids == prompt + output
    assert sample.loss_mask == [0] * n_prompt + [1] * 37
    assert sample.num_loss_tokens == 37
    assert sample.behav_logprobs == pytest.approx([0.0] * n_prompt + [-0.5] * 37)
    assert sample.versions == [-1] * n_prompt + [2] * 37
    assert sample.advantages == pytest.approx([0.0] * n_prompt + [1.0] * 37)  # R = 1, no baseline


def test_a_turn_whose_template_dropped_the_reasoning_trains_with_its_own_prompt() -> None:
    """Turn 2's prompt is the template's (no turn-1 reasoning): it is its own sequence."""
    out1 = [*_ids(REPLY1), TOKENIZER.eos_token_id]
    turn2 = [*Q1, {"role": "assistant", "content": REPLY1}, {"role": "user", "content": "And 2?"}]
    prompt2 = _prompt(turn2)
    out2 = [*_ids("<think>\nR\n</think>\n\nA"), TOKENIZER.eos_token_id]
    assert prompt2[: len(_prompt(Q1)) + len(out1)] != _prompt(Q1) + out1  # not an extension
    completions = [
        _completion("c1", _prompt(Q1), out1, minute=1),
        _completion("c2", prompt2, out2, minute=2),
    ]
    samples = build_samples([(_session(2.0), completions)], CFG)
    assert [s.completion_ids for s in samples] == [("c1",), ("c2",)]
    first, second = samples
    # Rewards [0, 2]: G_2 = 2, G_1 = 0 + 0.5 * 2 = 1.
    assert first.advantages[-len(out1) :] == pytest.approx([1.0] * len(out1))
    assert second.input_ids == prompt2 + out2
    assert second.loss_mask == [0] * len(prompt2) + [1] * len(out2)
    assert second.advantages[-len(out2) :] == pytest.approx([2.0] * len(out2))


def test_a_reply_whose_reasoning_a_budget_closed_is_context() -> None:
    output = [*_ids("<think>\n1 \n</think>\n\nThe answer."), TOKENIZER.eos_token_id]
    forced = _completion("c1", _prompt(Q1), output, minute=1, logit_transforms=["reasoning_budget"])
    assert build_samples([(_session(1.0), [forced])], CFG) == []  # no loss token: no sample
    plain = _completion("c1", _prompt(Q1), output, minute=1)
    (sample,) = build_samples([(_session(1.0), [plain])], CFG)
    assert sample.num_loss_tokens == len(output)
