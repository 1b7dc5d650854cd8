"""The parameter server's settings and its error."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from staleflow.config import ServiceConfig

TransportName = Literal["http", "shm", "nixl"]


class ParamsConfig(ServiceConfig):
    port: int = Field(8331, ge=0, le=65535)
    state_dir: Path = Field(Path(".staleflow/params"), description="where complete versions are stored")
    keep: int = Field(2, ge=1, le=10_000, description="complete versions kept: the newest K")
    chunk_bytes: int = Field(64 << 20, ge=4096, le=1 << 30, description="bytes per chunk (the per-request payload limit)")
    transports: tuple[TransportName, ...] = Field(("http", "shm"), description="pull transports offered; http is always on")
    shm_dir: Path = Field(Path("/dev/shm"), description="where shared-memory segments live")
    lease_ttl_s: float = Field(120.0, gt=0, description="a pull lease lapses after this long without use")
    push_ttl_s: float = Field(900.0, gt=0, description="an idle unfinished push is dropped after this long")
    fsync: bool = Field(True, description="fsync a version before it becomes visible "
                                          "(off: faster, survives process crashes but not power loss)")
    max_tensors: int = Field(200_000, ge=1)

    @model_validator(mode="after")
    def _http_always(self) -> ParamsConfig:
        if "http" not in self.transports:
            raise ValueError("transports must include 'http': pushes and the chunk API always go over HTTP")
        if len(set(self.transports)) != len(self.transports):
            raise ValueError("transports lists a transport twice")
        return self


class ParamsError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail
