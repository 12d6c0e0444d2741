"""The sharded embedding lookup and LM head compile without XLA's involuntary full rematerialisation."""

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import make_mesh

REMAT = "Involuntary full rematerialization"
# Embedding [V, D] stored (vocab on tensor, embed on fsdp); tokens split on batch over fsdp x expert.
MESH = ["mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2", "model.vocab_size=256", "model.num_layers=1",
        "model.embed_dim=64", "model.head_dim=16", "moe.num_experts=4", "moe.first_k_dense=0"]


def _model():
  cfg = configs.load("configs/tiny.py", MESH)
  mesh = make_mesh(cfg.mesh)
  return build_model(ModelConfig.from_config(cfg, mesh), mesh)


def test_lookup_from_stored_layout_would_rematerialise(devices, capfd):
  """The detector works: a plain gather from the stored table triggers the warning."""
  model = _model()
  tokens = jnp.zeros((32, 8), jnp.int32)
  lookup = jax.jit(lambda table, t: model.config.kernel.constrain(
      jnp.take(table, t, axis=0), ("batch", "length", "embed")))
  jax.block_until_ready(lookup(model.embed.embedding[...], tokens))
  assert REMAT in capfd.readouterr().err


def test_model_forward_backward_and_decode_do_not_rematerialise(devices, capfd):
  model = _model()
  assert tuple(model.embed.embedding[...].sharding.spec) == ("tensor", "fsdp")  # layout unchanged
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.zeros((32, 8), jnp.int32)

  def loss(p, t):
    logits = nnx.merge(graphdef, p, rest)(t).logits
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  def decode(p, t, cache):
    return nnx.merge(graphdef, p, rest)(t, cache=cache).logits

  jax.block_until_ready(jax.jit(jax.grad(loss))(params, tokens))
  jax.block_until_ready(jax.jit(decode)(params, tokens[:, :1], model.init_cache(32, 16)))
  assert REMAT not in capfd.readouterr().err
