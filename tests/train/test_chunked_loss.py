"""Chunked vocab projection + loss equals the dense computation, values and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshrl.sharding import make_mesh
from meshrl.train.chunked_loss import chunked_cross_entropy, chunked_logprobs, chunked_token_stats

B, T, D, V = 2, 37, 16, 50  # T not a multiple of the chunk: padding is exercised


def _inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (B, T, D))
  head = jax.random.normal(keys[1], (D, V)) * 0.3
  targets = jax.random.randint(keys[2], (B, T), 0, V)
  mask = jnp.asarray(np.random.default_rng(0).random((B, T)) > 0.3)
  targets = jnp.where(mask, targets, -100)  # ignored positions carry an out-of-range id
  return hidden, head, targets, mask


def _dense_logprobs(hidden, head, targets):
  logp = jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", hidden, head), axis=-1)
  return jnp.take_along_axis(logp, jnp.clip(targets, 0, V - 1)[..., None], axis=-1)[..., 0]


def _dense_loss(hidden, head, targets, mask):
  nll = -_dense_logprobs(hidden, head, targets)
  return jnp.sum(nll * mask), jnp.sum(mask.astype(jnp.float32))


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_cross_entropy_matches_dense(chunk):
  hidden, head, targets, mask = _inputs()
  loss_fn = lambda h, w: chunked_cross_entropy(h, w, targets, mask, chunk=chunk)[0]
  dense_fn = lambda h, w: _dense_loss(h, w, targets, mask)[0]
  (loss, count) = jax.jit(lambda h, w: chunked_cross_entropy(h, w, targets, mask, chunk=chunk)
                          )(hidden, head)
  want_loss, want_count = _dense_loss(hidden, head, targets, mask)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert float(count) == float(want_count)
  grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(hidden, head)
  want_grads = jax.grad(dense_fn, argnums=(0, 1))(hidden, head)
  for got, want in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-4


def test_chunked_logprobs_match_dense_with_gradients():
  hidden, head, targets, mask = _inputs()
  got = jax.jit(lambda h, w: chunked_logprobs(h, w, targets, chunk=8))(hidden, head)
  want = _dense_logprobs(hidden, head, targets)
  assert got.shape == (B, T)
  assert float(jnp.max(jnp.abs(got - want))) <= 1e-5
  weights = jax.random.normal(jax.random.key(1), (B, T))
  grads = jax.grad(lambda h, w: jnp.sum(chunked_logprobs(h, w, targets, chunk=8) * weights),
                   argnums=(0, 1))(hidden, head)
  want_grads = jax.grad(lambda h, w: jnp.sum(_dense_logprobs(h, w, targets) * weights),
                        argnums=(0, 1))(hidden, head)
  for got, want in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-4


def test_chunked_loss_never_builds_all_logits():
  hidden = jax.ShapeDtypeStruct((1, 4096, 64), jnp.float32)
  head = jax.ShapeDtypeStruct((64, 8192), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, 4096), jnp.bool_)
  grad = jax.grad(lambda h, w, t, m: chunked_cross_entropy(h, w, t, m, chunk=256)[0], (0, 1))
  temp = jax.jit(grad).lower(hidden, head, ids, mask).compile().memory_analysis().temp_size_in_bytes
  all_logits = 4096 * 8192 * 4
  assert temp < all_logits / 4, f"temp {temp} bytes vs {all_logits} for all logits"


def test_bad_shapes_raise():
  hidden, head, targets, mask = _inputs()
  with pytest.raises(ValueError, match="pass a tied"):
    chunked_cross_entropy(hidden, head.T, targets, mask, chunk=8)
  with pytest.raises(ValueError, match="chunk=0"):
    chunked_logprobs(hidden, head, targets, chunk=0)


def test_sequence_sharded_hidden_is_never_gathered():
  """Chunks interleave positions, so a length axis split over `sequence` stays split in the scan."""
  mesh = make_mesh(dict(data=1, fsdp=1, expert=1, sequence=8, tensor=1))
  split = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                    sharding=NamedSharding(mesh, P(None, "sequence")))
  head = jax.ShapeDtypeStruct((64, 1000), jnp.float32, sharding=NamedSharding(mesh, P()))
  grad = jax.grad(lambda h, w, t, m: chunked_cross_entropy(h, w, t, m, chunk=1024)[0], (0, 1))
  hlo = jax.jit(grad).lower(split((1, 8192, 64), jnp.float32), head, split((1, 8192), jnp.int32),
                            split((1, 8192), jnp.bool_)).compile().as_text()
  assert not re.search(r"\s(all-gather|all-to-all|collective-permute)(-start)?\(", hlo)


def _dense_stats(hidden, head, targets, scale):
  logp_all = jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", hidden, head) * scale, axis=-1)
  logp = jnp.take_along_axis(logp_all, jnp.clip(targets, 0, V - 1)[..., None], axis=-1)[..., 0]
  return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def test_chunked_token_stats_match_dense_with_gradients():
  """Log-probs and entropies at temperature 0.7 (scale 1/0.7), values and gradients of a loss that
  uses both; a dropped scale or an entropy of unscaled logits would fail."""
  hidden, head, targets, _ = _inputs()
  scale = 1 / 0.7
  logp, ent = jax.jit(lambda h, w: chunked_token_stats(h, w, targets, chunk=8, scale=scale))(hidden, head)
  want_logp, want_ent = _dense_stats(hidden, head, targets, scale)
  assert float(jnp.max(jnp.abs(logp - want_logp))) <= 1e-5
  assert float(jnp.max(jnp.abs(ent - want_ent))) <= 1e-5
  assert chunked_token_stats(hidden, head, targets, chunk=8, entropy=False)[1] is None
  w1, w2 = jax.random.normal(jax.random.key(1), (2, B, T))
  def objective(stats_fn):
    return lambda h, w: jnp.sum(stats_fn(h, w)[0] * w1) + jnp.sum(stats_fn(h, w)[1] * w2)
  grads = jax.grad(objective(lambda h, w: chunked_token_stats(h, w, targets, chunk=8, scale=scale)),
                   argnums=(0, 1))(hidden, head)
  want_grads = jax.grad(objective(lambda h, w: _dense_stats(h, w, targets, scale)), argnums=(0, 1))(hidden, head)
  for got, want in zip(grads, want_grads):
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-4
