"""Rewards: the math verifier's rules and its bounds on hostile input, every verifier in worker
processes under a deadline per item, timeouts that replace a stuck worker (counted), health probes
that answer while a batch is scored, and the REST batch endpoint."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.api.base import ServiceError
from staleflow.api.reward import RewardClient, RewardOut
from staleflow.rewards import RewardRequest, RewardScorer, VerifierError, answers_equal, extract_answer, normalize, verify_math
from staleflow.rewards.math_verify import MAX_EXPONENT, parse_number
from staleflow.servers.http import serve_in_thread
from staleflow.servers.reward import RewardConfig, create_app

# ---------------------------------------------------------------- user verifiers (imported by the workers)


def half_credit(response_text: str, answer: str) -> tuple[float, str]:
    return (0.5, "half") if answer in response_text else (0.0, "absent")


def hangs(response_text: str, answer: str) -> float:
    while True:
        time.sleep(1)


def raises(response_text: str, answer: str) -> float:
    raise RuntimeError("verifier bug")


def not_a_reward(response_text: str, answer: str) -> object:
    return ["nope"]


def spins(response_text: str, answer: str) -> float:
    while True:  # computes without sleeping: holds its interpreter's lock the whole time
        pass


USER_VERIFIERS = {"half": f"{__name__}:half_credit", "hang": f"{__name__}:hangs", "raise": f"{__name__}:raises",
                  "bad": f"{__name__}:not_a_reward", "spin": f"{__name__}:spins"}
TIMEOUT_S = 0.5

# ---------------------------------------------------------------- the math verifier


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("nested: \\boxed{\\frac{1}{\\frac{1}{2}}} done", "\\frac{1}{\\frac{1}{2}}", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("Natalia sold 48 clips.\n#### 1,234", "1234", 1.0),
    ("#### -7", "-7", 1.0),
    ("\\boxed{1,000,000}", "1000000", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("The final answer is $\\frac{7}{3}$. I hope it is correct.", "\\frac{7}{3}", 1.0),
    ("\\boxed{2.50}", "\\frac{5}{2}", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed 5", "5", 1.0),
    ("the answer: 12 apples", "12", 1.0),
    ("\\boxed{x^2+1}", "x^{2}+1", 1.0),
    ("\\boxed{\\$12.50}", "12.5", 1.0),
    ("I think it is 7 or 8", "8", 1.0),  # the last number, when nothing says "answer"
    ("\\boxed{0.333}", "\\frac13", 0.0),  # rounded is not equal
    ("\\boxed{(1,2)}", "[1,2]", 0.0),  # open and closed intervals differ
    ("\\boxed{12}", "-12", 0.0),
    ("\\boxed{4} but the answer is 5", "5", 0.0),  # the boxed answer wins
    ("I don't know", "8", 0.0),
])
def test_math_verifier_table(response: str, answer: str, reward: float) -> None:
    assert verify_math(response, answer)[0] == reward


def test_math_verifier_reasons() -> None:
    assert verify_math("\\boxed{3}", "3")[1] == "correct"
    assert verify_math("\\boxed{4}", "3")[1] == "wrong_answer"
    assert verify_math("no digits here", "3")[1] == "no_answer"
    assert extract_answer("a \\boxed{1} b \\boxed{\\{2\\}}") == ("\\{2\\}", "boxed")
    assert extract_answer("#### 9\nThe answer is 10") == ("9", "gsm8k")


@given(st.integers(min_value=-10**15, max_value=10**15))
def test_a_number_equals_its_comma_formatted_form(n: int) -> None:
    assert answers_equal(f"{n:,}", str(n))
    assert answers_equal(f"\\boxed{{{n:,}}}", str(n)) or verify_math(f"\\boxed{{{n:,}}}", str(n))[0] == 1.0
    assert not answers_equal(str(n), str(n + 1))


@given(st.integers(-10**6, 10**6), st.integers(1, 10**6))
def test_latex_fraction_slash_fraction_and_decimal_agree(p: int, q: int) -> None:
    value = Fraction(p, q)
    assert answers_equal(f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}")
    assert answers_equal(f"\\dfrac{{{p}}}{{{q}}}", f"{value.numerator}/{value.denominator}")
    if value.denominator in (1, 2, 4, 5, 8, 10, 16, 20, 25, 40, 50, 100):  # terminating decimals
        assert answers_equal(f"\\frac{{{p}}}{{{q}}}", format(value.numerator / value.denominator, ".10f"))


@given(st.text(alphabet="0123456789+-*/^(){}[],.=x \\frac", max_size=40))
def test_normalisation_is_idempotent(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once


NESTED_BRACES = st.recursive(st.text(alphabet="abc123+-", max_size=5),
                             lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner), max_leaves=8)


@given(NESTED_BRACES)
def test_boxed_extraction_keeps_nested_braces(content: str) -> None:
    assert extract_answer(f"so \\boxed{{{content}}} is it")[0] == content


# ---------------------------------------------------------------- hostile input, bounded

# strings a policy can write by itself, each of which once held the reward server for 24-95 s
HUGE_EXPONENT = "\\boxed{1e10000000}"
UNCLOSED_BOXES = "\\boxed{" * 8000
NESTED_FRACTIONS = "\\frac{1}{" * 4000
PROBE_STRINGS = [HUGE_EXPONENT, UNCLOSED_BOXES, NESTED_FRACTIONS,
                 "\\boxed{" + "\\frac{1}{" * 4000 + "2" + "}" * 8000 + "}"]


def test_a_number_beyond_the_bounds_is_not_evaluated() -> None:
    assert parse_number("1e10000000") is None
    assert parse_number(f"1e{MAX_EXPONENT + 1}") is None
    assert parse_number("9" * 5000) is None
    assert parse_number(f"2e{MAX_EXPONENT}") == Fraction(2 * 10**MAX_EXPONENT)
    assert answers_equal("1e10000000", "1e10000000")  # the same text is still the same answer
    assert not answers_equal("1e10000000", "1e10000001")
    assert verify_math(HUGE_EXPONENT, "1e10000000")[:2] == (1.0, "correct")


def test_deep_fraction_nesting_is_left_as_written() -> None:
    deep = "\\frac{1}{" * 200 + "2" + "}" * 200
    assert "\\frac" in normalize(deep) and normalize(deep) == normalize(normalize(deep))
    assert normalize("\\frac{1}{\\frac{1}{2}}") == "1/(1/2)"  # shallow nesting still converts


@pytest.fixture(scope="module")
def deadline_scorer() -> Iterator[RewardScorer]:
    s = RewardScorer(USER_VERIFIERS, workers=2, timeout_s=DEADLINE_S)
    yield s
    s.close()


DEADLINE_S = 5.0
SLACK_S = 20.0  # a killed worker's replacement may have to start before the next call runs
RESULT_REASONS = {"correct", "wrong_answer", "no_answer", "timeout"}


def test_the_probe_strings_score_a_result_within_the_deadline(deadline_scorer: RewardScorer) -> None:
    start = time.monotonic()
    verdicts = deadline_scorer.score([RewardRequest(text, "7") for text in PROBE_STRINGS])
    assert time.monotonic() - start < DEADLINE_S + SLACK_S
    assert [v.reason for v in verdicts] == ["wrong_answer", "no_answer", "wrong_answer", "wrong_answer"]


def test_a_built_in_verifier_that_overruns_its_deadline_is_killed_and_counted() -> None:
    with RewardScorer(workers=1, timeout_s=1e-4) as scorer:
        verdict = scorer.score([RewardRequest("1 + " * 50_000 + "\\boxed{2}", "2")])[0]
        assert (verdict.reward, verdict.reason) == (0.0, "timeout")
        assert scorer.pool.timeouts == 1 and scorer.pool.replaced == 1


ADVERSARIAL_PIECES = ["\\boxed{", "\\fbox{", "\\boxed ", "\\frac{1}{", "\\frac", "\\dfrac{", "{", "}", "\\{",
                      "1e10000000", "1e-99999999", "9" * 300, "-.5", "1/0", "0/0", ",", "(", ")", "[", "]",
                      "\\text{", "\\sqrt", "^\\circ", "\\left(", "\\right)", "$", "\\%", "answer is ",
                      "#### ", " ", "\n", ". I hope", "x = ", "\\,", "cm ", "1,234", "e", "."]
ADVERSARIAL_TEXT = st.lists(st.tuples(st.sampled_from(ADVERSARIAL_PIECES), st.integers(1, 3000)),
                            min_size=1, max_size=6).map(lambda runs: "".join(piece * n for piece, n in runs))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ADVERSARIAL_TEXT, st.sampled_from(["1", "1e10000000", "\\frac{1}{2}", "(1,2)"]))
def test_any_response_returns_within_its_deadline(deadline_scorer: RewardScorer, text: str, reference: str) -> None:
    text = text[:200_000]  # the server's max_chars
    start = time.monotonic()
    verdict = deadline_scorer.pool.call("math", text, reference)
    assert time.monotonic() - start < DEADLINE_S + SLACK_S
    assert verdict.reason in RESULT_REASONS, verdict


def test_health_probes_answer_while_a_batch_is_scored(deadline_scorer: RewardScorer) -> None:
    config = RewardConfig(port=0, verifiers=USER_VERIFIERS, timeout_s=DEADLINE_S)
    batch = [{"id": i, "response_text": text, "answer": "1"} for i, text in enumerate(PROBE_STRINGS)]
    batch += [{"id": "spin", "response_text": "x", "answer": "1", "verifier": "spin"}]
    with serve_in_thread(create_app(config, deadline_scorer)) as server, RewardClient(server.url) as client, \
            RewardClient(server.url, timeout=5.0) as prober:
        results: list[list[RewardOut]] = []
        scoring = threading.Thread(target=lambda: results.append(client.score(batch)))
        scoring.start()
        probes = 0
        while scoring.is_alive():
            assert prober.health().status == "ok"  # raises if a probe goes unanswered for 5 s
            probes += 1
            scoring.join(0.05)
        assert probes >= 1 and results, "the batch did not come back"
        assert [r.reason for r in results[0]][-1] == "timeout"
        assert prober.health().timeouts == {"spin": 1}
        assert 'staleflow_reward_timeouts_total{verifier="spin"} 1.0' in prober.http.get("/metrics").text


# ---------------------------------------------------------------- user verifiers in processes


@pytest.fixture(scope="module")
def scorer() -> Iterator[RewardScorer]:
    s = RewardScorer(USER_VERIFIERS, workers=2, timeout_s=TIMEOUT_S)
    yield s
    s.close()


def test_user_verifiers_by_name_and_by_path(scorer: RewardScorer) -> None:
    verdicts = scorer.score([
        RewardRequest("it is 42", "42", "half"),
        RewardRequest("it is 41", "42", f"{__name__}:half_credit"),
        RewardRequest("\\boxed{42}", "42"),  # the default: math
        RewardRequest(" 42 ", "42", "exact"),
        RewardRequest("x", "42", "raise"),
        RewardRequest("x", "42", "bad"),
    ])
    assert [(v.reward, v.reason) for v in verdicts] == [
        (0.5, "half"), (0.0, "absent"), (1.0, "correct"), (1.0, "correct"), (0.0, "error"), (0.0, "error")]
    assert "verifier bug" in verdicts[4].detail
    with pytest.raises(VerifierError, match="unknown verifier 'os:system'"):
        scorer.score([RewardRequest("x", "y", "os:system")])  # only configured code runs


def test_a_hanging_verifier_times_out_and_later_calls_still_work(scorer: RewardScorer) -> None:
    replaced = scorer.pool.replaced
    start = time.monotonic()
    verdicts = scorer.score([RewardRequest("x", "y", "hang"), RewardRequest("it is 42", "42", "half")])
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S, "the hanging verifier held the call"
    assert (verdicts[0].reward, verdicts[0].reason) == (0.0, "timeout")
    assert verdicts[1].reward == 0.5
    assert scorer.pool.replaced == replaced + 1
    # the replacement worker serves the next calls, the stuck one is gone
    again = scorer.score([RewardRequest("it is 42", "42", "half") for _ in range(6)])
    assert [v.reward for v in again] == [0.5] * 6
    assert all(w.process.is_alive() for w in scorer.pool._live)


def test_a_verifier_that_does_not_import_fails_at_startup() -> None:
    with pytest.raises(VerifierError, match="cannot import 'no_such_module'"):
        RewardScorer({"broken": "no_such_module:score"}, workers=1)
    with pytest.raises(VerifierError, match="taken by a built-in"):
        RewardScorer({"math": f"{__name__}:half_credit"})


# ---------------------------------------------------------------- REST


def test_rest_batch_endpoint(scorer: RewardScorer) -> None:
    config = RewardConfig(port=0, verifiers=USER_VERIFIERS, timeout_s=TIMEOUT_S, max_batch=8, max_chars=1000)
    with serve_in_thread(create_app(config, scorer)) as server, RewardClient(server.url) as client:
        assert client.health().status == "ok"
        results = client.score([
            {"id": "a", "response_text": "so \\boxed{\\frac{1}{2}}", "answer": "0.5"},
            {"id": 7, "response_text": "The answer is 3", "answer": "4", "verifier": "math"},
            {"id": "c", "response_text": "42", "answer": "42", "verifier": "half"},
            {"id": "d", "response_text": "", "answer": "1", "verifier": "hang"},
        ])
        assert [(r.id, r.reward, r.reason) for r in results] == [
            ("a", 1.0, "correct"), (7, 0.0, "wrong_answer"), ("c", 0.5, "half"), ("d", 0.0, "timeout")]
        with pytest.raises(ServiceError) as unknown:
            client.score([{"id": 1, "response_text": "x", "answer": "y", "verifier": "nope"}])
        assert unknown.value.status == 422 and "known: exact, math" in unknown.value.detail
        with pytest.raises(ServiceError) as too_many:
            client.score([{"id": i, "response_text": "x", "answer": "y"} for i in range(9)])
        assert too_many.value.status == 413
        with pytest.raises(ServiceError) as too_long:
            client.score([{"id": 1, "response_text": "x" * 1001, "answer": "y"}])
        assert too_long.value.status == 413
        with pytest.raises(ServiceError) as malformed:
            client.score([{"id": 1, "answer": "y"}])
        assert malformed.value.status == 422
        assert client.verifiers().user["half"] == USER_VERIFIERS["half"]
