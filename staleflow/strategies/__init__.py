"""Rollout coordination strategies (paper §5.3, Appendix D): pure decisions, no I/O."""

from staleflow.strategies.migration import plan_migrations
from staleflow.strategies.plan import CyclePlan, plan_cycle
from staleflow.strategies.routing import RouteDecision, route
from staleflow.strategies.speculative import SpeculativeState
from staleflow.strategies.state import (
    AdmissionBudget,
    InstanceState,
    MigrationMode,
    PendingTrajectory,
    RoutingMode,
    StrategyConfig,
    SyncMode,
)
from staleflow.strategies.sync import plan_syncs

__all__ = [
    "AdmissionBudget", "CyclePlan", "InstanceState", "MigrationMode", "PendingTrajectory", "RouteDecision",
    "RoutingMode", "SpeculativeState", "StrategyConfig", "SyncMode", "plan_cycle", "plan_migrations", "plan_syncs",
    "route",
]
