"""Building the model sharded on the mesh, and counting its parameters from shapes alone."""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh

from meshrl.model.params import sharded_init
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding.rules import TRAIN_RULES, Rules


def build_model(mc: ModelConfig, mesh: Mesh | None = None, *, seed: int = 0,
                rules: Rules = TRAIN_RULES) -> Transformer:
  """A Transformer whose every parameter is created directly in its sharding on `mesh`."""
  return sharded_init(lambda: Transformer(mc, rngs=nnx.Rngs(seed)), mesh, rules)


def parameter_counts(mc: ModelConfig) -> dict[str, int]:
  """{"total", "active_per_token", "embedding"} from jax.eval_shape (no memory is allocated).

  Active counts all non-expert weights, plus k of the E routed experts in each MoE layer.
  """
  abstract = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  routed = 0
  if abstract.moe_stack is not None:
    experts = nnx.state(abstract.moe_stack.mlp, nnx.Param)
    routed = sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(experts)
                 if len(x.shape) == 4)  # [L, E, ., .] expert weights
  inactive = routed - routed * mc.num_experts_per_tok // max(mc.num_experts, 1)
  embedding = mc.vocab_size * mc.embed_dim
  return {"total": total, "active_per_token": total - inactive, "embedding": embedding}
