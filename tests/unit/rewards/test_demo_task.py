"""The demo's warm-up targets: a direct boxed answer, or a worked answer that opens its box only
after the job's response budget, so that, cut off there, it earns nothing from the verifier."""

from __future__ import annotations

import random

import pytest

from staleflow.rewards import verify_math
from staleflow.tasks import ArithmeticTask
from staleflow.training.demo import DemoSpec, response_text, warmup_response, worked_text


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_both_targets_are_right_when_read_in_full(ops: str) -> None:
    task = ArithmeticTask(3, digits=2, ops=ops)
    for i in range(50):
        p = task.prompt(i)
        assert verify_math(response_text(p.answer), p.answer)[0] == 1.0
        assert verify_math(worked_text(p.text, p.answer), p.answer)[0] == 1.0


def test_a_worked_answer_cut_before_its_box_earns_nothing() -> None:
    task = ArithmeticTask(0, digits=2, ops="+")
    for i in range(200):
        p = task.prompt(i)
        text = worked_text(p.text, p.answer)
        cut = text[:text.index("\\boxed")]
        assert verify_math(cut, p.answer)[0] == 0.0


def test_warmup_mixes_the_targets_in_the_configured_share() -> None:
    rng = random.Random(0)
    p = ArithmeticTask(0, digits=2, ops="+").prompt(0)
    targets = [warmup_response(p.text, p.answer, rng, 0.25) for _ in range(4000)]
    share = sum(t == response_text(p.answer) for t in targets) / len(targets)
    assert 0.22 < share < 0.28
    assert all(t == response_text(p.answer) for t in (warmup_response(p.text, p.answer, rng, 1.0) for _ in range(50)))


def test_worked_text_refuses_a_prompt_that_is_not_the_task() -> None:
    with pytest.raises(ValueError):
        worked_text("What is the capital of France?", "Paris")


def test_the_spec_names_the_concise_share() -> None:
    assert 0 < DemoSpec().concise_fraction < 1
