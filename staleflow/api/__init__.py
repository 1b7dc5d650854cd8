"""The services' contracts: for each service, its wire models and its typed client, imported by the
service (which validates and answers with the models) and by every caller (which calls the
client). ``base`` holds what they share: the bearer token, the one error contract
(``ServiceError``) and ``Route``, an operation declared once and executed by a sync ``Client`` or
an ``AsyncClient``.

``manager``, ``trajectories``, ``instance``, ``coordinator``, ``reward`` and ``params`` (whose
full client, with the data-plane transports, is ``staleflow.transports.client.ParamsClient``).
"""

from staleflow.api.base import (
    AsyncClient,
    Client,
    Route,
    ServiceError,
    async_http_client,
    check_reply,
    http_client,
)

__all__ = ["AsyncClient", "Client", "Route", "ServiceError", "async_http_client", "check_reply", "http_client"]
