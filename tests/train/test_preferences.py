"""Preference pairs: every malformed line refused by file and line, rows encoded as the policy sees
them, the length budget refused or truncated as asked, and synthetic pairs the verifier would judge."""

import json

import numpy as np
import pytest

from meshrl.model.tokenizer import load_tokenizer
from meshrl.rl.envs.mixture import TaskMixture
from meshrl.rl.rewards import answer_reward
from meshrl.train.data import encode_example
from meshrl.train.preferences import encode_pairs, read_pairs, split_pairs
from meshrl.train.synthetic_pairs import policy_error, synthetic_pairs

GOOD = {"prompt": "rev abc=", "chosen": "cba", "rejected": "cab"}


def _write(tmp_path, *lines):
  path = tmp_path / "prefs.jsonl"
  path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
  return str(path)


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": "rev abc=", "chosen": "cba"}, ":3: 'rejected' is missing"),
    ({"prompt": "rev abc=", "chosen": "", "rejected": "cab"}, ":3: 'chosen' is empty"),
    ({"prompt": "rev abc=", "chosen": "cba", "rejected": "   "}, ":3: 'rejected' is empty"),
    ({"chosen": "cba", "rejected": "cab"}, ":3: 'prompt' is missing"),
    ({"prompt": "rev abc=", "chosen": 3, "rejected": "cab"}, ":3: 'chosen' is a int, not a string"),
    ({**GOOD, "margin": "big"}, ":3: 'margin'='big' is not a finite number"),
    ({**GOOD, "margin": float("nan")}, ":3: 'margin'=nan is not a finite number"),
    ({**GOOD, "rejected": "cba"}, ":3: 'chosen' and 'rejected' are the same text"),
    ("{not json", ":3: not JSON (Expecting property name"),
    ("[1, 2]", ":3: a JSON list, not an object"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad, fragment):
  path = _write(tmp_path, GOOD, "", bad, GOOD)  # line 2 is blank, the bad one is line 3
  with pytest.raises(ValueError) as error:
    read_pairs(path, field="rm.train_jsonl")
  assert str(error.value).startswith(path + fragment), str(error.value)
  assert "\n" not in str(error.value)


def test_empty_and_missing_files(tmp_path):
  with pytest.raises(ValueError, match=r"rm.train_jsonl='.*prefs.jsonl' holds no preference pairs"):
    read_pairs(_write(tmp_path, ""), field="rm.train_jsonl")
  with pytest.raises(ValueError, match=r"rm.eval_jsonl='.*nope.jsonl': no such file"):
    read_pairs(str(tmp_path / "nope.jsonl"), field="rm.eval_jsonl")


def test_rows_are_encoded_as_the_policy_sees_prompt_and_answer(tmp_path):
  tokenizer = load_tokenizer()
  pairs = read_pairs(_write(tmp_path, GOOD, {**GOOD, "chosen": "zyxw", "margin": 2}), field="f")
  arrays = encode_pairs(pairs, tokenizer, max_len=16)
  for i, pair in enumerate(pairs):
    for side, tokens, lengths in (("chosen", arrays.chosen, arrays.chosen_lengths),
                                  ("rejected", arrays.rejected, arrays.rejected_lengths)):
      want = encode_example({"prompt": pair.prompt, "answer": getattr(pair, side)}, tokenizer)["tokens"]
      assert lengths[i] == len(want) and tokens[i, -1] == tokenizer.pad_id
      np.testing.assert_array_equal(tokens[i, :lengths[i]], want)
      assert np.all(tokens[i, lengths[i]:] == tokenizer.pad_id)
  np.testing.assert_array_equal(arrays.margins, [0.0, 2.0])


def test_over_budget_is_refused_by_line_or_truncated_when_asked(tmp_path):
  tokenizer = load_tokenizer()
  path = _write(tmp_path, GOOD, {"prompt": "rev " + "a" * 30 + "=", "chosen": "long answer", "rejected": "x"})
  pairs = read_pairs(path, field="rm.train_jsonl")
  with pytest.raises(ValueError, match=rf"^{path}:2: prompt \+ chosen is 48 tokens, longer than rm.max_len=20; "
                                       r"raise rm.max_len or set rm.overflow='truncate'"):
    encode_pairs(pairs, tokenizer, max_len=20)
  arrays = encode_pairs(pairs, tokenizer, max_len=20, overflow="truncate")
  full = encode_example({"prompt": pairs[1].prompt, "answer": "long answer"}, tokenizer)["tokens"]
  assert arrays.chosen_lengths[1] == 20
  np.testing.assert_array_equal(arrays.chosen[1], full[-20:])  # the response and its EOS kept
  with pytest.raises(ValueError, match="rm.overflow='drop' is not one of 'reject', 'truncate'"):
    encode_pairs(pairs, tokenizer, max_len=20, overflow="drop")


def test_split_keeps_a_prompts_pairs_together(tmp_path):
  pairs = read_pairs(_write(tmp_path, GOOD, {**GOOD, "rejected": "bca"}, {**GOOD, "prompt": "rev xyz="}), field="f")
  train, held_out = split_pairs(pairs, lambda prompt: prompt == "rev abc=")
  assert [p.prompt for p in held_out] == ["rev abc="] * 2 and [p.prompt for p in train] == ["rev xyz="]


@pytest.mark.parametrize("task", ["reverse", "sort", "arithmetic"])
def test_synthetic_pairs_are_right_against_wrong_by_the_verifier(task):
  examples = TaskMixture(f"{task}:1.0", seed=5).take(200)
  pairs = synthetic_pairs(examples, seed=5, is_correct=lambda text, ex: answer_reward(text, ex) >= 1.0)
  assert len(pairs) >= 190
  by_prompt = {e["prompt"]: e for e in examples}
  for pair in pairs:
    assert answer_reward(pair.chosen, by_prompt[pair.prompt]) == 1.0
    assert answer_reward(pair.rejected, by_prompt[pair.prompt]) < 1.0
  again = synthetic_pairs(examples, seed=5, is_correct=lambda text, ex: answer_reward(text, ex) >= 1.0)
  assert again == pairs  # seeded
  # Half the rejected sides are other prompts' answers (well formed, wrong here; a near miss may
  # equal one too, often among small sums), the rest near misses.
  answers = {e["answer"] for e in examples}
  others = sum(p.rejected in answers for p in pairs) / len(pairs)
  assert others > 0.35 and (task != "reverse" or others < 0.65), others


def _order_shares(pairs):
  """(share of rejected sides that are the chosen side's symbols in another order, share that are
  the prompt's own order, share written with one symbol throughout where the answer has several)."""
  same = [p for p in pairs if sorted(p.rejected) == sorted(p.chosen)]
  copies = [p for p in pairs if p.rejected == p.chosen[::-1]]
  one_symbol = [p for p in pairs if len(set(p.rejected)) == 1 and len(set(p.chosen)) > 1]
  return len(same) / len(pairs), len(copies) / len(pairs), len(one_symbol) / len(pairs)


@pytest.mark.parametrize("task", ["reverse", "sort"])
def test_policy_error_negatives_are_verifier_wrong_and_teach_order(task):
  """rm.negatives="policy_errors": every chosen side verifier-right, every rejected side
  verifier-wrong, and the rejected sides are mostly the answer's own symbols in another order (the
  prompt's order among them) or one symbol throughout: what near misses rarely give. Fails if the
  option is ignored (the near-miss shares are measured beside it) or a draw the verifier accepts is
  kept as a rejected side."""
  examples = TaskMixture(f"{task}:1.0", seed=5).take(400)
  by_prompt = {e["prompt"]: e for e in examples}
  is_correct = lambda text, ex: answer_reward(text, ex) >= 1.0  # noqa: E731
  pairs = synthetic_pairs(examples, seed=5, is_correct=is_correct, negatives="policy_errors")
  near = synthetic_pairs(examples, seed=5, is_correct=is_correct)
  assert len(pairs) >= 380
  for pair in pairs:
    assert answer_reward(pair.chosen, by_prompt[pair.prompt]) == 1.0
    assert answer_reward(pair.rejected, by_prompt[pair.prompt]) < 1.0
  same, copies, one_symbol = _order_shares(pairs)
  near_same, near_copies, near_one_symbol = _order_shares(near)
  assert same > 0.3 and same > 1.5 * near_same, (same, near_same)
  assert one_symbol > 0.04 and one_symbol > 4 * near_one_symbol, (one_symbol, near_one_symbol)
  if task == "reverse":  # the prompt's order: the error a policy that copies instead of reversing makes
    assert copies > 0.06 and copies > 3 * near_copies, (copies, near_copies)
  assert synthetic_pairs(examples, seed=5, is_correct=is_correct, negatives="policy_errors") == pairs


def test_an_unknown_negatives_kind_is_one_line():
  with pytest.raises(ValueError, match=r"^rm.negatives='on_policy' is not one of 'near_misses', 'policy_errors'.$"):
    synthetic_pairs(TaskMixture("reverse:1.0", seed=5).take(2), seed=5, is_correct=lambda t, e: False,
                    negatives="on_policy")


def test_policy_errors_use_every_symbol_the_answer_lacks():
  """A replaced symbol may be any the answer lacks, the prompt's own "r", "e", "v" included: drawn
  only from outside the prompt, no wrong answer ever held them and RL against that reward model
  wrote "eee" (measured)."""
  rng = np.random.default_rng(0)
  seen = set()
  for _ in range(3000):
    seen |= set(policy_error("cba", rng, sorted(set("revabc"))))
  assert {"r", "e", "v", "z", "0"} <= seen and len(seen - set("cba")) >= 30, sorted(seen)


def test_the_reward_model_job_makes_the_negatives_rm_negatives_names():
  """rl/rewards/rm_job draws both sides' synthetic pairs with rm.negatives (an option dropped on the way
  from the config leaves the near misses: the order shares below fall to theirs)."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards import rm_job  # pylint: disable=import-outside-toplevel
  sizes = ["rm.synthetic_pairs=300", "rm.eval_pairs=300"]
  near = rm_job._synthetic_pairs(configs.load("configs/tiny_rm.py", sizes))  # pylint: disable=protected-access
  errors = rm_job._synthetic_pairs(configs.load("configs/tiny_rm.py", sizes + ["rm.negatives=policy_errors"]))  # pylint: disable=protected-access
  for near_side, errors_side in zip(near, errors):
    assert [p.prompt for p in near_side] == [p.prompt for p in errors_side]
    assert _order_shares(errors_side)[2] > 4 * _order_shares(near_side)[2] + 0.04
