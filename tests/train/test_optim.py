"""Optimizer from config: schedules against hand-computed rates, clipping, accumulation, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshrl.configs import load
from meshrl.train.optim import make_optimizer, make_schedule


def _optim(**fields):
  cfg = load("configs/base.py", [f"optim.{k}={v}" for k, v in fields.items()])
  return cfg.optim


def test_constant_with_warmup():
  lr = make_schedule(_optim(learning_rate=1e-3, warmup_steps=10))
  np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(500)], [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)


def test_cosine_after_warmup():
  lr = make_schedule(_optim(learning_rate=1.0, schedule="cosine", warmup_steps=4, decay_steps=100,
                            end_lr_ratio=0.1))
  def expected(step):
    t = min(step - 4, 100) / 100
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
  for step in (4, 29, 54, 104, 1000):
    np.testing.assert_allclose(lr(step), expected(step), rtol=1e-5)
  np.testing.assert_allclose(lr(2), 0.5, rtol=1e-6)


def test_linear_and_learning_rate_override():
  lr = make_schedule(_optim(learning_rate=1.0, schedule="linear", decay_steps=10, end_lr_ratio=0.0),
                     learning_rate=2.0)
  np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(20)], [2.0, 1.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "adafactor"])
def test_every_optimizer_takes_a_step(name):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
  tx = make_optimizer(_optim(name=name, learning_rate=0.1))
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  assert float(jnp.sum(new["w"])) < float(jnp.sum(params["w"]))


def test_clipping_bounds_the_update():
  params = {"w": jnp.zeros((2,))}
  tx = make_optimizer(_optim(name="sgd", learning_rate=1.0, grad_clip=1.0))
  updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)


def test_grad_accumulation_equals_big_batch():
  """Two micro-batches of 4 with accumulation == one batch of 8, for mean-squared-error."""
  x = jax.random.normal(jax.random.key(0), (8, 3))
  y = jax.random.normal(jax.random.key(1), (8,))
  params = {"w": jnp.array([0.1, -0.2, 0.3]), "b": jnp.array(0.5)}

  def loss(p, xb, yb):
    return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

  def run(tx, batches):
    p, opt = params, tx.init(params)
    for xb, yb in batches:
      updates, opt = tx.update(jax.grad(loss)(p, xb, yb), opt, p)
      p = optax.apply_updates(p, updates)
    return p

  fields = dict(learning_rate=0.05, warmup_steps=2, grad_clip=0.5)
  big = run(make_optimizer(_optim(**fields)), [(x, y)] * 3)
  small = run(make_optimizer(_optim(grad_accum_steps=2, **fields)),
              [(x[:4], y[:4]), (x[4:], y[4:])] * 3)
  for key in params:
    np.testing.assert_allclose(small[key], big[key], rtol=1e-5, atol=1e-6)
  assert not np.allclose(big["w"], params["w"])


@pytest.mark.parametrize("field, value, match", [
    ("name", "lion", "optim.name='lion'"),
    ("schedule", "step", "optim.schedule='step'"),
    ("grad_accum_steps", 0, "optim.grad_accum_steps=0"),
    ("warmup_steps", -1, "optim.warmup_steps=-1"),
])
def test_unknown_names_raise_with_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    make_optimizer(_optim(**{field: value}))
