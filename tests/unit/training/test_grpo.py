"""The GRPO/DAPO objective and its staleness corrections, on small tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")

pytestmark = pytest.mark.torch

from staleflow.config import AlgorithmConfig  # noqa: E402
from staleflow.training.grpo import group_advantages, policy_loss  # noqa: E402


def test_advantages_are_centred_and_scaled_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups)
    assert adv[:4].sum().abs() < 1e-9 and adv[0] > 0 > adv[1]
    assert torch.allclose(adv[4:], torch.zeros(2, dtype=torch.float64))  # all equal: no signal
    centred = group_advantages(rewards, groups, normalize_std=False)
    assert torch.allclose(centred[:4], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))


def _terms(cfg: AlgorithmConfig, behaviour_shift: float, advantage: float = 1.0):
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    behaviour = torch.full((1, 4), -1.0 - behaviour_shift)  # proximal/behaviour = e^shift
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    terms = policy_loss(logp, behaviour, torch.tensor([advantage]), mask, cfg, global_tokens=3, global_sequences=1)
    terms.loss.backward()
    return terms, logp.grad


def test_positive_advantage_raises_the_log_probs_of_response_tokens_only() -> None:
    terms, grad = _terms(AlgorithmConfig(correction="tis"), 0.0)
    assert (grad[0, :3] < 0).all() and grad[0, 3] == 0  # gradient descent raises logp where masked in
    assert terms.stats["tokens"] == 3


@pytest.mark.parametrize("shift", [0.5, 2.0])
def test_tis_truncates_the_behaviour_weight(shift: float) -> None:
    cfg = AlgorithmConfig(correction="tis", tis_cap=2.0)
    _, grad = _terms(cfg, shift)
    weight = min(float(torch.exp(torch.tensor(shift))), 2.0)
    assert torch.allclose(grad[0, :3], torch.full((3,), -weight / 3))


def test_decoupled_drops_tokens_over_the_cap_instead() -> None:
    cfg = AlgorithmConfig(correction="decoupled", tis_cap=2.0)
    _, kept = _terms(cfg, 0.5)
    assert torch.allclose(kept[0, :3], torch.full((3,), -float(torch.exp(torch.tensor(0.5))) / 3))
    terms, dropped = _terms(cfg, 2.0)
    assert torch.count_nonzero(dropped) == 0 and terms.stats["truncated"] == 3


def test_no_correction_clips_the_ratio_against_the_behaviour_policy() -> None:
    cfg = AlgorithmConfig(correction="none", clip_low=0.2, clip_high=0.28)
    _, inside = _terms(cfg, 0.1)  # ratio e^0.1 = 1.105 < 1.28: gradient flows
    assert (inside[0, :3] < 0).all()
    terms, outside = _terms(cfg, 1.0)  # ratio e^1 > 1.28 with A > 0: clipped, no gradient
    assert torch.count_nonzero(outside) == 0 and terms.stats["clipped"] == 3


def test_token_and_sequence_aggregation_weigh_lengths_differently() -> None:
    logp = torch.zeros((2, 4), requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0])
    for aggregation, short_weight in (("token", 1 / 5), ("sequence", 1 / 2)):
        logp.grad = None
        cfg = AlgorithmConfig(loss_aggregation=aggregation)
        policy_loss(logp, logp.detach(), adv, mask, cfg, global_tokens=5, global_sequences=2).loss.backward()
        assert torch.isclose(-logp.grad[0, 0], torch.tensor(short_weight))


def test_kl_penalty_pulls_towards_the_reference() -> None:
    cfg = AlgorithmConfig(kl_coef=1.0)
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    reference = torch.full((1, 2), -2.0)  # the policy moved up: KL pulls it back down
    terms = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones((1, 2)), cfg,
                        global_tokens=2, global_sequences=1, reference=reference)
    terms.loss.backward()
    assert (logp.grad > 0).all() and terms.stats["kl"] > 0
