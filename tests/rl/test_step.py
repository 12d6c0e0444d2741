"""The RL step program as a whole: the rollout reads the train state's own arrays (no copy), KL and
critic paths run end to end, a resumed run equals the uninterrupted one, a rerun is identical, and
config errors stop the run before anything is written."""

import json
import os

import jax
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.step import driver as loop
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.step.program import rl_step

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
         "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0", "log.progress_bar=false",
         "log.tensorboard=false", "log.plot=false", "rl.max_resample_rounds=1"]


def _cfg(*extra):
  return configs.load("configs/tiny.py", SMALL + list(extra))


@pytest.mark.slow  # suite budget: tests/rl/test_generation.py checks the rollout reads the train state without copy
def test_loop_hands_the_rollout_exactly_the_train_state_arrays(devices):
  run, prompts = loop.setup(_cfg("mesh.fsdp=4", "mesh.tensor=2"))
  seen = []
  rollout = run.rollout

  def spy(params, extra, *args):
    seen.append((jax.tree.leaves(params), jax.tree.leaves(extra)))
    return rollout(params, extra, *args)
  run.rollout = spy
  for step in range(2):
    params, extra = jax.tree.leaves(run.state.params), jax.tree.leaves(run.state.extra)
    count = len(seen)
    rl_step(run, prompts, jax.random.key(step))
    for got_params, got_extra in seen[count:]:
      assert all(a is b for a, b in zip(got_params, params)) and len(got_params) == len(params)
      assert all(a is b for a, b in zip(got_extra, extra))
  run.close()


def test_compiled_rollout_holds_less_than_one_parameter_copy(devices):
  """fsdp=8: the rollout's per-device arguments + temporaries stay below the bytes of one full copy
  of the parameters; a program that gathered (copied) the weights whole would not."""
  cfg = configs.load("configs/tiny.py", [
      "model.num_layers=4", "model.embed_dim=256", "model.mlp_dim=512", "moe.expert_mlp_dim=512",
      "moe.num_experts=8", "moe.first_k_dense=0", "rl.prompts_per_step=4", "rl.group_size=2",
      "rl.max_prompt_len=8", "rl.max_new_tokens=8", "model.max_seq_len=16", "mesh.fsdp=8",
      "rl.sft_steps=0"])
  run, _ = loop.setup(cfg)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.state.params))
  tokens, mask = TOK.encode_batch(["1+2="] * 4, length=8)
  compiled = run.rollout.lower(run.state.params, run.state.extra, tokens, mask, jax.random.key(0)).compile()
  memory = compiled.memory_analysis()
  per_device = memory.argument_size_in_bytes + memory.temp_size_in_bytes
  assert per_device < param_bytes, (per_device, param_bytes)  # measured: 24 MB vs 52 MB; a copy: 82 MB
  run.close()


@pytest.mark.parametrize("extra", [
    # The KL-loss path also runs in the resume test; both below are slow-run only (suite budget).
    pytest.param(["rl.kl_coef=0.1"], marks=pytest.mark.slow),
    pytest.param(["rl.kl_coef=0.05", "rl.kl_in_reward=true", "rl.advantage=rloo"], marks=pytest.mark.slow),
    ["rl.advantage=gae", "model.value_head=true", "rl.kl_coef=0.05"],
])
def test_three_step_loops_with_kl_and_critic(devices, extra):
  run, prompts = loop.setup(_cfg("rl.temperature=1.0", "model.init_std=0.3", *extra))
  run.pool.close()
  run.pool = RewardPool(lambda completion, example: float(len(completion) % 2))  # informative groups
  records = loop.train_steps(run, prompts, num_steps=3)
  run.close()
  assert len(records) == 3
  for record in records:
    assert all(np.isfinite(v) for v in record.values() if isinstance(v, float)), record
  assert records[-1]["kl"] > 0  # the policy moved away from the reference, and the KL sees it
  if "rl.advantage=gae" in extra:
    assert "vf_loss" in records[-1] and records[-1]["value_mean"] != 0
  if "rl.kl_in_reward=true" in extra:  # the KL went into the rewards: a metric, not a loss term
    assert run.spec.kl_coef == 0.0 and run.spec.kl_metric
    assert records[-1]["kl_reward"] < 0


def _lines(path):
  return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.mark.usefixtures("compile_cache")
@pytest.mark.parametrize("carried", [
    # async_partial checks all the others do and more (rollouts in flight, partial pools): they run with the
    # slow tests.
    pytest.param([], marks=pytest.mark.slow),
    # rollouts in flight saved and restored: async_partial below does it too, with partial harvests
    pytest.param(["rl.max_staleness=1", "rl.tis_level=token"], marks=pytest.mark.slow),
    pytest.param(["rl.engine=continuous", "rl.rollout_token_budget=48", "rl.max_resample_rounds=0"],
                 marks=pytest.mark.slow),  # partial rollouts (tests/rl/test_generation.py by default)
    # both: the next step's partial rollout dispatched ahead, its harvest saved with the carried pool
    ["rl.max_staleness=1", "rl.tis_level=token", "rl.engine=continuous", "rl.rollout_token_budget=48",
     "rl.max_resample_rounds=0"],
], ids=["sync", "async", "partial", "async_partial"])
def test_resume_equals_uninterrupted_and_rerun_is_identical(tmp_path, devices, carried):
  """Steps 1-4 straight vs steps 1-2, stop, resume 3-4: identical metrics (time aside); and the
  first two steps of both runs (two runs of one config and seed) are identical too. What a step
  carries to the next (asynchronous RL's rollouts in flight, partial rollouts' unfinished groups)
  goes through the checkpoint: a resume that dropped it would draw other samples."""
  common = ["checkpoint.every=2", "checkpoint.async_save=true", "rl.kl_coef=0.05", "eval.every=0",
            *carried]
  straight = loop.run(_cfg("rl.num_steps=4", *common), str(tmp_path / "straight"))
  first = loop.run(_cfg("rl.num_steps=2", *common), str(tmp_path / "split"))
  resumed = loop.run(_cfg("rl.num_steps=4", *common), str(tmp_path / "split"))
  assert [r["step"] for r in resumed] == [3, 4]
  assert loop.metrics_equal(straight[:2], first)
  assert loop.metrics_equal(straight[2:], resumed)
  assert not loop.metrics_equal(straight[:2], straight[2:])  # the comparison can fail
  if "rl.max_staleness=1" in carried and not "rl.rollout_token_budget=48" in carried:
    # step 1 trains on version 0, then always one version behind
    assert [r["staleness_max"] for r in straight] == [0.0, 1.0, 1.0, 1.0]
  if "rl.rollout_token_budget=48" in carried:
    assert sum(r["groups_carried"] for r in straight) > 0
  written = _lines(tmp_path / "split" / "metrics.jsonl")
  assert [r["step"] for r in written] == [1, 2, 3, 4]


def test_config_errors_stop_the_run_before_the_warm_start_writes_anything(tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="rl.num_minibatches=3 must divide the batch of 128"):
    loop.run(configs.load("configs/tiny.py", ["rl.num_minibatches=3"]), str(workdir))
  assert not workdir.exists()
  with pytest.raises(ValueError, match="data.jsonl='/nonexistent/data.jsonl': no such file"):
    loop.check_config(configs.load("configs/tiny.py", ["data.jsonl=/nonexistent/data.jsonl"]))
  with pytest.raises(ValueError, match="rl.kl_in_reward=true needs rl.kl_coef > 0"):
    loop.check_config(configs.load("configs/tiny.py", ["rl.kl_in_reward=true"]))
  with pytest.raises(ValueError, match="rl.loss_agg='tokens'"):
    loop.check_config(configs.load("configs/tiny.py", ["rl.loss_agg=tokens"]))


def test_script_prints_config_errors_as_one_line(tmp_path, capsys):
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("rl_script", "scripts/rl.py")
  rl_script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_script)
  code = rl_script.cli.run(rl_script.main, ["--config=configs/tiny.py", "--config.data.jsonl=/nonexistent.jsonl",
                                             f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "data.jsonl='/nonexistent.jsonl': no such file" in err[0]
  assert not os.path.exists(tmp_path / "run")


def test_run_stops_with_a_checkpoint_after_consecutive_non_finite_steps(tmp_path, devices):
  from meshrl.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  run, prompts = loop.setup(_cfg("rl.max_nonfinite_steps=2", "rl.dynamic_sampling=false"))
  update = run.update
  run.update = lambda state, batch, key: update(state, batch.replace(advantages=batch.advantages * np.nan), key)
  initial = jax.tree.map(np.asarray, run.state.params)
  with Checkpointer(str(tmp_path / "ckpt"), every=100) as checkpointer:
    with pytest.raises(loop.NonFiniteError, match="2 RL steps in a row .*rl.max_nonfinite_steps=2"):
      loop.train_steps(run, prompts, num_steps=5, hooks=(loop.checkpoint_hook(checkpointer, prompts),))
    checkpointer.wait()
    assert checkpointer.latest_step() == 2  # saved at once, although checkpoint.every is 100
  for want, got in zip(jax.tree.leaves(initial), jax.tree.leaves(run.state.params)):
    np.testing.assert_array_equal(np.asarray(got), want)  # no poisoned update was applied
  run.close()
