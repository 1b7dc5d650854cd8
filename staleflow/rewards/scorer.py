"""Scoring batches: every verifier, built-in or user, runs in the process pool under its deadline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from staleflow.config.reward import IMPORT_PATH
from staleflow.rewards.pool import VerifierPool
from staleflow.rewards.registry import BUILTIN_VERIFIERS, Verdict, VerifierError


@dataclass(frozen=True)
class RewardRequest:
    response_text: str
    answer: str
    verifier: str | None = None


class RewardScorer:
    """``user_verifiers`` maps names to ``"module.path:function"``. A request names a built-in
    ("math", "exact"), a configured name, or a configured import path itself; nothing else is
    imported, so a request cannot make the service run arbitrary code."""

    def __init__(self, user_verifiers: Mapping[str, str] | None = None, default: str = "math",
                 workers: int = 2, timeout_s: float = 5.0):
        self.user_verifiers = dict(user_verifiers or {})
        for name, target in self.user_verifiers.items():
            if name in BUILTIN_VERIFIERS:
                raise VerifierError(f"verifier name {name!r} is taken by a built-in")
            if not IMPORT_PATH.match(target):
                raise VerifierError(f"verifier {name!r}: {target!r} is not 'module.path:function'")
        self.default = default
        self.resolve(default)
        targets = sorted(BUILTIN_VERIFIERS) + sorted(set(self.user_verifiers.values()))
        self.pool = VerifierPool(targets, workers, timeout_s)

    def names(self) -> list[str]:
        return sorted(BUILTIN_VERIFIERS) + sorted(self.user_verifiers)

    def resolve(self, name: str | None) -> str:
        """A built-in name or a configured import path, for a requested verifier."""
        name = name or self.default
        if name in BUILTIN_VERIFIERS:
            return name
        if name in self.user_verifiers:
            return self.user_verifiers[name]
        if name in self.user_verifiers.values():
            return name
        raise VerifierError(f"unknown verifier {name!r}; known: {', '.join(self.names())}")

    def score(self, requests: Sequence[RewardRequest]) -> list[Verdict]:
        resolved = [self.resolve(r.verifier) for r in requests]  # refuse the batch before running any of it
        return self.pool.map([(target, r.response_text, r.answer) for target, r in zip(resolved, requests, strict=True)])

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
