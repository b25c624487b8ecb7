"""The rollout controller: runs the user's agent over a dataset, one RL session per run,
and reports each run's reward to the proxy."""
