"""The RL programs through the pipeline (model/pipeline.py): the update and the reference/proximal
log-probs on stage=2 equal the unpipelined ones, and a two-slice mesh with one stage per slice runs
a whole RL step (rollout, scoring, update)."""

import os
import signal
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.step import driver as loop
from meshrl.rl.step.program import _rollout_arrays, build_run, prepare, rl_step
from meshrl.sharding import make_mesh
from meshrl.sharding.mesh import FSDP_AXIS, STAGE_AXIS, axis_size

TOK = ByteTokenizer()
SMALL = ["model.num_layers=4", "moe.first_k_dense=2", "model.embed_dim=64", "model.head_dim=16",
         "model.mlp_dim=64", "moe.expert_mlp_dim=32", "moe.dispatch=dropless", "rl.max_prompt_len=8",
         "rl.max_new_tokens=8", "model.max_seq_len=16", "rl.prompts_per_step=4", "rl.group_size=4",
         "rl.dynamic_sampling=false", "rl.sft_steps=0", "log.progress_bar=false", "log.tensorboard=false",
         "log.plot=false"]
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8="]


def _run(*extra):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  mesh = make_mesh(cfg.mesh)
  return build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), TOK)


@pytest.mark.slow  # 65 s; by default tests/model/test_pipeline.py checks the pipelined loss and gradients
def test_update_and_logprobs_through_the_pipeline_equal_unpipelined(devices):
  """stage=2 x fsdp=4, 2 microbatches, KL to a reference, routing replay, SGD: the log-probs of the
  reference/proximal forward, the update's loss and metrics and the parameters after one step equal
  the fsdp=8 run's (one batch from the unpipelined rollout, fed to both)."""
  common = ["optim.name=sgd", "optim.learning_rate=0.5", "rl.kl_coef=0.1", "rl.num_minibatches=2"]
  plain = _run(*common, "mesh.fsdp=8")
  piped = _run(*common, "mesh.stage=2", "mesh.fsdp=4", "mesh.microbatches=2")
  tokens, mask = TOK.encode_batch(PROMPTS, length=8)
  out = plain.rollout(plain.state.params, plain.state.extra, tokens, mask, jax.random.key(0))
  rewards = np.random.RandomState(0).rand(16).astype(np.float32)
  scored = ScoredBatch(arrays=_rollout_arrays(out), rewards=rewards, correct=rewards,
                       sample_valid=np.ones(16, bool), domains=["arithmetic"] * 16, texts=[""] * 16)
  batch = jax.device_get(prepare(plain, scored)[0])  # host arrays: each run lays them out its way
  want_logp, _ = plain.logprob_fn(plain.state.params, plain.state.extra, batch)
  got_logp, _ = piped.logprob_fn(piped.state.params, piped.state.extra, batch)
  np.testing.assert_allclose(np.asarray(got_logp), np.asarray(want_logp), atol=1e-5, rtol=0)
  want_state, want = plain.update(plain.state, batch, jax.random.key(1))
  got_state, got = piped.update(piped.state, batch, jax.random.key(1))
  for name in ("loss", "kl", "moe_aux_loss", "grad_norm", "ratio_mean_first"):
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), atol=1e-5, rtol=1e-5, err_msg=name)
  for got_param, want_param in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
    np.testing.assert_allclose(np.asarray(got_param), np.asarray(want_param), atol=1e-5, rtol=0)
  plain.close()
  piped.close()


INNER = "MESHRL_TEST_TWO_SLICE_INNER"


@pytest.mark.slow  # 37 s (a fresh process); by default tests/model/test_pipeline.py checks the stage layout
def test_two_slice_mesh_runs_an_rl_step(devices):
  """mesh.num_slices=2 with mesh.stage=2 on 8 simulated devices: one stage per slice (devices 0-3 and
  4-7), fsdp=4 inside each. A whole RL step runs: the rollout generates from the stage-split weights,
  the update trains through the pipeline, and every parameter keeps its stage-split layout.

  It runs in a fresh process. In three clean-clone CI runs (69ee4f0, 15fd1d1, 34a818b) XLA:CPU aborted
  the pytest worker here, each time at 99% of the run, after the worker had run many other files;
  alone it has not aborted. A worker that dies ends the whole run. So an abort (SIGABRT, not a failed
  assertion) is retried once in a new process, with a warning that keeps its output."""
  if os.environ.get(INNER) == "1":
    _two_slice_step(devices)
    return
  command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "slow",
             f"{__file__}::test_two_slice_mesh_runs_an_rl_step"]
  for attempt in range(2):
    proc = subprocess.run(command, env={**os.environ, INNER: "1"}, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode != -signal.SIGABRT or attempt:
      break
    warnings.warn(f"XLA:CPU aborted the two-slice RL step; running it again. Its output:\n{proc.stdout[-3000:]}"
                  f"{proc.stderr[-3000:]}")
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _two_slice_step(devices):
  del devices
  cfg = configs.load("configs/tiny.py", SMALL + ["mesh.num_slices=2", "mesh.stage=2", "mesh.fsdp=-1",
                                                 "model.init_std=0.3"])
  run, prompts = loop.setup(cfg)
  assert axis_size(run.mesh, STAGE_AXIS) == 2 and axis_size(run.mesh, FSDP_AXIS) == 4
  assert [sorted(d.id for d in row.flat) for row in run.mesh.devices.reshape(2, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  before = [np.asarray(x) for x in jax.tree.leaves(run.state.params)]
  shardings = [x.sharding for x in jax.tree.leaves(run.state.params)]
  record = rl_step(run, prompts, jax.random.key(0))
  assert np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
  after = jax.tree.leaves(run.state.params)
  assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))
  for want, x in zip(shardings, after):
    assert x.sharding.is_equivalent_to(want, x.ndim)
  run.close()
