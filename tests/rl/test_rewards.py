"""Host-side reward functions, composition and fault-tolerant scoring."""

import numpy as np
import pytest

from meshrl.rl import rewards


def test_exact_match_strips_and_reads_tags():
  example = {"answer": " cba "}
  assert rewards.exact_match("cba\n", example) == 1.0
  assert rewards.exact_match("answer: cba", example) == 1.0
  assert rewards.exact_match("cb", example) == 0.0


@pytest.mark.parametrize("completion, expected", [
    ("19", 1.0), ("12+7=19", 1.0), ("the answer is 19.", 1.0), ("19.0", 1.0), ("\\boxed{19} 20", 1.0),
    ("answer: 19\nthen 3", 1.0), ("18", 0.0), ("", 0.0), ("nineteen", 0.0), ("19 then 20", 0.0),
])
def test_numeric_match(completion, expected):
  assert rewards.numeric_match(completion, {"answer": "19"}) == expected


def test_numeric_match_signs_commas_fractions():
  assert rewards.numeric_match("5-3", {"answer": "3"}) == 1.0  # "-" after a digit is an operator
  assert rewards.numeric_match("x = -3", {"answer": "-3"}) == 1.0
  assert rewards.numeric_match("1,000", {"answer": "1000"}) == 1.0
  assert rewards.numeric_match("\\boxed{0.5}", {"answer": "1/2"}) == 1.0
  assert rewards.numeric_match("0.3333", {"answer": "1/3"}) == 0.0  # exact comparison
  assert rewards.last_number("no digits") is None


def test_extract_answer_prefers_last_boxed():
  assert rewards.extract_answer("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
  assert rewards.extract_answer("Answer= 42 ok") == "42 ok"
  assert rewards.extract_answer("just 42") is None


def test_format_reward():
  numeric = {"answer": "19"}
  assert rewards.format_reward("19", numeric) == 1.0
  assert rewards.format_reward("\\boxed{19}", numeric) == 1.0
  assert rewards.format_reward("19 apples", numeric) == 0.0
  assert rewards.format_reward("19\n19", numeric) == 0.0
  assert rewards.format_reward("  ", {"answer": "abc"}) == 0.0
  assert rewards.format_reward("xyz", {"answer": "abc"}) == 1.0
  assert rewards.tagged_format("answer: 3", numeric) == 1.0
  assert rewards.tagged_format("3", numeric) == 0.0


def test_countdown_reward_accepts_any_valid_expression():
  example = {"answer": "3*5+7", "numbers": [3, 5, 7], "target": 22}
  for good in ["3*5+7", "7+5*3", "(5*3)+7", " 7 + 3*5 = 22", "answer: 3*5+7", "\\boxed{5*3+7}"]:
    assert rewards.countdown_reward(good, example) == 1.0, good
  for bad in ["22", "3*5+7+0", "3*5*7", "3*5+7-1+1", "5*5-3", "3*5+", "__import__('os')", "3**5",
              "7/0+3*5", "", "(" * 60 + "3*5+7" + ")" * 60]:
    assert rewards.countdown_reward(bad, example) == 0.0, bad


def test_countdown_reward_from_reference_only():
  example = {"answer": "8/2+1"}  # numbers {8, 2, 1}, target 5
  assert rewards.countdown_reward("1+8/2", example) == 1.0
  assert rewards.countdown_reward("8/2-1", example) == 0.0
  assert rewards.expression_value("8/3*3") == 8  # exact arithmetic


def test_answer_reward_dispatches_on_verifier():
  assert rewards.answer_reward("6+8", {"answer": "8+6", "verifier": "countdown",
                                       "numbers": [6, 8], "target": 14}) == 1.0
  assert rewards.answer_reward("19.0", {"answer": "19"}) == 1.0  # auto: numeric
  assert rewards.answer_reward("abc", {"answer": "abc"}) == 1.0  # auto: exact
  with pytest.raises(ValueError, match="verifier='llm'"):
    rewards.answer_reward("x", {"answer": "x", "verifier": "llm"})


def test_compose_weights_from_spec():
  reward = rewards.compose("answer:1.0,format:0.1")
  assert reward("19", {"answer": "19"}) == pytest.approx(1.1)
  assert reward("18", {"answer": "19"}) == pytest.approx(0.1)
  assert reward("18 x", {"answer": "19"}) == 0.0
  assert rewards.parse_weights("answer, format:0.5") == [("answer", 1.0), ("format", 0.5)]
  for bad, match in [("", "names nothing"), ("answer:x", "not a number"), ("answer,answer", "twice"),
                     ("answer:inf", "finite")]:
    with pytest.raises(ValueError, match=match):
      rewards.parse_weights(bad)
  with pytest.raises(ValueError, match="'speed' is unknown"):
    rewards.compose("answer:1,speed:1")


def test_score_batch_counts_raising_reward_without_crashing():
  def broken(completion, example):
    raise RuntimeError("boom")

  def nan_reward(completion, example):
    return float("nan")

  completions = ["19", "3", "abc"]
  examples = [{"answer": "19", "domain": "arithmetic"}, {"answer": "4", "domain": "arithmetic"},
              {"prompt": "no answer", "domain": "reverse"}]
  scores, info = rewards.score_batch({"answer": rewards.answer_reward, "broken": broken,
                                      "nan": nan_reward}, completions, examples)
  np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
  assert scores.dtype == np.float32
  assert info["reward_errors"] == 3 + 3 + 1  # broken x3, nan x3, answer on the row without answer
  assert info["errors_by_fn"] == {"answer": 1, "broken": 3, "nan": 3}
  assert info["first_errors"][0].startswith("answer[2]: KeyError")
  np.testing.assert_array_equal(info["per_fn"]["answer"], [1.0, 0.0, 0.0])
  assert info["by_domain"] == {"arithmetic": 0.5, "reverse": 0.0}


def test_score_batch_with_composed_reward_and_plain_callable():
  scores, info = rewards.score_batch(rewards.compose("answer:2,format:0.5"), ["19", "x"],
                                     [{"answer": "19"}, {"answer": "19"}])
  np.testing.assert_allclose(scores, [2.5, 0.0])
  assert info["reward_errors"] == 0
  scores, _ = rewards.score_batch(rewards.exact_match, ["a"], [{"answer": "a"}])
  np.testing.assert_array_equal(scores, [1.0])
  with pytest.raises(ValueError, match="len"):
    rewards.score_batch(rewards.exact_match, ["a"], [])


def test_overlong_penalty():
  got = rewards.overlong_penalty([5, 8, 10, 12, 14], max_len=12, buffer=4, penalty=1.0)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
  np.testing.assert_array_equal(rewards.overlong_penalty([20], max_len=12, buffer=0), [0.0])
  with pytest.raises(ValueError, match="buffer=13"):
    rewards.overlong_penalty([1], max_len=12, buffer=13)
