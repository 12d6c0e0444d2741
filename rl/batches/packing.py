"""Packed, length-aware update batches: trajectories packed into rows with segment ids.

A padded update batch holds every sample in its own row of S = max_prompt_len + max_new_tokens
columns, so its cost follows the longest sample. Packing puts the real tokens of each trajectory
(prompt + response, contiguous in the padded row) one after another into R rows of W columns:

  padded [B, S]:  __PPPPrrr_____      packed [R, W]:  PPPPrrrPPPrPPPPPrrrrrr__
                  _PPPrr________                      PPPPPPrrrrrrrPPrrrr_____
                  ...

Each trajectory keeps its positions (0.. over its real tokens) and gets its own segment id
(sample index + 1, 0 on padding), so the attention kernels never let one sample see another
(model/attention.py masks by segment ids and positions alone). `sequence_ids` (sample index, -1 on
padding) lets the losses reduce per sample (rl/algo/losses.py `Sequences`).

The packed shape [R, W] is static per run (`rl.packed_rows`, `rl.packed_row_len`): one compile. With
`rl.packed_row_buckets` = n > 1 a step takes the fewest rows of a ladder of n counts that hold its
trajectories (`row_ladder`: R, R/2, ..., R/2^(n-1), or R*k/n with rl.packed_row_spacing=even; one
compile per rung; a count that would not split into the minibatches over the data-parallel axes is
left out): dynamic sampling keeps only the groups whose rewards
differ, and the update then costs what the kept samples need, not what the rollout made (the groups
it drops would have been forwarded and backpropagated with a zero mask).
Rows are filled longest trajectory first into the least-loaded row (LPT), so their token counts
differ by at most one trajectory: every minibatch (a random subset of rows) and every data-parallel
shard of it gets about the same number of real tokens. When that spread leaves no row with room for
a trajectory, first-fit decreasing is tried before giving up with an error naming rl.packed_rows.

Per-sample quantities map both ways through one `PackPlan` (which packed cell holds which sample's
column): advantages are computed per sample ([B, S], the estimators' layout) and packed; reference
log-probs and values are computed packed and unpacked. MoE routes (routing replay) are packed with
the tokens. With ring attention's zigzag layout the plan's columns are zigzagged, so packing lands
directly in that layout.

Axis legend: B samples, S padded columns, R packed rows, W packed row length, L MoE layers,
K experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.model.ring_attention import zigzag
from meshrl.rl.batches.handover import UpdateBatch
from meshrl.sharding import hosts


@dataclasses.dataclass(frozen=True)
class PackingSpec:
  """The static packed shape and layout of a run."""
  rows: int  # R packed rows per update batch (the most, with buckets)
  row_len: int  # W tokens per row
  zigzag_shards: int = 1  # > 1: columns laid out zigzag over this many sequence shards
  ladder: tuple[int, ...] = ()  # the row counts a step may take, fewest first, ending at rows
  #                               (rl/step/run_spec.update_row_ladder); () = rows alone

  def __post_init__(self):
    if self.rows < 1 or self.row_len < 1:
      raise ValueError(f"packed shape rl.packed_rows={self.rows} x rl.packed_row_len={self.row_len} "
                       "must be at least 1 x 1.")
    if self.zigzag_shards > 1 and self.row_len % (2 * self.zigzag_shards):
      raise ValueError(f"rl.packed_row_len={self.row_len} is not divisible by {2 * self.zigzag_shards} "
                       f"(2 x mesh.sequence for attention.zigzag).")
    if self.ladder and (self.ladder[-1] != self.rows or list(self.ladder) != sorted(set(self.ladder))
                        or self.ladder[0] < 1):
      raise ValueError(f"the packed row ladder {self.ladder} must rise to rl.packed_rows={self.rows}.")

  @classmethod
  def from_config(cls, cfg, *, zigzag_shards: int = 1, ladder: tuple[int, ...] = ()) -> "PackingSpec":
    """rl.packed_rows (0 = one row per sample) x rl.packed_row_len (0 = prompt + response budget);
    `ladder`: RunSpec.update_row_ladder (rl.packed_row_buckets)."""
    rows, row_len = update_shape(cfg)
    return cls(rows=rows, row_len=row_len, zigzag_shards=zigzag_shards, ladder=tuple(ladder))

  @property
  def row_ladder(self) -> tuple[int, ...]:
    """The row counts a step may take, fewest first."""
    return self.ladder or (self.rows,)


def row_ladder(rows: int, rungs: int, spacing: str, fits) -> tuple[int, ...]:
  """The row counts of rl.packed_row_buckets = `rungs`, fewest first, each one that `fits(count)`:
    halve  rows, rows / 2, ... (at most `rungs` counts, each a whole half, stopping at the first half
           that does not fit): relative waste under 1/2, from rows / 2^(rungs-1) up;
    even   rows * k / rungs for k = 1..rungs, the whole ones that fit: waste under rows / rungs rows.
           Late in an RL run dynamic sampling keeps most groups, and a step's rows sit between rows / 2
           and rows, where halving takes all `rows`."""
  if spacing == "even":
    return tuple(sorted({rows * k // rungs for k in range(1, rungs + 1)
                         if rows * k % rungs == 0 and fits(rows * k // rungs)} | {rows}))
  if spacing != "halve":
    raise ValueError(f"rl.packed_row_spacing={spacing!r} is unknown; choose one of ('halve', 'even').")
  ladder = [rows]
  while len(ladder) < rungs and ladder[-1] % 2 == 0 and fits(ladder[-1] // 2):
    ladder.append(ladder[-1] // 2)
  return tuple(reversed(ladder))


def update_rows(cfg) -> int:
  """Rows of the run's update batch: rl.packed_rows when packing (0 = samples per step), else the
  samples per step (rl.prompts_per_step * rl.group_size)."""
  samples = cfg.rl.prompts_per_step * cfg.rl.group_size
  if not cfg.rl.pack_updates:
    return samples
  return int(cfg.rl.packed_rows) or samples


def update_shape(cfg) -> tuple[int, int]:
  """[rows, columns] of the run's update batches: packed [R, W] or padded [B, S]."""
  if cfg.rl.pack_updates:
    return update_rows(cfg), int(cfg.rl.packed_row_len) or cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  return update_rows(cfg), cfg.rl.max_prompt_len + cfg.rl.max_new_tokens


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Where each packed cell comes from: cell (r, w) holds sample[r, w]'s column column[r, w]."""
  sample: np.ndarray  # [R, W] int32 source sample, -1 on padding
  column: np.ndarray  # [R, W] int32 source column of the padded layout, 0 on padding
  num_samples: int  # B
  num_columns: int  # S

  @property
  def valid(self) -> np.ndarray:
    return self.sample >= 0  # [R, W] bool

  def row_tokens(self) -> np.ndarray:
    """[R] real tokens per packed row."""
    return self.valid.sum(axis=1)

  def pack(self, x: np.ndarray, fill=0) -> np.ndarray:
    """Padded [B, S, ...] -> packed [R, W, ...] (`fill` on padding)."""
    x = np.asarray(x)
    if x.shape[:2] != (self.num_samples, self.num_columns):
      raise ValueError(f"array of shape {x.shape} is not [B, S] = [{self.num_samples}, {self.num_columns}].")
    out = x[np.maximum(self.sample, 0), self.column]
    return np.where(self.valid.reshape(self.valid.shape + (1,) * (x.ndim - 2)), out,
                    np.asarray(fill, x.dtype))

  def unpack(self, y, fill=0) -> np.ndarray:
    """Packed [R, W, ...] -> padded [B, S, ...] (`fill` where no packed cell maps)."""
    y = np.asarray(y)
    if y.shape[:2] != self.sample.shape:
      raise ValueError(f"array of shape {y.shape} is not the packed [R, W] = {self.sample.shape}.")
    out = np.full((self.num_samples, self.num_columns) + y.shape[2:], fill, y.dtype)
    valid = self.valid
    out[self.sample[valid], self.column[valid]] = y[valid]
    return out


def trajectory_spans(segment_ids: np.ndarray, include: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(start [B], length [B]) of each included sample's real tokens (segment id != 0) in the padded
  layout; length 0 for a sample left out. Raises ValueError if a sample's tokens are not contiguous."""
  return _checked(*_spans(np.asarray(segment_ids) != 0, np.asarray(include, bool), np))


def device_spans(segment_ids: jax.Array, include: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`trajectory_spans` of [B, S] segment ids on the devices (kept there, rl/batches/rows.py): only the
  three [B] vectors come to the host."""
  starts, lengths, broken = _spans_program()(segment_ids, np.asarray(include, bool))
  return _checked(*(hosts.to_host(x) for x in (starts, lengths, broken)))


def _spans(real, include, xp):
  """(starts, lengths, broken [B]) from real [B, S] bool and include [B]: broken marks an included
  sample whose real tokens are not one contiguous span. numpy or jax.numpy as `xp`."""
  lengths = xp.where(include, real.sum(axis=1), 0)
  starts = xp.where(lengths > 0, xp.argmax(real, axis=1), 0)
  columns = xp.arange(real.shape[1])
  span = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
  return starts, lengths, xp.any(span != (real & (lengths > 0)[:, None]), axis=1)


@functools.cache
def _spans_program():
  return jax.jit(lambda segment_ids, include: _spans(segment_ids != 0, include, jnp))


def _checked(starts, lengths, broken) -> tuple[np.ndarray, np.ndarray]:
  broken = np.nonzero(np.asarray(broken))[0]
  if broken.size:
    raise ValueError(f"sample {int(broken[0])}'s real tokens (segment_ids != 0) are not contiguous; "
                     "packing needs one span of prompt + response per sample.")
  return np.asarray(starts).astype(np.int64), np.asarray(lengths).astype(np.int64)


def _fill_rows(lengths: np.ndarray, order: np.ndarray, rows: int, row_len: int, *, least_loaded: bool):
  """Row of each sample (-1: no room, or left out) filled in `order`; least-loaded row first (LPT)
  or first row with room (first fit)."""
  load = np.zeros(rows, np.int64)
  row_of = np.full(lengths.shape, -1, np.int64)
  for b in order:
    if lengths[b] == 0:
      continue
    if least_loaded:
      r = int(np.argmin(load))
      if load[r] + lengths[b] > row_len:
        return None
    else:
      fits = np.nonzero(load + lengths[b] <= row_len)[0]
      if not fits.size:
        return None
      r = int(fits[0])
    row_of[b] = r
    load[r] += lengths[b]
  return row_of


def assign_rows(lengths: np.ndarray, rows: int, row_len: int) -> np.ndarray:
  """Row of each sample [B] (-1 for length 0): longest first into the least-loaded row, so row
  loads differ by at most the longest trajectory; first-fit decreasing if that finds no room.

  Raises ValueError naming rl.packed_row_len for a trajectory longer than a row, and rl.packed_rows
  when the trajectories do not fit into the rows at all."""
  return fit_rows(lengths, (rows,), row_len)[0]


def fit_rows(lengths: np.ndarray, ladder: tuple[int, ...], row_len: int) -> tuple[np.ndarray, int]:
  """(row of each sample [B], rows): `assign_rows` into the fewest rows of `ladder` (fewest first,
  PackingSpec.row_ladder) that hold the trajectories. Raises as `assign_rows` does, naming the
  largest rung."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > row_len:
    b = int(np.argmax(lengths))
    raise ValueError(f"sample {b} has {int(lengths[b])} real tokens, more than rl.packed_row_len={row_len}; "
                     "a trajectory must fit in one packed row.")
  order = np.argsort(-lengths, kind="stable")
  for rows in ladder:
    if lengths.sum() > rows * row_len:
      continue  # cannot hold the tokens: no search
    for least_loaded in (True, False):
      row_of = _fill_rows(lengths, order, rows, row_len, least_loaded=least_loaded)
      if row_of is not None:
        return row_of, rows
  raise ValueError(f"the step's {int((lengths > 0).sum())} trajectories ({int(lengths.sum())} tokens, longest "
                   f"{int(lengths.max())}) do not fit in rl.packed_rows={ladder[-1]} rows of rl.packed_row_len="
                   f"{row_len} tokens; raise rl.packed_rows (a padded batch has one row per sample).")


def plan_packing(segment_ids: np.ndarray, include: np.ndarray, spec: PackingSpec) -> PackPlan:
  """The PackPlan of one step's padded [B, S] batch: samples with `include` [B] (the valid ones;
  groups kept only for dynamic sampling's static shape cost nothing) into spec.rows x spec.row_len."""
  segment_ids = np.asarray(segment_ids)
  return plan_from_spans(*trajectory_spans(segment_ids, include), spec, num_columns=segment_ids.shape[1])


def plan_from_spans(starts: np.ndarray, lengths: np.ndarray, spec: PackingSpec, *, num_columns: int) -> PackPlan:
  """`plan_packing` from the samples' spans (`trajectory_spans` or `device_spans`; length 0: left
  out) in a padded layout of `num_columns` columns."""
  num_samples = len(lengths)
  row_of, rows = fit_rows(lengths, spec.row_ladder, spec.row_len)
  sample = np.full((rows, spec.row_len), -1, np.int32)
  column = np.zeros((rows, spec.row_len), np.int32)
  offset = np.zeros(rows, np.int64)
  for b in np.nonzero(row_of >= 0)[0]:  # in sample order within each row
    r, n = row_of[b], lengths[b]
    sample[r, offset[r]:offset[r] + n] = b
    column[r, offset[r]:offset[r] + n] = np.arange(starts[b], starts[b] + n)
    offset[r] += n
  if spec.zigzag_shards > 1:
    sample, column = zigzag(sample, spec.zigzag_shards), zigzag(column, spec.zigzag_shards)
  return PackPlan(sample=sample, column=column, num_samples=num_samples, num_columns=num_columns)


_FILLS = {"tokens": 0, "positions": 0, "targets": 0, "loss_mask": False}


def pack_batch(batch: UpdateBatch, plan: PackPlan) -> UpdateBatch:
  """A padded host UpdateBatch [B, S] -> the packed one [R, W] with per-sample segment ids and
  sequence_ids; routing [B, L, S, K] -> [R, L, W, K]. Padding cells have loss_mask False."""
  if batch.sequence_ids is not None:
    raise ValueError("UpdateBatch is already packed (it has sequence_ids).")
  def pack(name, value):
    if value is None:
      return None
    if name == "routing":
      routes = plan.pack(np.moveaxis(np.asarray(value), 1, 2), 0)  # [R, W, L, K]
      return np.moveaxis(routes, 2, 1)  # [R, L, W, K]
    return plan.pack(value, _FILLS.get(name, 0))
  fields = {f.name: pack(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)}
  fields.update(_id_arrays(plan))
  return UpdateBatch(**fields)


def _id_arrays(plan: PackPlan) -> dict[str, np.ndarray]:
  """The packed batch's segment_ids (sample + 1, 0 on padding) and sequence_ids (sample, -1 on
  padding) [R, W]."""
  return {"segment_ids": np.where(plan.valid, plan.sample + 1, 0).astype(np.int32),
          "sequence_ids": plan.sample.astype(np.int32)}


def plan_ids(plan: PackPlan, sharding) -> dict[str, Any]:
  """`_id_arrays` on the devices, in `sharding` (None: one device; every host process passes the
  same plan)."""
  ids = _id_arrays(plan)
  return jax.tree.map(jnp.asarray, ids) if sharding is None else jax.device_put(ids, sharding)


def packing_metrics(plan: PackPlan) -> dict[str, float]:
  """Fill of the packed batch and the spread of its rows' real tokens."""
  tokens = plan.row_tokens()
  return {"packed_fill": float(tokens.sum() / plan.sample.size), "update_rows": float(plan.sample.shape[0]),
          "packed_row_tokens_max": float(tokens.max()), "packed_row_tokens_min": float(tokens.min())}
