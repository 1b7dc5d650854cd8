"""``StrictModel``: the pydantic base of every settings and file model: unknown fields are errors,
instances are immutable. A leaf module, so the calibration schema and ``staleflow.config`` can both
build on it."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
