"""Proxima's background trainer.

The pure, testable core lives in small modules:

- ``config``: typed configuration (PPO, advantages, batching, optimiser).
- ``samples``: sessions -> packed training sequences, discounted returns and
  group-relative advantages, staleness filtering.
- ``loss``: decoupled PPO (AReaL eq. 5) as a pure function of tensors.
- ``batching``: dynamic micro-batching (AReaL algorithm 1) and sequence packing.
- ``logprobs``: per-token logprobs of a packed micro-batch through an HF model.
"""
