"""Samples' arrays kept on the devices: the host side of an RL step moves rows, not their contents.

A rollout returns its per-token fields ([N, S] tokens, positions, masks, log-probs) and MoE routes
([L, N, S, K]) as device arrays split over the mesh. Brought to the host, every host process would
hold every sample's every token (`sharding/hosts.to_host` all-gathers): at a 1M-token context that
is the whole batch, [B, 1M] per field, on every host. But the host side of a step (scoring, dynamic
sampling, partial rollouts, packing plans) only ever moves whole samples, so it carries `DeviceRows`
instead: the device arrays the samples are in and, per sample, its row in them. What the host does
need of the tokens (the response columns for scoring) it pulls with `to_host(columns=...)`, and the
update batch is built from the rows on the devices (`gather`, then rl/batches/handover.py `align_on_devices`
and rl/batches/layouts.py's zigzag or packing).

`DeviceRows` behaves like a host [B, ...] array for that code: len, shape, slicing and index arrays
on the sample axis, `concatenate` with blank samples, `to_host` (a checkpoint's JSON, tests).
rl/batches/routes.py's `RoutingRows` is the same for the routes, whose sample axis is 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from meshrl.sharding import hosts


@dataclasses.dataclass(frozen=True)
class DeviceRows:
  """B samples' rows of device arrays, moved like a host [B, ...] array (sample axis first).

  sources: arrays (on the devices; numpy after a restore from JSON) holding the samples on `axis`,
    equal in every other dimension and dtype.
  rows: [B] int: sample b's row in the sources concatenated on `axis`; -1 = a blank sample.
  axis: the sources' sample axis.
  fill: every element of a blank sample.
  """
  sources: tuple[Any, ...]
  rows: np.ndarray
  axis: int = 0
  fill: Any = 0

  def __post_init__(self):
    shapes = {_other_dims(s, self.axis) for s in self.sources}
    if len(shapes) != 1:
      raise ValueError(f"{type(self).__name__}: sources of different shapes {sorted(shapes)} "
                       f"(apart from the sample axis {self.axis}).")
    total = sum(s.shape[self.axis] for s in self.sources)
    rows = np.asarray(self.rows)
    if rows.ndim != 1 or (rows.size and (rows.min() < -1 or rows.max() >= total)):
      raise ValueError(f"{type(self).__name__}: rows must be a [B] vector in -1..{total - 1}.")

  @classmethod
  def of(cls, source, rows: np.ndarray | None = None, **kw) -> "DeviceRows":
    """The samples `rows` (default all, in order) of one source array."""
    axis = kw.get("axis", cls.axis)
    return cls((source,), np.arange(source.shape[axis]) if rows is None else np.asarray(rows), **kw)

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.rows),) + _other_dims(self.sources[0], self.axis)

  @property
  def dtype(self):
    return np.dtype(self.sources[0].dtype)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index):
    """The samples `index` (a slice or an index array on the sample axis); one sample's row as host
    numpy for an integer (like numpy, which drops the axis)."""
    if isinstance(index, (int, np.integer)):
      return self[[index]].to_host()[0]
    return dataclasses.replace(self, rows=np.asarray(self.rows)[index])

  def to_host(self, columns: slice | None = None) -> np.ndarray:
    """[B, ...] numpy, sample axis first (collective with several processes: every host calls it
    with the same rows); blank samples `fill`. columns: only these of the axis after the samples'
    (the response columns of a [B, S] field), sliced on the devices before the gather."""
    shape = self.shape if columns is None else (len(self), len(range(*columns.indices(self.shape[1])))
                                                ) + self.shape[2:]
    out = np.full(shape, self.fill, self.dtype)
    for source, local in per_source(self.sources, np.asarray(self.rows), self.axis):
      mine = local >= 0
      if not mine.any():
        continue
      if columns is not None:
        source = _column_slicer(self.axis, columns.start, columns.stop, columns.step)(source)
      out[mine] = np.moveaxis(hosts.to_host(source), self.axis, 0)[local[mine]]
    return out

  def gather(self, sharding: NamedSharding | None) -> jax.Array:
    """The [B, ...] array (sample axis first; blank samples `fill`) built on the devices in
    `sharding` (None: the default device); see `gather_many`."""
    return gather_many({"": self}, sharding)[""]


def gather_many(fields: dict[str, DeviceRows], sharding: NamedSharding | None) -> dict[str, jax.Array]:
  """`DeviceRows.gather` of several fields at once: {name: [B, ...] array in `sharding`}. Fields whose
  samples lie alike (the same rows of sources of the same sizes: a batch's per-token fields) are
  gathered together, one jitted call to start them and one per source, whatever their number (an RL
  step's batch: 2 calls for its 5 aligned fields instead of 10)."""
  alike: dict[tuple, list[str]] = {}
  for name, field in fields.items():
    sizes = tuple(s.shape[field.axis] for s in field.sources)
    alike.setdefault((field.axis, sizes, np.asarray(field.rows, np.int64).tobytes()), []).append(name)
  out = {}
  for names in alike.values():
    first = fields[names[0]]
    specs = tuple((fields[n].shape, np.dtype(fields[n].dtype), fields[n].fill) for n in names)
    outs = _full_program(specs, sharding)()
    for j, (_, local) in enumerate(per_source(first.sources, np.asarray(first.rows, np.int32), first.axis)):
      if (local >= 0).any():
        sources = tuple(jnp.asarray(fields[n].sources[j]) for n in names)
        outs = _take_program(first.axis, sharding)(outs, sources, local)
    out.update(zip(names, outs))
  return out


def _other_dims(source, axis: int) -> tuple[int, ...]:
  return tuple(d for i, d in enumerate(source.shape) if i != axis)


def per_source(sources: Sequence[Any], index: np.ndarray, axis: int = 0):
  """(source, local) for each source: `index` (rows of the sources concatenated on `axis`, any
  shape; -1 = none) as rows of that source, -1 where they point elsewhere."""
  start = 0
  for source in sources:
    count = source.shape[axis]
    yield source, np.where((index >= start) & (index < start + count), index - start, -1).astype(np.int32)
    start += count


def concatenate(parts: Sequence[DeviceRows], blank: int = 0) -> DeviceRows:
  """The samples of `parts` (of one class, axis and fill) in order, then `blank` blank samples;
  sources shared by several parts are kept once."""
  axis = parts[0].axis
  sources, offsets, rows = [], {}, []
  for part in parts:
    starts = []
    for source in part.sources:
      if id(source) not in offsets:
        offsets[id(source)] = sum(s.shape[axis] for s in sources)
        sources.append(source)
      starts.append(offsets[id(source)])
    bounds = np.cumsum([0] + [s.shape[axis] for s in part.sources])
    local = np.asarray(part.rows)
    which = np.searchsorted(bounds, local, side="right") - 1
    rows.append(np.where(local < 0, -1, np.asarray(starts + [0])[which] + local - bounds[which]))
  rows.append(np.full(blank, -1))
  return dataclasses.replace(parts[0], sources=tuple(sources), rows=np.concatenate(rows).astype(np.int64))


# The small programs below are built once per static argument (functools.cache; shardings hash) and
# left to jax.jit's own cache for their input shapes.


@functools.cache
def _column_slicer(axis: int, start, stop, step):
  """jit(source -> source[..., start:stop:step] on the axis after `axis`), on the devices."""
  def cut(source):
    index = [slice(None)] * source.ndim
    index[1 if axis == 0 else 0] = slice(start, stop, step)
    return source[tuple(index)]
  return jax.jit(cut)


@functools.cache
def _take_program(axis: int, sharding: NamedSharding | None):
  """jit((outs, sources, local [B]) -> outs with the samples whose local row >= 0 taken from each
  source's `axis` (outs [B, ...] and sources: tuples alike); `outs` donated)."""
  def take_one(out, source, local):
    picked = jnp.moveaxis(jnp.take(source, jnp.maximum(local, 0), axis=axis), axis, 0).astype(out.dtype)
    return jnp.where((local >= 0).reshape((-1,) + (1,) * (out.ndim - 1)), picked, out)
  return jax.jit(lambda outs, sources, local: tuple(take_one(o, s, local) for o, s in zip(outs, sources)),
                 out_shardings=sharding, donate_argnums=0)


@functools.cache
def _full_program(specs: tuple[tuple[tuple[int, ...], np.dtype, Any], ...], sharding: NamedSharding | None):
  """jit(() -> one array per (shape, dtype, fill) of `specs`) in `sharding`: where a gather starts."""
  return jax.jit(lambda: tuple(jnp.full(shape, fill, dtype) for shape, dtype, fill in specs), out_shardings=sharding)


# RolloutBatch's per-token fields, [B, S = Lp + N], and the fill of a blank sample's (a group kept
# only for the batch's static shape) where it is not 0 / False.
PER_TOKEN_FIELDS = ("tokens", "positions", "segment_ids", "prompt_mask", "response_mask", "logprobs",
                    "policy_version")
PAD_FILL = {"policy_version": -1}


def rollout_rows(fields: dict, rows: np.ndarray | None = None) -> dict:
  """A RolloutBatch's fields {name: device array} (routing left out) as the host side of an RL step
  holds them: the per-token fields [B, S] stay on the devices as rl/batches/rows.DeviceRows (the host moves
  samples by row, pulls the response columns it scores, and the update batch is built on the
  devices), the per-sample fields (lengths, truncated [B]) come to every host (`hosts.to_host`).
  rows: the samples to keep (default all, in order)."""
  out = {}
  for name, value in fields.items():
    if name in PER_TOKEN_FIELDS:
      out[name] = DeviceRows.of(value, rows, fill=PAD_FILL.get(name, 0))
    else:
      out[name] = hosts.to_host(value) if rows is None else hosts.to_host(value)[rows]
  return out
