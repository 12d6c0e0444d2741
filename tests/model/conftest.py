"""Shared attention-kernel cases of tests/model (test_splash.py, test_splash_ring.py): packed inputs,
the outputs and q/k/v gradients of several kernels on them, and whether a call runs a Pallas kernel,
through the `attention_cases` fixture; `reorder_close`, the comparison of two float32 computations that
differ only in the order of their sums."""

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


# Two float32 programs that add the same terms in another order (another kernel, layout or block
# size) differ by a few units in the last place of the values' scale at each rounding, compounded
# through the layers. 64 ulps of the largest value bounds that with room (a tiny model's KV cache:
# 6e-6 to 1.1e-5 on values up to 8.2, i.e. 6-12 ulps), and stays far below any real defect (a wrong
# mask, position or block moves entries by the values' own size).
REORDER_ULPS = 64


def assert_reorder_close(actual, desired, *, ulps: int = REORDER_ULPS, what: str = "") -> None:
  """|actual - desired| <= ulps * float32 eps * max|desired|, elementwise (a relative bound on the
  array's scale, not an absolute atol set at the edge of one run)."""
  actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
  scale = float(np.max(np.abs(desired))) if desired.size else 0.0
  tolerance = ulps * float(np.finfo(np.float32).eps) * max(scale, np.finfo(np.float32).tiny)
  np.testing.assert_allclose(actual, desired, rtol=0, atol=tolerance,
                             err_msg=f"{what}: more than {ulps} float32 ulps of the scale {scale:.3g}")


@pytest.fixture
def reorder_close():
  """`assert_reorder_close(actual, desired, ulps=64, what="")` for tests of this folder."""
  return assert_reorder_close
