"""The jitted parts of the serving engine: prefill one request into a decode slot, decode a chunk of
tokens for every slot, and move prefix-cache blocks in and out of a cache row.

Decode slots are the rows of one KV cache with a per-row write index (model/kv_cache.py
`with_row_index`), as in the continuous-batching rollout engine (rl/engine.py); but requests arrive
at any time, so the host admits them between jitted chunks instead of from a pool inside the loop.

  prefill_slot(model, cache, slots, scratch, tokens [1, Tb], start, length, slot, row)
      prefills `length` real tokens (right-padded to a bucket Tb) at cache column `start` of a one-row
      scratch cache (columns < start already hold a reused prefix), copies the row into slot `slot`
      of the engine's cache and arms the slot's sampling state.
  decode_chunk(model, cache, slots, steps) decodes up to `steps` tokens for every live slot; a slot
      stops at one of its stop ids or at its token limit.

Padding tokens of a prefill get segment 0, so no real token attends to them, and their columns are
overwritten by the tokens decoded after the prompt.

Axis legend: C decode slots, S cache length, Tb prefill bucket, V vocab, M stop ids per slot,
P prefix-cache block length, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.model import kv_cache as kvc
from meshrl.model.transformer import Transformer


@struct.dataclass
class Slots:
  """Per-slot decoding state."""
  logits: jax.Array  # [C, V] float32: next-token logits
  live: jax.Array  # [C] bool: decoding a request
  count: jax.Array  # [C] int32: tokens generated so far
  limit: jax.Array  # [C] int32: the request's max_tokens
  position: jax.Array  # [C] int32: position of the next token written to the cache
  keys: jax.Array  # [C, 2] uint32: raw PRNG key of the request (token t uses fold_in(key, t))
  temperature: jax.Array  # [C] float32 (0 = greedy)
  top_p: jax.Array  # [C] float32 in (0, 1]
  stops: jax.Array  # [C, M] int32: stop ids (-1 = none)


@struct.dataclass
class SlotRow:
  """What a new request sets in its slot (the one-row version of Slots' request fields)."""
  limit: jax.Array  # [] int32
  key: jax.Array  # [2] uint32
  temperature: jax.Array  # [] float32
  top_p: jax.Array  # [] float32
  stops: jax.Array  # [M] int32


def empty_slots(num: int, vocab: int, max_stops: int) -> Slots:
  return Slots(logits=jnp.zeros((num, vocab), jnp.float32), live=jnp.zeros((num,), bool),
               count=jnp.zeros((num,), jnp.int32), limit=jnp.zeros((num,), jnp.int32),
               position=jnp.zeros((num,), jnp.int32), keys=jnp.zeros((num, 2), jnp.uint32),
               temperature=jnp.zeros((num,), jnp.float32), top_p=jnp.ones((num,), jnp.float32),
               stops=jnp.full((num, max_stops), -1, jnp.int32))


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
  """Per-row temperature and nucleus sampling: logits [C, V], keys [C, 2], temperature/top_p [C] ->
  tokens [C] int32; rows at temperature 0 take the argmax (as rl/sampling.py's greedy Sampler)."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # [C, V] descending
  cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  # The smallest prefix whose mass reaches top_p (the first token always stays).
  keep = jnp.concatenate([jnp.ones_like(cumulative[:, :1], bool),
                          cumulative[:, :-1] < top_p[:, None]], axis=-1)
  threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  filtered = jnp.where(scaled < threshold, -jnp.inf, scaled)
  drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, filtered).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def prefill_slot(model: Transformer, cache: kvc.KVCache, slots: Slots, scratch: kvc.KVCache,
                 tokens: jax.Array, start: jax.Array, length: jax.Array, slot: jax.Array,
                 row: SlotRow) -> tuple[kvc.KVCache, Slots]:
  """Prefills tokens [1, Tb] (the first `length` real) at column `start` of `scratch` (one row, scalar
  index; columns < start hold a reused prefix) and puts the row into slot `slot` of `cache` [C rows,
  per-row index]. Returns (cache, slots) with the slot live."""
  bucket = tokens.shape[1]
  offsets = jnp.arange(bucket, dtype=jnp.int32)[None, :]  # [1, Tb]
  real = offsets < length
  out = model(tokens, positions=start + offsets, segment_ids=real.astype(jnp.int32),
              cache=scratch.replace(index=jnp.asarray(start, jnp.int32)))
  logits = jax.lax.dynamic_index_in_dim(out.logits[0], length - 1, axis=0, keepdims=False)  # [V]
  filled = out.cache.replace(index=jnp.asarray(start + length, jnp.int32))
  take = jnp.arange(slots.live.shape[0]) == slot  # [C]
  cache = kvc.copy_rows(cache, filled, jnp.zeros_like(take, jnp.int32), take)
  put = lambda a, v: a.at[slot].set(v)  # noqa: E731
  slots = Slots(logits=put(slots.logits, logits), live=put(slots.live, True), count=put(slots.count, 0),
                limit=put(slots.limit, row.limit), position=put(slots.position, start + length),
                keys=put(slots.keys, row.key), temperature=put(slots.temperature, row.temperature),
                top_p=put(slots.top_p, row.top_p), stops=put(slots.stops, row.stops))
  return cache, slots


def decode_chunk(model: Transformer, cache: kvc.KVCache, slots: Slots, steps: int
                 ) -> tuple[kvc.KVCache, Slots, jax.Array, jax.Array]:
  """Decodes up to `steps` tokens for every live slot (a `lax.while_loop` that ends early once no slot
  is live). Returns (cache, slots, tokens [C, steps] int32, valid [C, steps] bool: generated now)."""
  num = slots.live.shape[0]

  def keep_going(carry):
    step, _, s, _, _ = carry
    return (step < steps) & jnp.any(s.live)

  def decode_one(carry):
    step, cache, s, tokens, valid = carry
    keys = jax.vmap(jax.random.fold_in)(s.keys, s.count)
    token = sample(s.logits, keys, s.temperature, s.top_p)
    live = s.live
    tokens = jax.lax.dynamic_update_slice(tokens, jnp.where(live, token, -1)[:, None], (0, step))
    valid = jax.lax.dynamic_update_slice(valid, live[:, None], (0, step))
    count = s.count + live
    ended = jnp.any(token[:, None] == s.stops, axis=1) | (count >= s.limit)
    out = model(token[:, None], positions=s.position[:, None], segment_ids=jnp.ones((num, 1), jnp.int32),
                cache=cache)
    s = s.replace(logits=jnp.where(live[:, None], out.logits[:, 0], s.logits), live=live & ~ended,
                  count=count, position=s.position + live)
    return step + 1, out.cache, s, tokens, valid

  start = (jnp.zeros((), jnp.int32), cache, slots, jnp.full((num, steps), -1, jnp.int32),
           jnp.zeros((num, steps), bool))
  _, cache, slots, tokens, valid = jax.lax.while_loop(keep_going, decode_one, start)
  return cache, slots, tokens, valid


def free_slot(slots: Slots, slot: jax.Array) -> Slots:
  """The slot stops decoding (a cancelled request); its cache row is dead until the next prefill."""
  return slots.replace(live=slots.live.at[slot].set(False))


def read_block(cache: kvc.KVCache, slot: jax.Array, start: jax.Array, size: int) -> dict:
  """The KV entries of cache columns [start, start + size) of row `slot`: {stack: {entry: [L, P, ...]}}."""
  def take(a):  # [L, C, S, ...] -> [L, P, ...]
    a = jax.lax.dynamic_index_in_dim(a, slot, axis=1, keepdims=False)
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)
  return jax.tree.map(take, cache.layers)


def place_block(scratch: kvc.KVCache, block: dict, start: jax.Array) -> kvc.KVCache:
  """scratch (one row) with a saved block {stack: {entry: [L, P, ...]}} written at columns
  [start, start + P) as real tokens at positions start.. of segment 1."""
  size = jax.tree.leaves(block)[0].shape[1]

  def put(a, b):  # a [L, 1, S, ...], b [L, P, ...]
    return jax.lax.dynamic_update_slice_in_dim(a, b[:, None].astype(a.dtype), start, axis=2)
  layers = jax.tree.map(put, scratch.layers, block)
  positions = jax.lax.dynamic_update_slice_in_dim(
      scratch.positions, (start + jnp.arange(size, dtype=jnp.int32))[None], start, axis=1)
  segments = jax.lax.dynamic_update_slice_in_dim(
      scratch.segment_ids, jnp.ones((1, size), jnp.int32), start, axis=1)
  return scratch.replace(layers=layers, positions=positions, segment_ids=segments)
