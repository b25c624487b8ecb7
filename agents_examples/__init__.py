"""Example agents, written the way users write them: no Proxima imports.

Each module exposes ``run_agent_return_reward(data)`` for the rollout
controller (``trainer/rollout/controller.py``) and runs standalone
(``python -m proxima.agents_examples.math_agent --base-url URL --api-key K --model M``).

- :mod:`proxima.agents_examples.math_agent`: multi-turn math on the OpenAI SDK.
- :mod:`proxima.agents_examples.tool_agent`: LangGraph + LangChain ``ChatOpenAI`` with a calculator tool.
- :mod:`proxima.agents_examples.httpx_agent`: one chat completion over plain httpx.
- :mod:`proxima.agents_examples.harness_agent`: a real harness binary (mini-swe-agent, Codex CLI)
  run as a subprocess on a shell task, scored by a verifier.
- :mod:`proxima.agents_examples.datasets`: seeded arithmetic datasets (JSONL) for them.
"""
