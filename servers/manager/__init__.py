"""The staleness manager: the durable ledger behind REST (paper §4.2-4.3).

``staleflow.config.manager`` holds the settings, ``store`` the durable ledger (the pure
``staleflow.ledger.Ledger`` over a SQL database, with group commit), ``service`` what the
endpoints answer over it, ``app`` the endpoints (``create_app(config)``).
"""

from staleflow.config import LedgerConfig, ManagerConfig
from staleflow.servers.manager.app import create_app
from staleflow.servers.manager.store import DurableLedger

__all__ = ["DurableLedger", "LedgerConfig", "ManagerConfig", "create_app"]
