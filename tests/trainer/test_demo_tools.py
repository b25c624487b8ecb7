"""``make demo-tools``: the tool demo agent's report, the evaluation's extra metrics and tool
line, and the demo-tools config run end to end on the tiny model: its warm start (recorded runs,
supervised steps, a pushed version, the evaluation after it), then one PPO step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from proxima.agents_examples.tool_demo_agent import score, well_formed
from proxima.trainer.config import load_raw_config
from proxima.trainer.pipeline.evaluation import Accuracy, Score, _metrics, tool_line
from proxima.trainer.pipeline.policies import Policy

ROOT = Path(__file__).resolve().parents[2]


def _call(expression: Any, name: str = "calculator") -> AIMessage:
    return AIMessage("", tool_calls=[{"name": name, "args": {"expression": expression}, "id": "1"}])


def test_well_formed_calls_name_the_calculator_with_a_string_expression() -> None:
    assert well_formed(_call("384 * 27"))
    assert not well_formed(_call(384))  # not a string
    assert not well_formed(_call("1 + 1", name="search"))
    assert not well_formed(AIMessage("10368"))  # an answer, no call
    assert not well_formed(None)


def test_score_first_try_needs_a_well_formed_first_call_and_the_right_answer() -> None:
    q = HumanMessage("What is 384 * 27?")
    tool = ToolMessage("10368", tool_call_id="1")
    used = score([q, _call("384 * 27"), tool, AIMessage("The answer is 10368.")], 10368)
    assert used == {"final": 1.0, "first_try": 1.0, "well_formed": 1.0, "turns": 2.0}
    wrong = score([q, _call("384 * 72"), tool, AIMessage("27648")], 10368)
    assert wrong == {"final": 0.0, "first_try": 0.0, "well_formed": 1.0, "turns": 2.0}
    guessed = score([q, AIMessage("10368")], 10368)  # right without the tool: not first try
    assert guessed == {"final": 1.0, "first_try": 0.0, "well_formed": 0.0, "turns": 1.0}
    assert score([q], 10368)["turns"] == 0.0


def test_metrics_are_means_of_numbers_every_item_reports() -> None:
    results = [
        {"final": 1.0, "first_try": 1.0, "well_formed": 1.0, "turns": 2.0, "note": "x"},
        {"final": 0.0, "first_try": 0.0, "well_formed": 0.0, "turns": 1.0},
    ]
    assert _metrics(results) == {"turns": 1.5, "well_formed": 0.5}
    assert _metrics([*results, 1.0]) == {}  # a plain float reports nothing else
    assert _metrics([{"final": 1.0, "ok": True}]) == {}  # a bool is not a number here


def test_tool_line_ends_with_first_try_and_well_formed_rates() -> None:
    policy = Policy(adapter=None, agent="a:b", items=None, fields={})  # type: ignore[arg-type]
    before = Accuracy(Score(0.1, 0.05, metrics={"well_formed": 0.2, "turns": 1.2}), None)
    after = Accuracy(Score(0.5, 0.45, metrics={"well_formed": 0.95, "turns": 2.0}), None)
    assert tool_line(policy, before, after) == (
        "tool agent: mean turns 1.20 -> 2.00\n"
        "tool agent: first-try accuracy 5.0% -> 45.0%; well-formed tool calls 20.0% -> 95.0%"
    )
    assert tool_line(policy, Accuracy(Score(0.1), None), after) is None


def test_demo_tools_config_warm_starts_then_trains_one_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = load_raw_config(ROOT / "agents_examples" / "tools_demo.toml")
    assert config["proxy"]["tool_fallback"] == "hermes"
    assert config["data"]["difficulty"] == "tool"
    assert config["warm_start"]["item_fields"] == {"first_tool_choice": "required"}
    out = tmp_path / "run"
    config.update(steps=1, output_dir=str(out))
    config["model"] = {"path": str(tiny_model_dir)}
    config["proxy"]["engines"] = 1
    config["data"].update(train_items=8, test_items=2)
    config["rollout"].update(group_size=2, max_concurrency=4, timeout_s=60)
    config["rollout"]["item_fields"].update(max_tokens=8, max_steps=2)
    config["eval"]["items"] = 2
    config["trainer"]["batch_size"] = 2
    # The random tiny model earns no reward: step anyway (the default would wait for signal).
    config["trainer"]["advantage"]["zero_signal"] = "keep"
    # Every warm-start run kept (the random model is never right): the supervised steps run.
    config["warm_start"].update(sessions=2, steps=2, min_reward=0.0)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    cli = [sys.executable, "-m", "proxima.cli", "--log-format", "text", "--log-level", "warning"]
    proc = subprocess.run(
        [*cli, "train", "--config", str(path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert (
        last.startswith("tool agent: first-try accuracy ") and "; well-formed tool calls " in last
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1
    warm = json.loads((out / "warm_start.json").read_text())
    assert (warm["runs"], warm["kept"], warm["version"]) == (2, 2, 1)
    assert len(warm["losses"]) == 2 and all(loss > 0 for loss in warm["losses"])
    assert 0 <= warm["after"]["well_formed"] <= 1
    assert "warm start: 2 of 2 runs kept, 2 supervised steps (loss " in proc.stdout
    log = [
        json.loads(line) for line in (out / "trainer" / "train_log.jsonl").read_text().splitlines()
    ]
    steps = [r for r in log if r.get("event", "step") == "step"]
    assert [r["version"] for r in steps] == [2]  # PPO started from the warm start's version
    for when in ("before", "after"):
        test = summary["scores"][when]["test"]
        assert 0 <= test["well_formed"] <= 1 and test["turns"] >= 1
    assert last.endswith(
        f"{summary['scores']['before']['test']['well_formed']:.1%} -> "
        f"{summary['scores']['after']['test']['well_formed']:.1%}"
    )


def test_first_turn_forced_until_a_tool_result_is_in_the_state() -> None:
    from langchain_openai import ChatOpenAI
    from proxima.agents_examples.tool_demo_agent import _first_turn_forced
    from pydantic import SecretStr

    llm = ChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key=SecretStr("k"))
    select = _first_turn_forced(llm)
    q = HumanMessage("What is 384 * 27?")
    first = select({"messages": [q]}, None)
    later = select({"messages": [q, _call("384 * 27"), ToolMessage("1", tool_call_id="1")]}, None)
    assert first.kwargs["tool_choice"] == "required"  # type: ignore[attr-defined]
    assert first.kwargs["parallel_tool_calls"] is False  # type: ignore[attr-defined]
    assert "tool_choice" not in later.kwargs  # type: ignore[attr-defined]


class _AlwaysCalls(GenericFakeChatModel):
    """A chat model that answers every turn with the same calculator call."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


def test_a_run_stopped_at_the_step_limit_scores_zero_with_its_turns() -> None:
    """``max_steps`` model calls, each a call: the result of the first is never answered.
    Reward 0, no first try, and the report keeps the turns taken and the well-formed first
    call (no crash, not an empty run)."""
    import asyncio
    import itertools

    from proxima.agents_examples.tool_demo_agent import run_react

    calls = (_call("384 * 27") for _ in itertools.count())
    data = {"question": "What is 384 * 27?", "answer": 384 * 27, "max_steps": 2}
    report, messages = asyncio.run(run_react(_AlwaysCalls(messages=calls), data))
    assert report == {"final": 0.0, "first_try": 0.0, "well_formed": 1.0, "turns": 2.0}
    # The tool's result came back; the second reply, a call again, was LangGraph's step-limit
    # stop (no call run, no number in it), not an answer.
    assert [m.content for m in messages if isinstance(m, ToolMessage)] == ["10368"]
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
    assert "10368" not in str(messages[-1].content)
