"""Rollout engines: the interface (``base``), the simulated backend (``sim``) and vLLM (``vllm_engine``).

``vllm_engine`` imports vLLM lazily, so this package works without it.
"""

from staleflow.engines import base
from staleflow.engines.base import *  # noqa: F403 -- the interface is the package's public face

__all__ = list(base.__all__)
