"""Verifiers by name: the built-ins, and user functions given as ``"module.path:function"``.

A verifier is any callable ``f(response_text: str, answer: str)`` returning a reward as a number
or bool, a ``(reward, reason)`` pair, a ``{"reward": ..., "reason": ...}`` dict, or a Verdict.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from staleflow.config.reward import IMPORT_PATH
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.rewards.math_verify import verify_math

VerifierFn = Callable[[str, str], Any]


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str
    detail: str = ""

    def to_json(self) -> dict:
        body: dict[str, Any] = {"reward": self.reward, "reason": self.reason}
        if self.detail:
            body["detail"] = self.detail
        return body


def math_verifier(response_text: str, answer: str) -> Verdict:
    return Verdict(*verify_math(response_text, answer))


def exact_verifier(response_text: str, answer: str) -> Verdict:
    """The whole response, whitespace-trimmed, equals the answer."""
    if response_text.strip() == answer.strip():
        return Verdict(1.0, "correct")
    return Verdict(0.0, "wrong_answer")


BUILTIN_VERIFIERS: Mapping[str, VerifierFn] = {"math": math_verifier, "exact": exact_verifier}


class VerifierError(StaleFlowError, ValueError):
    """A verifier that cannot be named, loaded or run."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.INVALID_VERIFIER, message)


def load_function(import_path: str) -> VerifierFn:
    """``"package.module:function"`` (or ``:Class.method``) -> the callable."""
    if not IMPORT_PATH.match(import_path):
        raise VerifierError(f"{import_path!r} is not 'module.path:function'")
    module_name, _, attribute = import_path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise VerifierError(f"cannot import {module_name!r} for verifier {import_path!r}: {exc}") from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise VerifierError(f"{module_name!r} has no {attribute!r} (verifier {import_path!r})")
    if not callable(target):
        raise VerifierError(f"{import_path!r} is not callable")
    return target


def as_verdict(result: Any) -> Verdict:
    """A verifier's return value as a Verdict; a malformed one is reward 0 with the reason."""
    if isinstance(result, Verdict):
        verdict = result
    elif isinstance(result, bool):
        verdict = Verdict(float(result), "correct" if result else "wrong_answer")
    elif isinstance(result, int | float):
        verdict = Verdict(float(result), "scored")
    elif isinstance(result, tuple) and len(result) == 2:
        verdict = Verdict(float(result[0]), str(result[1]))
    elif isinstance(result, Mapping) and "reward" in result:
        verdict = Verdict(float(result["reward"]), str(result.get("reason", "scored")), str(result.get("detail", "")))
    else:
        return Verdict(0.0, "error", f"verifier returned {type(result).__name__}, not a reward")
    if not math.isfinite(verdict.reward):
        return Verdict(0.0, "error", f"verifier returned a non-finite reward {verdict.reward}")
    return verdict


def run_verifier(fn: VerifierFn, response_text: str, answer: str) -> Verdict:
    """Call ``fn``; an exception becomes reward 0 with reason "error"."""
    try:
        return as_verdict(fn(response_text, answer))
    except Exception as exc:  # a user verifier may raise anything: report it, don't fail the batch
        return Verdict(0.0, "error", f"{type(exc).__name__}: {exc}"[:500])
