"""The trajectory server's settings live with the others (``staleflow.config.trajectories``)."""

from staleflow.config.trajectories import SamplingConfig, TaskConfig, TrajectoryServerConfig, TrajectorySettings

__all__ = ["SamplingConfig", "TaskConfig", "TrajectoryServerConfig", "TrajectorySettings"]
