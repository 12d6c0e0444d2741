"""Compressed gradient collectives (sharding/compress.py): int8 blocks round-trip within their scale,
the int8 and bfloat16 reductions equal psum within their rounding, error feedback drives the running
sum to the exact one, and dtypes the backend cannot reduce are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from meshrl.sharding import compress


def _mesh():
  return Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "data"))


def _partials(shape, seed=0):
  """[8, *shape]: one partial sum per device, with blocks of very different magnitudes."""
  rng = np.random.RandomState(seed)
  x = rng.randn(8, *shape).astype(np.float32)
  return x * np.logspace(-3, 1, shape[-1], dtype=np.float32)


def test_quantize_round_trip_within_half_a_step():
  x = jnp.asarray(_partials((3, 700))[0])
  q, scale = compress.quantize(x, 256)
  assert q.dtype == jnp.int8 and q.shape == (3, 3, 256) and scale.shape == (3, 3)
  back = compress.dequantize(q, scale, 700)
  step = np.repeat(np.asarray(scale), 256, axis=-1)[:, :700]
  assert np.all(np.abs(np.asarray(back) - np.asarray(x)) <= step / 2 + 1e-7)


def _run(fn, x, in_spec=P(("fsdp", "data")), out_spec=P(("fsdp", "data"))):
  return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=in_spec, out_specs=out_spec))(x)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_reduce_scatter_and_all_reduce_equal_psum_within_rounding(devices, dtype):
  """Over fsdp (4 devices): the reduced chunks and the all-reduced sums match psum_scatter / psum to
  the wire format's rounding (int8: half a step of each of the 4 summed blocks, then of the sum); a
  chunk sent to the wrong device or a scale applied to the wrong block misses by whole values."""
  grad = compress.GradReduce(dtype, block=64)
  parts = jnp.asarray(_partials((8, 96)))  # per device [8, 96]; devices stacked on axis 0

  def scattered(x_):
    return compress.reduce_scatter(x_[0], ("fsdp",), 0, grad)[None]  # [2, 96] of the sum

  def exact_scattered(x_):
    return jax.lax.psum_scatter(x_[0], "fsdp", scatter_dimension=0, tiled=True)[None]

  def summed(x_):
    return compress.all_reduce(x_[0], ("fsdp",), grad)[0][None]

  got, want = _run(scattered, parts), _run(exact_scattered, parts)
  tolerance = 0.02 * np.abs(np.asarray(want)).max(axis=-1, keepdims=True) + 1e-6
  assert got.shape == want.shape == (8, 2, 96)
  assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= tolerance)
  total = _run(summed, parts)
  exact = np.asarray(parts).reshape(4, 2, 8, 96).sum(axis=0)  # per data column
  for device in range(8):
    np.testing.assert_allclose(np.asarray(total)[device], exact[device % 2], atol=0.05 * np.abs(exact).max())


def test_error_feedback_drives_the_running_sum_to_the_exact_sum(devices):
  """The same partial sums all-reduced 64 times in int8 with error feedback: the mean of the results
  approaches the exact sum (the carried error is bounded, so the gap shrinks like 1/steps) and ends 20x
  closer than the one-shot rounding error, which without feedback repeats every step."""
  grad = compress.GradReduce("int8", block=32)
  parts = jnp.asarray(_partials((1, 200), seed=3))[:, 0]  # [8, 200]
  exact = np.asarray(parts).reshape(4, 2, 200).sum(axis=0)  # [2 data columns, 200]

  def steps(x_):
    def one(error, _):
      total, error = compress.all_reduce(x_[0], ("fsdp",), grad, error=error)
      return error, total
    _, totals = jax.lax.scan(one, jnp.zeros_like(x_[0]), None, length=64)
    plain = compress.all_reduce(x_[0], ("fsdp",), grad)[0]
    return totals[None], plain[None]

  totals, plain = jax.jit(jax.shard_map(steps, mesh=_mesh(), in_specs=P(("fsdp", "data")),
                                        out_specs=(P(("fsdp", "data")), P(("fsdp", "data")))))(parts)
  totals, plain = np.asarray(totals), np.asarray(plain)  # [8, 64, 200], [8, 200]
  for device in (0, 5):
    want = exact[device % 2]
    one_shot = np.abs(plain[device] - want).max()
    assert one_shot > 0  # int8 does round
    gaps = [np.abs(totals[device, :n].mean(axis=0) - want).max() for n in (1, 8, 64)]
    assert gaps[0] == pytest.approx(one_shot, rel=1e-5)  # the first step has nothing fed back
    assert gaps[2] < gaps[1] < gaps[0] and gaps[2] < one_shot / 20


def test_unknown_or_unreducible_dtypes_are_refused():
  with pytest.raises(ValueError, match=r"optim.grad_collective_dtype='float8_e4m3fn'.*cpu backend cannot "
                                       r"reduce.*float32, bfloat16, int8"):
    compress.GradReduce.from_name("float8_e4m3fn", "cpu")
  assert compress.GradReduce.from_name("float32", "tpu") is None
  assert compress.GradReduce.from_name("int8", "tpu") == compress.GradReduce("int8")
