"""Pipeline parallelism: a stack of blocks split into stages over the mesh's `stage` axis, with
microbatches passed from stage to stage (GPipe's fill-drain schedule: Huang et al. 2019, "GPipe",
arXiv 1811.06965).

Axis legend: S stages, M microbatches, B rows (B = M * b), b rows of one microbatch, T length,
D embed, L layers of the stack (L = S * C), C layers of one stage, I = M + S - 1 iterations.

Schedule: at iteration i, stage s runs its C layers on microbatch i - s (on nothing, a bubble, when
that lies outside [0, M)); then every stage passes its output to the next and the last stage's output
(microbatch i - S + 1, finished) comes round to stage 0, which stores it and takes microbatch i + 1.
The forward takes I iterations of one stage each where one device running all L layers would take M
of S stages each: each device idles (S - 1) / (M + S - 1) of them (`bubble_fraction`). `jax.grad`
through the loop runs the same schedule backwards.

How it is built: a `shard_map` manual over `stage` alone (every other axis left to the compiler)
runs the schedule on each stage's devices: the stack's parameters [L, ...] enter as [S, C, ...] split
over `stage` (TRAIN_RULES split `layers` over `stage`, so stage s holds layers s*C .. s*C + C - 1 and
the view is a local reshape), each stage scans its C layers, and `ppermute` passes the activations
[b, T, D] round the ring of stages. Inside, arrays keep their global shapes on the other axes, and
the model's own sharding constraints and shard_maps (ring attention, expert parallelism) name the
context's abstract mesh (sharding/mesh.py `in_context`), where `stage` is manual. The shard_map runs
with check_vma=False: jax 0.10.2 does not transpose a shard_map nested in a partly manual one with
its varying-axes checks on ("operates on axis 'stage' which is already bound by a parent
sdy.manual_computation"). The alternative, vmapping the stages with spmd_axis_name="stage", turns
every lax.switch and data-dependent loop bound inside the model (the blockwise attention's skipping
of dead block pairs) into all-branches selects, and its vma checks reject the ring attention.

Microbatch m is the rows m, m + M, m + 2M, ... of the batch, so each of the batch's shards (split over
the batch axes in contiguous blocks) holds b / shards rows of every microbatch: M must divide each
shard's rows (`resolve_microbatches`).

Memory: with `remat`, each stage's iteration is checkpointed whole: a device keeps its stage's input
for each of the I iterations ([I, b, T, D], the batch's activations at one layer) and, while it
recomputes one iteration for the backward, what the blocks' own remat policy saves for C layers of
one microbatch. Without it, every iteration's residuals stay, as an unpipelined stack's would.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshrl.sharding.mesh import STAGE_AXIS
AUTO_MICROBATCHES_PER_STAGE = 4  # microbatches=0 picks the most, up to this many per stage


def bubble_fraction(stages: int, microbatches: int) -> float:
  """Share of a device's pipeline iterations that run on no microbatch: (S - 1) / (M + S - 1)."""
  return (stages - 1) / (microbatches + stages - 1)


def resolve_microbatches(requested: int, *, rows: int, row_shards: int, stages: int,
                         what: str = "the batch") -> int:
  """The microbatch count M of a call: `requested` (mesh.microbatches), or with 0 the largest divisor of
  each shard's rows up to AUTO_MICROBATCHES_PER_STAGE * S (1 without stages).

  Raises ValueError naming mesh.microbatches, the rows and their shards when M does not divide each
  batch shard's rows (a microbatch must take the same number of rows from every shard).
  """
  if requested < 0:
    raise ValueError(f"mesh.microbatches={requested} must be >= 0 (0 = auto).")
  per_shard = rows // row_shards if row_shards and rows % row_shards == 0 else rows
  if requested == 0:
    if stages == 1:
      return 1
    cap = AUTO_MICROBATCHES_PER_STAGE * stages
    return max(d for d in range(1, min(per_shard, cap) + 1) if per_shard % d == 0)
  if per_shard % requested:
    raise ValueError(f"mesh.microbatches={requested} does not divide {what}: {rows} rows over "
                     f"{row_shards} batch shard(s) leave {per_shard} rows per shard, and every microbatch "
                     f"takes the same rows from each shard; choose a divisor of {per_shard} (0 = auto).")
  return requested


def check_batches(mesh_cfg, batches: list[tuple[str, int]], *, row_shards: int) -> None:
  """Raises `resolve_microbatches`' ValueError for the first of `batches` ((what, rows) of each training
  forward a run makes) whose batch shards mesh.microbatches does not divide, before anything runs."""
  for what, rows in batches:
    resolve_microbatches(int(mesh_cfg.get("microbatches", 0)), rows=rows, row_shards=row_shards,
                         stages=int(mesh_cfg.get("stage", 1)), what=what)


def split_rows(a: jax.Array, microbatches: int) -> jax.Array:
  """[B, ...] -> [M, b, ...]: microbatch m holds rows m, m + M, m + 2M, ..."""
  b = a.shape[0] // microbatches
  return a.reshape((b, microbatches) + a.shape[1:]).swapaxes(0, 1)


def merge_rows(a: jax.Array) -> jax.Array:
  """[M, b, ...] -> [B, ...], the inverse of `split_rows`."""
  return a.swapaxes(0, 1).reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _stage_split(mesh: Mesh | None) -> bool:
  return mesh is not None and mesh.shape.get(STAGE_AXIS, 1) > 1


def needs_stage_region(mesh: Mesh | None) -> bool:
  """Whether a call on `mesh` has a `stage` axis that is not manual yet (not inside `run` or
  `on_every_stage`)."""
  if not _stage_split(mesh):
    return False
  return STAGE_AXIS not in jax.sharding.get_abstract_mesh().manual_axes


def on_every_stage(fn: Callable, mesh: Mesh) -> Callable:
  """fn(*args) run by every stage group on the same inputs, in a shard_map manual over `stage` alone
  (inputs and outputs replicated over it; check_vma=False as in `run`): how generation runs on a mesh
  with stages. Left to the partitioner, the idle `stage` axis is free for it to split work over, and a
  paper_3t prefill on two slices so gathered every token's router scores (102 GiB per chip against 58
  on one slice); manual, each stage group runs the program as one slice would."""
  replicated = PartitionSpec()
  return jax.shard_map(fn, mesh=mesh, in_specs=replicated, out_specs=replicated,
                       axis_names=frozenset({STAGE_AXIS}), check_vma=False)


def _store(buffer: jax.Array, value: jax.Array, index: jax.Array, keep: jax.Array) -> jax.Array:
  """buffer[index] = value where `keep`, else unchanged."""
  old = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, old), index, 0)


def _schedule(fn: Callable, params_s: Any, x_in: jax.Array, rows_in: Any, layers_s: Any, *,
              stage: jax.Array, stages: int, shift: Callable) -> tuple[Any, jax.Array]:
  """The fill-drain loop on one stage's devices: I iterations of `fn` on microbatch i - stage.

  Args:
    fn: `stage_fn` (maybe checkpointed).
    params_s: this stage's parameters [C, ...].
    x_in: [M, b, T, D] every microbatch's input (only stage 0 reads it).
    rows_in: pytree of [M, b, ...].
    layers_s: pytree of [C, M, b, ...] or None.
    stage: [] int32 this stage's index; stages: S.
    shift: [b, T, D] -> [b, T, D], the activations passed to the next stage (from the previous).

  Returns:
    (outs [M, C, ...] of this stage's layers for every microbatch, finished [M, b, T, D]: the stack's
    outputs, complete on stage 0 only).
  """
  microbatches = x_in.shape[0]
  at = lambda tree, m, axis=0: jax.tree.map(  # noqa: E731
      lambda a: jax.lax.dynamic_index_in_dim(a, m, axis=axis, keepdims=False), tree)
  state = jnp.zeros(x_in.shape[1:], x_in.dtype)  # [b, T, D]
  zero = jnp.zeros((), jnp.int32)
  out_shapes = jax.eval_shape(fn, params_s, state, at(rows_in, zero), None if layers_s is None
                              else at(layers_s, zero, 1))[1]
  outs = jax.tree.map(lambda o: jnp.zeros((microbatches,) + o.shape, o.dtype), out_shapes)
  finished = jnp.zeros(x_in.shape, x_in.dtype)

  def iteration(carry, i):
    state, outs, finished = carry
    micro = i - stage  # the microbatch this stage runs
    valid = (micro >= 0) & (micro < microbatches)
    micro = jnp.clip(micro, 0, microbatches - 1)
    with jax.named_scope("pipeline_enter"):
      entering = jax.lax.dynamic_index_in_dim(x_in, jnp.minimum(i, microbatches - 1), keepdims=False)
      state = jnp.where(stage == 0, entering, state)
    y, out = fn(params_s, state, at(rows_in, micro), None if layers_s is None else at(layers_s, micro, 1))
    outs = jax.tree.map(lambda buf, o: _store(buf, o, micro, valid), outs, out)
    with jax.named_scope("pipeline_shift"):
      y = shift(y)
    done = i - (stages - 1)  # the microbatch that came round to stage 0, finished
    finished = _store(finished, y, jnp.maximum(done, 0), (stage == 0) & (done >= 0))
    return (y, outs, finished), None

  iterations = microbatches + stages - 1
  (_, outs, finished), _ = jax.lax.scan(iteration, (state, outs, finished),
                                        jnp.arange(iterations, dtype=jnp.int32))
  return outs, finished


def run(stage_fn: Callable, params: Any, x: jax.Array, per_row: Any, per_layer: Any, *, stages: int,
        microbatches: int, mesh: Mesh | None, remat: bool) -> tuple[jax.Array, Any]:
  """Runs a stack of L layers over x as S pipeline stages and M microbatches.

  Args:
    stage_fn: `(params_s, x_, rows, layers) -> (y_, outs)`: C layers on one microbatch; params_s is
      `params` with [C, ...] leaves, x_ [b, T, D], rows `per_row` with [b, ...] leaves, layers
      `per_layer` with [C, b, ...] leaves (or None); outs a pytree of per-layer outputs [C, ...].
    params: the stack's parameters, leaves [L, ...] (`layers` split over `stage`).
    x: [B, T, D] the stack's input.
    per_row: pytree of [B, ...] arrays each microbatch takes its rows of (positions, segment ids).
    per_layer: pytree of [L, B, ...] arrays each stage takes its layers' rows of (replayed MoE
      routes), or None.
    stages, microbatches: S (mesh.stage) and M. Without a `stage` axis on `mesh` (no mesh, or the
      axis of size 1) the stages run one after another on the same devices: the microbatches go
      through all L layers in turn.
    mesh: the mesh (None: one device).
    remat: checkpoint each stage's iteration whole (only its input is kept for the backward).

  Returns:
    (y [B, T, D], outs with leaves [L, M, ...]: every layer's outputs for every microbatch).
  """
  num_layers = jax.tree.leaves(params)[0].shape[0]
  batch = x.shape[0]
  if num_layers % stages or batch % microbatches:
    raise ValueError(f"pipeline of {stages} stages and {microbatches} microbatches over {num_layers} "
                     f"layers and {batch} rows: both must divide evenly.")
  split = stages if _stage_split(mesh) else 1  # stages that run on their own devices
  x_in = split_rows(x, microbatches)  # [M, b, T, D]
  rows_in = jax.tree.map(lambda a: split_rows(a, microbatches), per_row)  # [M, b, ...]
  by_stage = lambda a: a.reshape((split, a.shape[0] // split) + a.shape[1:])  # noqa: E731  [S, C, ...]
  stage_params = jax.tree.map(by_stage, params)
  layers_in = None if per_layer is None else jax.tree.map(  # [S, C, M, b, ...]
      lambda a: by_stage(jax.vmap(lambda l: split_rows(l, microbatches))(a)), per_layer)
  fn = jax.checkpoint(stage_fn, prevent_cse=False) if remat else stage_fn
  if split == 1:
    outs, finished = _schedule(fn, jax.tree.map(lambda a: a[0], stage_params), x_in, rows_in,
                               None if layers_in is None else jax.tree.map(lambda a: a[0], layers_in),
                               stage=jnp.zeros((), jnp.int32), stages=1, shift=lambda y: y)
    y = merge_rows(finished)
    outs = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), outs)  # [M, L, ...] -> [L, M, ...]
    return y, outs

  ring = [(s, (s + 1) % split) for s in range(split)]

  def per_stage(params_s, x_in, rows_in, layers_s):
    squeeze = lambda tree: None if tree is None else jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    outs, finished = _schedule(fn, squeeze(params_s), x_in, rows_in, squeeze(layers_s),
                               stage=jax.lax.axis_index(STAGE_AXIS), stages=split,
                               shift=lambda y: jax.lax.ppermute(y, STAGE_AXIS, ring))
    return jax.tree.map(lambda a: a[None], outs), finished[None]

  on_stages, everywhere = PartitionSpec(STAGE_AXIS), PartitionSpec()
  outs, finished = jax.shard_map(
      per_stage, mesh=mesh, in_specs=(on_stages, everywhere, everywhere, on_stages),
      out_specs=(on_stages, on_stages), axis_names=frozenset({STAGE_AXIS}), check_vma=False)(
          stage_params, x_in, rows_in, layers_in)
  y = merge_rows(finished[0])  # [B, T, D]: stage 0's
  # [S, M, C, ...] -> [L, M, ...]
  outs = jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2).reshape((num_layers, microbatches) + a.shape[3:]), outs)
  return y, outs
