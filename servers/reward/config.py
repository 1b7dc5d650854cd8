"""The reward server's settings: its section of the config tree (``staleflow.config.reward``)."""

from staleflow.config.reward import RewardConfig, RewardSettings

__all__ = ["RewardConfig", "RewardSettings"]
