"""The trainer's learning-rate schedule, a pure function of the optimizer step (no torch)."""

from __future__ import annotations

import math

from staleflow.config import AlgorithmConfig


def learning_rate(cfg: AlgorithmConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``: a linear warm-up
    over ``lr_warmup_steps`` steps (step s uses lr * (s + 1) / (warm-up + 1)), then constant or
    decayed (cosine or linear) to ``lr_min_ratio * lr`` at the last step. A pure function of the
    step, so a trainer resumed from a checkpoint continues the same schedule."""
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    if cfg.lr_decay == "constant":
        return cfg.lr
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_decay == "cosine" else 1 - progress
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * shape)
