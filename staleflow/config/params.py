"""The parameter server's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from staleflow.config.common import ServiceConfig
from staleflow.strict import StrictModel

TransportName = Literal["http", "shm", "nixl"]
PeerTransportName = Literal["auto", "shm", "nixl", "http"]


def default_retain(eta: int) -> int:
    """Versions a job may still route to under staleness bound ``eta``: the newest and the ``eta``
    before it (a trajectory started on version v - eta is still admissible)."""
    return eta + 1


class ParamsSettings(StrictModel):
    """What a job sets of the parameter server (its ``params:`` section)."""

    keep: int = Field(default=2, ge=1, le=10_000, description="complete versions kept: the newest K")
    chunk_bytes: int = Field(default=64 << 20, ge=4096, le=1 << 30, description="bytes per chunk (the per-request payload limit)")
    transports: tuple[TransportName, ...] = Field(default=("http", "shm"), description="transports offered for pulls, and for "
                                                                                 "pushes besides http; http is always on")
    shm_dir: Path = Field(default=Path("/dev/shm"), description="where shared-memory segments live")
    lease_ttl_s: float = Field(default=120.0, gt=0, description="a pull lease lapses after this long without use")
    push_ttl_s: float = Field(default=900.0, gt=0, description="an idle unfinished push is dropped after this long")
    fsync: bool = Field(default=True, description="fsync each version when it is persisted "
                                          "(off: faster, survives process crashes but not power loss)")
    persist: bool = Field(default=True, description="persist each new version to state_dir in the background, for "
                                            "crash recovery (off: versions live in host memory only)")
    persist_yield_s: float = Field(default=10.0, ge=0, le=3600,
                                   description="a persist pauses while pushes or pulls are in flight (they share memory "
                                               "bandwidth), for at most this long per version; 0: never pauses")
    max_tensors: int = Field(default=200_000, ge=1)
    egress_gbps: float | None = Field(default=None, gt=0, le=100_000,
                                      description="this server's egress limit in Gbit/s, over every chunk body it sends "
                                                  "(a token bucket shared by its connections): emulates a NIC, so a "
                                                  "fan-out from one endpoint can be measured on one host; null: none")
    sources: Literal["ps", "ros"] = Field(default="ps", description="where instances pull from: 'ps' the parameter server; "
                                                                  "'ros' the holders of the version (instances, relays) "
                                                                  "with pipeline replication, the PS's copy last")
    retain: int | None = Field(default=None, ge=1, le=10_000, description="with ROS: the newest K versions kept available "
                                                                        "(by holders or the PS's copy); null: keep, or in a "
                                                                        "job the versions its staleness bound eta may route to")
    retain_replicas: int = Field(default=2, ge=1, le=1000, description="with ROS: the PS drops its copy of a retained version "
                                                                       "once this many non-spot holders hold it whole")
    holder_ttl_s: float = Field(default=10.0, gt=0, le=3600, description="with ROS: a holder silent this long is declared "
                                                                         "failed (it stops counting for retention at half)")

    @model_validator(mode="after")
    def _http_always(self) -> ParamsSettings:
        if "http" not in self.transports:
            raise ValueError("transports must include 'http': pushes and the chunk API always go over HTTP")
        if len(set(self.transports)) != len(self.transports):
            raise ValueError("transports lists a transport twice")
        return self


class ParamsConfig(ParamsSettings, ServiceConfig):
    """The parameter server: its settings, where it listens and where it stores versions."""

    port: int = Field(default=8331, ge=0, le=65535)
    data_port: int | None = Field(default=0, ge=0, le=65535, description="port of the chunk data plane (chunk bodies of pushes "
                                                                  "and pulls, a thread per connection); 0: any free "
                                                                  "port; null: none, chunks go through the API port")
    state_dir: Path = Field(default=Path(".staleflow/params"), description="where complete versions are stored")
    holder_of: str | None = Field(default=None, description="run as a ROS holder of the parameter server at this URL: register "
                                                            "with it, pull versions from their holders and serve what is held")
    holder_id: str | None = Field(default=None, max_length=256, description="this holder's id (default: a random one)")
    zone: str = Field(default="", max_length=256, description="this holder's rack or zone label")
    spot: bool = Field(default=False, description="this holder is preemptible: it serves but never counts for retention")
    holder_follows: bool = Field(default=True, description="a holder pulls each new version as the reference server learns "
                                                           "of it (off: only when asked, POST /v1/ros/held/{version})")
    peer_transport: PeerTransportName = Field(default="auto", description="how a holder reads chunks from other holders: "
                                                                          "'auto' shm from a holder on its host, else nixl "
                                                                          "where both offer it, else http; 'shm' or 'nixl': "
                                                                          "that one where the holder offers it, else http")
    emulated_host: str | None = Field(default=None, max_length=256, description="the host this holder tells the reference "
                                                                                "server it runs on, instead of this boot's id "
                                                                                "(a bench's emulated hosts: no shm between "
                                                                                "them); null: the real one")

    def retained_versions(self) -> int:
        """The newest versions kept available under ROS (``retain``, else ``keep``)."""
        return self.retain if self.retain is not None else self.keep
