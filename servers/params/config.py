"""The parameter server's settings: its section of the config tree (``staleflow.config.params``)."""

from staleflow.config.params import ParamsConfig, ParamsSettings, TransportName

__all__ = ["ParamsConfig", "ParamsSettings", "TransportName"]
