"""Choosing the next token from logits: temperature, top-k, top-p (nucleus), greedy at temperature 0.

Per-sample keys: a sample's t-th token is drawn with `token_keys(sample_keys(key, ids), t)`, a key
derived from (the call's base key, the sample's id, t) alone, so a sample's tokens do not depend on
the slot, batch, scheduler or proposer it ran under.

Drawing is the Gumbel-max trick: the first maximum of the logits plus Gumbel noise from the key, the
token `jax.random.categorical` draws with that key (its argmax taken by `first_max_index`). The noise
depends only on the key, so two distributions drawn with the same key are coupled: a draft model that
proposes token t with token t's key proposes exactly the token the target draws whenever the two
agree on the argmax of the perturbed logits. Speculative verification (rl/generation/core.py) accepts
a proposal iff it IS the target's draw with that key, so the output of every proposer is the plain
sampler's, token for token, at any temperature, top-k and top-p (drafter-invariant speculative
decoding: Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
Speculative Decoding", arXiv:2411.07267).

Per-row parameters (`RowSampling`): a server's requests each bring their temperature and top-p; the
same functions take them as [R] arrays instead of the Sampler's constants.

Axis legend: R rows, W tokens per row (a speculative window), V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RowSampling:
  """Per-row sampling parameters (a server's requests): temperature [R] (0 = greedy), top_p [R]."""
  temperature: jax.Array
  top_p: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampler:
  """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. With `per_row`, the
  temperature and top-p come from a RowSampling per call (a server), and these are unused."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  per_row: bool = False

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"rl.temperature={self.temperature} must be >= 0.")
    if self.top_k < 0:
      raise ValueError(f"rl.top_k={self.top_k} must be >= 0.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"rl.top_p={self.top_p} must be in (0, 1].")

  @property
  def greedy(self) -> bool:
    """Every row takes the argmax (known when the program is built)."""
    return not self.per_row and self.temperature == 0

  def scaled(self, logits: jax.Array, rows: RowSampling | None = None) -> jax.Array:
    """Logits of the sampling distribution before filtering: logits / temperature (float32; the
    logits themselves where the temperature is 0)."""
    logits = logits.astype(jnp.float32)
    if not self.per_row:
      return logits if self.temperature == 0 else logits / self.temperature
    temperature = rows.temperature.reshape((-1,) + (1,) * (logits.ndim - 1))  # against [R, V] or [R, W, V]
    return logits / jnp.where(temperature > 0, temperature, 1.0)

  def log_probs(self, logits: jax.Array, tokens: jax.Array, rows: RowSampling | None = None) -> jax.Array:
    """Behaviour log-prob of `tokens` ([R] or [R, W]) under the temperature-scaled policy, logits
    [R, V] or [R, W, V].

    Top-k / top-p truncation is not applied here, so the recorded log-prob is the one the update
    recomputes from the full distribution (as verl and Tunix do)."""
    log_p = jax.nn.log_softmax(self.scaled(logits, rows), axis=-1)
    return jnp.take_along_axis(log_p, tokens[..., None], axis=-1)[..., 0]

  def draw(self, logits: jax.Array, keys: jax.Array, rows: RowSampling | None = None) -> jax.Array:
    """logits [R, V] or [R, W, V] and one typed key per token ([R] or [R, W]) -> tokens int32."""
    if logits.ndim == 3:  # each row's parameters repeated for each of its W tokens ([R] -> [R * W])
      repeated = jax.tree.map(lambda a: jnp.repeat(a, logits.shape[1]), rows)
      return self.draw(logits.reshape(-1, logits.shape[-1]), keys.reshape(-1), repeated).reshape(logits.shape[:2])
    greedy = first_max_index(logits)
    if self.greedy:
      return greedy
    scaled = self._filtered(self.scaled(logits, rows), rows)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], scaled.dtype))(keys)  # [R, V]
    drawn = first_max_index(scaled + noise)
    if not self.per_row:
      return drawn
    return jnp.where(rows.temperature > 0, drawn, greedy)

  def _filtered(self, scaled: jax.Array, rows: RowSampling | None) -> jax.Array:
    """Top-k, then top-p (the smallest prefix whose mass reaches top_p; the first token stays)."""
    if self.top_k:
      kth = jax.lax.top_k(scaled, self.top_k)[0][:, -1:]  # [R, 1]
      scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    top_p = rows.top_p[:, None] if self.per_row else self.top_p
    if self.per_row or self.top_p < 1.0:
      sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [R, V] descending
      cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
      keep = jnp.concatenate([jnp.ones_like(cumulative[:, :1], bool), cumulative[:, :-1] < top_p], axis=-1)
      threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
      scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    return scaled

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    """logits [R, V] and ONE key for the batch -> tokens [R] int32 (each row its own fold of the key)."""
    return self.draw(logits, jax.random.split(key, logits.shape[0]))


def first_max_index(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN where there is one), computed
  as a max and a min over the last axis. On rows as long as a vocabulary XLA's CPU backend runs
  argmax's (value, index) reduction 2-3x slower than these two (64 x 259 logits: 61 against 21 us,
  and 369 against 169 us with the Gumbel noise fused in; 64 x 32,000: 3.7 against 1.6 ms). On short
  rows argmax is the faster (a router's few experts: model/moe.top_k_indices keeps it).
  x [..., V] -> [...]."""
  columns = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
  return jnp.min(jnp.where(hit, columns, x.shape[-1]), axis=-1)


@jax.jit
def sample_keys(key: jax.Array, sample_ids: jax.Array) -> jax.Array:
  """One key per sample [B] from a base key and the samples' ids [B] int (fold_in(key, id))."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, sample_ids)


def token_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
  """The keys of each sample's token number `steps`: keys [B] and steps [B] or [] -> [B]; or steps
  [B, W] -> [B, W] (a window of tokens per sample). fold_in(keys[b], t)."""
  if steps.ndim == 2:
    return jax.vmap(lambda key, row: jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row))(keys, steps)
  steps = jnp.broadcast_to(steps, keys.shape)
  return jax.vmap(jax.random.fold_in)(keys, steps)
