"""The coordinator's settings: its strategy (``StrategyConfig``, declared once, in
``staleflow.config.strategy``), its timeouts, its cost model and where the other services are."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from staleflow.config.calibration import CalibrationRef
from staleflow.config.common import HttpUrl, ServiceConfig
from staleflow.config.cost import CostCoefficients
from staleflow.config.manager import MANAGER_URL
from staleflow.config.strategy import StrategyConfig
from staleflow.strict import StrictModel

INSTANCE_ID = r"^[A-Za-z0-9._:@+\-]{1,200}$"

STRATEGY_FIELDS = frozenset(StrategyConfig.__dataclass_fields__)
"""The strategy's settings, also accepted flat (``routing: vanilla`` for ``strategy: {routing: vanilla}``)."""


def strategy_inline(data: Any) -> Any:
    """For a ``mode="before"`` validator: flat strategy settings (``routing``, ``mu``, ...) move into
    ``strategy``; a flat one wins over the same one in ``strategy`` (a flag over a file)."""
    if not isinstance(data, dict) or not STRATEGY_FIELDS & data.keys():
        return data
    flat = {k: data[k] for k in STRATEGY_FIELDS & data.keys()}
    rest = {k: v for k, v in data.items() if k not in flat}
    strategy = rest.get("strategy", {})
    if isinstance(strategy, StrategyConfig):
        strategy = {k: getattr(strategy, k) for k in STRATEGY_FIELDS}
    if isinstance(strategy, dict):  # else validation names the wrong section
        rest["strategy"] = {**strategy, **flat}
    return rest


class InstanceEndpoint(StrictModel):
    instance_id: str = Field(pattern=INSTANCE_ID)
    url: HttpUrl
    params_url: HttpUrl | None = Field(default=None, description="where this instance pulls weights (a parameter-server "
                                                         "relay on its machine); default: the job's parameter server")


class CoordinatorSettings(StrictModel):
    """What a job sets of the coordinator (its ``coordinator:`` section)."""

    strategy: StrategyConfig = Field(default_factory=StrategyConfig,
                                     description="routing, sync, migration and their thresholds")
    cycle_period: float = Field(default=0.05, gt=0, description="seconds between cycles")
    command_timeout: float = Field(default=30.0, gt=0, description="seconds a queued command (a pull, a route) to an instance "
                                   "may take; the cycle waits for an interrupt or abort at most failure_timeout")
    failure_timeout: float = Field(default=10.0, gt=0, description="an instance silent this long is declared failed")
    stall_timeout: float = Field(default=60.0, ge=0, description="running work with no progress this long: failed (0: never)")
    reconcile_after: float = Field(default=5.0, gt=0, description="grace period: a trajectory routed to an instance but not "
                                   "held there this long goes back to pending, and one an instance holds without "
                                   "being routed there is aborted on it")
    cost: CostCoefficients = Field(default_factory=CostCoefficients,
                                   description="cost-model coefficients of every instance (default: paper Table 4)")
    calibration: CalibrationRef | None = Field(
        default=None, description="take cost from this `staleflow calibrate` entry (instead of giving cost); read when "
                          "the coordinator starts")
    sim_weights_bytes: int | None = Field(default=None, ge=0, description="Pull size for sim instances without a PS")

    @model_validator(mode="before")
    @classmethod
    def _strategy_inline(cls, data: Any) -> Any:
        return strategy_inline(data)

    @model_validator(mode="after")
    def _one_cost_source(self) -> CoordinatorSettings:
        if self.calibration is not None and "cost" in self.model_fields_set and self.cost != CostCoefficients():
            raise ValueError("give either cost (coefficients) or calibration (a calibration file), not both")
        return self


class CoordinatorConfig(CoordinatorSettings, ServiceConfig):
    """The coordinator service: its settings and the services it drives."""

    manager_url: HttpUrl = MANAGER_URL
    ts_url: HttpUrl
    params_url: HttpUrl | None = None
    instances: list[InstanceEndpoint] = []
