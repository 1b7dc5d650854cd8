"""The GRPO/DAPO objective with a staleness correction, as pure tensor functions.

Notation per response token: ``logp`` the current policy's log-prob (with gradient), ``behaviour``
the log-prob recorded by the rollout engine when it sampled the token (possibly several versions
old: the segments of a partial rollout come from different versions), ``proximal`` the policy at
the start of this optimizer step. One optimizer step per batch means proximal = logp detached,
so no extra forward pass is needed.

* ``none``: PPO with the behaviour policy as the old policy, clipped to [1 - clip_low, 1 + clip_high].
* ``tis`` (truncated importance sampling): the PPO ratio is taken against the proximal policy and
  the token is weighted by w = min(proximal / behaviour, tis_cap).
* ``decoupled`` (decoupled PPO, as AReaL): the same ratio against the proximal policy, weight
  w = proximal / behaviour, and tokens with w > tis_cap are dropped from the loss.

Token-level aggregation (DAPO) averages over every response token of the global batch; sequence
aggregation (GRPO) averages per-sequence means. Both are normalised by the *global* count, so the
sum over ranks of the per-rank losses is the batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from staleflow.config import AlgorithmConfig


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean (divided by the group's std)."""
    _, index, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, rewards)
    means = sums / counts
    centred = rewards - means[index]
    if not normalize_std:
        return centred
    squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, index, centred**2)
    std = torch.sqrt(squares / torch.clamp(counts - 1, min=1))
    return centred / (std[index] + eps)


@dataclass
class LossTerms:
    loss: torch.Tensor  # this rank's share of the batch loss (scalar, with gradient)
    stats: dict[str, torch.Tensor]  # sums over this rank's tokens (detached), to be all-reduced


def policy_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: AlgorithmConfig, *, global_tokens: float, global_sequences: float,
                reference: torch.Tensor | None = None) -> LossTerms:
    """All tensors are [sequences, tokens]; ``advantages`` is per sequence broadcast over tokens,
    ``mask`` 1 on response tokens. Returns this rank's loss and summed statistics."""
    mask = mask.to(logp.dtype)
    proximal = logp.detach()
    log_weight = (proximal - behaviour) * mask
    if cfg.correction == "none":
        ratio = torch.exp((logp - behaviour) * mask)
        weight = torch.ones_like(logp)
        kept = mask
    else:
        ratio = torch.exp((logp - proximal) * mask)
        raw = torch.exp(log_weight)
        if cfg.correction == "tis":
            weight, kept = torch.clamp(raw, max=cfg.tis_cap), mask
        else:
            weight, kept = raw, mask * (raw <= cfg.tis_cap).to(mask.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv) * weight.detach()
    if reference is not None and cfg.kl_coef > 0:
        delta = (reference - logp) * mask  # k3 estimator of KL(pi || ref): e^d - d - 1
        per_token = per_token + cfg.kl_coef * (torch.exp(delta) - delta - 1)
    per_token = per_token * kept
    if cfg.loss_aggregation == "token":
        loss = per_token.sum() / max(global_tokens, 1.0)
    else:
        lengths = torch.clamp(mask.sum(-1), min=1.0)
        loss = (per_token.sum(-1) / lengths).sum() / max(global_sequences, 1.0)
    with torch.no_grad():
        clip_active = ((ratio - clipped).abs() > 1e-6).to(mask.dtype) * mask
        stats = {
            "tokens": mask.sum(),
            "importance_weight": (torch.exp(log_weight) * mask).sum(),
            # 0 where there are no tokens; no host sync (no branching on the tensor's values)
            "importance_weight_max": torch.cat([(torch.exp(log_weight) * mask).flatten(), mask.new_zeros(1)]).max(),
            "truncated": ((torch.exp(log_weight) > cfg.tis_cap).to(mask.dtype) * mask).sum(),
            "clipped": clip_active.sum(),
            "negative_logp": (-proximal * mask).sum(),
        }
        if reference is not None:
            stats["kl"] = ((torch.exp((reference - proximal) * mask) - (reference - proximal) * mask - 1) * mask).sum()
    return LossTerms(loss, stats)
