"""Decode slots driven from the host between jitted calls: the episodic scheduler and the server.

When what a slot is fed next is not known when the loop starts (an environment's observation, a
request that arrives later), the host holds the device state (`Slots`, `Pool`) between jitted
programs that all call rl/generation/core.py:

  prefill    prompts [P, Lp] -> their cache rows, next-token logits and MoE routes (prefix sharing)
  admit      copy prompt rows into free slots for new samples (a group shares its prompt's prefill)
  start      a request's prompt extended into a free slot after a prefix already placed there (the
             server: no shared prompts; `place` puts saved prefix blocks into a slot's cache row);
             with only part of the prompt fed, the sample waits (paused) for `feed`
  feed       the next rl.prefill_chunk tokens of a started request's prompt (core.extend_chunk), one
             call between decode chunks; the sample decodes once its prompt is in
  decode     up to `steps` decode steps of every live slot (core.decode_step); ends early when no
             slot is live
  observe    observation tokens extended into paused slots, which resume (core.observe)
  resume     samples re-prefilled from their buffers into slots (core.resume)
  finish     end samples and free their slots
  read       the small per-slot and per-sample vectors the host schedules by

Every program takes the generation weights (params, extra, draft params) first, so new parameters
reuse the compiled programs; the caches stay on the devices in the form the decode steps read
(kv_cache.unstack'ed where the model decodes unrolled).

Axis legend: P prompts, B samples, C slots, R rows, T tokens, Lp prompt columns, S buffer columns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation import core
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.prefill import prefill_models
from meshrl.rl.generation.state import Counters, Pool, Slots
from meshrl.sharding import hosts


@dataclasses.dataclass(frozen=True)
class Graphs:
  """The model graphs the programs merge weights into: target and (speculative) draft."""
  target: Any
  rest: Any = None  # the target's non-parameter state is passed in `extra`
  draft: Any = None
  draft_rest: Any = None


class SlotEngine:
  """The jitted programs of host-driven decode slots (see the module docstring).

  graphs: the target's (and draft's) GraphDef; config: the decode step's numbers; slots C; cache_len:
  the caches' columns (buffer width + speculative window + extension slack)."""

  def __init__(self, graphs: Graphs, config: StepConfig, *, slots: int, cache_len: int,
               per_row_sampling: bool = False, stop_ids: int = 0, unrolled: bool | None = None,
               prefill_chunk: int = 0):
    self.graphs, self.config = graphs, config
    self.prefill_chunk = prefill_chunk
    self.num_slots, self.cache_len = slots, cache_len
    self.per_row_sampling, self.stop_ids, self.unrolled = per_row_sampling, stop_ids, unrolled
    self.decode = jax.jit(self._decode, donate_argnums=(1, 2))
    self.observe = jax.jit(self._observe, donate_argnums=(1, 2))
    self.admit = jax.jit(self._admit, donate_argnums=(1,))
    self.start = jax.jit(self._start, donate_argnums=(1, 2))
    self.feed = jax.jit(self._feed, donate_argnums=(1, 2))
    self.read_block = jax.jit(_read_block, static_argnums=(3,))
    self.place = jax.jit(_place_block, donate_argnums=(0,))
    self.resume = jax.jit(self._resume, donate_argnums=(1,))
    self.prefill = jax.jit(self._prefill)
    self.finish = jax.jit(_finish, donate_argnums=(0, 1))

  # --- building blocks -------------------------------------------------------------------------

  def models(self, weights) -> core.Models:
    params, extra, draft_params = weights
    target = nnx.merge(self.graphs.target, params, extra)
    draft = None if self.graphs.draft is None else nnx.merge(self.graphs.draft, draft_params, self.graphs.draft_rest)
    return core.bind(target, draft, unrolled=self.unrolled)

  @functools.partial(jax.jit, static_argnums=(0, 2, 3))
  def empty(self, weights, num_samples: int, vocab: int) -> Slots:
    """C empty slots over fresh caches, in the models' decode form."""
    return core.new_slots(self.models(weights), self.num_slots, self.cache_len, num_samples=num_samples,
                          vocab=vocab, window=self.config.window, per_row_sampling=self.per_row_sampling,
                          stop_ids=self.stop_ids)

  @functools.partial(jax.jit, static_argnums=(0, 2))
  def counters(self, weights, num_samples: int) -> Counters:
    """Zero running counters for a host loop of `decode` calls, laid out as `decode` returns them."""
    return core.laid_out_counters(self.models(weights), Counters.zeros(num_samples))

  def _prefill(self, weights, prompts, prompt_mask):
    """prompts [P, Lp] -> (cache rows, draft cache rows or None, logits [P, V], routing or None); the
    target and the draft prefilled in chunks of rl.prefill_chunk alike (prefill.prefill_models)."""
    models = self.models(weights)
    cache, draft_cache, logits, routing = prefill_models(models, prompts, prompt_mask, self.cache_len,
                                                             self.prefill_chunk)
    return core.as_rows(models, cache), core.as_rows(models, draft_cache), logits, routing

  def _admit(self, weights, slots: Slots, pool: Pool, prompts, rows, sid):
    """Samples sid [R] into slots rows [R] (C: none) from their prompts' rows of `prompts` (a
    `prefill` result); the samples' prompt columns get the prefill's routes."""
    del weights
    num = pool.num_samples
    take = jnp.zeros((slots.num_slots,), bool).at[rows].set(sid < num, mode="drop")
    new_sid = jnp.where(take, slots.sid.at[rows].set(sid, mode="drop"), slots.sid)
    slots = core.admit(slots, pool, new_sid, take, prompts[:3])
    routing = prompts[3]
    if pool.routing is not None and routing is not None:  # [L, R, Lp, K] routes of the samples' prompts
      routes = routing[:, pool.group_of[jnp.clip(sid, 0, num - 1)]]
      pool = pool.replace(routing=pool.routing.at[:, sid, :routing.shape[2]].set(routes, mode="drop"))
    return slots, pool

  def _decode(self, weights, slots: Slots, pool: Pool, version, counters=None, *, steps):
    """Up to `steps` decode steps (fewer when no slot is live; traced, so a budget's shorter last
    chunk runs the same program) -> (slots, pool, counters): the steps' counts added to `counters`
    (None: from zero)."""
    return core.decode_loop(self.models(weights), self.config, slots, pool, version, counters, steps=steps)

  def _observe(self, weights, slots, pool, rows, tokens, lengths):
    return core.observe(self.models(weights), slots, pool, rows, tokens, lengths)

  def _resume(self, weights, slots, pool, rows, sid):
    return core.resume(self.models(weights), slots, pool, rows, sid)

  def _start(self, weights, slots: Slots, pool: Pool, slot, row_tokens, length, prefix, rest, fed, request):
    """A request into slot `slot` (the server; sample `slot` of a pool of C): its buffer row becomes
    row_tokens [S] (the prompt, its first `length` real), columns [0, prefix) of the slot's cache
    already hold the prompt's first `prefix` tokens (placed from the prefix cache), and rest [1, T]
    (the prompt's tokens from `prefix` on, right-padded) is fed now up to prompt token `fed` (length:
    all of it; less: the sample waits, paused, for `feed` to bring in the rest). request:
    (max_tokens [], seed [] (the sample's key is jax.random.key(seed), made here: no eager dispatch per
    request), temperature [], top_p [], stop ids [M])."""
    models = self.models(weights)
    max_tokens, seed, temperature, top_p, stops = request
    key = jax.random.key_data(jax.random.key(seed))
    put = lambda a, v: a.at[slot].set(v)  # noqa: E731
    pool = pool.replace(
        tokens=put(pool.tokens, row_tokens), policy=put(pool.policy, False), logprobs=put(pool.logprobs, 0.0),
        versions=put(pool.versions, -1), pad=put(pool.pad, 0), count=put(pool.count, length),
        generated=put(pool.generated, 0), turn_start=put(pool.turn_start, 0), max_lengths=put(pool.max_lengths, max_tokens),
        keys=put(pool.keys, key), done=put(pool.done, False), stopped=put(pool.stopped, False),
        paused=put(pool.paused, fed < length))
    cache = slots.cache
    slots = slots.replace(sid=put(slots.sid, slot), position=put(slots.position, prefix),
                          cache=cache.replace(index=put(cache.index, prefix)),
                          draft_cache=None if slots.draft_cache is None else slots.draft_cache.replace(
                              index=put(slots.draft_cache.index, prefix)))
    if slots.sampling is not None:
      slots = slots.replace(sampling=slots.sampling.replace(temperature=put(slots.sampling.temperature, temperature),
                                                            top_p=put(slots.sampling.top_p, top_p)))
    if slots.stops is not None:
      slots = slots.replace(stops=put(slots.stops, stops))
    rows = jnp.reshape(slot, (1,)).astype(jnp.int32)
    slots, _ = core.extend(models, slots, rows, rest, jnp.reshape(fed - prefix, (1,)).astype(jnp.int32))
    return slots, pool

  def _feed(self, weights, slots: Slots, pool: Pool, slot, fed):
    """The next `prefill_chunk` tokens of the prompt in slot `slot`'s buffer row (a `start`ed request
    whose cache row holds its first `fed` tokens, fed > 0; prompt longer than a chunk), fed by
    core.extend_chunk (the last chunk ends at the prompt's end, re-feeding the columns before it);
    the sample is unpaused (decodes from the next decode step on) once its prompt is in. The host
    knows the tokens in after the call: min(fed + prefill_chunk, prompt length)."""
    length = pool.count[slot]  # the prompt (nothing generated yet)
    rows = jnp.reshape(slot, (1,)).astype(jnp.int32)
    slots, after, _, _ = core.extend_chunk(self.models(weights), slots, rows, pool.tokens[rows], length[None],
                                           jnp.reshape(fed, (1,)).astype(jnp.int32), self.prefill_chunk)
    return slots, pool.replace(paused=pool.paused.at[slot].set(after[0] < length))


def _finish(slots: Slots, pool: Pool, sid):
  """Samples sid [R] (B: none) end (done, unpaused) and their slots are emptied."""
  num = pool.num_samples
  pool = pool.replace(done=pool.done.at[sid].set(True, mode="drop"),
                      paused=pool.paused.at[sid].set(False, mode="drop"))
  freed = jnp.isin(slots.sid, sid) & (slots.sid < num)
  return slots.replace(sid=jnp.where(freed, num, slots.sid)), pool


def _read_block(cache: kvc.KVCache, slot: jax.Array, start: jax.Array, size: int) -> dict:
  """The KV entries of cache columns [start, start + size) of row `slot` (a stacked cache):
  {stack: {entry: [L, P, ...]}}, a prefix-cache block."""
  def take(a):  # [L, C, S, ...] -> [L, P, ...]
    a = jax.lax.dynamic_index_in_dim(a, slot, axis=1, keepdims=False)
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)
  return jax.tree.map(take, cache.layers)


def _place_block(cache: kvc.KVCache, slot: jax.Array, block: dict, start: jax.Array) -> kvc.KVCache:
  """`cache` (stacked) with a saved block {stack: {entry: [L, P, ...]}} written into row `slot` at
  columns [start, start + P) as real tokens at positions start.. of segment 1."""
  size = jax.tree.leaves(block)[0].shape[1]

  def put(a, b):  # a [L, C, S, ...], b [L, P, ...]
    row = jax.lax.dynamic_update_slice_in_dim(a[:, slot], b.astype(a.dtype), start, axis=1)
    return a.at[:, slot].set(row)
  positions = jax.lax.dynamic_update_slice_in_dim(cache.positions[slot], start + jnp.arange(size, dtype=jnp.int32),
                                                  start, axis=0)
  segments = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids[slot], jnp.ones((size,), jnp.int32), start, axis=0)
  return cache.replace(layers=jax.tree.map(put, cache.layers, block), positions=cache.positions.at[slot].set(positions),
                       segment_ids=cache.segment_ids.at[slot].set(segments))


def buckets(limit: int, smallest: int = 8) -> tuple[int, ...]:
  """Lengths programs are compiled for: powers of two from `smallest` below `limit`, and `limit`."""
  sizes, size = [], smallest
  while size < limit:
    sizes.append(size)
    size *= 2
  return tuple(sizes) + (limit,)


def read(slots: Slots, pool: Pool, **extra: jax.Array) -> dict[str, np.ndarray]:
  """The host's view of the state: per slot sid [C]; per sample count, generated, turn_start, done,
  paused, stopped [B] (numpy); and the `extra` arrays by their names, in the same transfer."""
  fields = {"sid": slots.sid, "count": pool.count, "generated": pool.generated,
            "turn_start": pool.turn_start, "done": pool.done, "paused": pool.paused, "stopped": pool.stopped,
            **extra}
  if all(value.is_fully_addressable for value in fields.values()):
    return {name: np.asarray(value) for name, value in jax.device_get(fields).items()}
  return {name: hosts.to_host(value) for name, value in fields.items()}  # several hosts: each field whole


@functools.partial(jax.jit, static_argnums=(3,))
def read_tokens(tokens: jax.Array, sid: jax.Array, end: jax.Array, width: int) -> jax.Array:
  """tokens [B, S] (or any [B, S] field): the `width` columns before end [R] of rows sid [R] (-1 before
  column 0) -> [R, W]."""
  columns = end[:, None] - width + jnp.arange(width)[None, :]
  picked = jnp.take_along_axis(tokens[sid], jnp.maximum(columns, 0), axis=1)
  return jnp.where(columns >= 0, picked, jnp.asarray(-1).astype(tokens.dtype))
