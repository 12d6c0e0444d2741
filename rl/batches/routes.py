"""MoE routing replay without the host: the rollouts' routes stay on the devices.

A rollout records the experts each token went to, [L, N, S, K] per rollout call (L MoE layers, N
samples, S positions, K experts per token). At paper_3t that is 58 x 64 x 1,048,576 x 8 int32, 116
GiB: far more than a host should hold, and with several host processes every host would hold all of
it (sharding/hosts.to_host). The host side of an RL step (scoring, dynamic sampling, partial
rollouts, packing plans) only ever moves whole samples, so it carries `RoutingRows` instead: the
device arrays the routes are in and, per sample, its row in them. `assemble` then builds the update
batch's routing [B, L, S', K] on the devices in one jitted program, in the update's layout:

  padded    a gather of rows (blank samples get expert 0 everywhere; their loss mask is False), then
            the zigzag chunk order of ring attention on the S axis;
  packed    each packed cell (r, w) gathers its sample's routes at its column (rl/batches/packing.PackPlan).

Compiled for v5p:16x16x16 at paper_3t (routes split over expert x sequence like the update batch),
the padded assembly needs 3.6 GiB of temporaries per chip (the rows are all-gathered over the batch
axes, 1.8 GiB, not over `sequence`), against 116 GiB per host to bring the routes to the host. The
packed one gathers single cells and is proven on CPU meshes only.

`RoutingRows` behaves like a [B, L, S, K] array for the host code that moves samples: len, slicing
and index arrays on the sample axis (`[...]`), `concatenate` of several, `to_host` for a checkpoint's
JSON (asynchronous RL's rollouts in flight) and `from_host` back.
"""

from __future__ import annotations

import dataclasses
import functools


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.model.ring_attention import zigzag
from meshrl.rl.batches.rows import DeviceRows, per_source


@dataclasses.dataclass(frozen=True)
class RoutingRows(DeviceRows):
  """The routes [B, L, S, K] of B samples, kept where the rollouts left them (rl/batches/rows.py).

  sources: [L, N_i, S, K] int32 arrays (on the devices; numpy after a restore from JSON), the
    rollouts' routing as the rollout programs return it (sample axis 1).
  rows: [B] int: sample b's row in the sources concatenated on axis 1; -1 = a blank sample.
  """
  axis: int = 1

  @classmethod
  def of_rollout(cls, routing, rows: np.ndarray | None = None) -> "RoutingRows":
    """A rollout's routing [L, N, S, K] (its samples `rows`, default all N in order)."""
    return cls.of(routing, rows)

  @classmethod
  def from_host(cls, routes: np.ndarray) -> "RoutingRows":
    """Host routes [B, L, S, K] (`to_host`'s output) as one source."""
    return cls.of_rollout(np.swapaxes(np.asarray(routes, np.int32), 0, 1))


def assemble(routing: RoutingRows, sharding: NamedSharding | None, *, zigzag_shards: int = 1,
             plan=None) -> jax.Array:
  """The update batch's routing [B, L, S, K] int32 (padded; zigzag over `zigzag_shards`) or
  [R, L, W, K] (packed by `plan`, a rl/batches/packing.PackPlan, already zigzag), built on the devices.

  sharding: the NamedSharding of the update's [B, S] arrays (batch axes x `sequence`); the routes
    get it on their B and S axes. None: no mesh (one device).
  """
  rows = np.asarray(routing.rows, np.int32)
  out_sharding = None if sharding is None else routes_sharding(sharding)
  if plan is None:
    program, index, extra = rows_program(out_sharding, zigzag_shards), rows, ()
  else:
    program = cells_program(out_sharding)
    index = np.where(plan.valid, rows[np.maximum(plan.sample, 0)], -1).astype(np.int32)  # [R, W]
    extra = (plan.column.astype(np.int32),)
  # One call per source, each filling in the samples it holds (each rollout round's routes have the
  # same shape, so the same two compiled programs serve however many rounds a step draws).
  _, layers, _, k = routing.shape
  shape = routing.shape if plan is None else (plan.sample.shape[0], layers, plan.sample.shape[1], k)
  out = zeros_program(shape, out_sharding)()
  for source, local in per_source(routing.sources, index, axis=1):
    if source.shape[1] == 0:  # a round that ended no group (restored from a checkpoint): nothing to fill
      continue
    out = program(out, source if isinstance(source, jax.Array) else jnp.asarray(source), local, *extra)
  return out


def _rows(out, source, rows, shards):
  """out [B, L, S, K] with the samples whose rows [B] point into source [L, N, S, K] (-1: not
  there) replaced by theirs, zigzag over `shards` on S like `out`."""
  picked = jnp.swapaxes(jnp.take(source, jnp.maximum(rows, 0), axis=1), 0, 1).astype(jnp.int32)
  picked = zigzag(picked, shards, axis=2) if shards > 1 else picked  # [B, L, S, K]
  return jnp.where((rows >= 0)[:, None, None, None], picked, out)


def _cells(out, source, cells, columns):
  """out [R, L, W, K] with the cells (r, w) whose cells[r, w] point into source (-1: not there)
  replaced by that row's routes at column columns[r, w]."""
  picked = jnp.swapaxes(source[:, jnp.maximum(cells, 0), columns], 0, 1).astype(jnp.int32)  # [R, L, W, K]
  return jnp.where((cells >= 0)[:, None, :, None], picked, out)


@functools.cache
def rows_program(out_sharding: NamedSharding | None, shards: int):
  """jit((out [B, L, S, K], source [L, N, S, K], rows [B]) -> out): the padded assembly's step for
  one source (`out` donated), zigzag over `shards` on S; one program per (output sharding, shards),
  shapes left to jit's cache (rl/step/aot.py compiles it too)."""
  return jax.jit(functools.partial(_rows, shards=shards), out_shardings=out_sharding, donate_argnums=0)


@functools.cache
def cells_program(out_sharding: NamedSharding | None):
  """jit((out [R, L, W, K], source, cells [R, W], columns [R, W]) -> out): the packed assembly's
  step for one source (`out` donated)."""
  return jax.jit(_cells, out_shardings=out_sharding, donate_argnums=0)


@functools.cache
def zeros_program(shape: tuple[int, ...], out_sharding: NamedSharding | None):
  """jit(() -> zeros [shape] int32) in `out_sharding`: where the assembly starts."""
  return jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=out_sharding)


def routes_sharding(sharding: NamedSharding) -> NamedSharding:
  """The routes' [B, L, S, K] sharding for update arrays [B, S] in `sharding`: the same on B and S."""
  spec = sharding.spec
  return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if len(spec) else None, None,
                                                    spec[1] if len(spec) > 1 else None, None))
