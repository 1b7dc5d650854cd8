"""A Ray job's relays are parameter servers with the job's egress limit, as the parameter server."""

from __future__ import annotations

from staleflow.config import JobConfig
from staleflow.launch.ray.actors import relay_app
from staleflow.transports.egress import GBIT


def test_a_relay_takes_the_jobs_egress_limit() -> None:
    limited = relay_app(JobConfig(engine="sim", params={"egress_gbps": 2.5}), "ns", "relay-0", "token")
    assert limited.state.egress.bytes_per_s == 2.5 * GBIT
    assert relay_app(JobConfig(engine="sim"), "ns", "relay-0", "token").state.egress is None
