"""The workload model: reproducible, truncated, group-correlated lengths and stable pseudo-tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from staleflow.workload import PRESETS, LengthFinish, preset, pseudo_tokens


def lengths(seed: int, name: str = "paper-20k") -> np.ndarray:
    """Response lengths of one training step, shaped (groups, members)."""
    w = preset(name, seed)
    return np.array([[w.target_length(g.group_id, t)[0] for t in g.trajectory_ids] for g in w.groups(0)])


def test_reproducible_from_the_seed_and_different_across_seeds() -> None:
    assert np.array_equal(lengths(7), lengths(7))
    assert not np.array_equal(lengths(7), lengths(8))


def test_paper_presets_have_the_papers_shape() -> None:
    for name, limit in (("paper-20k", 20_480), ("paper-40k", 40_960)):
        w = preset(name)
        assert (w.batch_size, w.group_size, w.max_response_tokens, w.max_prompt_tokens) == (128, 16, limit, 2_048)
        assert w.trajectories_per_step == 2048
        groups = w.groups(3)
        assert len(groups) == 128 and all(len(g.trajectory_ids) == 16 for g in groups)
        assert len({t for g in groups for t in g.trajectory_ids}) == 2048
        assert all(1 <= len(g.prompt_ids) <= 2_048 for g in groups)


def test_lengths_are_truncated_at_the_limit_with_a_long_tail() -> None:
    w = preset("paper-20k", 1)
    results = [w.target_length(g.group_id, t) for g in w.groups(0) for t in g.trajectory_ids]
    truncated = [n for n, finish in results if finish is LengthFinish.LENGTH]
    stopped = [n for n, finish in results if finish is LengthFinish.STOP]
    assert truncated and all(n == 20_480 for n in truncated)
    assert all(1 <= n < 20_480 for n in stopped)
    assert 0.005 < len(truncated) / len(results) < 0.15  # a tail, not the bulk
    assert max(stopped) > 3 * float(np.median(stopped))
    # a smaller max_tokens truncates more
    n, finish = w.target_length("s0-g0", "s0-g0/m0", max_tokens=1)
    assert (n, finish) == (1, LengthFinish.LENGTH)


def test_members_of_a_group_are_correlated() -> None:
    """Appendix C: trajectories of one prompt tend to be all long or all short."""
    log_lengths = np.log(lengths(3))
    between = log_lengths.mean(axis=1).var(ddof=1)
    within = log_lengths.var(axis=1, ddof=1).mean()
    group_size = log_lengths.shape[1]
    icc = (between - within / group_size) / (between - within / group_size + within)
    expected = preset("paper-20k").group_correlation
    assert expected == pytest.approx(0.36 / 0.61)
    assert icc > 0.35  # well above 0: shuffling members across groups would give ~0
    shuffled = np.random.default_rng(0).permutation(log_lengths.ravel()).reshape(log_lengths.shape)
    between_s = shuffled.mean(axis=1).var(ddof=1)
    within_s = shuffled.var(axis=1, ddof=1).mean()
    assert (between_s - within_s / group_size) / (between_s - within_s / group_size + within_s) < 0.15


def test_pseudo_tokens_are_a_pure_function_of_position() -> None:
    whole_tokens, whole_logprobs = pseudo_tokens("traj-1", 5, 0, 300, 512, 0)
    head = pseudo_tokens("traj-1", 5, 0, 120, 512, 0)
    tail = pseudo_tokens("traj-1", 5, 120, 300, 512, 0)
    assert head[0] + tail[0] == whole_tokens and head[1] + tail[1] == whole_logprobs
    assert all(0 < t < 512 for t in whole_tokens)  # never the EOS token 0
    assert all(lp < 0 and math.isfinite(lp) for lp in whole_logprobs)
    assert pseudo_tokens("traj-2", 5, 0, 300, 512, 0)[0] != whole_tokens
    assert pseudo_tokens("traj-1", 6, 0, 300, 512, 0)[0] != whole_tokens
    assert pseudo_tokens("traj-1", 5, 10, 10, 512, 0) == ([], [])


def test_ci_preset_is_tiny_and_unknown_presets_are_refused() -> None:
    w = PRESETS["ci-tiny"]
    assert w.trajectories_per_step == 16 and w.max_response_tokens <= 64
    with pytest.raises(ValueError, match="unknown workload preset 'nope'"):
        preset("nope")
    with pytest.raises(ValueError, match="batch_size"):
        type(w)(**{**w.__dict__, "batch_size": 0})
