"""FLOPs of compiled programs: loop bodies count as often as they run (XLA's cost_analysis counts a
scanned layer or a decode step once), and a loop that stops early is left per iteration."""

import jax
import jax.numpy as jnp

from meshrl.train.metrics import program_flops

N = 32
DOT = 2 * N ** 3  # one [N, N] @ [N, N]


def _compiled(f, *args):
  return jax.jit(f).lower(*args).compile()


def test_scan_bodies_count_once_per_trip_and_early_stopping_loops_per_iteration():
  x = jnp.ones((N, N))

  def f(x):
    c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ x), None), x, None, length=10)  # 10 dots
    c = jax.lax.fori_loop(0, 3, lambda i, c: c @ x @ x, c)  # 6 dots
    c = jax.lax.while_loop(lambda s: s[1] < 5, lambda s: (s[0] @ x, s[1] + (s[0].sum() > 0)), (c, 0))[0]
    return c @ x  # 1 dot, and the early-stopping while: 1 dot per iteration
  compiled = _compiled(f, x)
  flops = program_flops(compiled.as_text())
  assert flops.fixed == 17 * DOT and flops.per_iteration == DOT
  assert flops.at(4) == 21 * DOT
  assert compiled.cost_analysis()["flops"] < 6 * DOT  # each body once: 5 dots; what this corrects


def test_contracted_dims_and_batched_dots():
  a, b = jnp.ones((4, 8, 16)), jnp.ones((4, 16, 24))
  flops = program_flops(_compiled(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b).as_text())
  assert flops.fixed == 2 * 4 * 8 * 24 * 16 and flops.per_iteration == 0


def test_convolutions_count_like_the_matmuls_they_are():
  """TPU HLO writes matmuls as `convolution`s; a 3x3 convolution of 8 -> 16 features over a 10x10
  image (SAME padding): 2 * 10 * 10 * 16 outputs * (3 * 3 * 8) products each."""
  image, kernel = jnp.ones((1, 10, 10, 8)), jnp.ones((3, 3, 8, 16))
  conv = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  text = _compiled(conv, image, kernel).as_text()
  assert "convolution(" in text
  assert program_flops(text).fixed == 2 * 10 * 10 * 16 * 3 * 3 * 8
