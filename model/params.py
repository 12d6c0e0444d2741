"""Parameters that carry logical axis names, and their sharded creation.

Every weight is an `nnx.Param` (or, for non-trained state such as the MoE router bias, another
`nnx.Variable` type) with metadata `axes`: one logical name per dimension (sharding/rules.py). The
mesh and the rule set turn those names into shardings; `sharded_init` creates the state under `jit`
straight into them, so a model larger than one device never exists whole anywhere.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshrl.sharding.rules import TRAIN_RULES, Rules, logical_to_spec


def param(key: jax.Array, shape: Sequence[int], axes: Sequence[str | None], *,
          std: float | None = 0.02, dtype=jnp.float32) -> nnx.Param:
  """A normal(0, std) weight (zeros when std is 0, ones when std is None) named by `axes`."""
  if len(axes) != len(shape):
    raise ValueError(f"param of shape {tuple(shape)} got {len(axes)} axis names {tuple(axes)}.")
  if std is None:
    value = jnp.ones(shape, dtype)
  elif std == 0:
    value = jnp.zeros(shape, dtype)
  else:
    value = (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=tuple(axes))


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _axes_of(variable: nnx.Variable) -> tuple:
  meta = variable.get_metadata()
  if "axes" not in meta:
    raise ValueError(f"variable of shape {jnp.shape(variable.get_value())} has no logical axes metadata.")
  return tuple(meta["axes"])


def state_shardings(state: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
  """NamedShardings for every Variable of `state` (a prefix tree of the state).

  Shapes are taken into account: a mesh axis that does not divide a dimension leaves it whole.
  """
  def sharding(v):
    spec = logical_to_spec(_axes_of(v), rules, mesh, shape=jnp.shape(v.get_value()))
    return NamedSharding(mesh, spec)
  return jax.tree.map(sharding, state, is_leaf=_is_variable)


def sharded_init(make_module: Callable[[], nnx.Module], mesh: Mesh | None,
                 rules: Rules = TRAIN_RULES) -> nnx.Module:
  """Builds the module with every Variable born sharded on `mesh` (under jit with out_shardings).

  `make_module()` is traced once abstractly to read shapes and axes, then run under `jit` whose
  outputs land directly in their shardings. Without a mesh it simply calls `make_module()`.
  """
  if mesh is None:
    return make_module()
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
  shardings = state_shardings(abstract_state, mesh, rules)

  def create():
    return nnx.state(make_module())

  state = jax.jit(create, out_shardings=shardings)()
  return nnx.merge(graphdef, state)
