"""Shared attention-kernel cases of tests/model (test_splash.py, test_splash_ring.py): packed inputs,
the outputs and q/k/v gradients of several kernels on them, and whether a call runs a Pallas kernel,
through the `attention_cases` fixture."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def packed_inputs(batch: int, length: int, heads: int, kv_heads: int, head_dim: int, cuts: tuple[int, ...]):
  """(q [B, T, N, H], k, v [B, T, K, H], d_out [B, T, N, H], segment ids [B, T], positions [B, T]):
  random fp32 queries, keys, values and output cotangent; row 0 packs documents cut at `cuts`
  (positions restarting at each), every other row is one document. Ids and positions are numpy."""
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (batch, length, heads, head_dim))
  k = jax.random.normal(ks[1], (batch, length, kv_heads, head_dim))
  v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim))
  d_out = jax.random.normal(ks[3], (batch, length, heads, head_dim))
  sizes = np.diff([0, *cuts, length])
  seg = np.zeros((batch, length), np.int32)
  pos = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
  seg[0] = np.repeat(np.arange(len(sizes)), sizes)
  pos[0] = np.concatenate([np.arange(size) for size in sizes])
  return q, k, v, d_out, seg, pos


def outputs_and_grads(impls: dict, q, k, v, d_out) -> dict:
  """{name: (out, (dq, dk, dv))}: each kernel fn(q, k, v) -> out, and the gradient of sum(out * d_out),
  jitted."""
  results = {}
  for name, fn in impls.items():
    def loss(q, k, v, fn=fn):
      out = fn(q, k, v)
      return jnp.sum(out * d_out), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    results[name] = (out, grads)
  return results


def calls_pallas(fn, *args) -> bool:
  """Whether fn(*args) traces a Pallas kernel call (splash attention) into its jaxpr."""
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.fixture(scope="session")
def attention_cases():
  """The helpers above as one namespace (test modules load by path, so they share through fixtures)."""
  return types.SimpleNamespace(packed_inputs=packed_inputs, outputs_and_grads=outputs_and_grads,
                               calls_pallas=calls_pallas)
