"""What generation hands the RL step: `RolloutBatch`, one [B, S] row per sample, read off the pool.

Axis legend: B samples, S = Lp + N columns (prompt, then the sample's tokens), L MoE layers, K experts
per token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.rl.generation.state import Pool


@struct.dataclass
class RolloutBatch:
  """Prompts and completions laid out as one [B, S] sequence per sample (prompt left-padded)."""
  tokens: jax.Array  # [B, S] int32: prompt (left-padded with PAD) then the sample's tokens (PAD after)
  positions: jax.Array  # [B, S] int32: 0.. over real tokens (padding gets 0)
  segment_ids: jax.Array  # [B, S] int32: 1 on real tokens, 0 on padding
  prompt_mask: jax.Array  # [B, S] bool: real prompt tokens
  response_mask: jax.Array  # [B, S] bool: the policy's own tokens (a multi-turn episode's observations not)
  logprobs: jax.Array  # [B, S] float32: behaviour log-prob of each policy token (0 elsewhere)
  lengths: jax.Array  # [B] int32: tokens after the prompt (the response; an episode's turns and observations)
  truncated: jax.Array  # [B] bool: ended without a stop token (its length limit)
  policy_version: jax.Array  # [B, S] int32: version of the policy that generated each token (-1 elsewhere)
  routing: Any  # [L, B, S, K] int32 expert choices of every token fed (None for a dense model)


def rollout_batch(pool: Pool, prompt_len: int, pad_id: int) -> RolloutBatch:
  """The pool's samples as a RolloutBatch; prompt_len = Lp, the prompt columns."""
  real = pool.real()
  columns = jnp.arange(pool.width)[None, :]
  return RolloutBatch(
      tokens=jnp.where(real, pool.tokens, pad_id), positions=pool.positions(),
      segment_ids=real.astype(jnp.int32), prompt_mask=real & (columns < prompt_len),
      response_mask=pool.policy & real, logprobs=jnp.where(pool.policy & real, pool.logprobs, 0.0),
      lengths=pool.count - prompt_len, truncated=~pool.stopped,
      policy_version=jnp.where(pool.policy & real, pool.versions, -1), routing=pool.routing)
