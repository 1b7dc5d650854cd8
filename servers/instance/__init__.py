"""The rollout instance server: one engine behind the command / snapshot / completed-feed API.

Endpoints (all JSON; errors are ``{"error": {"code", "message"}}`` with a 4xx status):

* ``POST /v1/commands`` -- one Route / Interrupt / Abort / Pull command ``{command_id, kind, ...}``.
  Commands are applied one at a time in arrival order; each applied command gets the next sequence
  number. A retry with the same ``command_id`` and the same body gets the stored response again
  (header ``Idempotent-Replay: true``) without re-applying it; the same ``command_id`` with a
  different body is refused with 409.
* ``GET /v1/snapshot`` -- the five snapshot fields of paper §5.2 plus ``instance_id``, ``seq`` (the
  last applied command) and timestamps. Taken under the command lock, so it reflects exactly the
  commands up to ``seq``.
* ``GET /v1/completed?after=SEQ&limit=N&wait_s=S`` -- the completed-trajectory feed. Items carry
  increasing ``seq`` numbers; asking for ``after=SEQ`` also acknowledges everything up to ``SEQ``,
  which is then released (the feed has one consumer, the trajectory server). ``wait_s`` long-polls.
* Optional push: with ``completion_callback_url`` set, batches ``{"instance_id", "items"}`` are
  POSTed there in order, retried with capped exponential backoff on connection errors and 5xx
  (at-least-once: receivers deduplicate on ``(instance_id, seq)``); a 4xx answer drops the batch.
  A delivered batch is acknowledged like a poll.
* ``GET /v1/health``.
* ``POST /v1/sim/advance`` -- sim engine on the virtual clock only: ``{"to": t}``, ``{"by": dt}``
  or ``{"until_idle": true}``; returns after the finished trajectories reached the feed.

``config`` holds the settings and the engine factory, ``wire`` the request models and the error body,
``state`` the outbox and the command-applying server, ``app`` the endpoints.
"""

from staleflow.servers.instance.app import create_app
from staleflow.servers.instance.config import InstanceConfig, SimConfig, VllmConfig, create_engine
from staleflow.servers.instance.state import InstanceServer
from staleflow.servers.instance.wire import (
    AbortCommand,
    InterruptCommand,
    PullCommand,
    RouteCommand,
    TrajectoryIn,
    trajectory_json,
)

__all__ = [
    "AbortCommand",
    "InstanceConfig",
    "InstanceServer",
    "InterruptCommand",
    "PullCommand",
    "RouteCommand",
    "SimConfig",
    "TrajectoryIn",
    "VllmConfig",
    "create_app",
    "create_engine",
    "trajectory_json",
]
