"""Logical axis rules give the expected PartitionSpecs and per-device shard shapes."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrl.sharding import (ROLLOUT_RULES, TRAIN_RULES, constrain, logical_to_spec, make_mesh,
                             named_shardings, rules_from_config)


def _mesh(**sizes):
  base = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=1, num_slices=1)
  base.update(sizes)
  return make_mesh(ml_collections.ConfigDict(base))


def test_weight_and_activation_specs(devices):
  mesh = _mesh(fsdp=2, expert=2, tensor=2)
  assert logical_to_spec(("embed", "mlp"), TRAIN_RULES, mesh) == P("fsdp", "tensor")
  assert logical_to_spec(("experts", "embed", "expert_mlp"), TRAIN_RULES, mesh) == P(
      "expert", "fsdp", "tensor")
  # The batch takes fsdp and expert first, so the activation's embed stays whole.
  assert logical_to_spec(("batch", "length", "embed"), TRAIN_RULES, mesh) == P(
      ("fsdp", "expert"), None, None)


def test_size_one_axes_are_dropped(devices):
  mesh = _mesh(fsdp=8)
  assert logical_to_spec(("vocab", "embed"), TRAIN_RULES, mesh) == P(None, "fsdp")


def test_rollout_rules_keep_parameter_layout(devices):
  mesh = _mesh(fsdp=2, sequence=2, tensor=2)
  for names in [("embed", "mlp"), ("experts", "embed", "expert_mlp"), ("vocab", "embed")]:
    assert logical_to_spec(names, TRAIN_RULES, mesh) == logical_to_spec(names, ROLLOUT_RULES, mesh)
  assert logical_to_spec(("batch", "length"), TRAIN_RULES, mesh) == P("fsdp", "sequence")
  assert logical_to_spec(("batch", "length"), ROLLOUT_RULES, mesh) == P("fsdp", None)


def test_shard_shapes_on_real_arrays(devices):
  mesh = _mesh(fsdp=4, tensor=2)
  tree = {"w_in": ("embed", "mlp"), "emb": ("vocab", "embed"), "act": ("batch", "length", "embed")}
  shardings = named_shardings(tree, mesh, TRAIN_RULES)
  arrays = {"w_in": jnp.ones((64, 32)), "emb": jnp.ones((16, 64)), "act": jnp.ones((8, 6, 64))}
  placed = jax.tree.map(jax.device_put, arrays, shardings)
  assert placed["w_in"].addressable_shards[0].data.shape == (16, 16)
  assert placed["emb"].addressable_shards[0].data.shape == (8, 16)
  assert placed["act"].addressable_shards[0].data.shape == (2, 6, 64)
  assert len({s.device for s in placed["w_in"].addressable_shards}) == 8


def test_constrain_inside_jit(devices):
  mesh = _mesh(fsdp=8)
  x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
  y = jax.jit(lambda a: constrain(a * 2, ("batch", "embed"), mesh))(x)
  assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("fsdp", None)), 2)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_rule_overrides_from_config(devices):
  cfg = ml_collections.ConfigDict(dict(train_rules="vocab=none;mlp=tensor,expert"))
  rules = dict(rules_from_config(cfg, "train"))
  assert rules["vocab"] == () and rules["mlp"] == ("tensor", "expert")
  with pytest.raises(ValueError, match="mesh axes"):
    rules_from_config(ml_collections.ConfigDict(dict(train_rules="mlp=model")), "train")
  with pytest.raises(ValueError, match="NAME=AXIS"):
    rules_from_config(ml_collections.ConfigDict(dict(train_rules="hidden=tensor")), "train")


def test_stage_free_shardings_replicate_the_layers_over_stages_only(devices):
  """A block weight [layers, embed, mlp] on stage=2 x fsdp=2 x tensor=2: the pipelined update holds
  layers split over `stage`; the generation layout keeps fsdp and tensor and replicates the layers
  over the stages (each stage group holds every layer), and the reshard moves real arrays."""
  from meshrl.sharding.rules import stage_free_shardings  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  mesh = _mesh(stage=2, fsdp=2, tensor=2)
  spec = logical_to_spec(("layers", "embed", "mlp"), TRAIN_RULES, mesh)
  assert spec == P("stage", "fsdp", "tensor")
  weights = jax.device_put(jnp.arange(4 * 8 * 8, dtype=jnp.float32).reshape(4, 8, 8), NamedSharding(mesh, spec))
  free = stage_free_shardings({"w": weights.sharding})
  assert free["w"].spec == P(None, "fsdp", "tensor")
  moved = jax.jit(lambda t: t, out_shardings=free)({"w": weights})["w"]
  assert moved.sharding.shard_shape(moved.shape) == (4, 4, 4)
  np.testing.assert_array_equal(np.asarray(moved), np.asarray(weights))
  unchanged = NamedSharding(mesh, P("fsdp", "tensor"))
  assert stage_free_shardings(unchanged) == unchanged


def test_generation_arrays_are_never_split_over_stages(devices):
  """The KV cache [layers, batch, length, kv heads, head dim] of a rollout on stage=2: generation
  runs every layer on every stage group, so its cache must not be split over `stage` (a prefill that
  wrote each layer's keys to one stage's chips needed 102 GiB per chip on paper_3t, against 58)."""
  from meshrl.model.kv_cache import CACHE_AXES  # pylint: disable=import-outside-toplevel
  mesh = _mesh(stage=2, fsdp=2, tensor=2)
  assert logical_to_spec(CACHE_AXES["k"], ROLLOUT_RULES, mesh) == P(None, "fsdp", None, "tensor", None)
  assert logical_to_spec(("layers", "embed"), TRAIN_RULES, mesh) == P("stage", "fsdp")
