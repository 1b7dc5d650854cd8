"""The parameter server's error; its settings live with the others (``staleflow.config.params``)."""

from __future__ import annotations

from staleflow.config.params import ParamsConfig, TransportName
from staleflow.errors import StaleFlowError

__all__ = ["ParamsConfig", "ParamsError", "TransportName"]


class ParamsError(StaleFlowError):
    """A request the parameter store refuses."""
