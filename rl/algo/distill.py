"""Distilling a draft model for speculative decoding from the target's own completions.

The target completes the task prompts (greedy or sampled, through the generation engine: an
rl/generation Generator); the draft then learns
the target's next-token distribution on those sequences, token by token: KL(p_target || q_draft) over
the positions that predict a response token ("kl", as DistillSpec, Zhou et al. 2024, does on
on-policy data), or cross-entropy on the target's sampled tokens ("ce"). A draft whose distribution is
closer to the target's accepts more proposals (rl/generation/proposers.py).

Axis legend: B sequences, T length, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshrl.model.transformer import Transformer
from meshrl.rl.generation.generator import check_draft
from meshrl.rl.generation.output import RolloutBatch

LOSSES = ("kl", "ce")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  steps: int = 200
  learning_rate: float = 3e-3
  loss: str = "kl"  # "kl" to the target's distribution or "ce" on its tokens
  batch_size: int = 0  # sequences per step (0: all of them)

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"distill steps={self.steps} must be at least 1.")
    if self.loss not in LOSSES:
      raise ValueError(f"distill loss={self.loss!r}; choose one of {LOSSES}.")
    if self.learning_rate <= 0:
      raise ValueError(f"distill learning_rate={self.learning_rate} must be > 0.")


def distill_loss(draft: Transformer, batch: RolloutBatch, target_logits: jax.Array, kind: str):
  """Mean per-token loss of the draft on the response predictions of `batch` -> (loss, metrics).

  target_logits [B, T, V]: the target's logits on batch.tokens (position t predicts token t+1).
  """
  logits = draft(batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids).logits
  mask = batch.response_mask[:, 1:].astype(jnp.float32)  # [B, T-1]: t predicts a response token
  log_q = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  if kind == "kl":
    log_p = jax.nn.log_softmax(target_logits[:, :-1], axis=-1)
    per_token = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  else:
    per_token = -jnp.take_along_axis(log_q, batch.tokens[:, 1:, None], axis=-1)[..., 0]
  agree = jnp.argmax(logits[:, :-1], -1) == jnp.argmax(target_logits[:, :-1], -1)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(per_token * mask) / count, {"greedy_agreement": jnp.sum(agree * mask) / count}


def distill(target: Transformer, draft: Transformer, batch: RolloutBatch, key: jax.Array,
            dc: DistillConfig = DistillConfig()):
  """Trains `draft` (in place: its params are updated) on the target's completions `batch` (by a
  Generator of the target's model: its group size, length and temperature) -> list of per-step
  metric dicts (host floats)."""
  check_draft(target.config, draft.config)
  target_logits = jax.jit(lambda b: jax.lax.stop_gradient(
      target(b.tokens, positions=b.positions, segment_ids=b.segment_ids).logits))(batch)
  graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
  optimizer = optax.adam(dc.learning_rate)
  opt_state = optimizer.init(params)
  rows = batch.tokens.shape[0]
  size = rows if not dc.batch_size else min(dc.batch_size, rows)

  @jax.jit
  def step(params, opt_state, index):
    pick = jax.random.permutation(jax.random.fold_in(key, index), rows)[:size]
    sub = jax.tree.map(lambda a: a[pick], batch)

    def loss_fn(p):
      return distill_loss(nnx.merge(graphdef, p, rest), sub, target_logits[pick], dc.loss)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)

  history = []
  for i in range(dc.steps):
    params, opt_state, metrics = step(params, opt_state, i)
    history.append(metrics)
  nnx.update(draft, params)
  return [{k: float(v) for k, v in m.items()} for m in jax.device_get(history)]
