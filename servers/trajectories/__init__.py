"""The trajectory server (TS): the data plane between the dataset, rollout instances, the reward
function, the staleness manager and the trainer (paper §3 Figure 6, §5.1).

``staleflow.config.trajectories`` holds the settings, ``rewards`` the reward functions, ``wire`` the request models,
``store`` the durable trajectory and group records, ``service`` the server's logic over the store,
``app`` the endpoints.
"""

from staleflow.config import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories.app import create_app
from staleflow.servers.trajectories.rewards import RewardFn, http_reward, local_math_reward, make_reward, sim_reward
from staleflow.servers.trajectories.service import TrajectoryServer

__all__ = [
    "RewardFn",
    "SamplingConfig",
    "TrajectoryServer",
    "TrajectoryServerConfig",
    "create_app",
    "http_reward",
    "local_math_reward",
    "make_reward",
    "sim_reward",
]
