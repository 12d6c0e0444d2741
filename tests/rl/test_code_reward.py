"""The "code" reward (rl/rewards/code.py) and the "code" task family (rl/envs/code_tasks.py)."""

import concurrent.futures
import time

import numpy as np
import pytest

from meshrl.rl import envs, rewards, sandbox
from meshrl.rl.envs import code_tasks
from meshrl.rl.rewards import code

DOUBLE = {"tests": [{"call": f"double({x})", "expected": 2 * x} for x in (1, 2, 3, 4)]}


@pytest.fixture(scope="module")
def pool():
  try:
    with sandbox.SandboxPool(2, limits=code.DEFAULT_LIMITS) as shared:
      yield shared
  except sandbox.SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run).
    pytest.skip(f"bubblewrap unavailable: {error}")


@pytest.fixture(scope="module")
def strict(pool):
  return code.CodeReward(partial=False, pool=pool)


@pytest.fixture(scope="module")
def partial(pool):
  return code.CodeReward(partial=True, pool=pool)


def _fenced(source):
  return f"Here it is:\n```python\n{source}\n```\nDone."


def _tasks_covering_every_template(per_template=1):
  """Generated tasks (seeded), drawn until every template of every level appears."""
  tasks, counts = [], {}
  for seed in range(400):
    difficulty = 1 + seed % code_tasks.LEVELS
    example = envs.make_example("code", np.random.default_rng([seed]), difficulty=difficulty)
    key = (difficulty, example["entry_point"])
    if counts.get(key, 0) < per_template:
      counts[key] = counts.get(key, 0) + 1
      tasks.append(example)
  expected = {(d, t.name) for d, ts in code_tasks.TEMPLATES.items() for t in ts}
  assert set(counts) == expected and min(counts.values()) == per_template
  return tasks


def test_extract_code():
  assert code.extract_code("```python\na = 1\n```") == "a = 1\n"
  assert code.extract_code("```py\nx\n```\ntext\n```\nlast\n```") == "last\n"
  assert code.extract_code("def f(): pass") == "def f(): pass"


def test_reference_answers_agree_with_independent_expected_values():
  """In-process check of the generator (trusted code): reference source vs the separate
  implementation that produced each test's expected value."""
  for difficulty in range(1, code_tasks.LEVELS + 1):
    for seed in range(150):
      example = envs.make_example("code", np.random.default_rng([seed, difficulty]),
                                  difficulty=difficulty)
      namespace = {}
      exec(example["answer"], namespace)  # pylint: disable=exec-used
      assert example["verifier"] == "code" and example["domain"] == "code"
      assert len(example["tests"]) >= 4
      for test in example["tests"]:
        got = eval(test["call"], namespace)  # pylint: disable=eval-used
        assert got == test["expected"] and type(got) is type(test["expected"]), (example, test)
      assert example["entry_point"] in example["prompt"] and "```python" in example["prompt"]


def test_every_template_reference_scores_one_and_wrong_answers_score_less(strict, partial):
  tasks = _tasks_covering_every_template()
  references = [_fenced(task["answer"]) for task in tasks]
  constant = [_fenced(f"def {task['entry_point']}(*args):\n    return 0") for task in tasks]
  start = time.monotonic()
  assert strict.rewards(references, tasks).tolist() == [1.0] * len(tasks)
  assert strict.rewards([""] * len(tasks), tasks).tolist() == [0.0] * len(tasks)
  wrong = partial.rewards(constant, tasks)
  assert (wrong < 1.0).all(), [t["prompt"] for t, w in zip(tasks, wrong) if w >= 1.0]
  assert time.monotonic() - start < 60


def test_partial_credit_is_the_fraction_passed(strict, partial):
  half = _fenced("def double(x):\n    return 2 * x if x < 3 else 0")
  assert partial(half, DOUBLE) == 0.5 and strict(half, DOUBLE) == 0.0
  score = strict.score(half, DOUBLE)
  assert (score.passed, score.total, score.reason) == (2, 4, None)
  assert score.errors[0] == "test 2: wrong value"
  assert strict(_fenced("def double(x):\n    return x + x"), DOUBLE) == 1.0


def test_assert_string_tests_and_tests_that_raise(partial):
  example = {"tests": ["assert double(2) == 4", "assert double(3) == 7", "def (:",
                       {"call": "double(1 / 0)", "expected": 0}, {"call": "double(5)",
                                                                  "expected": 10}]}
  score = partial.score(_fenced("def double(x):\n    return 2 * x"), example)
  assert (score.passed, score.total) == (2, 5)
  assert any("SyntaxError" in e for e in score.errors)


def test_cheating_candidates_get_no_credit(partial):
  cheats = {
      "always-equal object": "class Any:\n  def __eq__(self, other): return True\n"
                             "def double(x):\n  return Any()",
      "bool for int": "def double(x):\n  return True",
      "exit before tests": "import os\nos._exit(0)",
      "sys.exit at import": "import sys\nsys.exit(0)",
      "fake summary lines": "import sys\nfor n in range(50):\n  print('0' * 32, '{\"passed\": 4, "
                            "\"total\": 4, \"errors\": []}')\nsys.stdout.flush()\n"
                            "def double(x): return None",
      "read expected values": "import json\nT = json.load(open('tests.json'))\n"
                              "def double(x): return T",
      "peek at the parent": "import os\nM = open(f'/proc/{os.getppid()}/mem', 'rb')\n"
                            "def double(x): return None",
      "write fake results": "import os\nfor i in range(4):\n  os.write(3, b'{\"i\": %d, \"ok\": true}\\n' % i)\n"
                            "def double(x): return None",
  }
  for name, source in cheats.items():
    score = partial.score(_fenced(source), DOUBLE)
    assert score.passed == 0, (name, score)


def test_a_hanging_sample_delays_only_itself(pool):
  reward = code.CodeReward(partial=True, pool=pool,
                           limits=sandbox.Limits(timeout_s=6.0, cpu_s=12, memory_mb=256))
  hang = _fenced("def double(x):\n  if x == 3:\n    while True: pass\n  return 2 * x")
  good = _fenced("def double(x):\n  return 2 * x")
  finished = {}
  start = time.monotonic()

  def score(name, completion):
    value = reward(completion, DOUBLE)
    finished[name] = time.monotonic() - start
    return value

  with concurrent.futures.ThreadPoolExecutor(4) as threads:  # as the RL loop calls rewards
    futures = {name: threads.submit(score, name, completion)
               for name, completion in [("hang", hang), ("good1", good), ("good2", good),
                                        ("good3", good)]}
    values = {name: future.result() for name, future in futures.items()}
  assert values == {"hang": 0.5, "good1": 1.0, "good2": 1.0, "good3": 1.0}
  assert finished["hang"] >= 5.0  # a wide margin: the good samples take ~0.1 s alone, ~2 s on a busy machine
  assert max(finished[k] for k in ("good1", "good2", "good3")) < finished["hang"]


def test_bad_examples_raise_clear_errors_and_batches_survive(strict):
  for example, match in [({}, "no 'tests'"), ({"tests": []}, "non-empty list"),
                         ({"tests": "assert True"}, "non-empty list"),
                         ({"tests": [{"call": 3}]}, r"tests\[0\]"),
                         ({"tests": [{"call": "f()", "expected": object()}]}, "JSON")]:
    with pytest.raises(ValueError, match=match):
      strict("x", example)
  total, info = rewards.score_batch({"code": strict}, ["def double(x): return 2*x", "x"],
                                    [DOUBLE, {"prompt": "no tests"}])
  assert total.tolist() == [1.0, 0.0] and info["reward_errors"] == 1
  assert "no 'tests'" in info["first_errors"][0]
  scores = strict.score_many(["def double(x): return 2*x", "x"], [DOUBLE, {}])
  assert scores[0].passed == 4 and isinstance(scores[1], ValueError)


def test_binary_garbage_and_crashes_are_recorded(strict):
  garbage = strict.score("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 100)\n"
                         "def double(x): return 2 * x", DOUBLE)
  assert garbage.passed == 4  # the candidate's own stdout goes nowhere near the grading
  crash = strict.score("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", DOUBLE)
  assert crash.passed == 0


def test_code_domain_in_the_mixture_and_registries(strict):
  assert {"code", "code_partial"} <= set(rewards.REWARDS)
  assert envs.DOMAINS["code"].verifier == "code" and "code" in rewards.VERIFIERS
  examples = envs.TaskMixture("code:1,arithmetic:1", difficulty=2, seed=3).take(12)
  code_examples = [e for e in examples if e["domain"] == "code"]
  assert code_examples and all(e["verifier"] == "code" for e in code_examples)
  assert rewards.compose("code_partial:1.0").terms[0][2].partial
  # The "answer" reward routes by the example's verifier to the sandboxed code reward.
  assert rewards.answer_reward(code_examples[0]["answer"], code_examples[0]) == 1.0
