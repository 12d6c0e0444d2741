"""Proposers of speculative decoding: k tokens per slot that the target then checks in one forward.

  none   no proposals (k = 0): one token per slot per target forward.
  draft  a small meshrl model (its own params and KV cache, the slots' rows) decodes k tokens after
         the slot's current one (Leviathan et al. 2023, "Fast Inference from Transformers via
         Speculative Decoding"). It draws token t with token t's key (rl/generation/sampling.py), so
         at temperature > 0 its proposals are coupled with the target's draws.
  ngram  prompt lookup, draft-free: the k tokens that followed the latest earlier occurrence of the
         row's last n tokens in its own sequence (Saxena 2023, "Prompt Lookup Decoding").

Axis legend: C slots, k proposals, H history columns, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation.sampling import RowSampling, Sampler

METHODS = ("none", "draft", "ngram")


@dataclasses.dataclass(frozen=True)
class ProposerSpec:
  """method (METHODS); k proposals per target forward; ngram_n tokens matched by "ngram"."""
  method: str = "none"
  k: int = 4
  ngram_n: int = 3

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"rl.speculative={self.method!r}; choose one of {', '.join(METHODS)}.")
    if self.method != "none" and self.k < 1:
      raise ValueError(f"rl.speculative_k={self.k} must be at least 1.")
    if self.ngram_n < 1:
      raise ValueError(f"rl.ngram_n={self.ngram_n} must be at least 1.")

  @property
  def window(self) -> int:
    """Proposals a decode step makes (0 without speculation)."""
    return 0 if self.method == "none" else self.k


def draft_propose(draft, weights, cache: kvc.KVCache, current: jax.Array, position: jax.Array,
                  sampler: Sampler, keys: jax.Array, k: int, rows: RowSampling | None = None):
  """k+1 single-token draft steps reading current, d_0, .., d_{k-1}, so the draft's cache holds the
  same columns as the target's after its verification forward.

  current [C] the slot's token about to be fed; position [C] its position; keys [C, k] the token keys
  of d_0..d_{k-1}. Returns (proposals [C, k] int32, the draft's cache)."""
  def step(carry, i):
    c, token = carry
    out = draft(token[:, None], positions=(position + i)[:, None], segment_ids=jnp.ones_like(token)[:, None],
                cache=c, layer_weights=weights)
    key = jax.lax.dynamic_index_in_dim(keys, jnp.minimum(i, k - 1), axis=1, keepdims=False)
    drawn = sampler.draw(out.logits[:, 0], key, rows)
    return (out.cache, drawn), drawn
  (cache, _), proposals = jax.lax.scan(step, (cache, current), jnp.arange(k))
  (cache, _), _ = step((cache, proposals[-1]), jnp.asarray(k))  # feeds d_{k-1}; its draw is unused
  return proposals.T, cache


def ngram_propose(history: jax.Array, length: jax.Array, n: int, k: int) -> jax.Array:
  """Prompt lookup: for each row the k tokens that followed the latest earlier occurrence of its last n
  tokens. history [C, H] int32 (negative where there is no token: prompt padding), length [C] its used
  length -> proposals [C, k] int32 (0 where nothing matched or the continuation runs out)."""
  width = history.shape[1]
  suffix_at = jnp.clip(length[:, None] - n + jnp.arange(n), 0, width - 1)  # [C, n]
  suffix = jnp.take_along_axis(history, suffix_at, axis=1)  # [C, n]
  starts = jnp.arange(width - n + 1)  # [W]
  windows = history[:, starts[:, None] + jnp.arange(n)]  # [C, W, n]
  match = jnp.all(windows == suffix[:, None, :], axis=-1)  # [C, W]
  match &= (starts[None, :] + n < length[:, None]) & jnp.all(suffix >= 0, axis=1, keepdims=True)
  latest = jnp.max(jnp.where(match, starts[None, :], -1), axis=1)  # [C]
  follow_at = latest[:, None] + n + jnp.arange(k)  # [C, k]
  follow = jnp.take_along_axis(history, jnp.clip(follow_at, 0, width - 1), axis=1)
  known = (latest[:, None] >= 0) & (follow_at < length[:, None]) & (follow >= 0)
  return jnp.where(known, follow, 0).astype(jnp.int32)
