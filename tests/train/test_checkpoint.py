"""Checkpoints: round trip, restore onto a different mesh, data-iterator state, max_to_keep."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from meshrl.configs import load
from meshrl.model.init import build_model
from meshrl.model.moe import RouterBias
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding import make_mesh
from meshrl.train.checkpoint import Checkpointer, from_nested_dict, to_nested_dict
from meshrl.train.optim import make_optimizer
from meshrl.train.state import abstract_train_state, create_train_state


def _mesh(**sizes):
  axes = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=1, num_slices=1)
  axes.update(sizes)
  return make_mesh(ml_collections.ConfigDict(axes))


def _state(cfg, mesh, seed):
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=seed)
  return create_train_state(model, make_optimizer(cfg.optim), mesh)[1]


@pytest.fixture(scope="module")
def cfg():
  return load("configs/tiny.py", ["model.embed_dim=64", "model.mlp_dim=128", "moe.expert_mlp_dim=64",
                                  "moe.aux_free_bias=true"])


def _assert_equal_trees(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_moments_sharded_like_params(state):
  adam = state.opt_state[1][0]  # chain(clip, adamw): ScaleByAdamState
  for moment in (adam.mu, adam.nu):
    for m, p in zip(jax.tree.leaves(moment), jax.tree.leaves(state.params), strict=True):
      assert m.sharding == p.sharding


class _Small(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    self.router_bias = RouterBias(jnp.arange(4.0))


def test_nested_dict_round_trip(cfg):
  _, state = create_train_state(_Small(), make_optimizer(cfg.optim))
  nested = to_nested_dict(state)
  assert set(nested) == {"step", "params", "opt_state", "extra"}
  assert set(nested["params"]["linear"]) == {"kernel", "bias"}
  _assert_equal_trees(from_nested_dict(nested, state), state)


def test_restore_onto_a_different_mesh(cfg, tmp_path):
  saved = _state(cfg, _mesh(fsdp=8), seed=1)
  saved = saved.replace(step=saved.step + 7)
  with Checkpointer(str(tmp_path), every=1, async_save=True) as ckpt:
    assert ckpt.restore(saved) is None
    assert ckpt.save(7, saved, data_state={"next_index": 42, "skipped": 3}, config=cfg)

  other_mesh = _mesh(fsdp=2, tensor=4)
  mc = ModelConfig.from_config(cfg, other_mesh)
  _, target = abstract_train_state(lambda: Transformer(mc, rngs=nnx.Rngs(0)), make_optimizer(cfg.optim),
                                   other_mesh)
  for state in (saved, target):
    _assert_moments_sharded_like_params(state)
  with Checkpointer(str(tmp_path)) as ckpt:
    restored = ckpt.restore(target)
  assert restored.step == 7
  assert restored.data_state == {"next_index": 42, "skipped": 3}
  assert restored.config["model"]["embed_dim"] == 64
  _assert_equal_trees(restored.state, saved)
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target), strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  assert any(not x.sharding.is_fully_replicated and "tensor" in str(x.sharding.spec)
             for x in jax.tree.leaves(restored.state.params))


def test_max_to_keep_and_every(tmp_path):
  state = {"w": jnp.arange(4.0)}
  with Checkpointer(str(tmp_path), every=2, max_to_keep=2, async_save=False) as ckpt:
    for step in range(1, 9):
      if ckpt.should_save(step):
        ckpt.save(step, {"w": state["w"] * step})
    assert ckpt.all_steps() == [6, 8]
    restored = ckpt.restore(state)
  assert restored.step == 8
  np.testing.assert_array_equal(restored.state["w"], np.arange(4.0) * 8)
