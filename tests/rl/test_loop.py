"""The RL driver: bad input is refused or counted, and a short warm start + GRPO run learns."""

import json
import os

import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl import loop
from meshrl.rl.batch import next_prompts, score_rollout, select_groups

TOK = ByteTokenizer()


def test_group_size_one_rejected_for_grpo():
  cfg = configs.load("configs/tiny.py", ["rl.group_size=1"])
  with pytest.raises(ValueError, match="needs rl.group_size >= 2, got 1"):
    loop.check_config(cfg)


def test_batch_must_divide_data_parallel_axes():
  cfg = configs.load("configs/tiny.py", ["rl.prompts_per_step=3", "rl.group_size=2", "mesh.fsdp=4",
                                         "mesh.tensor=2"])
  with pytest.raises(ValueError, match="6 sequences.*data\\*fsdp\\*expert = 4"):
    loop.check_config(cfg, 8)


def test_long_prompts_truncated_or_rejected_and_counted():
  examples = iter([{"prompt": "x" * 30, "answer": "1"}, {"prompt": "1+1=", "answer": "2"},
                   {"prompt": "2+2=", "answer": "4"}] * 3)
  batch = next_prompts(examples, TOK, count=2, max_len=8, overflow="reject")
  assert batch.rejected == 1 and [e["prompt"] for e in batch.examples] == ["1+1=", "2+2="]
  batch = next_prompts(iter([{"prompt": "y" * 30, "answer": "1"}] * 2), TOK, count=2, max_len=8,
                       overflow="truncate")
  assert batch.truncated == 2 and batch.tokens.shape == (2, 8) and batch.mask.all()
  with pytest.raises(ValueError, match="every prompt is longer than rl.max_prompt_len=8"):
    next_prompts(iter([{"prompt": "z" * 30, "answer": "1"}] * 1000), TOK, count=2, max_len=8,
                 overflow="reject")


def _arrays(texts, prompt_len=4, budget=4):
  rows = []
  for text in texts:
    ids = TOK.encode(text, add_bos=False, add_eos=True)[:budget]
    rows.append([TOK.pad_id] * prompt_len + ids + [TOK.pad_id] * (budget - len(ids)))
  tokens = np.asarray(rows, np.int32)
  mask = np.zeros_like(tokens, bool)
  mask[:, prompt_len:] = tokens[:, prompt_len:] != TOK.pad_id
  return {"tokens": tokens, "response_mask": mask, "lengths": mask.sum(1)}


def test_raising_reward_and_empty_completions_are_counted_not_fatal():
  def flaky(completion, example):
    if completion == "boom":
      raise RuntimeError("reward code crashed")
    return float(completion == example["answer"])
  arrays = _arrays(["2", "boom", "", "3"])
  scored = score_rollout(arrays, [{"answer": "2"}, {"answer": "3"}], TOK, flaky, group_size=2,
                         max_new_tokens=4, overlong_buffer=0, overlong_penalty_value=1.0)
  np.testing.assert_array_equal(scored.rewards, [1, 0, 0, 1])
  assert scored.info["reward_errors"] == 1


def test_dynamic_sampling_keeps_informative_groups_first():
  def scored(rewards):
    rewards = np.asarray(rewards, np.float32)
    arrays = {"tokens": np.arange(len(rewards))[:, None]}
    return type("S", (), {"arrays": arrays, "rewards": rewards, "correct": rewards})()
  first, second = scored([1, 1, 0, 1]), scored([0, 0, 1, 0])
  arrays, rewards, _, valid = select_groups([first, second], num_groups=2, group_size=2, dynamic=True)
  np.testing.assert_array_equal(rewards, [0, 1, 1, 0])
  np.testing.assert_array_equal(valid, [True, True])
  _, _, _, valid = select_groups([scored([1, 1, 0, 0])], num_groups=2, group_size=2, dynamic=True)
  np.testing.assert_array_equal(valid, [False, False])


def test_jsonl_row_without_prompt_is_skipped(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2", "domain": "arithmetic"}\n{"answer": "3"}\nnot json\n')
  cfg = configs.load("configs/tiny.py", [f"data.jsonl={path}", "data.tasks=", "rl.sft_steps=0"])
  run = loop.setup(cfg)
  assert run.tasks[0]["prompt"] == "1+1="


def test_short_run_reward_rises(tmp_path):
  """Warm start + GRPO, the demo's recipe cut short: reward must rise (and nothing recompiles)."""
  cfg = configs.load("configs/tiny.py", ["rl.num_steps=60", "log.progress_bar=false",
                                         "log.tensorboard=false", "checkpoint.every=30"])
  records = loop.run(cfg, str(tmp_path))
  rewards = np.asarray([r["reward_mean"] for r in records])
  first, last = rewards[:10].mean(), rewards[-10:].mean()
  assert last >= first + 0.08, (first, last)
  assert len({r["compiles"] for r in records[1:]}) == 1  # nothing compiles after the first step
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 60 and {"step", "reward_mean", "kl", "entropy", "clip_frac",
                               "response_len_mean", "tokens_per_s", "time_s"} <= set(json.loads(lines[0]))
  assert os.path.exists(tmp_path / "reward_curve.png") and os.path.exists(tmp_path / "config.json")
