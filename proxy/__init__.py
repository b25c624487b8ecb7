"""Proxima proxy: an OpenAI-compatible server that records RL trajectories."""

__version__ = "0.1.0"
