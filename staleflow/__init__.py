"""StaleFlow: staleness-aware rollout coordination for asynchronous RL post-training."""

__version__ = "0.1.0"
