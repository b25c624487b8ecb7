"""``proxima train`` and ``proxima eval``: the run config, the demo model, the processes a
run starts, evaluation and plots."""
