"""The instance server's settings: its section of the config tree (``staleflow.config.instance``)."""

from staleflow.config.instance import ID_PATTERN, InstanceConfig, InstanceSettings, SimConfig, VllmConfig

__all__ = ["ID_PATTERN", "InstanceConfig", "InstanceSettings", "SimConfig", "VllmConfig"]
