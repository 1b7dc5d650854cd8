"""The rollout instance server: one engine behind the command / snapshot / completed-feed API.

Endpoints (all JSON; errors are ``{"detail", "code", ...}`` with a 4xx status, as on every service):

* ``POST /v1/commands`` -- one Route / Interrupt / Abort / Pull command ``{command_id, kind, ...}``.
  Commands are applied one at a time in arrival order; each applied command gets the next sequence
  number. A retry with the same ``command_id`` and the same body gets the stored response again
  (header ``Idempotent-Replay: true``) without re-applying it; the same ``command_id`` with a
  different body is refused with 409.
* ``GET /v1/snapshot`` -- the five snapshot fields of paper §5.2 plus ``instance_id``, ``seq`` (the
  last applied command) and timestamps. Taken under the command lock, so it reflects exactly the
  commands up to ``seq``.
* ``GET /v1/completed?after=SEQ&limit=N&wait_s=S`` -- the completed-trajectory feed. Items carry
  increasing ``seq`` numbers; ``wait_s`` long-polls. Reading changes nothing.
* ``POST /v1/completed/ack`` -- ``{"seqs": [...]}``: the consumer holds these items, which then leave
  the outbox. Only items handed out (by the feed or the callback) can be acknowledged; others
  are listed as ignored. Like every mutating endpoint, it needs the token when one is set.
* Optional push: with ``completion_callback_url`` set, batches ``{"instance_id", "items"}`` are
  POSTed there in order (at-least-once: receivers deduplicate on ``(instance_id, seq)``). The
  receiver being unreachable or restarting (network errors, 502/503/504) is retried with capped,
  jittered backoff; a 4xx, or another server error that persists, drops the batch (logged), and
  the coordinator's reconciliation hands those trajectories back. A delivered batch is acknowledged.
* ``GET /v1/health``.
* ``POST /v1/sim/advance`` -- sim engine on the virtual clock only: ``{"to": t}``, ``{"by": dt}``
  or ``{"until_idle": true}``; returns after the finished trajectories reached the feed.

``staleflow.config.instance`` holds the settings, ``staleflow.api.instance`` the wire models and the
client (the trajectories are ``staleflow.api.trajectory``'s), ``wire`` the conversions between them
and the engine's types, ``service`` the outbox and the command-applying server, ``app`` the
endpoints; ``staleflow.engines.factory`` builds the engine.
"""

from staleflow.api.instance import AbortCommand, InterruptCommand, PullCommand, RouteCommand
from staleflow.api.trajectory import WireTrajectory
from staleflow.config import InstanceConfig, SimConfig, VllmConfig
from staleflow.engines.factory import create_engine
from staleflow.servers.instance.app import create_app
from staleflow.servers.instance.service import InstanceServer
from staleflow.servers.instance.wire import wire_trajectory

__all__ = [
    "AbortCommand",
    "InstanceConfig",
    "InstanceServer",
    "InterruptCommand",
    "PullCommand",
    "RouteCommand",
    "SimConfig",
    "VllmConfig",
    "WireTrajectory",
    "create_app",
    "create_engine",
    "wire_trajectory",
]
