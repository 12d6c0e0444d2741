"""The reward model an RL run trains first (rl/rewards/rm_first.py, configs/tiny_rm.py's pipeline).

Claims and the bugs they catch:
- an empty folder gets a reward model trained there by the same job as scripts/train_rm.py, and a
  second run reuses it without writing a byte (a retrain every run, a job that differs between the
  two entry points so the one never reuses the other's model);
- the run's training reward is the reward model's score, never the verifier's (fast: the preset's
  reward pool scores sampled completions as the trained RM does alone and runs no verifier; slow: an
  RM planted to prefer wrong answers drives the policy's verified accuracy down while its RM score
  rises: a verifier used silently would drive it up);
- a folder holding a reward model of another shape, another tokenizer or other rm.* settings, or
  something that is not a reward-model run, is refused in one line naming the folder and the setting
  before anything is written or removed (a stale model silently reused, a folder cleared);
- a bad RL setting is refused before the reward model trains (found only after minutes of training).
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from support import folder_digests
from meshrl import configs
from meshrl.configs import cli
from meshrl.rl.rewards.rm_first import ensure_reward_model, folder_state
from meshrl.train.checkpoint import Checkpointer
from meshrl.rl.rewards.rm_job import reward_model_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=32",
         "data.seq_len=32", "rm.max_len=16", "rm.steps=3", "rm.synthetic_pairs=64", "rm.eval_pairs=16", "rm.batch_size=8",
         "rm.eval_every=0", "log.progress_bar=false", "log.tensorboard=false", "log.plot=false",
         "checkpoint.async_save=false",
         # the synthetic pipeline (no warm start before the reward model; tests/rl/test_policy_pairs.py
         # covers the preset's policy pairs), its raw scores as rewards
         "rm.pairs_from=synthetic", "rm.init=model", "rl.rm_binarize=false"]


def _cfg(rm_dir, *extra):
  return configs.load("configs/tiny_rm.py", SMALL + [f"rl.reward_model_checkpoint={rm_dir}", *extra])


def _plant(folder, cfg, step, *, weights=False) -> str:
  """A reward-model folder as the job leaves it: config.json and a checkpoint at `step` saved with
  `cfg`'s reward-model config; `weights`: a random model of that shape (a score to read), else one
  tiny array (checks that read configs only)."""
  rm_cfg = reward_model_config(cfg)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(rm_cfg.to_dict(), f)
  state = {"params": {"x": jnp.zeros(2)}}
  if weights:
    from flax import nnx  # pylint: disable=import-outside-toplevel
    from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
    from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
    from meshrl.train.state import TrainState  # pylint: disable=import-outside-toplevel
    model = build_model(ModelConfig.from_config(rm_cfg), None, seed=1)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, extra=extra)
  with Checkpointer(os.path.join(folder, "checkpoints"), async_save=False) as ckpt:
    ckpt.save(step, state, config=rm_cfg, force=True)
  return str(folder)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
  """A random reward model of the preset's settings, as if trained to rm.steps (model.init_std 0.5:
  scores that differ by completion)."""
  folder = str(tmp_path_factory.mktemp("planted") / "rm")
  return _plant(folder, _cfg(folder, "model.init_std=0.5"), 3, weights=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):  # about 100 s on the 2 busy cores (compilation, 8 simulated devices)
  """A reward model the run trained first into an empty rl.reward_model_checkpoint, and the run's
  work directory (checked, never written)."""
  folder = tmp_path_factory.mktemp("trained")
  rm_dir, run = str(folder / "rm"), str(folder / "run")
  assert ensure_reward_model(_cfg(rm_dir), run) == "trained"
  assert not os.path.exists(run)
  return rm_dir


@pytest.mark.slow
def test_the_run_trains_into_an_empty_folder_then_reuses_it(trained, tmp_path, capsys):
  records = [json.loads(line) for line in open(os.path.join(trained, "metrics.jsonl"))]
  assert records[-1]["step"] == 3 and "eval/pairwise_accuracy" in records[-1]
  cfg = _cfg(trained)
  assert folder_state(trained, reward_model_config(cfg)) == "done"
  before = folder_digests(trained)
  assert ensure_reward_model(cfg, str(tmp_path / "run")) == "reused"
  assert folder_digests(trained) == before and not os.path.exists(tmp_path / "run")
  assert "reused" in capsys.readouterr().out
  # One more rm.* step is another reward model: refused, not retrained over the old one.
  with pytest.raises(ValueError, match=r"rm.steps=3 there, 4 here"):
    ensure_reward_model(_cfg(trained, "rm.steps=4"), str(tmp_path / "run"))
  assert folder_digests(trained) == before


def test_train_rm_runs_the_same_job_into_the_folder_the_run_reads(tmp_path, monkeypatch):
  """scripts/train_rm.py with the preset prepares the reward model the run would train (its config,
  equal to the run's by every setting, and rl.reward_model_checkpoint as its folder); the job's
  training itself is captured, not run."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("train_rm_script", os.path.join(REPO, "scripts", "train_rm.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  jobs = []

  class Done(Exception):
    pass

  def capture(job):
    jobs.append(job)
    raise Done()
  monkeypatch.setattr("meshrl.rl.rewards.rm_job.train_reward_model", capture)
  monkeypatch.chdir(REPO)
  rm_dir = str(tmp_path / "rm")
  with pytest.raises(Done):
    module.main(["--config=configs/tiny_rm.py", f"--config.rl.reward_model_checkpoint={rm_dir}"] +
                [f"--config.{o}" for o in SMALL])
  (job,) = jobs
  assert job.workdir == rm_dir and job.cfg.model.value_head
  assert job.cfg.to_dict() == reward_model_config(_cfg(rm_dir)).to_dict()
  assert not os.path.exists(rm_dir)


def test_a_reward_model_of_the_same_settings_is_reused_as_it_is(planted, tmp_path, capsys):
  before = folder_digests(planted)
  assert ensure_reward_model(_cfg(planted, "model.init_std=0.5"), str(tmp_path / "run")) == "reused"
  assert folder_digests(planted) == before and not os.path.exists(tmp_path / "run")
  assert "reused" in capsys.readouterr().out
  # One more rm.* step is another reward model: refused, not retrained over the old one.
  with pytest.raises(ValueError, match=r"rm.steps=3 there, 4 here"):
    ensure_reward_model(_cfg(planted, "model.init_std=0.5", "rm.steps=4"), str(tmp_path / "run"))
  assert folder_digests(planted) == before


def test_the_training_reward_is_the_reward_models_score(planted, tmp_path):
  """The preset's reward pool over completions: every reward equals the RM's score of that
  completion (loaded and scored alone, on one device), and the verifier scores no sample."""
  # pylint: disable=import-outside-toplevel
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.envs.mixture import TaskMixture
  from meshrl.rl.rewards.sources import reward_model_scorer, reward_pool
  from meshrl.sharding import make_mesh
  cfg = _cfg(planted, "model.init_std=0.5")
  mesh = make_mesh(cfg.mesh)
  tokenizer = tokenizer_from_config(cfg)
  examples = TaskMixture(cfg.data.tasks, seed=5).take(12)
  completions = [e["answer"] if i % 3 == 0 else e["answer"][::-1] + "q" for i, e in enumerate(examples)]
  pool = reward_pool(cfg, mesh, tokenizer)
  try:
    rewards, info = pool.score(completions, examples)
  finally:
    pool.close()
  alone, _ = reward_model_scorer(cfg, None, tokenizer)(completions, examples)
  np.testing.assert_allclose(rewards, alone, atol=1e-5)
  assert set(info["sources"]) == {"reward_model"}  # no verifier row
  verified = np.asarray([1.0 if i % 3 == 0 else 0.0 for i in range(12)], np.float32)
  assert not np.allclose(rewards, verified)


def _refused(cfg, workdir, fragment, *watched):
  before = [folder_digests(w) for w in watched]
  with pytest.raises(ValueError) as error:
    ensure_reward_model(cfg, workdir)
  message = str(error.value)
  assert fragment in message and "\n" not in message, message
  assert [folder_digests(w) for w in watched] == before
  return message


def test_a_stale_or_foreign_folder_is_refused_naming_it_before_anything_is_written(tmp_path):
  run = str(tmp_path / "run")
  cfg = _cfg(tmp_path / "x")
  other_shape = _plant(tmp_path / "shape", _cfg(tmp_path / "shape", "model.embed_dim=32"), 3)
  message = _refused(_cfg(other_shape), run, "model.embed_dim=32 there, 64 here", other_shape)
  assert message.startswith(f"rl.reward_model_checkpoint='{other_shape}' holds a reward model trained with other")
  tokenizer = tmp_path / "tok" / "tokenizer.json"
  tokenizer.parent.mkdir()
  tokenizer.write_text('{"model": {}}')
  other_tok = _plant(tmp_path / "tok_rm", _cfg(tmp_path / "tok_rm", f"model.tokenizer={tokenizer}"), 3)
  _refused(_cfg(other_tok), run, "model.tokenizer='sha256:", other_tok)
  other_data = _plant(tmp_path / "data", _cfg(tmp_path / "data", "rm.train_jsonl=prefs.jsonl"), 3)
  _refused(_cfg(other_data), run, "rm.train_jsonl='prefs.jsonl' there, '' here", other_data)
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForSequenceClassification"]}))
  _refused(_cfg(hf), run, "holds config.json but no reward-model run of meshrl", str(hf))
  # The switch's own settings, and the RL run's checks, before the reward model trains.
  empty = str(tmp_path / "empty")
  _refused(_cfg(empty, "rl.group_size=1"), run, "rl.group_size >= 2", str(tmp_path))
  assert not os.path.exists(empty)
  _refused(_cfg(empty, "rl.reward_sources=*=verifier"), run, "no domain of rl.reward_sources='*=verifier'")
  _refused(_cfg(run), run, "is the RL run's work directory")
  _refused(_cfg(empty, "rl.reward_model_checkpoint="), run, "rm.train_before_rl=true trains the reward model into")
  assert not os.path.exists(empty) and not os.path.exists(run)
  assert folder_state(str(tmp_path / "nothing"), reward_model_config(cfg)) == "empty"


@pytest.mark.slow
def test_a_planted_reward_model_that_prefers_wrong_answers_drives_the_policy_away_from_the_verifier(tmp_path):
  """configs/tiny_rm.py's pipeline in one scripts/rl.py call, its preference file swapped for one
  whose "chosen" is the verifier's wrong answer: the RM learns to prefer wrong answers and RL against
  it lowers held-out verified accuracy while raising the RM's score (the tiny demo, rewarded by the
  verifier, raises accuracy from the same warm start: a verifier used in training fails this)."""
  # pylint: disable=import-outside-toplevel
  import importlib.util
  from meshrl.rl.envs.mixture import TaskMixture
  from meshrl.rl.rewards import answer_reward
  from meshrl.train.synthetic_pairs import synthetic_pairs
  examples = TaskMixture("reverse:1.0", seed=0).take(1024)
  pairs = synthetic_pairs(examples, seed=0, is_correct=lambda text, ex: answer_reward(text, ex) >= 1.0)
  prefs = tmp_path / "wrong_is_better.jsonl"
  prefs.write_text("".join(json.dumps({"prompt": p.prompt, "chosen": p.rejected, "rejected": p.chosen}) + "\n"
                           for p in pairs))
  spec = importlib.util.spec_from_file_location("rl_script", os.path.join(REPO, "scripts", "rl.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  workdir = str(tmp_path / "run")
  argv = ["--config=configs/tiny_rm.py", f"--workdir={workdir}", f"--config.rm.train_jsonl={prefs}",
          f"--config.rl.reward_model_checkpoint={tmp_path / 'rm'}", "--config.rm.steps=100",
          "--config.rl.num_steps=12", "--config.eval.every=12", "--config.eval.num_prompts=100",
          "--config.log.progress_bar=false", "--config.checkpoint.enabled=false",
          "--config.rm.pairs_from=synthetic", "--config.rm.init=model", "--config.rl.rm_binarize=false"]
  cwd = os.getcwd()
  os.chdir(REPO)
  try:
    assert cli.run(module.main, argv) == 0
  finally:
    os.chdir(cwd)
  rm_evals = [json.loads(line) for line in open(tmp_path / "rm" / "metrics.jsonl")]
  assert rm_evals[-1]["eval/pairwise_accuracy"] > 0.7  # it learned to prefer the wrong answers
  evals = [json.loads(line) for line in open(os.path.join(workdir, "eval.jsonl"))]
  assert [e["step"] for e in evals] == [0, 12]
  assert evals[-1]["eval/rm_score"] > evals[0]["eval/rm_score"]
  assert evals[-1]["eval/accuracy"] < evals[0]["eval/accuracy"] - 0.1, evals
