"""The typed hand-over between the RL stages: RolloutBatch -> ScoredBatch -> UpdateBatch.

  rollout (jit)  -> RolloutBatch   tokens and behaviour log-probs, per generated token (rl/generation)
  score (host)   -> ScoredBatch    + rewards, per-sample domains and texts, valid samples; the
                                   per-token fields stay on the devices (rl/batches/rows.DeviceRows)
  prepare        -> UpdateBatch    prediction-aligned arrays, + advantages and the optional parts,
                                   built on the devices (`align_on_devices`; host arrays of
                                   restored rollouts: `align_for_update`)
  update (jit)   <- UpdateBatch    checked against the LossSpec before it is jitted on

An `UpdateBatch` is laid out by *predicting position*: row b, column s holds the input token
`tokens[b, s]` and what the model's output at s is scored on, `targets[b, s] = tokens[b, s + 1]`,
with its loss mask, behaviour log-prob and advantage. So every per-token field is a plain [B, S]
array whose columns may be permuted freely (zigzag for ring attention, packing) without breaking
the next-token shift, which is taken once, here, in contiguous order.

Axis legend: B sequences, S tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.model.ring_attention import zigzag
from meshrl.rl.batches.routes import routes_sharding
from meshrl.rl.batches.rows import gather_many


@dataclasses.dataclass
class ScoredBatch:
  """One step's samples, scored (every array [B, ...], groups contiguous).

  `arrays` holds the RolloutBatch fields: tokens, positions, segment_ids, prompt_mask, response_mask,
  logprobs, policy_version [B, S] (rl/batches/rows.DeviceRows on the devices, or numpy from a checkpoint's
  rollouts in flight); lengths, truncated [B] (numpy); routing,
  a rl/batches/routes.RoutingRows of [B, L, S, K] on the devices, or absent for a dense model.
  """
  arrays: dict[str, Any]
  rewards: np.ndarray  # [B] float32: the reward the advantages see (task reward + shaping)
  correct: np.ndarray  # [B] float32: the task reward alone, for metrics
  sample_valid: np.ndarray  # [B] bool: False for padding groups kept only for the static shape
  domains: list[str]  # [B] task domain of each sample
  texts: list[str]  # [B] decoded responses
  info: dict = dataclasses.field(default_factory=dict)  # counts from scoring (errors, timeouts)

  def __post_init__(self):
    size = self.arrays["tokens"].shape[0]
    for name, value in (("rewards", self.rewards), ("correct", self.correct),
                        ("sample_valid", self.sample_valid), ("domains", self.domains),
                        ("texts", self.texts)):
      if len(value) != size:
        raise ValueError(f"ScoredBatch.{name} has {len(value)} entries for {size} samples.")


@struct.dataclass
class UpdateBatch:
  """What the jitted update consumes, aligned by predicting position (see the module docstring).

  Required: tokens, positions, segment_ids, targets [B, S] int32; loss_mask [B, S] bool;
  old_logprobs, advantages [B, S] float32.
  Optional (None when absent; `check` says which a LossSpec needs): ref_logprobs [B, S] (KL),
  old_values and returns [B, S] (critic), routing [B, L, S, K] int32 (MoE routing replay),
  behaviour_logprobs [B, S] (truncated importance weights: the rollout's log-probs, while
  old_logprobs are then the proximal policy's, recomputed before the update, or the behaviour's
  again, unread, when the update's own forward is the proximal policy: LossSpec.proximal_in_update), sequence_ids [B, S]
  int32 (packed rows, rl/batches/packing.py: the sample of each token, -1 on padding).

  `old_logprobs` is the proximal policy of the clipped ratio: the rollout's log-probs when no
  importance correction is on.
  """
  tokens: Any
  positions: Any
  segment_ids: Any
  targets: Any
  loss_mask: Any
  old_logprobs: Any
  advantages: Any
  ref_logprobs: Any = None
  old_values: Any = None
  returns: Any = None
  routing: Any = None
  behaviour_logprobs: Any = None
  sequence_ids: Any = None

  def check(self, spec) -> "UpdateBatch":
    """Raises ValueError naming every field the loss terms of `spec` (losses.LossSpec) need but
    this batch lacks, or a field whose shape disagrees with tokens [B, S]; returns self."""
    missing = [name for name in spec.required_fields() if getattr(self, name) is None]
    if missing:
      raise ValueError(f"UpdateBatch lacks {missing}, which the configured loss needs "
                       f"({spec.describe()}).")
    shape = np.shape(self.tokens)
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if field.name == "routing":
        if np.ndim(value) != 4 or (np.shape(value)[0], np.shape(value)[2]) != shape:
          raise ValueError(f"UpdateBatch.routing has shape {np.shape(value)}; expected [B, L, S, K] "
                           f"with [B, S] = {shape}.")
      elif np.shape(value) != shape:
        raise ValueError(f"UpdateBatch.{field.name} has shape {np.shape(value)}, tokens {shape}.")
    return self

  @property
  def num_sequences(self) -> int:
    return int(np.shape(self.tokens)[0])


def _shift_left(x: np.ndarray, fill) -> np.ndarray:
  """x[:, 1:] followed by one column of `fill`: the value at the next position, [B, S, ...]."""
  pad = np.full_like(x[:, :1], fill)
  return np.concatenate([x[:, 1:], pad], axis=1)


def align_for_update(scored: ScoredBatch) -> dict[str, np.ndarray]:
  """Prediction-aligned host arrays of a ScoredBatch (the required UpdateBatch fields but
  advantages, plus routing when the rollout recorded it). Samples that are not valid get an
  all-False loss mask, so they contribute nothing."""
  arrays = scored.arrays
  response = arrays["response_mask"] & scored.sample_valid[:, None]
  aligned = {
      "tokens": arrays["tokens"].astype(np.int32),
      "positions": arrays["positions"].astype(np.int32),
      "segment_ids": arrays["segment_ids"].astype(np.int32),
      "targets": _shift_left(arrays["tokens"].astype(np.int32), 0),
      "loss_mask": _shift_left(response, False),
      "old_logprobs": _shift_left(arrays["logprobs"].astype(np.float32), 0.0),
  }
  if arrays.get("routing") is not None:  # RoutingRows: the routes stay on the devices (rl/batches/routes.py)
    aligned["routing"] = arrays["routing"]
  return aligned


ALIGNED_FROM = ("tokens", "positions", "segment_ids", "response_mask", "logprobs")  # what alignment reads


def align_on_devices(scored: ScoredBatch, sharding) -> dict[str, Any]:
  """`align_for_update` of a ScoredBatch whose per-token fields are kept on the devices
  (rl/batches/rows.DeviceRows): the same arrays [B, S] in contiguous sample order, built on the devices in
  `sharding` (None: one device); only the [B] valid flags come from the host."""
  arrays = scored.arrays
  fields = gather_many({name: arrays[name] for name in ALIGNED_FROM}, sharding)
  if sharding is None:
    valid = jax.numpy.asarray(scored.sample_valid, bool)
  else:  # every host process passes the same flags
    valid = jax.device_put(np.asarray(scored.sample_valid, bool), NamedSharding(sharding.mesh, PartitionSpec()))
  aligned = _align_program(sharding)(fields, valid)
  if arrays.get("routing") is not None:  # RoutingRows, assembled by rl/batches/routes.py
    aligned["routing"] = arrays["routing"]
  return aligned


def align_arrays(fields: dict, valid):
  """align_for_update's arithmetic on jax arrays: `ALIGNED_FROM` fields [B, S] and valid [B] -> the
  aligned fields (traced inside jit: `align_on_devices`, rl/step/aot.py's `batch` step)."""
  jnp = jax.numpy
  shift = lambda x, fill: jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], fill)], axis=1)  # noqa: E731
  tokens = fields["tokens"].astype(jnp.int32)
  return {"tokens": tokens, "positions": fields["positions"].astype(jnp.int32),
          "segment_ids": fields["segment_ids"].astype(jnp.int32), "targets": shift(tokens, 0),
          "loss_mask": shift(fields["response_mask"] & valid[:, None], False),
          "old_logprobs": shift(fields["logprobs"].astype(jnp.float32), 0.0)}


@functools.cache
def _align_program(sharding):
  return jax.jit(align_arrays, out_shardings=sharding)


def zigzag_batch(batch: UpdateBatch, num_shards: int) -> UpdateBatch:
  """Lays every per-token field out zigzag over `num_shards` sequence shards (ring attention's
  causal balance); routing [B, L, S, K] is permuted on its S axis. A no-op for one shard."""
  if num_shards <= 1:
    return batch
  def permute(name, value):
    if value is None:
      return None
    return zigzag(value, num_shards, axis=2 if name == "routing" else 1)
  return batch.replace(**{f.name: permute(f.name, getattr(batch, f.name))
                          for f in dataclasses.fields(batch)})


def device_put_batch(batch: UpdateBatch, sharding) -> UpdateBatch:
  """Host UpdateBatch -> jax arrays: [B, S] fields in `sharding` (batch axes x `sequence`), routing
  with the same layout on its B and S axes. With `sharding=None`, plain device_put."""
  if sharding is None:
    return jax.tree.map(jax.numpy.asarray, batch)
  def put(name, value):
    if value is None:
      return None
    if name == "routing":
      return jax.device_put(value, routes_sharding(sharding))
    return jax.device_put(value, sharding)
  return batch.replace(**{f.name: put(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)})
