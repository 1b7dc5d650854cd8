"""Rule-based, verifiable rewards (pure verifiers; the REST service is staleflow.servers.reward)."""

from staleflow.rewards.math_verify import answers_equal, extract_answer, normalize, verify_math
from staleflow.rewards.registry import BUILTIN_VERIFIERS, Verdict, VerifierError, load_function
from staleflow.rewards.scorer import RewardRequest, RewardScorer

__all__ = [
    "BUILTIN_VERIFIERS",
    "RewardRequest",
    "RewardScorer",
    "Verdict",
    "VerifierError",
    "answers_equal",
    "extract_answer",
    "load_function",
    "normalize",
    "verify_math",
]
