"""Rollout coordination strategies (paper §5.3, Appendix D): pure decisions, no I/O. Their settings
(``StrategyConfig`` and the routing, sync and migration modes) are in ``staleflow.config.strategy``."""

from staleflow.strategies.migration import plan_migrations
from staleflow.strategies.plan import CyclePlan, plan_cycle
from staleflow.strategies.repack import KvReadings, RepackMove, plan_repack
from staleflow.strategies.routing import RouteDecision, route
from staleflow.strategies.speculative import SpeculativeState
from staleflow.strategies.speed import DecodeSpeeds
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory
from staleflow.strategies.sync import plan_syncs

__all__ = [
    "AdmissionBudget", "CyclePlan", "DecodeSpeeds", "InstanceState", "KvReadings", "PendingTrajectory", "RepackMove",
    "RouteDecision", "SpeculativeState", "plan_cycle", "plan_migrations", "plan_repack", "plan_syncs", "route",
]
