"""Generated tasks checked against independent answers (Python's own arithmetic, `sorted`, slicing,
a brute-force countdown search), not against their own verifiers; and the held-out split."""

import ast
import itertools
import json
import operator
import re
from fractions import Fraction

import numpy as np
import pytest

from meshrl import configs
from meshrl.rl import envs
from meshrl.rl.step import driver as loop
from meshrl.rl.step.evaluation import held_out_examples


def _examples(domain, difficulty, count=300):
  return [envs.make_example(domain, np.random.default_rng([11, i]), difficulty=difficulty)
          for i in range(count)]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _python_value(expression: str) -> int:
  """Evaluates + - * over integers with Python's own operators (via its parser)."""
  def walk(node):
    if isinstance(node, ast.BinOp):
      return _OPS[type(node.op)](walk(node.left), walk(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -walk(node.operand)
    assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
    return node.value
  return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_arithmetic_answers_equal_python_arithmetic(difficulty):
  for example in _examples("arithmetic", difficulty):
    assert example["prompt"].endswith("=")
    assert int(example["answer"]) == _python_value(example["prompt"][:-1]), example


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_sequence_answers_equal_sorted_and_slicing(difficulty):
  for domain, expected in (("reverse", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s))),
                           ("copy", lambda s: s)):
    for example in _examples(domain, difficulty, 100):
      match = re.fullmatch(r"(rev|sort|copy) (\w+)=", example["prompt"])
      assert match, example
      assert example["answer"] == expected(match.group(2)), example


def _reachable(numbers, target) -> bool:
  """Brute force: can + - * / over all of `numbers` (each once) make `target` exactly?"""
  values = [Fraction(n) for n in numbers]

  def search(vals):
    if len(vals) == 1:
      return vals[0] == target
    for i, j in itertools.permutations(range(len(vals)), 2):
      rest = [v for k, v in enumerate(vals) if k not in (i, j)]
      a, b = vals[i], vals[j]
      candidates = [a + b, a - b, a * b] + ([a / b] if b else [])
      if any(search(rest + [c]) for c in candidates):
        return True
    return False
  return search(values)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_countdown_targets_are_reachable_by_brute_force(difficulty):
  for example in _examples("countdown", difficulty, 40):
    numbers, target = example["numbers"], example["target"]
    assert example["prompt"] == f"{target} from {' '.join(map(str, numbers))}="
    assert _reachable(numbers, target), example


def test_held_out_prompts_never_appear_in_training():
  cfg = configs.load("configs/tiny.py", ["eval.num_prompts=30", "data.tasks=arithmetic:1.0"])
  held_out = {e["prompt"] for e in held_out_examples(cfg)}
  assert 15 <= len(held_out) <= 30  # single-digit arithmetic has few distinct held-out prompts
  source = loop.train_source(cfg)
  trained = {source[i]["prompt"] for i in range(3000)}
  assert not held_out & trained
  assert len(trained) > 100  # and training still sees most of the prompt space
  everything = envs.TaskMixture(cfg.data.tasks, seed=cfg.seed)
  assert held_out <= {everything[i]["prompt"] for i in range(5000)}  # the split is of the same tasks


def test_eval_jsonl_overlapping_training_is_refused(tmp_path):
  rows = '{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": "4"}\n'
  (tmp_path / "train.jsonl").write_text(rows)
  (tmp_path / "eval.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
  cfg = configs.load("configs/tiny.py", [f"data.jsonl={tmp_path / 'train.jsonl'}", "data.tasks=",
                                         f"eval.jsonl={tmp_path / 'eval.jsonl'}", "eval.every=10"])
  source = loop.train_source(cfg)
  with pytest.raises(ValueError, match=r"eval.jsonl=.*shares 1 prompt\(s\) with the training data, e.g. '2\+2='"):
    held_out_examples(cfg, train_prompts=[e["prompt"] for e in source.pools["jsonl"]])


@pytest.mark.parametrize("tasks", ["", "reverse:1.0"])
def test_a_files_held_out_rows_are_the_ones_evaluated(tmp_path, tasks):
  """Without eval.jsonl, evaluation drew only data.tasks' held-out side: a run on data.jsonl alone
  (data.tasks empty, as docs/rl-on-your-data.md shows) stopped with "tasks='' names nothing", and one
  beside a task family never evaluated a row of its file. Now the held-out examples are the eval side
  of the training mixture: every file row on that side of the split (and the family's), none that
  training draws."""
  from meshrl.rl.envs.mixture import in_eval_split  # pylint: disable=import-outside-toplevel
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "domain": "add"} for a in range(20) for b in range(10)]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = configs.load("configs/tiny.py", [f"data.jsonl={tmp_path / 'train.jsonl'}", f"data.tasks={tasks}",
                                         "eval.num_prompts=400"])
  held_out = held_out_examples(cfg)
  held_file = {e["prompt"] for e in held_out if e.get("domain") == "add"}
  expected = {r["prompt"] for r in rows if in_eval_split(r["prompt"], cfg.data.eval_fraction)}
  assert 10 <= len(expected) <= 80 and held_file == expected  # the file's whole held-out side
  assert {e["domain"] for e in held_out} == ({"add"} if not tasks else {"add", "reverse"})
  source = loop.train_source(cfg)
  trained = {source[i]["prompt"] for i in range(2000)}
  assert not {e["prompt"] for e in held_out} & trained
  assert len(trained & {r["prompt"] for r in rows}) > 100
