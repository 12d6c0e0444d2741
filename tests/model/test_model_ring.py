"""The model on a sequence-sharded mesh: ring attention, zigzag layout, sequence-sharded decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.ring_attention import zigzag
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import make_mesh

SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "moe.first_k_dense=1", "model.max_seq_len=64",
         "attention.block_q=4", "attention.block_kv=4"]


def _model(*extra):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  mesh = make_mesh(cfg.mesh)
  return build_model(ModelConfig.from_config(cfg, mesh), mesh), mesh


def _loss(model, tokens, positions, segments, targets, mask):
  graphdef, state = nnx.split(model)

  def loss_fn(state):
    logits = nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segments).logits
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)
  return jax.jit(loss_fn)(state)


def test_zigzag_loss_equals_contiguous_loss(devices):
  ring_model, mesh = _model("attention.impl=ring", "mesh.sequence=4", "mesh.fsdp=2")
  ref_model, _ = _model("attention.impl=reference", "mesh.sequence=4", "mesh.fsdp=2")
  rng = np.random.RandomState(0)
  tokens_all = rng.randint(0, 259, (2, 33)).astype(np.int32)
  tokens, targets = tokens_all[:, :-1], tokens_all[:, 1:]
  positions = np.broadcast_to(np.arange(32, dtype=np.int32), (2, 32))
  segments = np.concatenate([np.ones((2, 20), np.int32), 2 * np.ones((2, 12), np.int32)], axis=1)
  mask = (rng.rand(2, 32) > 0.2).astype(np.float32)
  contiguous = _loss(ref_model, tokens, positions, segments, targets, mask)
  batch = [zigzag(a, 4) for a in (tokens, positions, segments, targets, mask)]
  zigzagged = _loss(ring_model, *batch)
  assert abs(float(zigzagged) - float(contiguous)) <= 1e-6


@pytest.mark.slow  # suite budget: tests/model/test_ring_prefill.py's default case checks the ring prefill and
# the sequence-sharded decode against the unsharded rollout
def test_ring_forward_and_sharded_decode_equal_reference(devices):
  ring_model, _ = _model("attention.impl=ring", "mesh.sequence=4", "mesh.fsdp=2")
  ref_model, _ = _model("attention.impl=reference", "mesh.sequence=4", "mesh.fsdp=2")
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 259, (2, 16)), jnp.int32)
  full = ref_model(tokens).logits
  np.testing.assert_allclose(np.asarray(ring_model(tokens).logits), np.asarray(full), atol=1e-5)
  # Decode against a cache of 16 slots split over the 4 sequence shards.
  out = ring_model(tokens[:, :8], cache=ring_model.init_cache(2, 16))
  steps, cache = [out.logits], out.cache
  for t in range(8, 16):
    out = ring_model(tokens[:, t:t + 1], cache=cache)
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), atol=1e-5)
