"""Routing replay through the whole model: foreign routes change the logits and equal running each
layer's MoE with its own slice of those routes."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig

SMALL = ["model.num_layers=3", "model.embed_dim=64", "model.head_dim=16", "moe.expert_mlp_dim=32",
         "moe.num_experts=4", "moe.num_experts_per_tok=2", "moe.first_k_dense=0", "model.scan_layers=false"]


def _per_layer_forward(model, tokens, routing):
  """The decoder written out layer by layer: each block's attention, then its MoE called directly
  with `routing[i]`; independent of the model's stack plumbing."""
  graphdef, state = nnx.split(model.moe_stack)
  x = model.embed(tokens)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  segments = jnp.ones_like(tokens)
  for i in range(routing.shape[0]):
    block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
    attn_out, _ = block.attn(block.attn_norm(x), positions, segments, None, None)
    x = x + attn_out
    moe_out, _ = block.mlp(block.mlp_norm(x), routing=routing[i])
    x = x + moe_out
  return jnp.einsum("btd,dv->btv", model.final_norm(x), model.output_projection())


def test_foreign_routes_change_logits_and_equal_per_layer_moe_calls():
  cfg = configs.load("configs/tiny.py", SMALL)
  model = build_model(ModelConfig.from_config(cfg), seed=0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 10)), jnp.int32)
  own = model(tokens)
  routing = own.aux["routing"]  # [L, B, T, K]
  assert routing.shape == (3, 2, 10, 2)
  # Replaying the model's own routes reproduces it exactly.
  np.testing.assert_array_equal(model(tokens, routing=routing).logits, own.logits)
  # Foreign routes: every token sent to other experts, and layers given each other's routes.
  foreign = (routing + 1) % 4
  replayed = model(tokens, routing=foreign)
  assert np.abs(np.asarray(replayed.logits) - np.asarray(own.logits)).max() > 1e-3
  np.testing.assert_array_equal(replayed.aux["routing"], foreign)
  np.testing.assert_allclose(replayed.logits, _per_layer_forward(model, tokens, foreign), atol=1e-5)
  shuffled = foreign[::-1]
  assert np.abs(np.asarray(model(tokens, routing=shuffled).logits)
                - np.asarray(replayed.logits)).max() > 1e-4  # layer i gets routes i, not another's
  np.testing.assert_allclose(model(tokens, routing=shuffled).logits,
                             _per_layer_forward(model, tokens, shuffled), atol=1e-5)
  assert float(replayed.aux["route_mismatch"]) > 0.5 and float(own.aux["route_mismatch"]) == 0.0
