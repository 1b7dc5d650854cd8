"""The reward server: verifiable rule-based rewards on CPU, off the rollout path (paper Figure 6).

``staleflow.config.reward`` holds the settings, ``app`` the endpoints (``create_app(config)``); its wire models and
client (``RewardClient``) are ``staleflow.api.reward``; the verifiers themselves live in the library, ``staleflow.rewards``.
"""

from staleflow.api.reward import RewardClient
from staleflow.config import RewardConfig
from staleflow.servers.reward.app import create_app

__all__ = ["RewardClient", "RewardConfig", "create_app"]
