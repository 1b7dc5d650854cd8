"""The staleness manager's settings: its section of the config tree (``staleflow.config.manager``)."""

from staleflow.config.manager import MANAGER_PORT, MANAGER_URL, LedgerConfig, ManagerConfig, ManagerSettings

__all__ = ["MANAGER_PORT", "MANAGER_URL", "LedgerConfig", "ManagerConfig", "ManagerSettings"]
