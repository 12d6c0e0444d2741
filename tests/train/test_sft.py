"""SFT: target/weight alignment on a packed row, memorising a fixed batch, and the full loop with
metrics, checkpoints and an exact resume."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs import load
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.rl.envs import TaskMixture
from meshrl.sharding import make_mesh
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.data import make_sft_data
from meshrl.train.metrics import read_jsonl
from meshrl.train.optim import make_optimizer
from meshrl.train.sft import make_sft_step, next_token_targets, put_batch, run_sft
from meshrl.train.state import create_train_state


def test_targets_and_weights_on_a_packed_row():
  batch = {"tokens": jnp.array([[10, 11, 12, 20, 21, 22, 0]]),
           "segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 0]]),
           "positions": jnp.array([[0, 1, 2, 0, 1, 2, 0]]),
           "loss_mask": jnp.array([[0, 1, 1, 0, 1, 1, 0]])}
  targets, weights = next_token_targets(batch)
  assert targets.tolist() == [[11, 12, 20, 21, 22, 0, 0]]
  # 11, 12 are predicted inside doc 1, 21, 22 inside doc 2; 20 starts doc 2 and padding is no target.
  assert weights.tolist() == [[1, 1, 0, 1, 1, 0, 0]]


def test_packed_row_loss_equals_each_document_alone():
  """Packing isolates documents: each token's loss in a packed row equals its loss when its document
  runs alone (segment ids stop attention across documents, positions restart at 0)."""
  cfg = load("configs/tiny.py", ["data.seq_len=32"])
  model = build_model(ModelConfig.from_config(cfg), seed=0)
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 256, size=n).astype(np.int32) for n in (9, 12, 7)]

  def per_token_nll(tokens, positions, segments):
    logits = model(jnp.asarray(tokens)[None], positions=jnp.asarray(positions)[None],
                   segment_ids=jnp.asarray(segments)[None]).logits[0]
    logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32))
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens)[1:, None], axis=-1)[:, 0])
  tokens = np.concatenate(docs + [np.zeros(4, np.int32)])
  segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(4)]).astype(np.int32)
  positions = np.concatenate([np.arange(len(d)) for d in docs] + [np.zeros(4)]).astype(np.int32)
  packed = per_token_nll(tokens, positions, segments)
  start = 0
  for doc in docs:
    alone = per_token_nll(doc, np.arange(len(doc)), np.ones(len(doc), np.int32))
    np.testing.assert_allclose(packed[start:start + len(doc) - 1], alone, atol=2e-5)
    start += len(doc)
  # Without segment ids the second document would see the first: the check can fail.
  leaky = per_token_nll(tokens, positions, np.ones_like(segments))
  assert np.abs(leaky[len(docs[0]):len(docs[0]) + 11] - packed[len(docs[0]):len(docs[0]) + 11]).max() > 1e-4


def test_tiny_moe_memorises_a_fixed_batch():
  cfg = load("configs/tiny.py", ["data.seq_len=64", "rl.sft_batch_size=8"])
  mc = ModelConfig.from_config(cfg)
  tx = make_optimizer(cfg.optim, learning_rate=3e-3)
  graphdef, state = create_train_state(build_model(mc, seed=0), tx)
  batch = put_batch(next(make_sft_data(cfg, source=TaskMixture(cfg.data.tasks, seed=0))), None)
  step = make_sft_step(graphdef, None, cfg, tx)
  state, first = step(state, batch)
  for _ in range(99):
    state, metrics = step(state, batch)
  ce0, ce = float(first["ce"]), float(metrics["ce"])
  assert ce < 0.1 * ce0, (ce0, ce)
  assert float(metrics["loss"]) < 0.1 * float(first["loss"])
  assert int(state.step) == 100


def _source(cfg):
  return TaskMixture(cfg.data.tasks, difficulty=cfg.data.difficulty, seed=cfg.seed)


def _mesh_cfg(workdir, **overrides):
  fields = {"data.seq_len": 32, "rl.sft_batch_size": 8, "rl.sft_steps": 4, "rl.sft_learning_rate": 3e-3,
            "checkpoint.every": 2, "checkpoint.async_save": True, "log.progress_bar": False,
            "mesh.fsdp": 4, "mesh.tensor": 2, "model.embed_dim": 64, "moe.aux_free_bias": True,
            "moe.score_func": "sigmoid", "workdir": str(workdir)}
  fields.update(overrides)
  return load("configs/tiny.py", [f"{k}={v}" for k, v in fields.items()])


@pytest.mark.usefixtures("compile_cache")
def test_run_sft_writes_outputs_and_resumes(tmp_path):
  workdir = tmp_path / "run"
  cfg = _mesh_cfg(workdir, **{"log.profile_start": 3, "log.profile_steps": 1})
  mesh = make_mesh(cfg.mesh)
  first = run_sft(cfg, str(workdir), mesh, source=_source(cfg))
  assert [r["step"] for r in first.history] == [1, 2, 3, 4]
  profile = json.loads((workdir / "profile" / "summary.json").read_text())  # log.profile_start: step 3 traced
  assert profile["steps"] == [3, 3]
  assert {p["program"]: p["calls"] for p in profile["programs"]}["jit_sft_step"] == 1
  assert all(r["compiles"] == 1 for r in first.history)  # no step compiles after the first
  assert first.history[-1]["loss"] < first.history[0]["loss"]
  bias = np.asarray(first.state.extra["moe_stack"]["mlp"]["router_bias"].get_value())
  assert np.abs(bias).sum() > 0  # aux-loss-free balancing moved the bias
  assert os.path.exists(workdir / "loss_curve.png")
  assert os.listdir(workdir / "tb")

  with Checkpointer(str(workdir / "checkpoints")) as ckpt:
    assert ckpt.all_steps() == [2, 4]
    saved = ckpt.restore(first.state)
  assert saved.config["data"]["seq_len"] == 32
  assert set(saved.data_state) >= {"grain", "skipped_malformed", "skipped_too_long"}

  resumed = run_sft(cfg, str(workdir), mesh, num_steps=6, source=_source(cfg))
  assert [r["step"] for r in resumed.history] == [5, 6]
  assert json.loads((workdir / "profile" / "summary.json").read_text()) == profile  # past the window
  assert int(resumed.state.step) == 6
  steps = [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl"))]
  assert steps == [1, 2, 3, 4, 5, 6]
  for leaf in jax.tree.leaves(resumed.state.params):
    assert leaf.sharding.mesh.shape == mesh.shape

  # The same 6 steps without a break land on the same weights: state and data position resumed.
  straight = run_sft(_mesh_cfg(tmp_path / "straight", **{"checkpoint.enabled": False}),
                     str(tmp_path / "straight"), mesh, num_steps=6, source=_source(cfg))
  for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_mismatched_shapes_fail_before_compiling(tmp_path):
  with pytest.raises(ValueError, match="data.seq_len=128 is longer than model.max_seq_len=64"):
    bad = _mesh_cfg(tmp_path, **{"data.seq_len": 128})
    run_sft(bad, str(tmp_path), source=_source(bad))
  cfg = _mesh_cfg(tmp_path, **{"rl.sft_batch_size": 6})
  with pytest.raises(ValueError, match="rl.sft_batch_size=6 is not divisible"):
    run_sft(cfg, str(tmp_path), make_mesh(cfg.mesh), source=_source(cfg))


def _poisoned(rows_fn):
  """model_rows whose loss weights are NaN: every step's loss and gradient are non-finite."""
  def rows(batch, zigzag_shards=1):
    out = rows_fn(batch, zigzag_shards)
    return {**out, "weights": np.full_like(out["weights"], np.nan)}
  return rows


def test_a_nonfinite_step_leaves_params_and_optimizer_bit_identical():
  cfg = load("configs/tiny.py", ["data.seq_len=32", "rl.sft_batch_size=4", "model.num_layers=1",
                                 "model.embed_dim=32", "moe.aux_free_bias=true",
                                 "moe.score_func=sigmoid"])
  tx = make_optimizer(cfg.optim, learning_rate=1e-2)
  graphdef, state = create_train_state(build_model(ModelConfig.from_config(cfg), seed=0), tx)
  good = put_batch(next(make_sft_data(cfg, source=TaskMixture(cfg.data.tasks, seed=0))), None)
  bad = {**good, "weights": good["weights"].at[0, 3].set(jnp.nan)}  # one planted NaN
  step = make_sft_step(graphdef, None, cfg, tx)
  before = jax.device_get((state.params, state.opt_state, state.extra))
  state, metrics = step(state, bad)
  assert float(metrics["nonfinite"]) == 1.0
  after = jax.device_get((state.params, state.opt_state, state.extra))
  for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(got, want)  # bit-identical: a select, not a zero update
  state, metrics = step(state, good)  # a finite batch is applied
  assert float(metrics["nonfinite"]) == 0.0
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(state.params)),
                                                      jax.tree.leaves(before[0]))]
  assert any(moved)


@pytest.mark.usefixtures("compile_cache")
def test_sft_stops_on_a_nonfinite_streak_and_on_preemption_with_a_checkpoint(tmp_path, monkeypatch):
  from meshrl.train import sft  # pylint: disable=import-outside-toplevel
  from meshrl.train.preemption import Preemption  # pylint: disable=import-outside-toplevel
  from meshrl.train.stops import NonFiniteError  # pylint: disable=import-outside-toplevel
  small = {"model.num_layers": 1, "model.embed_dim": 32, "mesh.fsdp": 1, "mesh.tensor": 1,
           "checkpoint.async_save": False, "checkpoint.every": 100, "log.tensorboard": False,
           "log.plot": False, "rl.max_nonfinite_steps": 2, "rl.sft_steps": 5}
  # Preemption requested during step 1: it finishes, is saved, and the run returns; a rerun resumes.
  cfg = _mesh_cfg(tmp_path / "pre", **small)
  preemption = Preemption()
  preemption.request("SIGTERM")
  stopped = run_sft(cfg, str(tmp_path / "pre"), source=_source(cfg), preemption=preemption)
  assert stopped.preempted and [r["step"] for r in stopped.history] == [1]
  with Checkpointer(str(tmp_path / "pre" / "checkpoints")) as ckpt:
    assert ckpt.all_steps() == [1]
  resumed = run_sft(cfg, str(tmp_path / "pre"), source=_source(cfg))
  assert not resumed.preempted and int(resumed.state.step) == 5

  # Every step non-finite: after 2 in a row the run saves and stops, parameters untouched.
  cfg = _mesh_cfg(tmp_path / "nan", **small)
  monkeypatch.setattr(sft, "model_rows", _poisoned(sft.model_rows))
  initial = jax.device_get(build_model(ModelConfig.from_config(cfg), seed=cfg.seed))
  with pytest.raises(NonFiniteError, match=r"2 SFT steps in a row \(up to step 2\).*checkpoint of step 2"):
    run_sft(cfg, str(tmp_path / "nan"), source=_source(cfg))
  with Checkpointer(str(tmp_path / "nan" / "checkpoints")) as ckpt:
    assert ckpt.latest_step() == 2
  assert [r["nonfinite_steps"] for r in read_jsonl(str(tmp_path / "nan" / "metrics.jsonl"))][-1] == 2
  monkeypatch.undo()
  restored = run_sft(cfg, str(tmp_path / "nan"), source=_source(cfg), num_steps=2)  # restores only
  from flax import nnx  # pylint: disable=import-outside-toplevel
  want = jax.tree.leaves(nnx.state(initial, nnx.Param))
  got = jax.tree.leaves(jax.device_get(restored.state.params))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


def test_sft_and_the_first_model_are_built_from_the_given_model_numbers(tmp_path):
  """run_sft and initial_model take the run's model numbers (an RL warm start passes its run spec's)
  rather than building them from cfg again: numbers whose vocabulary differs from the config's are
  what the trained model, its state and the first model hold. Fails if either rebuilt them from cfg."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import initial_model, model_config  # pylint: disable=import-outside-toplevel
  cfg = _mesh_cfg(tmp_path, **{"model.num_layers": 1, "model.embed_dim": 32, "mesh.fsdp": 1, "mesh.tensor": 1,
                               "checkpoint.enabled": False, "log.tensorboard": False, "log.plot": False,
                               "rl.sft_batch_size": 4})
  numbers = model_config(cfg)
  wider = dataclasses.replace(numbers, vocab_size=numbers.vocab_size + 64)
  assert initial_model(cfg, None, numbers=wider).config == wider
  result = run_sft(cfg, str(tmp_path), None, source=_source(cfg), num_steps=1, numbers=wider)
  assert result.model.config == wider and [r["step"] for r in result.history] == [1]
  embed = [x.shape for x in jax.tree.leaves(result.state.params) if wider.vocab_size in x.shape]
  assert embed and not [x for x in jax.tree.leaves(result.state.params) if numbers.vocab_size in x.shape]
