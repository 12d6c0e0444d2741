"""A multi-turn rollout's episodes on the devices (rl/multiturn.py), so that no host holds the batch's
tokens: each turn's tokens and each extension's observation are appended at the row's fill, then
`assemble`d with the prompts into the RolloutBatch fields.

Axis legend: P prompts, G group size, B = P * G episodes, Lp prompt length, N episode tokens after the
prompt, S = Lp + N, W tokens appended in one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.rl.rollout import prompt_layout


@struct.dataclass
class Episodes:
  """Every row's episode after its prompt, written on the devices turn by turn (so no host holds the
  batch's tokens): tokens [B, N] int32 (pad_id past the fill), logprobs [B, N] float32 (the behaviour
  log-probs of policy tokens, else 0), policy [B, N] bool (the policy's own tokens), fill [B] int32
  (tokens written). Split by rows like the batch (MultiTurnPrograms: the `batch` rule)."""
  tokens: jax.Array
  logprobs: jax.Array
  policy: jax.Array
  fill: jax.Array


def empty_episodes(batch: int, length: int, pad_id: int) -> Episodes:
  return Episodes(tokens=jnp.full((batch, length), pad_id, jnp.int32),
                  logprobs=jnp.zeros((batch, length), jnp.float32),
                  policy=jnp.zeros((batch, length), bool), fill=jnp.zeros((batch,), jnp.int32))


def append(episodes: Episodes, new, lengths, logprobs=None, *, policy: bool) -> Episodes:
  """Row b's first lengths[b] entries of new [B, W] (and of logprobs [B, W]; None: 0) written at its
  fill, which moves on by lengths[b]; entries that would pass N are dropped (the host's budgets keep
  an episode within N)."""
  width, length = new.shape[1], episodes.tokens.shape[1]
  step = jnp.arange(width)[None, :]
  columns = jnp.where(step < lengths[:, None], episodes.fill[:, None] + step, length)
  rows = jnp.arange(new.shape[0])[:, None]
  put = lambda buffer, value: buffer.at[rows, columns].set(value, mode="drop")  # noqa: E731
  return Episodes(tokens=put(episodes.tokens, new.astype(jnp.int32)),
                  logprobs=put(episodes.logprobs, 0.0 if logprobs is None else logprobs),
                  policy=put(episodes.policy, policy), fill=episodes.fill + lengths)


def assemble(prompts, prompt_mask, episodes: Episodes, version, group: int) -> dict:
  """The RolloutBatch fields (routing absent) of prompts [P, Lp] (left-padded, each shared by its G
  rows) followed by their rows' episodes: per-token fields [B, S] (S = Lp + N) and lengths [B]
  (episode tokens); `version` the policy version of the episode's policy tokens."""
  rep = lambda a: jnp.repeat(a, group, axis=0)  # noqa: E731
  positions, segments = prompt_layout(prompt_mask)
  batch, length = episodes.tokens.shape
  prompt_len = prompts.shape[1]
  real = jnp.arange(length)[None, :] < episodes.fill[:, None]
  episode_positions = rep(jnp.sum(prompt_mask, axis=1).astype(jnp.int32))[:, None] + jnp.arange(length)
  before = lambda value, dtype: jnp.full((batch, prompt_len), value, dtype)  # noqa: E731
  return {
      "tokens": jnp.concatenate([rep(prompts), episodes.tokens], axis=1),
      "positions": jnp.concatenate([rep(positions), jnp.where(real, episode_positions, 0)], axis=1),
      "segment_ids": jnp.concatenate([rep(segments), real.astype(jnp.int32)], axis=1),
      "prompt_mask": jnp.concatenate([rep(prompt_mask), jnp.zeros((batch, length), bool)], axis=1),
      "response_mask": jnp.concatenate([before(False, bool), episodes.policy], axis=1),
      "logprobs": jnp.concatenate([before(0.0, jnp.float32), episodes.logprobs], axis=1),
      "policy_version": jnp.concatenate([before(-1, jnp.int32),
                                         jnp.where(episodes.policy, version, -1).astype(jnp.int32)], axis=1),
      "lengths": episodes.fill,
  }
