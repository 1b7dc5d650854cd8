"""The parameter server's error; its settings live with the others (``staleflow.config.params``)."""

from __future__ import annotations

from staleflow.config.params import ParamsConfig, TransportName

__all__ = ["ParamsConfig", "ParamsError", "TransportName"]


class ParamsError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail
