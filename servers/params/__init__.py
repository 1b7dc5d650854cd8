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

Durability: a version lives in ``state_dir/versions/vNNNNNNNNNN/`` as one safetensors file plus
``manifest.json``, written last and renamed into place; a push in progress lives in a
``.staging-*`` folder that a restart discards. Data is served with pread from the stored file (or
from shared memory), so the PS's own memory stays bounded by a few pieces per stream.

Endpoints (JSON errors ``{"detail": ...}``): see docs/params.md.

``config`` holds the settings, ``store`` the durable store and its rules, ``app`` the REST app; its
wire models and routes are ``staleflow.api.params``, and its client (``ParamsClient``, with the
transports) lives in the library, ``staleflow.transports.client``.
"""

from staleflow.api.base import ServiceError
from staleflow.servers.params.app import create_app
from staleflow.servers.params.config import ParamsConfig
from staleflow.servers.params.rules import ParamsError
from staleflow.servers.params.store import ParamStore
from staleflow.transports.client import ParamsClient, RawTensor

__all__ = ["ParamStore", "ParamsClient", "ParamsConfig", "ParamsError", "RawTensor", "ServiceError", "create_app"]
