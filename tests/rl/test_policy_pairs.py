"""Reward-model pairs over a policy's own samples (rl/rewards/policy_pairs.py, rm.pairs_from="policy") and a
reward model that starts from the warm-started policy (rm.init="policy").

Claims and the bugs they catch:
- every pair's chosen side is a verifier-right sample and its rejected side a verifier-wrong sample of
  the same prompt, over real samples of a model through the generation engine (sides swapped, a
  sample paired with another prompt's, a prompt whose samples are all right or all wrong paired);
- no pair's prompt is a held-out prompt (the split's eval side, or one evaluation draws): the
  policy's prompts from the wrong side of the hash split;
- rm.pairs_from reaches the job: its pairs are the policy's, and the synthetic ones with
  "policy+synthetic" (the option dropped, or the warm start never asked for); rm.init reaches the
  model the job trains (the policy's weights dropped);
- the warm start's settings decide a reward model trained on its samples (a model of another warm
  start reused).
"""

import os

import numpy as np
import pytest

from meshrl import configs
from meshrl.rl.envs.mixture import in_eval_split
from meshrl.rl.rewards import policy_pairs as pp
from meshrl.rl.rewards import rm_job
from meshrl.train.preferences import Pair

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=32",
         "data.seq_len=32", "rm.max_len=16", "rm.steps=3", "rm.synthetic_pairs=64", "rm.eval_pairs=16",
         "rm.batch_size=8", "rm.eval_every=0", "log.progress_bar=false", "log.tensorboard=false",
         "log.plot=false", "checkpoint.async_save=false", "eval.batch_size=16", "rm.policy_prompts=32",
         "rm.policy_samples=4", "rm.pairs_from=synthetic", "rm.init=model", "rm.policy_temperatures=",
         "rl.temperature=0.7"]  # the preset's recipe is policy pairs at two temperatures: each test names its own


def _cfg(*extra):
  return configs.load(os.path.join(REPO, "configs/tiny_rm.py"), SMALL + list(extra))


def _even(text, example):  # a planted verifier: right when the completion has an even length
  del example
  return len(text) % 2 == 0


def test_pairs_from_planted_samples_put_the_right_sample_first_within_its_prompt():
  examples = [{"prompt": "rev abc=", "answer": "cba"}, {"prompt": "rev dog=", "answer": "god"},
              {"prompt": "rev owl=", "answer": "lwo"}, {"prompt": "rev sun=", "answer": "nus"}]
  samples = [["cba", "abc", "cba", "ccc", ""],  # one right text (twice), two wrong, an empty one
             ["odg", "ggg"],  # none right: no pair
             ["lwo", "lwo"],  # all right: no pair
             ["xx", "nus", "sun"]]
  verifier = lambda text, example: text == example["answer"]  # noqa: E731
  pairs = pp.pairs_from_samples(examples, samples, is_correct=verifier, origin="t")
  assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
      ("rev abc=", "cba", "abc"), ("rev abc=", "cba", "ccc"), ("rev sun=", "nus", "xx"), ("rev sun=", "nus", "sun")]
  assert [p.where for p in pairs] == ["t:0", "t:0", "t:3", "t:3"]
  with pytest.raises(ValueError, match="2 sample lists for 4 examples"):
    pp.pairs_from_samples(examples, samples[:2], is_correct=verifier)


def test_pairs_over_a_models_samples_are_right_over_wrong_of_one_prompt(monkeypatch):
  """A random model's samples through the generation engine, labelled by a planted verifier: each
  pair's sides are that prompt's own samples, chosen right and rejected wrong, and every prompt with
  both gives its pairs."""
  # pylint: disable=import-outside-toplevel
  import jax
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.sharding import make_mesh
  from meshrl.train.init_from import initial_model
  cfg = _cfg("model.init_std=0.5", "rl.temperature=1.0")
  mesh = make_mesh(cfg.mesh)
  model, tokenizer = initial_model(cfg, mesh), tokenizer_from_config(cfg)
  examples = pp.training_examples(cfg, 24)
  key = jax.random.key(11)
  samples = pp.sample_policy(cfg, mesh, model, tokenizer, examples, samples=4, key=key)
  assert len(samples) == 24 and all(len(s) == 4 for s in samples)
  assert len({t for s in samples for t in s}) > 24  # sampled, not one string
  pairs = pp.pairs_from_samples(examples, samples, is_correct=_even)
  assert pairs
  by_prompt = {e["prompt"]: s for e, s in zip(examples, samples)}
  for pair in pairs:
    own = by_prompt[pair.prompt]
    assert pair.chosen in own and pair.rejected in own
    assert _even(pair.chosen, None) and not _even(pair.rejected, None)
  mixed = {e["prompt"] for e, s in zip(examples, samples)
           if any(_even(t, None) for t in s if t.strip()) and any(not _even(t, None) for t in s if t.strip())}
  assert {p.prompt for p in pairs} == mixed
  # The same key, the same samples (the reward model's pairs do not change between two runs).
  assert pp.sample_policy(cfg, mesh, model, tokenizer, examples[:16], samples=4, key=key) == samples[:16]


def test_a_multi_turn_runs_pairs_are_whole_episodes_graded_by_their_environments(monkeypatch):
  """rl.multi_turn: the samples are whole episodes of the run's episode runner (the text after the
  prompt, what the RL step's reward model reads) on the multi-turn families of data.tasks, each
  labelled by its own environment's reward. A planted environment rewards an action whose first
  character's code is even, so every label can be checked against its text: catches labels from the
  verifier instead of the environment, episodes given to another example, and the padding's kept."""
  # pylint: disable=import-outside-toplevel
  import jax
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.envs.base import StepResult
  from meshrl.rl.step import episodes
  from meshrl.sharding import make_mesh
  from meshrl.train.init_from import initial_model

  class Planted:
    def reset(self, task):
      return task["prompt"]

    def step(self, action):
      return StepResult("", float(action[:1] != "" and ord(action[0]) % 2 == 0), True, {})
  monkeypatch.setattr(episodes, "default_env", lambda example: Planted())
  cfg = configs.load(os.path.join(REPO, "configs/tiny_agent.py"), [
      "model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
      "model.mlp_dim=64", "moe.num_experts=0", "model.init_std=0.5", "rl.max_new_tokens=24", "rl.max_turn_tokens=8",
      "rl.max_obs_tokens=8", "eval.batch_size=4", "rl.temperature=1.0", "rm.pairs_from=policy"])
  mesh = make_mesh(cfg.mesh)
  examples = pp.training_examples(cfg, 5)
  assert len(examples) == 5 and all(e.get("verifier") for e in examples)  # the files family's tasks
  texts, solved = pp.labelled_samples(cfg, mesh, initial_model(cfg, mesh), tokenizer_from_config(cfg), examples,
                                      samples=3, key=jax.random.key(0))
  assert [len(t) for t in texts] == [len(r) for r in solved] == [3] * 5  # the padded batch's extra dropped
  labels = [ok for rs in solved for ok in rs]
  assert labels == [t[:1] != "" and ord(t[0]) % 2 == 0 for ts in texts for t in ts]
  assert 0 < sum(labels) < len(labels) and len({t for ts in texts for t in ts}) > 5


def test_no_held_out_prompt_is_paired(monkeypatch):
  """Every sampled prompt gets a right and a wrong sample, so every prompt drawn is paired: none may
  be a held-out one (the eval side of data.eval_fraction, or a prompt the evaluation draws)."""
  from meshrl.rl.step.evaluation import held_out_examples  # pylint: disable=import-outside-toplevel
  cfg = _cfg("rm.policy_prompts=200")
  drawn = []

  def planted(cfg_, mesh, model, tokenizer, examples, *, samples, key, temperature=None):
    del cfg_, mesh, model, tokenizer, key, temperature
    drawn.extend(examples)
    return [[e["answer"]] + [e["answer"] + "x"] * (samples - 1) for e in examples]
  monkeypatch.setattr(pp, "sample_policy", planted)
  train, held_out = pp.policy_pairs(cfg, None, None, None, report=lambda line: None)
  assert len(drawn) == 200 and len(train) == 175 and len(held_out) == 25
  prompts = {p.prompt for p in train + held_out}
  assert len(prompts) == 200
  assert not any(in_eval_split(p, cfg.data.eval_fraction) for p in prompts)
  assert not prompts & {e["prompt"] for e in held_out_examples(cfg)}
  assert all(p.chosen == e["answer"] for p, e in zip(train, [e for i, e in enumerate(drawn) if i % 8 != 7]))


def test_a_policy_with_no_mixed_prompt_is_refused_naming_the_field(monkeypatch):
  monkeypatch.setattr(pp, "sample_policy", lambda *a, samples, **k: [["zz"] * samples for _ in a[4]])
  with pytest.raises(ValueError, match=r"^rm.policy_prompts=32: the warm-started policy's samples give no training pair"):
    pp.policy_pairs(_cfg(), None, None, None, report=lambda line: None)


PLANTED = [Pair(f"rev {w}=", w[::-1], w, 0.0, "planted") for w in ("abc", "dog", "owl", "cat", "sun", "map")]


@pytest.mark.parametrize("pairs_from", ["policy", "policy+synthetic", "synthetic"])
def test_the_option_reaches_the_job(pairs_from, tmp_path, monkeypatch):
  """The job's pairs are the policy's (planted), with the synthetic ones behind them for
  "policy+synthetic"; "synthetic" never asks for the warm start."""
  calls = []

  def warm():
    calls.append(1)
    return "cfg", "mesh", "model", "tokenizer"
  monkeypatch.setattr(pp, "policy_pairs", lambda *a, **k: (PLANTED[:4], PLANTED[4:]))
  rm_cfg = rm_job.reward_model_config(_cfg(f"rm.pairs_from={pairs_from}"))
  job = rm_job.prepare_reward_model(rm_cfg, str(tmp_path / "rm"), warm_policy=warm)
  synthetic_train, synthetic_held_out = rm_job._synthetic_pairs(rm_cfg)  # pylint: disable=protected-access
  from meshrl.model.tokenizer import tokenizer_from_config  # pylint: disable=import-outside-toplevel
  from meshrl.train.preferences import encode_pairs  # pylint: disable=import-outside-toplevel
  want = {"policy": (PLANTED[:4], PLANTED[4:]), "synthetic": (synthetic_train, synthetic_held_out),
          "policy+synthetic": (PLANTED[:4] + synthetic_train, PLANTED[4:] + synthetic_held_out)}[pairs_from]
  encode = lambda pairs: encode_pairs(pairs, tokenizer_from_config(rm_cfg), max_len=16, overflow="reject")  # noqa: E731
  np.testing.assert_array_equal(job.train.chosen, encode(want[0]).chosen)
  np.testing.assert_array_equal(job.train.rejected, encode(want[0]).rejected)
  np.testing.assert_array_equal(job.held_out.chosen, encode(want[1][:16]).chosen)
  assert len(calls) == (pairs_from != "synthetic")
  assert ("policy" in job.source) == (pairs_from != "synthetic")
  assert not os.path.exists(tmp_path / "rm")


def test_rm_init_policy_starts_the_reward_model_from_the_policys_weights(tmp_path, monkeypatch):
  # pylint: disable=import-outside-toplevel
  import jax
  from flax import nnx
  from meshrl.sharding import make_mesh
  from meshrl.train.init_from import initial_model
  cfg = _cfg("rm.init=policy", "seed=3")
  mesh = make_mesh(cfg.mesh)
  policy = initial_model(_cfg("seed=9"), mesh)  # other weights than the reward model's own init
  job = rm_job.prepare_reward_model(rm_job.reward_model_config(cfg), str(tmp_path / "rm"),
                                    warm_policy=lambda: (cfg, mesh, policy, None))
  models = []

  class Done(Exception):
    pass

  def capture(cfg_, workdir, mesh_, model, **k):
    models.append(model)
    raise Done()
  monkeypatch.setattr(rm_job, "run_reward_model", capture)
  with pytest.raises(Done):
    rm_job.train_reward_model(job)
  (model,) = models
  got, want = nnx.state(model, nnx.Param).to_pure_dict(), nnx.state(policy, nnx.Param).to_pure_dict()
  got.pop("value_head")  # the score head is the reward model's own
  assert set(got) == set(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="need the warm-started policy, and none was given"):
    rm_job.prepare_reward_model(rm_job.reward_model_config(cfg), str(tmp_path / "rm2"))


def test_the_run_warm_starts_into_its_own_sft_folder_first(tmp_path, monkeypatch):
  """scripts/rl.py's first job with rm.pairs_from=policy: the warm start runs into the RL run's
  sft/ (which the driver resumes) before the reward model's pairs are made, and the status says so."""
  from meshrl.rl.rewards import rm_first  # pylint: disable=import-outside-toplevel
  folders, jobs = [], []
  monkeypatch.setattr(rm_first, "warm_start", lambda cfg, folder, mesh=None: folders.append(folder) or
                      (cfg, None, None, None))
  monkeypatch.setattr(pp, "policy_pairs", lambda *a, **k: (PLANTED[:4], PLANTED[4:]))

  class Done(Exception):
    pass

  def capture(job):
    jobs.append(job)
    raise Done()
  monkeypatch.setattr(rm_first, "train_reward_model", capture)
  run, rm_dir = str(tmp_path / "run"), str(tmp_path / "rm")
  with pytest.raises(Done):
    rm_first.ensure_reward_model(_cfg("rm.pairs_from=policy", f"rl.reward_model_checkpoint={rm_dir}"), run)
  assert folders == [os.path.join(run, "sft")] and len(jobs[0].train) == 4
  # Without checkpoints the driver cannot resume it: a temporary folder, gone afterwards.
  folders.clear()
  with pytest.raises(Done):
    rm_first.ensure_reward_model(_cfg("rm.pairs_from=policy", f"rl.reward_model_checkpoint={rm_dir}",
                                      "checkpoint.enabled=false"), run)
  assert len(folders) == 1 and "meshrl_warm_start_" in folders[0] and not os.path.exists(folders[0])


def test_the_warm_starts_settings_make_a_policy_pairs_reward_model():
  base = rm_job.reward_model_config(_cfg("rm.pairs_from=policy"))
  other = rm_job.reward_model_config(_cfg("rm.pairs_from=policy", "rl.sft_steps=7", "rl.temperature=0.3"))
  assert base.rl.temperature != 0.3
  assert [d[0] for d in rm_job.settings_diff(base.to_dict(), other)] == ["rl.sft_steps", "rl.temperature"]
  synthetic = rm_job.reward_model_config(_cfg())
  assert rm_job.settings_diff(synthetic.to_dict(), rm_job.reward_model_config(_cfg("rl.sft_steps=7"))) == []


def test_a_bad_preference_line_is_refused_before_the_warm_start(tmp_path):
  """rm.pairs_from=policy beside rm.train_jsonl: the file's bad line is named before the warm start
  runs (found only after minutes of SFT and sampling otherwise)."""
  prefs = tmp_path / "prefs.jsonl"
  prefs.write_text('{"prompt": "rev abc=", "chosen": "cba", "rejected": "abc"}\n{"prompt": "rev dog="}\n')
  calls = []
  rm_cfg = rm_job.reward_model_config(_cfg("rm.pairs_from=policy", f"rm.train_jsonl={prefs}"))
  with pytest.raises(ValueError, match=rf"^{prefs}:2: "):
    rm_job.prepare_reward_model(rm_cfg, str(tmp_path / "rm"), warm_policy=lambda: calls.append(1))
  assert not calls and not os.path.exists(tmp_path / "rm")
