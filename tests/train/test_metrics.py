"""Metrics: JSONL + TensorBoard + curve files, MFU arithmetic, compile counting."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs import load
from meshrl.model.init import parameter_counts
from meshrl.model.transformer import ModelConfig
from meshrl.train.metrics import (CompileCounter, MetricsWriter, mfu, model_flops_per_token,
                                  plot_curve, read_jsonl, read_tensorboard, tensorboard_events)


def test_writer_files_and_curve(tmp_path, caplog):
  """... and a NaN metric prints nothing: tensorboardX logged "NaN or Inf found in input tensor" on
  stderr for each one."""
  workdir = str(tmp_path)
  with MetricsWriter(workdir, total_steps=5, progress_bar=True) as writer:
    for step in range(1, 6):
      writer.write(step, {"reward": jnp.float32(step / 5), "kl": np.float64(0.1), "n": np.int32(3),
                          "load": jnp.arange(2.0), "bad": float("nan")})
  lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
  records = [json.loads(line) for line in lines]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert records[-1]["reward"] == pytest.approx(1.0) and records[0]["n"] == 3
  assert records[0]["load"] == [0.0, 1.0] and records[0]["bad"] == "nan"
  board = read_tensorboard(os.path.join(workdir, "tb"))
  assert set(board) == {"reward", "kl", "n", "bad"}  # scalars only: not "step", not the list "load"
  assert board["reward"] == pytest.approx({r["step"]: r["reward"] for r in records})
  assert board["n"] == {step: 3 for step in range(1, 6)} and np.isnan(board["bad"][5])
  events = tensorboard_events(os.path.join(workdir, "tb"))
  assert sum(event.HasField("summary") for event in events) == 5  # one event per record, not per scalar
  assert "NaN or Inf" not in caplog.text
  jsonl = os.path.join(workdir, "metrics.jsonl")
  png = plot_curve(jsonl, "reward", os.path.join(workdir, "reward_curve.png"), smooth=2)
  assert os.path.getsize(png) > 1000
  with pytest.raises(ValueError, match="'missing'"):
    plot_curve(jsonl, "missing", os.path.join(workdir, "x.png"))


def test_resume_drops_later_steps(tmp_path):
  with MetricsWriter(str(tmp_path), tensorboard=False, progress_bar=False) as writer:
    for step in range(1, 6):
      writer.write(step, {"loss": step})
  with MetricsWriter(str(tmp_path), tensorboard=False, progress_bar=False, resume_step=3) as writer:
    writer.write(4, {"loss": 40})
  records = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_flops_per_token_dense_by_hand():
  cfg = load("configs/tiny.py:dense")
  mc = ModelConfig.from_config(cfg)
  d, h, kv, hd, f, v = 128, 4, 2, 32, 256, 259
  per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f + 2 * d  # q, o; k, v; SwiGLU; norms
  n = 2 * per_layer + v * d + d  # tied: the embedding is also the output projection; final norm
  assert parameter_counts(mc)["active_per_token"] == n
  attention = 2 * 64 * mc.num_heads * 2 * mc.head_dim * mc.num_layers / 2
  assert model_flops_per_token(mc, seq_len=64) == pytest.approx(6 * n + 3 * attention)
  assert model_flops_per_token(mc, seq_len=64, training=False, causal=False) == pytest.approx(
      2 * n + 2 * attention)
  assert mfu(1000.0, 1e9, 4e12) == pytest.approx(0.25)


def test_moe_counts_only_active_experts():
  moe = ModelConfig.from_config(load("configs/tiny.py"))
  counts = parameter_counts(moe)
  assert counts["active_per_token"] < counts["total"]
  assert model_flops_per_token(moe, seq_len=1, causal=False) < 6 * counts["total"]


def test_compile_counter_sees_only_new_shapes():
  @jax.jit
  def step_fn(x):
    return x * 2 + 1

  with CompileCounter() as counter:
    step_fn(jnp.ones(3))
    step_fn(jnp.ones(3))
    assert counter.count("step_fn") == 1
    step_fn(jnp.ones(4))
    assert counter.count("step_fn") == 2
