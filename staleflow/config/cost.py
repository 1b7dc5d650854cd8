"""The cost model's coefficients as settings (``CostCoefficients``): the one declaration of k1..k5
and the KV budget, which the coordinator, the sim engine and calibration entries hold."""

from __future__ import annotations

from pydantic import Field

from staleflow.cost_model import CostModel
from staleflow.strict import StrictModel


class CostCoefficients(StrictModel):
    """The cost model's coefficients (paper Eq. 2-4; the defaults are paper Table 4): what
    ``staleflow.cost_model.CostModel`` takes, a calibration entry's ``cost``, the coordinator's
    ``cost`` section and the sim engine's coefficients. The one declaration of k1..k5 and the KV
    budget as settings (``staleflow.config.CostConfig`` is this model)."""

    k1: float = Field(default=CostModel.k1, ge=0, description="s per KV unit read by attention in one decode step")
    k2: float = Field(default=CostModel.k2, ge=0, description="s, memory-bound floor of the GEMMs")
    k3: float = Field(default=CostModel.k3, ge=0, description="s per running trajectory once compute-bound")
    k4: float = Field(default=CostModel.k4, ge=0, description="s, constant per-step overhead")
    k5: float = Field(default=CostModel.k5, gt=0, description="KV units per token")
    kv_budget: float = Field(default=CostModel.kv_budget, gt=0, description="M, KV budget in KV units")

    def cost_model(self) -> CostModel:
        return CostModel(**self.model_dump(include=set(CostCoefficients.model_fields)))
