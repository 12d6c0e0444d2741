"""Choosing the next token from logits: temperature, top-k, top-p (nucleus), greedy at temperature 0.

Per-sample keys: a rollout sample's t-th token is drawn with `token_keys(sample_keys(key, ids), t)`,
a key derived from (the rollout's base key, the sample's id, t) alone, so a sample's tokens do not
depend on the row, decode slot or batch it ran in (static and continuous rollouts agree exactly).

Axis legend: B batch, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampler:
  """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"rl.temperature={self.temperature} must be >= 0.")
    if self.top_k < 0:
      raise ValueError(f"rl.top_k={self.top_k} must be >= 0.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"rl.top_p={self.top_p} must be in (0, 1].")

  def scaled(self, logits: jax.Array) -> jax.Array:
    """Logits of the sampling distribution before filtering: logits / temperature (float32)."""
    logits = logits.astype(jnp.float32)
    return logits if self.temperature == 0 else logits / self.temperature

  def log_probs(self, logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Behaviour log-prob of `tokens` [B] under the temperature-scaled policy: [B].

    Top-k / top-p truncation is not applied here, so the recorded log-prob is the one the update
    recomputes from the full distribution (as verl and Tunix do).
    """
    log_p = jax.nn.log_softmax(self.scaled(logits), axis=-1)
    return jnp.take_along_axis(log_p, tokens[:, None], axis=-1)[:, 0]

  def sample_rows(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """logits [B, V], one PRNG key per row [B] -> sampled token ids [B] int32 (row b uses keys[b])."""
    return jax.vmap(lambda row, k: self(row[None], k)[0])(logits, keys)

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    """logits [B, V] -> sampled token ids [B] int32."""
    if self.temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = self.scaled(logits)
    if self.top_k:
      kth = jax.lax.top_k(scaled, self.top_k)[0][:, -1:]  # [B, 1]
      scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if self.top_p < 1.0:
      sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
      cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
      # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
      keep = jnp.concatenate([jnp.ones_like(cumulative[:, :1], bool),
                              cumulative[:, :-1] < self.top_p], axis=-1)
      threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
      scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def sample_keys(key: jax.Array, sample_ids: jax.Array) -> jax.Array:
  """One key per sample [B] from a base key and the samples' ids [B] int (fold_in(key, id))."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, sample_ids)


def token_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
  """The keys [B] of each sample's token number steps [B] (or [] for all): fold_in(keys[b], t)."""
  steps = jnp.broadcast_to(steps, keys.shape)
  return jax.vmap(jax.random.fold_in)(keys, steps)
