"""The parameter server (PS): versioned model parameters between the trainer and the rollout
instances (paper §5.1, Figure 6 steps 4-5; Appendix A).

The trainer Pushes version v after each step; instances Pull the version the coordinator names.
Every version is immutable once committed, so the paper's read-write rule becomes:

* a version is written by exactly one Push and becomes visible atomically at its commit; a Pull
  of a version still being pushed waits for the commit (``wait_s``) or is refused, never served
  half-written bytes;
* Pulls share: any number of leases on a version at once;
* eviction is the other exclusive writer: a version outside the newest ``keep`` takes no new
  leases and is deleted only when its last lease is released (or expires).

Memory first: a push writes into a shared-memory slot and the version is visible from there;
a background thread persists it to ``state_dir/versions/vNNNNNNNNNN/`` (one safetensors file plus
``manifest.json``, written last and renamed into place), and a restart serves the newest persisted
versions again. Data is sent from the slot (or the file), so the PS's own memory stays bounded.

Endpoints (errors are ``{"detail", "code", ...}`` with a stable code): see docs/params.md.

The modules, by concern: ``rules`` the pure rules and records (version specs, retention, chunk
cutting, coverage), ``files`` a version's folder on disk, ``push`` the pushes in progress
(``PushTable``), ``store`` the store that owns them (versions, leases, retention, persistence),
``app`` the REST app, ``dataplane`` the chunk bodies' own port, ``relay`` the cross-node relay,
``reference`` the pure rules of reference-oriented storage (holders, sources, retention) and
``holders`` the reference server and the holder agent that apply them. The wire models and routes are ``staleflow.api.params``; the client
(``ParamsClient``, with the transports) lives in the library, ``staleflow.transports.client``.
"""

from staleflow.api.base import ServiceError
from staleflow.config import ParamsConfig
from staleflow.servers.params.app import create_app
from staleflow.servers.params.rules import ParamsError
from staleflow.servers.params.store import ParamStore
from staleflow.transports.client import ParamsClient, RawTensor

__all__ = ["ParamStore", "ParamsClient", "ParamsConfig", "ParamsError", "RawTensor", "ServiceError", "create_app"]
