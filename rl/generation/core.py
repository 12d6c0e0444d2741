"""The decode core: one decode step, "extend rows at their own index", and rollback (prompts are
prefilled into fresh caches by rl/generation/prefill.py, through `extend_chunk` when chunked).

Every token meshrl generates goes through `decode_step`; every token fed without being generated (a
prompt refilled into a slot, a multi-turn observation, a sample resumed under new parameters) goes
through `extend` or `resume`. Schedulers (rl/generation/loop.py inside one jitted loop,
rl/generation/host.py between jitted chunks) only decide which slot holds which sample and when.

The invariant between steps, per live slot: every token of its sample up to `count` is in the slot's
cache rows, and `logits` are the distribution of the next one. A decode step then:
  1. draws t0 from the logits with the key (sample, t) (t: the sample's policy tokens so far);
  2. asks the proposer for d_0..d_{k-1} after t0 (k = 0: none);
  3. feeds [t0, d_0..d_{k-1}] in ONE forward at the slot's own cache index, getting the distributions
     after each;
  4. accepts the leading run of d_i that equal the target's own draw there (with d_i's key): those
     are exactly the tokens plain decoding would have drawn (rl/generation/sampling.py), so the
     output is the plain sampler's whatever the proposer; commits t0 and the accepted run, cut at a
     stop token, a stop sequence or the sample's limit; their behaviour log-probs, policy version and
     MoE routes go to the sample's buffer;
  5. keeps the logits after the last committed token and rolls the caches back past it (the rejected
     proposals' columns become empty again; without proposals an idle row has written an empty
     column in step 3, so there is nothing to roll back).
With k = 0 this is plain decoding. Rows move by different counts, so the caches have per-row write
indices; a static batch without proposals keeps one shared index (`lockstep`: every row writes at
the same column, a finished row's writes land in its own dead row): one dynamic-update-slice per
cache entry instead of one row-indexed write per row (both update the cache in place).

Axis legend: B samples, C slots, R rows extended, T tokens extended, k proposals, K1 = k + 1, S
cache/buffer columns, V vocab, L MoE layers, K experts per token, M stop sequences, W their length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation.proposers import ProposerSpec, draft_propose, ngram_propose
from meshrl.rl.generation.sampling import Sampler, token_keys
from meshrl.rl.generation.state import Counters, Pool, Slots, empty_slots


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The static numbers of a decode step."""
  sampler: Sampler
  stop_tokens: tuple[int, ...]
  pad_id: int
  proposer: ProposerSpec = ProposerSpec()
  stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that end a turn (`</cmd>`)
  pause_on_stop: bool = False  # a turn's end pauses the sample for the host (episodes) instead of ending it
  turn_tokens: int = 0  # policy tokens per turn (0: no turn limit)

  @property
  def window(self) -> int:
    """W, the longest stop sequence (0: none)."""
    return max((len(s) for s in self.stop_sequences), default=0)


class Models(NamedTuple):
  """The target (and draft) model a decode loop calls, with the per-layer weights taken once outside
  the loop when the model decodes unrolled (Transformer.decode_loop_inputs)."""
  target: Any
  weights: Any = None
  draft: Any = None
  draft_weights: Any = None


def bind(target, draft=None, *, unrolled: bool | None = None) -> Models:
  """Models for a decode loop: per-layer weights when the target decodes unrolled (its
  ModelConfig.unrolled_decode, or `unrolled`); the caches must then be kvc.unstack'ed too."""
  unrolled = target.config.unrolled_decode if unrolled is None else unrolled
  if not unrolled:
    return Models(target, None, draft, None)
  return Models(target, target.layer_weights(), draft, None if draft is None else draft.layer_weights())


def per_layer(models: Models, cache):
  """`cache` in the form `models` decodes with (kv_cache.unstack when unrolled), None stays None."""
  return cache if cache is None or models.weights is None else kvc.unstack(cache)


def as_rows(models: Models, cache):
  """A cache of whole rows (prompts prefilled by prefill.prefill_models, fresh rows) as slot rows: per-row
  write index, in the form `models` decodes with; None stays None."""
  return None if cache is None else per_layer(models, kvc.with_row_index(cache))


def new_slots(models: Models, num_slots: int, cache_len: int, **options) -> Slots:
  """`num_slots` empty slots over fresh caches of `cache_len` columns (the draft's too), in the form
  `models` decodes with; options: state.empty_slots's (num_samples, vocab, ...)."""
  draft = None if models.draft is None else per_layer(models, models.draft.init_cache(num_slots, cache_len))
  return laid_out_slots(models, empty_slots(per_layer(models, models.target.init_cache(num_slots, cache_len)),
                                            draft, **options))


def laid_out_slots(models: Models, slots: Slots) -> Slots:
  """`slots` constrained to the layout the decode step leaves them in: the caches by
  kv_cache.CACHE_AXES, every per-slot array split over the batch axes (host.read gathers `sid` on
  several hosts). Fresh slots left to the partitioner came out replicated, so a host loop's first
  decode call compiled (and ran) for replicated caches and its next calls compiled again for split
  ones."""
  lay = models.target.config.kernel.constrain
  rows = lambda a: None if a is None else lay(a, ("batch",) + (None,) * (a.ndim - 1))  # noqa: E731
  draft = None if slots.draft_cache is None else laid_out_cache(models.draft.config, slots.draft_cache)
  return slots.replace(sid=rows(slots.sid), cache=laid_out_cache(models.target.config, slots.cache), draft_cache=draft,
                       logits=lay(slots.logits, ("batch", "vocab")), position=rows(slots.position),
                       window=rows(slots.window), sampling=jax.tree.map(rows, slots.sampling),
                       stops=rows(slots.stops))


def admit(slots: Slots, pool: Pool, sid: jax.Array, take: jax.Array, prompt_rows) -> Slots:
  """Slots where take [C] start their samples sid [C] afresh from the samples' prompts' rows
  prompt_rows = (cache, draft cache or None, logits [P, V]) (per-row index, `as_rows`): the cache
  row copied whole, the prompt's next-token logits, the sample's position, an empty stop window.
  The other slots keep everything but their sid (sid [C] is every slot's sample after)."""
  cache, draft_cache, logits = prompt_rows
  rows = jnp.clip(sid, 0, pool.num_samples - 1)
  group = pool.group_of[rows]
  copy = lambda dst, src: None if dst is None else kvc.copy_rows(dst, src, group, take)  # noqa: E731
  return slots.replace(sid=sid, cache=copy(slots.cache, cache), draft_cache=copy(slots.draft_cache, draft_cache),
                       logits=jnp.where(take[:, None], logits[group], slots.logits),
                       position=jnp.where(take, pool.count[rows] - pool.pad[rows], slots.position),
                       window=None if slots.window is None else jnp.where(take[:, None], -1, slots.window))


def decode_loop(models: Models, config: StepConfig, slots: Slots, pool: Pool, version: jax.Array,
                counters: Counters | None = None, *, steps: int | jax.Array = 0,
                lockstep: bool = False) -> tuple[Slots, Pool, Counters]:
  """`decode_step` while a slot is live, at most `steps` times (0: no limit; a traced [] int32 may
  be passed, so a host loop's calls of different lengths share one program), in one
  lax.while_loop -> (slots, pool, counters): the steps' counts added to `counters` (None: zeros), so
  a host loop of calls keeps its running totals on the devices. Pure; jit it."""
  def keep_going(carry):
    step, s, p, _ = carry
    going = jnp.any(live_slots(s, p))
    return going if isinstance(steps, int) and not steps else going & ((steps == 0) | (step < steps))

  def body(carry):
    step, s, p, c = carry
    return (step + 1, *decode_step(models, config, s, p, version, c, lockstep=lockstep))
  carry = (jnp.zeros((), jnp.int32), slots, pool, Counters.zeros(pool.num_samples) if counters is None else counters)
  slots, pool, counters = jax.lax.while_loop(keep_going, body, carry)[1:]
  return slots, pool, laid_out_counters(models, counters)


def laid_out_counters(models: Models, counters: Counters) -> Counters:
  """`counters` replicated on the models' mesh, as `decode_loop` returns them, so the running totals
  a host loop passes back meet the layout its decode call was compiled for."""
  lay = models.target.config.kernel.constrain
  return jax.tree.map(lambda a: lay(a, (None,) * a.ndim), counters)


# --- the decode step -------------------------------------------------------------------------------


def _stop_sequence_hits(window: jax.Array, fed: jax.Array, sequences) -> jax.Array:
  """[C, K1] bool: fed[:, j] completes one of the stop sequences, reading the turn's earlier tokens
  in window [C, W] (-1 before the turn's first)."""
  width = window.shape[1]
  ids = np.full((len(sequences), width), -1, np.int32)
  for i, s in enumerate(sequences):
    ids[i, width - len(s):] = s
  history = jnp.concatenate([window, fed], axis=1)  # [C, W + K1]
  ends = jnp.arange(fed.shape[1])[:, None] + 1 + jnp.arange(width)[None, :]  # [K1, W]
  last = history[:, ends]  # [C, K1, W]: the W tokens ending at fed[:, j]
  table, used = jnp.asarray(ids), jnp.asarray(ids >= 0)
  match = jnp.all((last[:, :, None, :] == table) | ~used, axis=-1)  # [C, K1, M]
  return jnp.any(match, axis=-1)


def _shift_window(window: jax.Array, fed: jax.Array, count: jax.Array) -> jax.Array:
  """The last W tokens after committing fed[:, :count] to the turn: window [C, W], fed [C, K1]."""
  width = window.shape[1]
  history = jnp.concatenate([window, fed], axis=1)
  return jnp.take_along_axis(history, count[:, None] + jnp.arange(width)[None, :], axis=1)


def _write(buffer: jax.Array, sid: jax.Array, columns: jax.Array, values) -> jax.Array:
  """buffer [B, S] with values [C, K1] written at rows sid [C], columns [C, K1] (S: dropped)."""
  return buffer.at[jnp.broadcast_to(sid[:, None], columns.shape), columns].set(values, mode="drop")


def write_routes(routing, sid: jax.Array, columns: jax.Array, routes):
  """routing [L, B, S, K] with routes [L, R, T, K] written at rows sid [R], columns [R, T] (S:
  dropped), as `_write`; routing or routes None (a dense model): routing as it is."""
  if routing is None or routes is None:
    return routing
  return routing.at[:, jnp.broadcast_to(sid[:, None], columns.shape), columns].set(routes, mode="drop")


def live_slots(slots: Slots, pool: Pool) -> jax.Array:
  """[C] bool: the slot holds a sample that is neither done nor paused."""
  num = pool.num_samples
  rows = jnp.clip(slots.sid, 0, num - 1)
  return (slots.sid < num) & ~pool.done[rows] & ~pool.paused[rows]


def decode_step(models: Models, config: StepConfig, slots: Slots, pool: Pool, version: jax.Array,
                counters: Counters, *, lockstep: bool = False) -> tuple[Slots, Pool, Counters]:
  """One decode step of every live slot (see the module docstring). Pure; jit it (inside a loop)."""
  sampler, k = config.sampler, config.proposer.window
  num, width = pool.num_samples, pool.width
  rows = jnp.clip(slots.sid, 0, num - 1)
  live = live_slots(slots, pool)
  generated, fill = pool.generated[rows], pool.count[rows]
  keys = jax.random.wrap_key_data(pool.keys[rows])  # [C]
  offsets = jnp.arange(k + 1)[None, :]  # [1, K1]
  window_keys = token_keys(keys, generated[:, None] + offsets)  # [C, K1]: keys of tokens t .. t+k

  # 1-2. Draw the next token; propose k more after it.
  first = sampler.draw(slots.logits, window_keys[:, 0], slots.sampling)  # [C]
  draft_cache = slots.draft_cache
  if config.proposer.method == "draft":
    proposals, draft_cache = draft_propose(models.draft, models.draft_weights, draft_cache, first,
                                           slots.position, sampler, window_keys[:, 1:], k, slots.sampling)
  elif config.proposer.method == "ngram":
    history = jnp.where(jnp.arange(width)[None, :] >= pool.pad[rows][:, None], pool.tokens[rows], -1)
    history = history.at[jnp.arange(rows.shape[0]), jnp.minimum(fill, width - 1)].set(first)
    proposals = ngram_propose(history, fill + 1, config.proposer.ngram_n, k)
  fed = first[:, None] if k == 0 else jnp.concatenate([first[:, None], proposals], axis=1)  # [C, K1]

  # 3. One forward of the window at each slot's own index. Without proposals a slot commits its one
  # token or nothing, so a row with no room (idle) writes an empty column (the position and segment
  # of an empty one, masked for every query) and its index stays: nothing to roll back after.
  room = jnp.minimum(pool.max_lengths[rows] - generated, width - fill)  # [C] tokens the sample may add
  if config.turn_tokens:
    room = jnp.minimum(room, config.turn_tokens - (generated - pool.turn_start[rows]))
  start = slots.cache.index
  positions, segments = slots.position[:, None] + offsets, jnp.ones_like(fed)
  empty_idle = k == 0 and not lockstep
  if empty_idle:
    writes = (live & (room > 0))[:, None]
    positions = jnp.where(writes, positions, kvc.EMPTY_POSITION)
    segments = jnp.where(writes, segments, kvc.EMPTY_SEGMENT)
  out = models.target(fed, positions=positions, segment_ids=segments, cache=slots.cache,
                      layer_weights=models.weights)

  # 4. Accept proposals equal to the target's draws; commit up to a stop or the sample's limit.
  if k:
    target_draws = sampler.draw(out.logits[:, :k], window_keys[:, 1:], slots.sampling)  # [C, k]
    accepted = jnp.sum(jnp.cumprod(proposals == target_draws, axis=1), axis=1).astype(jnp.int32)
  else:
    accepted = jnp.zeros_like(generated)
  in_run = (offsets <= accepted[:, None]) & (offsets < room[:, None])
  is_stop = jnp.isin(fed, jnp.asarray(config.stop_tokens, jnp.int32))
  if config.stop_sequences:
    is_stop |= _stop_sequence_hits(slots.window, fed, config.stop_sequences)
  if slots.stops is not None:  # a request's own stop ids
    is_stop |= jnp.any(fed[:, :, None] == slots.stops[:, None, :], axis=-1)
  is_stop &= in_run
  hit = jnp.any(is_stop, axis=1)
  count = jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, jnp.minimum(accepted + 1, room))
  count = jnp.where(live, count, 0).astype(jnp.int32)  # [C] tokens committed
  ended = live & (hit | (count >= room))

  dists = slots.logits[:, None] if k == 0 else jnp.concatenate([slots.logits[:, None], out.logits[:, :k]], 1)
  logprobs = sampler.log_probs(dists, fed, slots.sampling)  # [C, K1]: token j from the logits before it
  committed = offsets < count[:, None]
  columns = jnp.where(committed, fill[:, None] + offsets, width)  # [C, K1] (width: dropped)
  sid = jnp.where(live, slots.sid, num)
  end_field = "paused" if config.pause_on_stop else "done"
  pool = pool.replace(
      tokens=_write(pool.tokens, sid, columns, fed), logprobs=_write(pool.logprobs, sid, columns, logprobs),
      versions=_write(pool.versions, sid, columns, jnp.broadcast_to(version, fed.shape)),
      policy=_write(pool.policy, sid, columns, True),
      routing=write_routes(pool.routing, sid, columns, out.aux.get("routing")),  # [L, C, K1, K] routes
      count=pool.count.at[sid].add(count, mode="drop"), generated=pool.generated.at[sid].add(count, mode="drop"),
      stopped=pool.stopped.at[sid].set(hit, mode="drop"),
      **{end_field: getattr(pool, end_field).at[sid].set(ended, mode="drop")})

  # 5. The logits after the last committed token; the caches forget everything after it.
  after = jnp.take_along_axis(out.logits, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = jnp.where((count > 0)[:, None], after, slots.logits)
  if lockstep:
    cache = out.cache
  elif empty_idle:  # count is 1 where the row wrote its token, else 0
    cache = out.cache.replace(index=(start + count).astype(jnp.int32))
  else:
    cache = rollback(out.cache, start + count)
    draft_cache = None if draft_cache is None else rollback(draft_cache, start + count)
  window = None if slots.window is None else _shift_window(slots.window, fed, count)
  accepted = jnp.where(live, jnp.minimum(accepted, jnp.maximum(count - 1, 0)), 0)
  counters = counters.replace(
      steps=counters.steps + 1, slot_steps=counters.slot_steps + jnp.sum(live),
      committed=counters.committed + jnp.sum(count), proposed=counters.proposed + k * jnp.sum(live),
      accepted=counters.accepted + jnp.sum(accepted),
      row_accepted=counters.row_accepted.at[sid].add(accepted, mode="drop"))
  slots = slots.replace(cache=cache, draft_cache=draft_cache, logits=logits, position=slots.position + count,
                        window=window)
  return slots, pool, counters


def rollback(cache: kvc.KVCache, keep: jax.Array) -> kvc.KVCache:
  """Forgets every column at or after keep [C] that was written since (up to cache.index [C]): their
  positions go back to EMPTY_POSITION (segments EMPTY_SEGMENT) so no query attends them, and the
  write index returns to keep. Entries stay; the next write overwrites them."""
  columns = jnp.arange(cache.max_len)[None, :]  # [1, S]
  stale = (columns >= keep[:, None]) & (columns < cache.index[:, None])  # [C, S]
  return cache.replace(positions=jnp.where(stale, kvc.EMPTY_POSITION, cache.positions),
                       segment_ids=jnp.where(stale, kvc.EMPTY_SEGMENT, cache.segment_ids),
                       index=keep.astype(jnp.int32))


# --- feeding tokens that were not generated ---------------------------------------------------------


def extend(models: Models, slots: Slots, rows: jax.Array, tokens: jax.Array, lengths: jax.Array, skip=None):
  """Feeds tokens [R, T] (right-padded; row r's first lengths[r] real) into slots `rows` [R] (C: no
  slot) at each one's own write index and position, in one forward (rows with length 0 keep their
  cache, logits and position). skip [R] (`extend_chunk`): row r's first skip[r] tokens are not real
  either; their columns are written empty. Returns (slots, routes [L, R, T, K] of the fed tokens or
  None)."""
  span = tokens.shape[1]
  real = jnp.arange(span)[None, :] < lengths[:, None]  # [R, T]
  if skip is not None:
    real &= jnp.arange(span)[None, :] >= skip[:, None]
  at = jnp.clip(rows, 0, slots.num_slots - 1)
  position = slots.position[at]
  positions = jnp.where(real, position[:, None] + jnp.arange(span), kvc.EMPTY_POSITION)

  def feed(model, weights, cache):
    sub = kvc.take_rows(cache, at)
    index = sub.index
    out = model(tokens, positions=positions, segment_ids=real.astype(jnp.int32), cache=sub, layer_weights=weights)
    return kvc.put_rows(cache, rows, out.cache.replace(index=index + lengths)), out
  cache, out = feed(models.target, models.weights, slots.cache)
  draft_cache = slots.draft_cache
  if draft_cache is not None:
    draft_cache, _ = feed(models.draft, models.draft_weights, draft_cache)
  last = jnp.take_along_axis(out.logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  fed = lengths > (0 if skip is None else skip)
  logits = slots.logits.at[rows].set(jnp.where(fed[:, None], last, slots.logits[at]), mode="drop")
  slots = slots.replace(cache=cache, draft_cache=draft_cache, logits=logits,
                        position=slots.position.at[rows].add(lengths, mode="drop"))
  return slots, out.aux.get("routing")


def extend_chunk(models: Models, slots: Slots, rows: jax.Array, tokens: jax.Array, lengths: jax.Array,
                 fed: jax.Array, chunk: int):
  """One chunk of a chunked prefill (Sarathi-Serve's chunked prefills, Agrawal et al. 2024,
  arXiv:2403.02310): the next `chunk` tokens of each row's tokens [R, T] (its first lengths[r] real,
  fed[r] of them already in its slot) extended into slots `rows` [R] at their own index (`extend`).
  Every chunk is `chunk` wide and ends at or before the row's last token, so no write runs past it:
  a row's last chunk starts at token lengths - chunk, re-feeding tokens already in the cache (the
  same tokens at the same columns and positions write the same entries), and a row shorter than a
  chunk starts chunk - lengths columns before its first token (columns that must hold nothing: a
  left-padded prompt's padding, prefill.fill_prompts), written empty. Rows with nothing left are not
  touched. Returns (slots, fed [R] after the chunk, routes [L, R, chunk, K] or None, starts [R]: the
  token each row's chunk began at, negative when it began before the row)."""
  active = fed < lengths
  start = jnp.minimum(fed, lengths - chunk)
  todo = jnp.where(active, chunk, 0)
  feed_rows = jnp.where(active, rows, slots.num_slots)
  back = jnp.where(active, fed - start, 0)  # columns re-fed or skipped: the write index steps back

  def rewind(cache):
    return None if cache is None else cache.replace(index=cache.index.at[feed_rows].add(-back, mode="drop"))
  slots = slots.replace(cache=rewind(slots.cache), draft_cache=rewind(slots.draft_cache),
                        position=slots.position.at[feed_rows].add(-back, mode="drop"))
  columns = jnp.clip(start[:, None] + jnp.arange(chunk)[None, :], 0, tokens.shape[1] - 1)
  slots, routes = extend(models, slots, feed_rows, jnp.take_along_axis(tokens, columns, axis=1), todo,
                         skip=jnp.maximum(-start, 0))
  return slots, jnp.where(active, start + todo, fed), routes, start


def append(pool: Pool, sid: jax.Array, tokens: jax.Array, lengths: jax.Array, routes=None) -> Pool:
  """The pool with tokens [R, T] (the first lengths[r] of each) appended to samples sid [R] (B: none)
  as extensions (not the policy's), with their routes [L, R, T, K]; the samples' turns restart."""
  span = tokens.shape[1]
  num, width = pool.num_samples, pool.width
  fill = pool.count[jnp.clip(sid, 0, num - 1)]
  offsets = jnp.arange(span)[None, :]
  columns = jnp.where(offsets < lengths[:, None], fill[:, None] + offsets, width)  # [R, T]
  return pool.replace(tokens=_write(pool.tokens, sid, columns, tokens.astype(jnp.int32)),
                      routing=write_routes(pool.routing, sid, columns, routes),
                      count=pool.count.at[sid].add(lengths, mode="drop"),
                      turn_start=pool.turn_start.at[sid].set(pool.generated[jnp.clip(sid, 0, num - 1)],
                                                             mode="drop"))


def observe(models: Models, slots: Slots, pool: Pool, rows: jax.Array, tokens: jax.Array,
            lengths: jax.Array) -> tuple[Slots, Pool]:
  """A multi-turn observation: tokens [R, T] extended into slots `rows` [R] and appended to their
  samples, which resume (unpaused) with a fresh turn (their stop-sequence window cleared)."""
  sid = slots.sid[jnp.clip(rows, 0, slots.num_slots - 1)]
  sid = jnp.where(rows < slots.num_slots, sid, pool.num_samples)
  slots, routes = extend(models, slots, rows, tokens, lengths)
  pool = append(pool, sid, tokens, lengths, routes)
  pool = pool.replace(paused=pool.paused.at[sid].set(False, mode="drop"))
  if slots.window is not None:
    slots = slots.replace(window=slots.window.at[rows].set(-1, mode="drop"))
  return slots, pool


def resume(models: Models, slots: Slots, pool: Pool, rows: jax.Array, sid: jax.Array) -> Slots:
  """Samples sid [R] (B: none) re-prefilled from their buffers, every token so far, into slots `rows`
  [R] under the current parameters (a partial rollout carried to the next step, a sample moved to
  another slot). Their caches are rebuilt whole; their logits and positions follow."""
  at = jnp.clip(sid, 0, pool.num_samples - 1)
  count = pool.count[at]

  def emptied(model, cache):  # the rows' cache rows fresh: every column empty, write index 0
    if cache is None:
      return None
    return kvc.put_rows(cache, rows, as_rows(models, model.init_cache(rows.shape[0], cache.max_len)))
  slots = slots.replace(sid=slots.sid.at[rows].set(sid, mode="drop"), cache=emptied(models.target, slots.cache),
                        draft_cache=emptied(models.draft, slots.draft_cache),
                        position=slots.position.at[rows].set(-pool.pad[at], mode="drop"))
  # The whole buffer row, its left padding written empty: column c at position c - pad, as prefilled.
  slots, _ = extend(models, slots, rows, pool.tokens[at], count, skip=pool.pad[at])
  window = slots.window
  if window is not None:  # the current turn's last W tokens
    width = window.shape[1]
    columns = count[:, None] - width + jnp.arange(width)[None, :]  # [R, W]
    turn_begins = count - (pool.generated[at] - pool.turn_start[at])
    recent = jnp.take_along_axis(pool.tokens[at], jnp.maximum(columns, 0), axis=1)
    window = window.at[rows].set(jnp.where(columns >= turn_begins[:, None], recent, -1), mode="drop")
  return slots.replace(window=window)

def laid_out_cache(mc, cache: kvc.KVCache) -> kvc.KVCache:
  """A cache (stacked, or per layer: kv_cache.unstack) constrained to its layout
  (kv_cache.CACHE_AXES; positions and segments by batch and cache_length; a per-row write index by
  batch). The chunks' row gathers (`extend`) otherwise leave the layout to the partitioner, which
  replicated the cache over the batch axes (AOT prefill, v5e:2x2, fsdp x expert)."""
  lay = mc.kernel.constrain
  if kvc.is_unstacked(cache):
    layers = {stack: tuple({name: lay(a, kvc.entry_axes(name, per_layer=True)) for name, a in layer.items()}
                           for layer in per_layer_entries)
              for stack, per_layer_entries in cache.layers.items()}
  else:
    layers = {stack: {name: lay(a, kvc.CACHE_AXES[name]) for name, a in entries.items()}
              for stack, entries in cache.layers.items()}
  ids = ("batch", "cache_length")
  index = cache.index if cache.index.ndim == 0 else lay(cache.index, ("batch",))
  return cache.replace(layers=layers, positions=lay(cache.positions, ids), segment_ids=lay(cache.segment_ids, ids),
                       index=index)
