"""Rejection-sampling fine-tuning on the run's own verified successes (rl/step/rft.py, issue 33), and
the warm start at another level than RL (rl.sft_difficulty, rl/envs/levels.warm_start_source)."""

import json

import numpy as np
import pytest

from meshrl import configs
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs.levels import AtLevel, warm_start_source
from meshrl.rl.envs.mixture import TaskMixture, in_eval_split
from meshrl.rl.step import driver as loop
from meshrl.rl.step.bootstrap import Bootstrap, bootstrap_hooks
from meshrl.rl.step.rft import RejectionFineTune, held_out_filter

G = 2
_SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
          "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
          "data.seq_len=16", "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0",
          "rl.sft_batch_size=8", "log.progress_bar=false", "log.tensorboard=false", "log.plot=false"]


def _round(examples, correct, rewards=None, valid=None) -> ScoredBatch:
  """A scored round of len(examples) groups of G samples: texts "<prompt>#<i>", planted outcomes."""
  correct = np.asarray(correct, np.float32)
  size = len(correct)
  return ScoredBatch(arrays={"tokens": np.zeros((size, 3), np.int32)}, rewards=correct if rewards is None else np.asarray(rewards, np.float32),
                     correct=correct, sample_valid=np.ones(size, bool) if valid is None else np.asarray(valid),
                     domains=["reverse"] * size,
                     texts=[f"{examples[i // G]['prompt']}#{i % G}" for i in range(size)])


def _prompts(fraction, held_out, count):
  """`count` reversal prompts on the held-out (or the train) side of the hash split."""
  words = (f"rev {a}{b}{c}=" for a in "abcdefgh" for b in "abcdefgh" for c in "abcdefgh")
  return [p for p in words if in_eval_split(p, fraction) == held_out][:count]


def test_bank_holds_only_verified_successes_and_never_a_held_out_prompt():
  """Only samples the verifier accepted (correct > 0; a shaped reward alone does not count), valid ones,
  of prompts on the train side of the split; each (prompt, response) once, the newest kept."""
  cfg = configs.load("configs/tiny.py", ["rl.rft_every=1"])
  (held,), (abc, xyz, qrs) = _prompts(cfg.data.eval_fraction, True, 1), _prompts(cfg.data.eval_fraction, False, 3)
  examples = [{"prompt": abc}, {"prompt": held}, {"prompt": xyz}, {"prompt": qrs}]
  rft = RejectionFineTune.from_config(cfg)
  rft.group_size = G
  # abc: one success; held: two successes (held out); xyz: reward 1 but not correct; qrs: a success
  # in an invalid sample (partial-rollout padding).
  rft.observe(examples, _round(examples, [1, 0, 1, 1, 0, 0, 1, 0], rewards=[1, 0, 1, 1, 1, 1, 1, 0],
                               valid=[1, 1, 1, 1, 1, 1, 0, 1]))
  assert rft.rows() == [{"prompt": abc, "answer": f"{abc}#0"}]
  rft.observe(examples[:1], _round(examples[:1], [1, 1]))  # the same response again, and a new one
  assert [r["answer"] for r in rft.rows()] == [f"{abc}#0", f"{abc}#1"]
  assert rft.metrics() == {"rft_added": 2.0, "rft_bank": 2.0}


def test_eval_jsonl_prompts_never_enter_the_bank(tmp_path):
  path = tmp_path / "eval.jsonl"
  path.write_text(json.dumps({"prompt": "rev abc=", "answer": "cba"}) + "\n")
  cfg = configs.load("configs/tiny.py", ["rl.rft_every=1", f"eval.jsonl={path}"])
  held_out = held_out_filter(cfg)
  assert held_out("rev abc=") and not held_out("rev abd=")
  rft = RejectionFineTune.from_config(cfg)
  rft.group_size = G
  examples = [{"prompt": "rev abc="}, {"prompt": "rev abd="}]
  rft.observe(examples, _round(examples, [1, 1, 1, 0]))
  assert [r["prompt"] for r in rft.rows()] == ["rev abd="]


def test_bank_keeps_the_newest_and_goes_through_the_checkpoint_state():
  rft = RejectionFineTune(every=1, steps=1, capacity=3, learning_rate=1e-3, group_size=G)
  examples = [{"prompt": f"rev {c}bc="} for c in "abcd"]
  rft.observe(examples, _round(examples, [1, 0] * 4))
  assert [r["prompt"] for r in rft.rows()] == ["rev bbc=", "rev cbc=", "rev dbc="]
  cfg = configs.load("configs/tiny.py", ["rl.rft_every=2", "rl.retry_unsolved=0"])
  bootstrap = Bootstrap.from_config(cfg, processes=1)
  assert bootstrap is not None and bootstrap.rft is not None and bootstrap.retry is None
  bootstrap.rft.bank = rft.bank
  restored = Bootstrap.from_config(cfg, processes=1)
  restored.set_state(json.loads(json.dumps(bootstrap.get_state())))
  assert restored.rft.rows() == rft.rows()


def test_rft_round_fine_tunes_the_policy_on_the_bank_and_only_on_its_steps(devices):
  """The hook runs rl.rft_steps SFT steps every rl.rft_every RL steps: the parameters move and the
  bank's cross-entropy falls from round to round (a skipped SFT step leaves both as they were); on
  other steps nothing changes; the RL optimizer's state and step are left alone."""
  import jax  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", _SMALL + ["rl.rft_every=2", "rl.rft_steps=3", "rl.rft_learning_rate=3e-3"])
  run, _ = loop.setup(cfg)
  run.pool.close()
  hooks = bootstrap_hooks(run)
  assert hooks == [run.bootstrap.rft]
  rft = run.bootstrap.rft
  for word in ("abc", "bca", "cab", "acb"):
    rft._add(f"rev {word}=", word[::-1])  # pylint: disable=protected-access
  rft._add("rev abcdefghij=", "jihgfedcba")  # pylint: disable=protected-access  (longer than data.seq_len: left out)
  params = jax.tree.map(np.asarray, run.state.params)
  opt_state, rl_step = jax.tree.map(np.asarray, run.state.opt_state), int(run.state.step)
  metrics = {}
  hooks[0](1, run, metrics)  # not a multiple of rl.rft_every: no round
  assert "rft_loss" not in metrics and metrics["rft_bank"] == 5.0
  jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, run.state.params))
  first, second = {}, {}
  hooks[0](2, run, first)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(b) - a).max()), params,
                                       run.state.params))
  assert max(moved) > 0
  hooks[0](4, run, second)
  assert second["rft_loss"] < first["rft_loss"] and first["rft_rows"] == 4.0
  assert int(run.state.step) == rl_step
  jax.tree.map(np.testing.assert_array_equal, opt_state, jax.tree.map(np.asarray, run.state.opt_state))


# --- the warm start's level ------------------------------------------------------------------------


def test_warm_start_trains_at_rl_sft_difficulty_on_the_train_side_and_rl_keeps_its_level():
  cfg = configs.load("configs/tiny_hard.py", ["rl.sft_difficulty=1"])
  source = loop.train_source(cfg)
  warm = warm_start_source(cfg, source)
  assert isinstance(warm, AtLevel)
  rows = [warm[i] for i in range(200)]
  assert {r["difficulty"] for r in rows} == {1} and {source[i]["difficulty"] for i in range(20)} == {2}
  assert {r["domain"] for r in rows} == {"reverse", "copy", "sort"}  # the mixture's domains kept
  assert all(len(r["answer"]) == 3 for r in rows)  # level 1: three symbols
  assert not any(in_eval_split(r["prompt"], cfg.data.eval_fraction) for r in rows)
  assert [warm[i] for i in range(5)] == rows[:5]  # random access, reproducible
  same = warm_start_source(configs.load("configs/tiny_hard.py", ["rl.sft_difficulty="]), source)
  assert same is source


def test_warm_start_mixes_levels_by_their_weights():
  cfg = configs.load("configs/tiny_hard.py", ["rl.sft_difficulty=1:3,2:1"])
  warm = warm_start_source(cfg, loop.train_source(cfg))
  levels = np.array([warm[i]["difficulty"] for i in range(400)])
  assert set(levels) == {1, 2} and 0.17 < (levels == 2).mean() < 0.33  # a quarter at level 2
  assert all(len(warm[i]["answer"]) == {1: 3, 2: 5}[warm[i]["difficulty"]] for i in range(40))


def test_warm_start_levels_per_domain_keep_the_other_domains_draws():
  """rl.sft_difficulty="copy=1:1,2:1;*=1:1,2:0.03": copy half at level 2, the others as the plain
  mix gives them, example for example (the same generator per index)."""
  cfg = configs.load("configs/tiny_hard.py", ["rl.sft_difficulty=copy=1:1,2:1;*=1:1,2:0.03"])
  source = loop.train_source(cfg)
  warm = warm_start_source(cfg, source)
  plain = warm_start_source(configs.load("configs/tiny_hard.py", ["rl.sft_difficulty=1:1,2:0.03"]), source)
  rows, plain_rows = [warm[i] for i in range(600)], [plain[i] for i in range(600)]
  copy = np.array([r["difficulty"] for r in rows if r["domain"] == "copy"])
  assert 0.4 < (copy == 2).mean() < 0.6
  assert [r for r in rows if r["domain"] != "copy"] == [r for r in plain_rows if r["domain"] != "copy"]
  assert not any(in_eval_split(r["prompt"], cfg.data.eval_fraction) for r in rows)
  # a domain without an entry (and no "*") keeps its RL level: the source's example as it is
  only_copy = warm_start_source(configs.load("configs/tiny_hard.py", ["rl.sft_difficulty=copy=1"]), source)
  assert all(only_copy[i] == source[i] for i in range(60) if source[i]["domain"] != "copy")
  assert {only_copy[i]["difficulty"] for i in range(60) if source[i]["domain"] == "copy"} == {1}


@pytest.mark.parametrize("family", ["reverse", "copy", "sort"])
def test_tiny_hard_one_family_trains_and_evaluates_that_family_alone(family):
  """configs/tiny_hard.py:<family>: RL rows and held-out prompts of that family at level 2 only, its
  warm start at level 1 with its own trace of level 2 (FAMILY_LEVEL2_WEIGHT), the options unchanged."""
  from meshrl.configs import tiny_hard  # pylint: disable=import-outside-toplevel
  cfg = configs.load(f"configs/tiny_hard.py:{family}")
  three = configs.load("configs/tiny_hard.py")
  for key in ("retry_unsolved", "replay_groups", "rft_every", "rft_steps", "sft_steps", "num_steps"):
    assert cfg.rl[key] == three.rl[key]
  source = loop.train_source(cfg)
  assert {(source[i]["domain"], source[i]["difficulty"]) for i in range(60)} == {(family, 2)}
  warm = warm_start_source(cfg, source)
  levels = np.array([warm[i]["difficulty"] for i in range(2000)])
  weight = tiny_hard.FAMILY_LEVEL2_WEIGHT[family]
  share = (levels == 2).mean()
  assert {warm[i]["domain"] for i in range(200)} == {family} and set(levels) == {1, 2}
  assert 0.7 * weight / (1 + weight) < share < 1.3 * weight / (1 + weight)  # the three-family mix gives reverse 3%
  assert not any(in_eval_split(warm[i]["prompt"], cfg.data.eval_fraction) for i in range(400))
  with pytest.raises(ValueError, match=r"configs/tiny_hard.py:nope: choose one family of \['copy', 'reverse', 'sort'\]"):
    configs.load("configs/tiny_hard.py:nope")


def test_warm_start_leaves_file_rows_as_they_are():
  mixture = TaskMixture("reverse:1.0,jsonl:1.0", pools={"jsonl": [{"prompt": "hi=", "answer": "yo"}]})
  warm = AtLevel(mixture, {"reverse": "reverse"}, 3)
  rows = [warm[i] for i in range(40)]
  assert {r["prompt"] for r in rows if r.get("domain") != "reverse"} == {"hi="}
  assert all(len(r["answer"]) == 7 for r in rows if r.get("domain") == "reverse")


def test_tiny_hard_works_unchanged_on_a_users_rows(tmp_path):
  """configs/tiny_hard.py with data.jsonl / eval.jsonl and no generated family: the curriculum ("all")
  and rl.sft_difficulty have nothing to govern and step aside; retries, replay and RFT stay on."""
  rows = [{"prompt": f"rev {w}=", "answer": w[::-1], "verifier": "exact"} for w in ("abcde", "fghij", "klmno")]
  for name, chosen in (("data.jsonl", rows[:2]), ("eval.jsonl", rows[2:])):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in chosen))
  cfg = configs.load("configs/tiny_hard.py", [f"data.jsonl={tmp_path / 'data.jsonl'}",
                                              f"eval.jsonl={tmp_path / 'eval.jsonl'}", "data.tasks="])
  loop.check_config(cfg, 8)
  source = loop.train_source(cfg)
  assert warm_start_source(cfg, source) is source
  bootstrap = Bootstrap.from_config(cfg, processes=1)
  assert bootstrap.curriculum is None and bootstrap.retry is not None and bootstrap.rft is not None
  assert bootstrap.rft.held_out("rev klmno=") and not bootstrap.rft.held_out("rev abcde=")


@pytest.mark.slow  # ~80 s on a busy 2-core machine; fast companion: test_rft_round_fine_tunes_the_policy_...
def test_rft_composes_with_the_curriculum_retries_and_replay_through_rl_steps(devices):
  """Two RL steps with every bootstrapping option on and a reward that pays responses of even length:
  the bank fills from the steps' own rollouts with accepted responses only, and step 2's record
  holds an SFT round (rft_loss) beside the curriculum's, retries' and replay's figures."""
  from meshrl.rl.rewards.pool import RewardPool  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", _SMALL + ["model.max_seq_len=32", "data.seq_len=32",
      "data.tasks=reverse:1.0,sort:1.0", "data.difficulty=2", "data.level_curriculum=all",
      "data.level_curriculum_window=8", "rl.retry_unsolved=1", "rl.replay_groups=4", "rl.dynamic_sampling=true",
      "rl.max_resample_rounds=1", "rl.rft_every=2", "rl.rft_steps=2", "rl.temperature=1.0", "model.init_std=0.3"])
  run, prompts = loop.setup(cfg)
  run.pool.close()
  run.pool = RewardPool(lambda completion, example: float(len(completion) % 2 == 0))
  records = loop.train_steps(run, prompts, num_steps=2, hooks=tuple(bootstrap_hooks(run)))
  run.close()
  bank = run.bootstrap.rft.rows()
  assert bank and all(len(row["answer"]) % 2 == 0 for row in bank)
  assert "rft_loss" not in records[0] and np.isfinite(records[1]["rft_loss"])
  assert records[1]["rft_bank"] == len(bank) and "curriculum/level/sort" in records[1]
  assert "retried_prompts" in records[1] and "replay_stored" in records[1]
