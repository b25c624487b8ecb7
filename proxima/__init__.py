"""Proxima: train unmodified LLM agents with asynchronous RL through an OpenAI-compatible proxy.

One namespace for the whole project; the repository's top-level folders are its subpackages:

- ``proxima.proxy``: the OpenAI/Anthropic-compatible server that records trajectories.
- ``proxima.trainer``: the background trainer (decoupled PPO) and the rollout controller.
- ``proxima.agents_examples``: unmodified example agents.
- ``proxima.migrations``: Alembic migrations of the trajectory store.
- ``proxima.cli``: the ``proxima`` command, the only module that sees both proxy and trainer.
"""

__version__ = "0.1.0"
