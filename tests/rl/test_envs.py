"""Generated task domains, the mixture sampler and JSONL loading."""

import json

import numpy as np
import pytest

from meshrl.rl import envs, rewards

# "code" grades by running programs in the sandbox; its own tests: tests/rl/test_code_reward.py.
GENERATED = sorted(name for name in envs.DOMAINS if name != "code")


def _examples(domain, difficulty, count=200, seed=0):
  return [envs.make_example(domain, np.random.default_rng([seed, i]), difficulty=difficulty)
          for i in range(count)]


@pytest.mark.parametrize("domain", GENERATED)
def test_every_level_verifies_its_own_answer_and_rejects_a_wrong_one(domain):
  family = envs.DOMAINS[domain]
  assert family.verifier in rewards.VERIFIERS
  assert family.levels >= 3
  for difficulty in range(1, family.levels + 1):
    for example in _examples(domain, difficulty):
      assert set(example) >= {"prompt", "answer", "domain", "verifier", "difficulty"}
      assert example["domain"] == domain and example["difficulty"] == difficulty
      assert rewards.answer_reward(example["answer"], example) == 1.0, example
      assert rewards.answer_reward(example["answer"] + "7", example) == 0.0, example
      assert rewards.answer_reward("", example) == 0.0, example


@pytest.mark.parametrize("domain", GENERATED)
def test_level_one_is_short_for_a_byte_model(domain):
  for example in _examples(domain, 1):
    assert len(example["prompt"].encode()) <= 20, example
    assert len(example["answer"].encode()) <= 8, example


def test_harder_levels_are_longer():
  for domain in GENERATED:
    lengths = [np.mean([len(e["prompt"]) + len(e["answer"]) for e in _examples(domain, d, 50)])
               for d in range(1, envs.DOMAINS[domain].levels + 1)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], (domain, lengths)


def test_hand_checked_examples():
  assert rewards.answer_reward("19", {"prompt": "12+7=", "answer": "19", "verifier": "numeric"}) == 1.0
  example = envs.make_example("countdown", np.random.default_rng(1), difficulty=2)
  numbers, target = example["numbers"], example["target"]
  assert example["prompt"] == f"{target} from {' '.join(map(str, numbers))}="
  assert rewards.expression_value(example["answer"]) == target


def test_mixture_is_deterministic_and_random_access():
  spec = "arithmetic:1.0,reverse:0.5,countdown:0.5"
  first = envs.TaskMixture(spec, difficulty=2, seed=7).take(50)
  assert first == envs.TaskMixture(spec, difficulty=2, seed=7).take(50)
  assert first != envs.TaskMixture(spec, difficulty=2, seed=8).take(50)
  mixture = envs.TaskMixture(spec, difficulty=2, seed=7)
  assert mixture[30] == first[30] and mixture.take(5, start=10) == first[10:15]
  iterator = iter(mixture)
  assert [next(iterator) for _ in range(3)] == first[:3]


def test_mixture_follows_weights():
  counts = {}
  for example in envs.TaskMixture("arithmetic:3,sort:1", seed=0).take(2000):
    counts[example["domain"]] = counts.get(example["domain"], 0) + 1
  assert set(counts) == {"arithmetic", "sort"}
  assert 0.7 < counts["arithmetic"] / 2000 < 0.8


def test_mixture_pools_and_errors():
  pool = [{"prompt": "hi=", "answer": "ho", "domain": "user"}]
  mixture = envs.TaskMixture("user:1", pools={"user": pool}, seed=0)
  assert mixture[5] == pool[0] and mixture[5] is not pool[0]
  for spec, kwargs, match in [("chess:1", {}, "'chess' is unknown"),
                              ("arithmetic:0", {}, "must be positive"),
                              ("countdown:1", {"difficulty": 4}, "difficulty=4"),
                              ("user:1", {"pools": {"user": []}}, "empty")]:
    with pytest.raises(ValueError, match=match):
      envs.TaskMixture(spec, **kwargs)


def _write(tmp_path, lines):
  path = tmp_path / "tasks.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_jsonl_skips_and_counts_bad_rows(tmp_path):
  path = _write(tmp_path, [
      json.dumps({"prompt": "2+2=", "answer": 4, "domain": "arithmetic"}),
      "{not json",
      json.dumps({"answer": "x"}),  # no prompt
      "",
      json.dumps({"prompt": "rev ab=", "answer": "ba", "extra": 1}),
      json.dumps(["a list"]),
      json.dumps({"prompt": "q", "answer": None}),
  ])
  loaded = envs.load_jsonl(path)
  assert loaded.num_bad == 4 and loaded.bad_lines == [2, 3, 6, 7]
  assert loaded.examples[0] == {"prompt": "2+2=", "answer": "4", "domain": "arithmetic",
                                "verifier": "numeric"}
  assert loaded.examples[1] == {"prompt": "rev ab=", "answer": "ba", "domain": "jsonl", "extra": 1}
  assert rewards.answer_reward("4", loaded.examples[0]) == 1.0


def test_jsonl_strict_mode_names_the_line(tmp_path):
  path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"}), json.dumps({"answer": "x"})])
  with pytest.raises(ValueError, match=r"tasks.jsonl:2: .*'prompt'"):
    envs.load_jsonl(path, skip_bad=False)
