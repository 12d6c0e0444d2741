"""What the decode core works on: the samples' buffers (`Pool`) and the decode slots (`Slots`).

A sample's buffer row holds its whole sequence in the RolloutBatch layout, prompt then episode:
columns [0, pad) are the prompt's left padding, [pad, Lp) its real tokens, then every token the
sample adds, generated ones (`policy` True, with their behaviour log-prob, policy version and MoE
routes) and extensions (a multi-turn observation: `policy` False, routes recorded too), up to
`count`. The position of column c is c - pad, so a cache column and a buffer column hold the same
token. A server's request has pad 0 and its prompt at columns [0, len).

A slot is one row of the KV cache, decoding the sample `sid` (B = empty). Its next-token logits and
the position of its next token travel with it; the draft model's cache (speculative decoding) has
the same rows. Everything a sample needs to resume elsewhere is in the pool: a slot can be freed and
refilled (continuous batching), paused while the host steps an environment (episodic), or dropped
and its sample re-prefilled later under new parameters (partial rollouts).

Axis legend: P prompts, G group size, B samples, C slots, Lp prompt columns, S buffer columns,
L MoE layers, K experts per token, V vocab, W stop-sequence window.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation.sampling import RowSampling


@struct.dataclass
class Pool:
  """The samples' buffers and bookkeeping (see the module docstring); every array [B, ...]."""
  tokens: jax.Array  # [B, S] int32: prompt (left-padded with pad_id), then the sample's tokens
  logprobs: jax.Array  # [B, S] float32: behaviour log-prob of policy tokens (0 elsewhere)
  versions: jax.Array  # [B, S] int32: policy version of policy tokens (-1 elsewhere)
  policy: jax.Array  # [B, S] bool: the policy generated this token
  pad: jax.Array  # [B] int32: left padding of the prompt (position of column c is c - pad)
  count: jax.Array  # [B] int32: columns filled (the next token's column)
  generated: jax.Array  # [B] int32: policy tokens so far (token t draws with key (sample, t))
  turn_start: jax.Array  # [B] int32: `generated` when the current turn began (episodes)
  max_lengths: jax.Array  # [B] int32: policy tokens the sample may generate
  keys: jax.Array  # [B, ...] uint32: raw key data of each sample's PRNG key
  group_of: jax.Array  # [B] int32: the prompt of each sample (its group)
  priority: jax.Array  # [B] int32: admission order of waiting samples (lowest first)
  done: jax.Array  # [B] bool: ended
  stopped: jax.Array  # [B] bool: its last turn ended on a stop token or stop sequence
  paused: jax.Array  # [B] bool: a turn ended and the host has not answered yet (episodes)
  routing: Any  # [L, B, S, K] int32 expert choices of every fed token, or None (dense model)

  @property
  def num_samples(self) -> int:
    return self.tokens.shape[0]

  @property
  def width(self) -> int:
    """S, the buffer's columns."""
    return self.tokens.shape[1]

  def positions(self) -> jax.Array:
    """[B, S] int32: each column's position, 0 on padding and past the fill."""
    columns = jnp.arange(self.width)[None, :]
    return jnp.where(self.real(), columns - self.pad[:, None], 0).astype(jnp.int32)

  def real(self) -> jax.Array:
    """[B, S] bool: columns holding a token (past the padding, before the fill)."""
    columns = jnp.arange(self.width)[None, :]
    return (columns >= self.pad[:, None]) & (columns < self.count[:, None])


@functools.partial(jax.jit, static_argnames=("group_size", "width", "pad_id", "max_new_tokens",
                                               "routing_shape"))
def new_pool(prompts: jax.Array, prompt_mask: jax.Array, keys: jax.Array, *, group_size: int, width: int,
             pad_id: int, max_lengths=None, max_new_tokens: int | None = None,
             routing_shape: tuple[int, int] | None = None) -> Pool:
  """A pool of fresh samples, G per prompt (sample b is prompt b // G, in its group's order).

  prompts [P, Lp] left-padded with prompt_mask [P, Lp]; keys [B] typed PRNG keys; width S >= Lp;
  max_lengths [B] (default max_new_tokens, else S - Lp); routing_shape (L, K) of a MoE model. One
  program (eagerly its dozen operations cost the episodic rollout, which waits for them, a few ms a
  step)."""
  num_prompts, prompt_len = prompts.shape
  num = num_prompts * group_size
  group_of = jnp.arange(num, dtype=jnp.int32) // group_size
  tokens = jnp.full((num, width), pad_id, jnp.int32).at[:, :prompt_len].set(
      jnp.where(prompt_mask, prompts, pad_id).astype(jnp.int32)[group_of])
  budget = width - prompt_len if max_new_tokens is None else max_new_tokens
  limits = jnp.full((num,), budget, jnp.int32) if max_lengths is None else jnp.minimum(
      jnp.asarray(max_lengths, jnp.int32), budget)
  pad = (prompt_len - jnp.sum(prompt_mask, axis=1).astype(jnp.int32))[group_of]
  routing = None
  if routing_shape is not None:
    routing = jnp.zeros((routing_shape[0], num, width, routing_shape[1]), jnp.int32)
  zeros = lambda: jnp.zeros((num,), jnp.int32)  # noqa: E731  (distinct buffers: pools are donated)
  return Pool(tokens=tokens, logprobs=jnp.zeros((num, width), jnp.float32),
              versions=jnp.full((num, width), -1, jnp.int32), policy=jnp.zeros((num, width), bool),
              pad=pad, count=jnp.full((num,), prompt_len, jnp.int32), generated=zeros(), turn_start=zeros(),
              max_lengths=limits, keys=jax.random.key_data(keys), group_of=group_of,
              priority=jnp.arange(num, dtype=jnp.int32), done=limits < 1, stopped=jnp.zeros((num,), bool),
              paused=jnp.zeros((num,), bool), routing=routing)


@struct.dataclass
class Slots:
  """C decode slots: rows of the KV cache (and of the draft's), each decoding sample `sid`."""
  sid: jax.Array  # [C] int32: the sample in each slot (B = empty)
  cache: kvc.KVCache  # C rows; per-row write index [C] (a scalar one when every row moves in lockstep)
  draft_cache: Any  # the draft model's cache, the same rows and index (None without a draft)
  logits: jax.Array  # [C, V] float32: next-token logits of the slot's sample
  position: jax.Array  # [C] int32: position of the slot's next token
  window: Any  # [C, W] int32: the turn's last W tokens for stop sequences (-1 before them), or None
  sampling: Any  # RowSampling of [C] per-request parameters (a server), or None
  stops: Any = None  # [C, M] int32 per-request extra stop ids (-1: none), or None

  @property
  def num_slots(self) -> int:
    return self.sid.shape[0]


def empty_slots(cache: kvc.KVCache, draft_cache, *, num_samples: int, vocab: int, window: int = 0,
                per_row_sampling: bool = False, stop_ids: int = 0) -> Slots:
  """C empty slots over `cache` (C rows, made per-row indexed); stop_ids: room for that many extra
  stop ids per slot (a server's requests)."""
  num = cache.positions.shape[0]
  return Slots(sid=jnp.full((num,), num_samples, jnp.int32), cache=kvc.with_row_index(cache),
               draft_cache=None if draft_cache is None else kvc.with_row_index(draft_cache),
               logits=jnp.zeros((num, vocab), jnp.float32), position=jnp.zeros((num,), jnp.int32),
               window=jnp.full((num, window), -1, jnp.int32) if window else None,
               sampling=RowSampling(temperature=jnp.zeros((num,), jnp.float32),
                                    top_p=jnp.ones((num,), jnp.float32)) if per_row_sampling else None,
               stops=jnp.full((num, stop_ids), -1, jnp.int32) if stop_ids else None)


@struct.dataclass
class Counters:
  """What a decode call did (speculative decoding's acceptance among it)."""
  steps: jax.Array  # [] int32: decode steps (target forwards of the slots)
  slot_steps: jax.Array  # [] int32: live slots summed over steps
  committed: jax.Array  # [] int32: tokens committed
  proposed: jax.Array  # [] int32: proposals made to live slots
  accepted: jax.Array  # [] int32: proposals accepted
  row_accepted: jax.Array  # [B] int32: proposals accepted per sample

  @classmethod
  def zeros(cls, num_samples: int) -> "Counters":
    zero = jnp.zeros((), jnp.int32)
    return cls(steps=zero, slot_steps=zero, committed=zero, proposed=zero, accepted=zero,
               row_accepted=jnp.zeros((num_samples,), jnp.int32))

  def metrics(self) -> dict[str, jax.Array]:
    """acceptance_rate (accepted / proposed) and tokens_per_forward (committed per live slot-step)."""
    return {"acceptance_rate": self.accepted / jnp.maximum(self.proposed, 1),
            "tokens_per_forward": self.committed / jnp.maximum(self.slot_steps, 1),
            "target_forwards": self.steps}
