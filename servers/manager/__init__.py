"""The staleness manager: the durable ledger behind REST (paper §4.2-4.3).

``config`` holds the settings, ``store`` the durable ledger (the pure ``staleflow.ledger.Ledger``
over a SQL database, with group commit), ``app`` the endpoints (``create_app(config)``).
"""

from staleflow.servers.manager.app import create_app

__all__ = ["create_app"]
