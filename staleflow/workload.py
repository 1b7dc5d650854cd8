"""A workload model for simulated rollouts: prompts, response lengths and the generated tokens.

Everything is a pure function of ``(seed, ids)``, so a run is reproducible from its seed and a
trajectory resumed on another instance keeps its target length and its token stream.

Response lengths are log-normal with group correlation (paper Appendix C: "trajectories within a
group tend to be either all long or all short"): each prompt group draws a log-mean
``log(response_median) + group_sigma * z_group`` and each member adds ``member_sigma * z_member``.
The intra-group correlation of the log-lengths is therefore
``group_sigma**2 / (group_sigma**2 + member_sigma**2)``. Lengths are truncated at the request's
``max_tokens`` (finish reason ``length``); shorter ones end with the EOS token (``stop``).

The paper gives no length distribution, so the presets' medians and sigmas are assumptions chosen
to give a long tail of the kind its Figures 4 and 25 describe: a few percent of trajectories hit
the limit and the longest group is several times the median.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from enum import StrEnum
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()
_MASK64 = (1 << 64) - 1


def stable_hash64(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process and on every platform."""
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def stable_uniform(*parts: object) -> float:
    """A uniform float in (0, 1) determined by ``parts``."""
    return ((stable_hash64(*parts) >> 11) + 0.5) * 2.0**-53


def stable_normal(*parts: object) -> float:
    """A standard normal variate determined by ``parts``."""
    return _NORMAL.inv_cdf(stable_uniform(*parts))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def pseudo_tokens(
    key: str, seed: int, start: int, end: int, vocab_size: int, eos_token_id: int
) -> tuple[list[int], list[float]]:
    """Deterministic tokens and log-probs for positions ``[start, end)`` of stream ``key``.

    Position ``p`` always gets the same token, wherever the stream is generated, and no position
    gets the EOS token (it is placed explicitly where a stream stops).
    """
    if end <= start:
        return [], []
    base = np.uint64(stable_hash64("tokens", seed, key))
    with np.errstate(over="ignore"):
        positions = np.arange(start, end, dtype=np.uint64)
        mixed = _splitmix64(positions * np.uint64(0xD1B54A32D192ED03) + base)
        tokens = mixed % np.uint64(vocab_size - 1)
        tokens = tokens + (tokens >= np.uint64(eos_token_id)).astype(np.uint64)
        uniform = ((_splitmix64(mixed) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return tokens.astype(np.int64).tolist(), np.log(uniform).tolist()


class LengthFinish(StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and the ids of the trajectories sampled from it."""

    group_id: str
    prompt_ids: tuple[int, ...]
    trajectory_ids: tuple[str, ...]


@dataclass(frozen=True)
class WorkloadModel:
    """Seeded length and content model of one RL workload (see the module docstring)."""

    name: str
    batch_size: int  # prompt groups per training step
    group_size: int  # trajectories per prompt
    max_response_tokens: int
    max_prompt_tokens: int
    response_median: float  # median response length in tokens (before truncation)
    group_sigma: float  # std of the per-group log-mean
    member_sigma: float  # std of the per-member log-noise
    prompt_median: float
    prompt_sigma: float
    vocab_size: int = 151_936  # Qwen2/3 vocabulary
    eos_token_id: int = 151_643
    min_response_tokens: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("batch_size", "group_size", "max_response_tokens", "max_prompt_tokens", "min_response_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.response_median <= 0 or self.prompt_median <= 0:
            raise ValueError("response_median and prompt_median must be > 0")
        if self.group_sigma < 0 or self.member_sigma < 0 or self.prompt_sigma < 0:
            raise ValueError("sigmas must be >= 0")
        if not 0 <= self.eos_token_id < self.vocab_size or self.vocab_size < 2:
            raise ValueError(f"eos_token_id {self.eos_token_id} must lie in a vocabulary of >= 2 tokens")

    @property
    def trajectories_per_step(self) -> int:
        return self.batch_size * self.group_size

    @property
    def group_correlation(self) -> float:
        """Intra-group correlation of the (untruncated) log-lengths."""
        total = self.group_sigma**2 + self.member_sigma**2
        return self.group_sigma**2 / total if total else 0.0

    # ------------------------------------------------------------------ lengths

    def natural_length(self, group_id: str, traj_id: str) -> int:
        """The response length the model "wants" to generate, before any max_tokens limit."""
        log_mean = math.log(self.response_median) + self.group_sigma * stable_normal("group", self.seed, group_id)
        log_len = log_mean + self.member_sigma * stable_normal("member", self.seed, traj_id)
        return max(self.min_response_tokens, round(math.exp(min(log_len, 60.0))))

    def target_length(self, group_id: str, traj_id: str, max_tokens: int | None = None) -> tuple[int, LengthFinish]:
        """Final response length under ``max_tokens`` (default: the preset's limit) and why it ends."""
        limit = self.max_response_tokens if max_tokens is None else max_tokens
        natural = self.natural_length(group_id, traj_id)
        if natural >= limit:
            return limit, LengthFinish.LENGTH
        return natural, LengthFinish.STOP

    # ------------------------------------------------------------------ prompts

    def prompt_length(self, group_id: str) -> int:
        z = stable_normal("prompt", self.seed, group_id)
        length = round(self.prompt_median * math.exp(self.prompt_sigma * z))
        return min(self.max_prompt_tokens, max(1, length))

    def prompt_ids(self, group_id: str) -> tuple[int, ...]:
        tokens, _ = pseudo_tokens(
            f"prompt:{group_id}", self.seed, 0, self.prompt_length(group_id), self.vocab_size, self.eos_token_id
        )
        return tuple(tokens)

    def groups(self, step: int, batch_size: int | None = None, group_size: int | None = None) -> list[PromptGroup]:
        """The prompt groups of training step ``step`` (ids ``s{step}-g{i}``, members ``/m{j}``)."""
        batch = self.batch_size if batch_size is None else batch_size
        members = self.group_size if group_size is None else group_size
        result = []
        for i in range(batch):
            group_id = f"s{step}-g{i}"
            trajectories = tuple(f"{group_id}/m{j}" for j in range(members))
            result.append(PromptGroup(group_id, self.prompt_ids(group_id), trajectories))
        return result

    def with_seed(self, seed: int) -> WorkloadModel:
        return replace(self, seed=seed)


PRESETS: dict[str, WorkloadModel] = {
    # The paper's main setting (§6.1): DAPO-Math, prompts <= 2K, responses <= 20K, 128 x 16.
    "paper-20k": WorkloadModel(
        name="paper-20k",
        batch_size=128,
        group_size=16,
        max_response_tokens=20_480,
        max_prompt_tokens=2_048,
        response_median=5_000,
        group_sigma=0.6,
        member_sigma=0.5,
        prompt_median=200,
        prompt_sigma=0.5,
    ),
    # `staleflow up`'s default: long-tailed responses <= 2K, so coordination shows in seconds.
    "demo": WorkloadModel(
        name="demo",
        batch_size=16,
        group_size=8,
        max_response_tokens=2_048,
        max_prompt_tokens=256,
        response_median=320,
        group_sigma=0.7,
        member_sigma=0.5,
        prompt_median=64,
        prompt_sigma=0.4,
    ),
    # Small enough for unit tests and CI.
    "ci-tiny": WorkloadModel(
        name="ci-tiny",
        batch_size=4,
        group_size=4,
        max_response_tokens=64,
        max_prompt_tokens=16,
        response_median=24,
        group_sigma=0.5,
        member_sigma=0.3,
        prompt_median=8,
        prompt_sigma=0.3,
        vocab_size=512,
        eos_token_id=0,
    ),
}
# The §6.5 / Appendix B-C setting: responses <= 40K.
PRESETS["paper-40k"] = replace(PRESETS["paper-20k"], name="paper-40k", max_response_tokens=40_960, response_median=8_000)


def preset(name: str, seed: int = 0) -> WorkloadModel:
    """A named preset (``paper-20k``, ``paper-40k``, ``demo``, ``ci-tiny``) with the given seed."""
    try:
        model = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return model.with_seed(seed)


__all__ = [
    "PRESETS",
    "LengthFinish",
    "PromptGroup",
    "WorkloadModel",
    "preset",
    "pseudo_tokens",
    "stable_hash64",
    "stable_normal",
    "stable_uniform",
]
