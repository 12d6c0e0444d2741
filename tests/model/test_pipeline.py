"""Pipeline parallelism (model/pipeline.py): the pipelined forward and its gradients equal the plain
stack's for 2 and 4 stages and several microbatch counts, each stage's layers stay on its devices,
and stage or microbatch counts that do not divide the model or the batch are refused by name."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import pipeline
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.sharding.traffic import replica_groups
from meshrl.sharding import make_mesh
from meshrl.train.sft import sft_loss

# 8 blocks: 4 dense then 4 MoE, so both stacks split over 2 and over 4 stages. Exact dispatch, so a
# microbatch routes its tokens as the whole batch does.
MODEL = ["model.num_layers=8", "moe.first_k_dense=4", "model.embed_dim=32", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "moe.num_experts=4",
         "moe.expert_mlp_dim=16", "model.max_seq_len=16", "moe.dispatch=dropless",
         "moe.aux_loss_coef=0.1", "moe.z_loss_coef=0.01"]
ROWS, LENGTH = 16, 12


def _cfg(*extra):
  return configs.load("configs/tiny.py", MODEL + list(extra))


def _batch():
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, 259, (ROWS, LENGTH)).astype(np.int32)
  segments = np.ones((ROWS, LENGTH), np.int32)
  segments[::3, LENGTH // 2:] = 2  # packed rows: two documents
  positions = np.where(segments == 2, np.arange(LENGTH) - LENGTH // 2, np.arange(LENGTH)).astype(np.int32)
  weights = (rng.rand(ROWS, LENGTH) > 0.3).astype(np.float32)
  return {"tokens": tokens, "positions": positions, "segment_ids": segments,
          "targets": np.roll(tokens, -1, axis=1), "weights": weights}


def _loss_and_grads(cfg):
  """(loss, metrics, grads) of the SFT objective (cross-entropy + MoE balance terms) on `_batch`, the
  model built on cfg's mesh from seed 0 (the same values on any mesh)."""
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  loss = functools.partial(sft_loss, graphdef=graphdef, moe_cfg=cfg.moe)
  (value, metrics), grads = jax.jit(jax.value_and_grad(lambda p, e, b: loss(p, e, batch=b), has_aux=True))(
      params, extra, _batch())
  return jax.device_get((value, metrics, grads))


@pytest.fixture(scope="module")
def unpipelined():
  return _loss_and_grads(_cfg("mesh.fsdp=8"))


@pytest.mark.parametrize("stages,microbatches,mesh", [
    pytest.param(2, 2, "fsdp=4", marks=pytest.mark.slow), (2, 4, "fsdp=2,expert=2"), (4, 4, "fsdp=2"),
    pytest.param(2, 1, "fsdp=4", marks=pytest.mark.slow), pytest.param(4, 8, "fsdp=2", marks=pytest.mark.slow),
    pytest.param(2, 2, "sequence=2,fsdp=2,ring", marks=pytest.mark.slow)])
def test_pipelined_loss_and_grads_equal_unpipelined(devices, unpipelined, stages, microbatches, mesh):
  """Loss, MoE metrics (the load-balancing loss is rebuilt from the batch's load, not averaged over
  microbatches) and every parameter's gradient within 1e-5 of the plain stack (float32): a microbatch
  sent to the wrong stage, a layer run twice or skipped, a bubble iteration whose output is kept, or a
  gradient lost in the ring's transpose all break it."""
  axes = [f"mesh.{part}" for part in mesh.split(",") if part != "ring"]
  ring = ["attention.impl=ring", "model.remat=full"] if "ring" in mesh else []
  cfg = _cfg(f"mesh.stage={stages}", f"mesh.microbatches={microbatches}", *axes, *ring)
  want_loss, want_metrics, want_grads = unpipelined
  loss, metrics, grads = _loss_and_grads(cfg)
  np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
  for name in ("ce", "moe_aux_loss", "moe_z_loss", "expert_load"):
    np.testing.assert_allclose(metrics[name], want_metrics[name], atol=1e-5, rtol=0, err_msg=name)
  flat, flat_want = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  assert len(flat) == len(flat_want)
  for got, want in zip(flat, flat_want):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_each_stage_holds_and_runs_only_its_layers(devices):
  """stage=2 x fsdp=4: a device holds half of the blocks' parameters, the compiled program passes
  activations between stages by collective permutes, and no all-gather spans the two stages (a stage
  that ran every layer would gather the other stage's weights)."""
  cfg = _cfg("mesh.stage=2", "mesh.fsdp=4", "mesh.microbatches=2")
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  kernel = model.moe_stack.mlp.gate[...]  # [L, E, D, F]
  assert kernel.sharding.shard_shape(kernel.shape)[0] == kernel.shape[0] // 2
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  loss = functools.partial(sft_loss, graphdef=graphdef, moe_cfg=cfg.moe)
  grad_fn = jax.jit(jax.grad(lambda p, e, b: loss(p, e, batch=b)[0]))
  hlo = grad_fn.lower(params, extra, _batch()).compile().as_text()
  stage_of = {d.id: i for i, row in enumerate(mesh.devices.reshape(2, 4)) for d in row}
  permutes = [line for line in hlo.splitlines() if "collective-permute(" in line]
  assert permutes
  gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
  assert gathers  # FSDP's weight gathers, inside each stage
  for line in gathers:
    for group in replica_groups(line):
      assert len({stage_of[d] for d in group}) == 1, line[:300]


def test_bad_stage_and_microbatch_counts_name_the_fields(devices):
  with pytest.raises(ValueError, match=r"mesh.stage=3 does not divide the layers: model.num_layers=8 "
                                       r"with moe.first_k_dense=4"):
    ModelConfig.from_config(_cfg("mesh.stage=3"))
  with pytest.raises(ValueError, match=r"mesh.stage=2 and mesh.num_slices=3"):
    make_mesh(_cfg("mesh.stage=2", "mesh.num_slices=3", "mesh.fsdp=-1").mesh, jax.devices()[:6])
  # 16 rows over fsdp=4 leave 4 per shard: 3 microbatches cannot take equal rows from each shard.
  cfg = _cfg("mesh.stage=2", "mesh.fsdp=4", "mesh.microbatches=3")
  with pytest.raises(ValueError, match=r"mesh.microbatches=3 does not divide.*16 rows over 4 batch shard"):
    _loss_and_grads(cfg)


def test_microbatches_take_strided_rows_and_auto_fills_each_shard():
  rows = np.arange(12)
  split = pipeline.split_rows(jnp.asarray(rows), 3)  # microbatch m: rows m, m + 3, ...
  np.testing.assert_array_equal(split[1], [1, 4, 7, 10])
  np.testing.assert_array_equal(pipeline.merge_rows(split), rows)
  assert pipeline.resolve_microbatches(0, rows=64, row_shards=4, stages=2) == 8  # 16 per shard, cap 4 x 2
  assert pipeline.resolve_microbatches(0, rows=64, row_shards=64, stages=2) == 1
  assert pipeline.resolve_microbatches(0, rows=64, row_shards=4, stages=1) == 1
  assert pipeline.bubble_fraction(2, 2) == pytest.approx(1 / 3)


@pytest.mark.slow  # tests/rl/test_pipeline_rl.py's two-slice RL step generates on stages in the default run
def test_generation_on_a_staged_mesh_equals_the_plain_model(devices):
  """A prefill and 4 decode steps with a KV cache on stage=2 x fsdp=4 (weights still split over the
  stages): the logits equal the fsdp=8 model's. Generation never runs through the pipeline; every
  stage group runs it whole (pipeline.on_every_stage); a cached call sent through the pipeline's
  microbatches would lose its cache, one with a stage missing would lose layers."""
  tokens = jnp.asarray(np.random.RandomState(1).randint(3, 259, (4, 10)), jnp.int32)

  def generate(cfg):
    mesh = make_mesh(cfg.mesh)
    graphdef, state = nnx.split(build_model(ModelConfig.from_config(cfg, mesh), mesh))

    @jax.jit
    def run(state):
      model = nnx.merge(graphdef, state)
      out = model(tokens[:, :6], cache=model.init_cache(4, 16))
      logits, cache = [out.logits[:, -1]], out.cache
      for t in range(6, 10):
        out = model(tokens[:, t:t + 1], cache=cache)
        logits.append(out.logits[:, 0])
        cache = out.cache
      return jnp.stack(logits, 1)
    return np.asarray(run(state))

  want = generate(_cfg("mesh.fsdp=8"))
  np.testing.assert_allclose(generate(_cfg("mesh.stage=2", "mesh.fsdp=4")), want, atol=1e-5, rtol=0)
