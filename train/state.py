"""The train state: one pytree of arrays that jitted steps take and return.

A model is split once, at the jit boundary, into a static `graphdef` and three pytrees of arrays:
`params` (every `nnx.Param`, trained), `opt_state` (optax, laid out like `params`) and `extra`
(every other `nnx.Variable`, e.g. the MoE `RouterBias`, updated outside the gradient). Steps take a
`TrainState` and return a new one; `merge_model` puts the arrays back into a module for generation,
export or a notebook.

Shardings: params keep the shardings they were born with (model/params.py `sharded_init`); the
optimizer state is created under `jit` with `out_shardings` that give every moment the sharding of
its parameter, so nothing is ever gathered onto one device.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.model.moe import RouterBias
from meshrl.model.params import state_shardings
from meshrl.model.moe import update_router_bias as _update_bias
from meshrl.sharding.rules import TRAIN_RULES, Rules


@struct.dataclass
class TrainState:
  step: jax.Array  # [] int32, number of `step` calls so far (micro-batches with grad accumulation)
  params: nnx.State  # nnx.Param arrays, sharded by the TRAIN rules
  opt_state: optax.OptState  # moments etc., each sharded like its parameter
  extra: nnx.State  # non-trained variables (RouterBias [L, E], ...), usually replicated


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`model` -> (graphdef, params, extra): params are the nnx.Params, extra every other variable."""
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  return graphdef, params, extra


def merge_model(graphdef: nnx.GraphDef, state: TrainState) -> nnx.Module:
  """The module holding `state`'s params and extra (arrays are shared, not copied)."""
  return nnx.merge(graphdef, state.params, state.extra)


def merge_batch_model(graphdef: nnx.GraphDef, params: nnx.State, extra: nnx.State, *,
                      zigzag_inputs: bool) -> nnx.Module:
  """The model a training loss runs on its batch: told that the batch's tokens are laid out zigzag
  over `sequence` when they are (the RL update and log-probs, SFT), for splash's ring, whose masks
  are by index (model/attention.py `KernelConfig.inputs_zigzag`); arrays shared, not copied."""
  model = nnx.merge(graphdef, params, extra)
  return model.with_kernel(inputs_zigzag=True) if zigzag_inputs else model


def shardings_of(tree: Any) -> Any:
  """The `.sharding` of every array leaf of `tree` (a pytree of the same structure)."""
  return jax.tree.map(lambda x: x.sharding, tree)


def _path_key(path) -> tuple:
  return tuple(str(k) for k in path)


def like_params_shardings(abstract_tree: Any, params: nnx.State, mesh: Mesh) -> Any:
  """Shardings for a tree laid out like `params` (optimizer moments, accumulated gradients).

  A leaf whose key path ends with a parameter's path and has that parameter's shape gets its
  sharding; any other leaf (counts, Adafactor's factored rows) is replicated on `mesh`.
  """
  by_path = {_path_key(path): (leaf.shape, leaf.sharding)
             for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  replicated = NamedSharding(mesh, PartitionSpec())

  def sharding(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      found = by_path.get(key[start:])
      if found is not None and found[0] == leaf.shape:
        return found[1]
    return replicated
  return jax.tree_util.tree_map_with_path(sharding, abstract_tree)


def init_opt_state(tx: optax.GradientTransformation, params: nnx.State,
                   mesh: Mesh | None = None) -> optax.OptState:
  """`tx.init(params)` with every moment born in its parameter's sharding (no gather)."""
  if mesh is None:
    return jax.jit(tx.init)(params)
  abstract = jax.eval_shape(tx.init, params)
  return jax.jit(tx.init, out_shardings=like_params_shardings(abstract, params, mesh))(params)


def create_train_state(model: nnx.Module, tx: optax.GradientTransformation,
                       mesh: Mesh | None = None) -> tuple[nnx.GraphDef, TrainState]:
  """Splits `model` and builds its optimizer state: -> (graphdef, TrainState at step 0).

  Args:
    model: a module whose parameters are already sharded (model/init.py `build_model`).
    tx: the optimizer (train/optim.py `make_optimizer`).
    mesh: the run's mesh; with None the optimizer state follows jit's default placement.
  """
  graphdef, params, extra = split_model(model)
  step = jnp.zeros((), jnp.int32)
  if mesh is not None:
    step = jax.device_put(step, NamedSharding(mesh, PartitionSpec()))
  return graphdef, TrainState(step=step, params=params, opt_state=init_opt_state(tx, params, mesh),
                              extra=extra)


def abstract_train_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                         mesh: Mesh, rules: Rules = TRAIN_RULES) -> tuple[nnx.GraphDef, TrainState]:
  """(graphdef, TrainState of ShapeDtypeStructs with shardings on `mesh`); nothing is allocated.

  The restore target of a resumed run: `Checkpointer.restore` reads every array straight into these
  shardings, so a model need not be initialised first only to be overwritten.
  """
  graphdef, params, extra = split_model(nnx.eval_shape(make_model))

  def place(state):
    shardings = state_shardings(state, mesh, rules)
    return jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s)),
        state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  params, extra = place(params), place(extra)
  abstract_opt = jax.eval_shape(tx.init, params)
  opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_opt,
                           like_params_shardings(abstract_opt, params, mesh))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
  return graphdef, TrainState(step=step, params=params, opt_state=opt_state, extra=extra)


def abstract_state(state: Any) -> Any:
  """`state` with every array replaced by a ShapeDtypeStruct carrying its sharding."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def update_router_bias(extra: nnx.State, expert_load: jax.Array, rate: float) -> nnx.State:
  """Applies the aux-loss-free balancing update to every RouterBias in `extra`.

  Args:
    extra: the non-trained state; its `router_bias` leaf is [L, E] (one row per MoE layer).
    expert_load: [L, E] fraction of routed slots per expert in the last step (aux["expert_load"]).
    rate: cfg.moe.bias_update_rate.

  Returns:
    `extra` with each layer's bias moved towards balance (model/moe.py `update_router_bias`).
  """
  def update(variable):
    if not isinstance(variable, RouterBias):
      return variable
    new_bias = jax.vmap(_update_bias, in_axes=(0, 0, None))(variable.get_value(), expert_load, rate)
    return variable.replace(new_bias)
  return jax.tree.map(update, extra, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_bytes(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation) -> int:
  """Bytes of one train state of `make_model()`'s model and `tx` (parameters, other variables and
  optimizer state): what one checkpoint holds. From shapes (eval_shape); nothing is allocated."""
  _, params, extra = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
  opt_state = jax.eval_shape(tx.init, params)
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((params, extra, opt_state)))
