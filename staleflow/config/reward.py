"""The reward server's settings."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from staleflow.config.common import ServiceConfig
from staleflow.strict import StrictModel

VERIFIER_NAME = re.compile(r"^[A-Za-z][\w.-]{0,63}$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*$")
"""A user verifier: ``module.path:function`` (``staleflow.rewards.registry`` imports it)."""


class RewardSettings(StrictModel):
    """What a job sets of the reward server (its ``reward_server:`` section)."""

    default_verifier: str = Field(default="math", description="used when a request names none")
    verifiers: dict[str, str] = Field(default_factory=dict, description="user verifiers: name -> 'module.path:function'")
    workers: int = Field(default=2, ge=1, le=256, description="processes running the verifiers (built-in and user)")
    timeout_s: float = Field(default=5.0, gt=0, le=3600, description="deadline per item, for every verifier: an item "
                             "that overruns it scores 0 with reason 'timeout' and its worker is replaced")
    max_batch: int = Field(default=4096, ge=1, description="items per request")
    max_chars: int = Field(default=200_000, ge=1, description="characters per response_text or answer")

    @field_validator("verifiers")
    @classmethod
    def _valid_verifiers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, target in value.items():
            if not VERIFIER_NAME.match(name):
                raise ValueError(f"verifier name {name!r}: letters, digits, '_', '.', '-', starting with a letter")
            if not IMPORT_PATH.match(target):
                raise ValueError(f"verifier {name!r}: {target!r} is not 'module.path:function'")
        return value


class RewardConfig(RewardSettings, ServiceConfig):
    port: int = Field(default=8332, ge=0, le=65535)
