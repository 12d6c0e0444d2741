"""Between the update batch's layout and one contiguous row per sample, on the devices.

The update batch is laid out for the model: zigzag over the `sequence` axis for ring attention, or
packed into rows (rl/batches/packing.py). The advantage estimators read a sample's tokens in order (the
outcome reward goes on its last loss token, GAE scans columns), so `prepare` takes the batch's
per-token arrays to the samples' layout and the advantages back:

  zigzag   ring_attention.unzigzag_on_mesh / zigzag_on_mesh: two collective permutes of one chunk
           per device; no device ever holds more than its slice.
  packed   a gather of the packed cells into [B, S] (padding gets `fill`) and back, by the plan's
           sample and column of each cell.
  padded   nothing to do.

Both directions are jitted with the arrays' shardings: [B, S] split like the update batch (batch
axes x `sequence`). Before, each array went to the host (`hosts.to_host`: every host pulled the
whole batch) and the advantages were computed on one device: at paper_3t, 4 x 256 MiB per step
through every host and onto one chip.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.model.ring_attention import unzigzag_on_mesh, zigzag_on_mesh
from meshrl.sharding.mesh import SEQUENCE_AXIS, axis_size


@dataclasses.dataclass(frozen=True)
class SampleLayout:
  """to_samples: batch layout -> [B, S] contiguous; from_samples: back. Both take and return device
  arrays, or pytrees of them (None passes through), in one jitted call: `to_program(tree, *cells)`
  and `from_program(tree, *cells)`, pure, with the step's device arrays they read (`cells`: a packed
  batch's sample and column of each cell) passed apart, so a program of a caller can call them inside
  its own (rl/step/program.py: the advantages between the two directions, one program)."""
  to_program: Callable[..., Any]
  from_program: Callable[..., Any]
  cells: tuple = ()

  def to_samples(self, tree):
    return self.to_program(tree, *self.cells)

  def from_samples(self, tree):
    return self.from_program(tree, *self.cells)


def _each(fn: Callable) -> Callable:
  """fn(x, *args) -> the same on every array of a pytree (one program for a whole batch's fields)."""
  return lambda tree, *args: jax.tree.map(lambda x: fn(x, *args), tree)


@functools.cache
def _unpack_program(shape: tuple[int, int], samples_sharding):
  return jax.jit(_each(functools.partial(_unpack, num_samples=shape[0], num_columns=shape[1])),
                 out_shardings=samples_sharding)


@functools.cache
def _pack_program(batch_sharding):
  return jax.jit(_each(_pack), out_shardings=batch_sharding)


@functools.cache
def _zigzag_program(mesh, batch_sharding, undo: bool):
  return jax.jit(_each(functools.partial(unzigzag_on_mesh if undo else zigzag_on_mesh, mesh=mesh, axis=1)),
                 out_shardings=batch_sharding)


def _unpack(y, sample, column, *, num_samples: int, num_columns: int):
  """Packed [R, W] -> [B, S]: cell (r, w) goes to (sample[r, w], column[r, w]); 0 / False elsewhere."""
  rows = jnp.where(sample >= 0, sample, num_samples)  # padding cells: out of range, dropped
  out = jnp.zeros((num_samples, num_columns), y.dtype)
  return out.at[rows, column].set(y, mode="drop")


def _pack(x, sample, column):
  """[B, S] -> packed [R, W]: each cell's sample and column; 0 / False on padding cells."""
  picked = x[jnp.maximum(sample, 0), column]
  return jnp.where(sample >= 0, picked, jnp.zeros((), x.dtype))


def sample_layout(*, plan=None, zigzag_shards: int = 1, mesh=None, batch_sharding=None,
                  samples_sharding=None) -> SampleLayout:
  """The two directions for this step's batch.

  Args:
    plan: the step's rl/batches/packing.PackPlan when updates are packed (else None).
    zigzag_shards: > 1 when the padded batch is zigzag over the mesh's `sequence` axis.
    mesh: the run's mesh (None: one device).
    batch_sharding: NamedSharding of the update batch's [B, S] (or packed [R, W]) arrays.
    samples_sharding: NamedSharding of [B, S] contiguous arrays (the packed case; else the batch's).
  """
  if plan is not None:
    cells = (plan.sample.astype(np.int32), plan.column.astype(np.int32))  # [R, W] each
    cells = jax.tree.map(jnp.asarray, cells) if batch_sharding is None else \
        jax.device_put(cells, batch_sharding)  # from numpy: every host process passes the same plan
    shape = (plan.num_samples, plan.num_columns)
    return SampleLayout(_unpack_program(shape, samples_sharding), _pack_program(batch_sharding), tuple(cells))
  if zigzag_shards > 1:
    if axis_size(mesh, SEQUENCE_AXIS) != zigzag_shards:
      raise ValueError(f"a zigzag over {zigzag_shards} shards needs the mesh's 'sequence' axis of that "
                       f"size; mesh={None if mesh is None else dict(mesh.shape)}.")
    return SampleLayout(_zigzag_program(mesh, batch_sharding, True), _zigzag_program(mesh, batch_sharding, False))
  return SampleLayout(_same, _same)


def _same(tree):
  """The padded layout is the samples' own."""
  return tree
