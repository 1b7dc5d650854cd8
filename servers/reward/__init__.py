"""The reward server: verifiable rule-based rewards on CPU, off the rollout path (paper Figure 6).

``config`` holds the settings, ``app`` the endpoints (``create_app(config)``); its wire models and
client (``RewardClient``) are ``staleflow.api.reward``; the verifiers themselves live in the library, ``staleflow.rewards``.
"""

from staleflow.api.reward import RewardClient
from staleflow.servers.reward.app import create_app
from staleflow.servers.reward.config import RewardConfig

__all__ = ["RewardClient", "RewardConfig", "create_app"]
