"""Schedulers that run inside one jitted loop: the pool of samples is known when the call starts.

  static      one slot per sample; every sample starts at once. Without a proposer the rows move in
              lockstep on one shared cache index (`core.decode_step(lockstep=True)`).
  continuous  C < B slots; a slot whose sample ends is refilled in the same iteration with the next
              waiting sample (its prompt's cache row copied over the slot's whole row), so no slot
              waits for the slowest sample (Orca's iteration-level scheduling, Yu et al., OSDI 2022).
  budgeted    continuous for at most `max_steps` iterations: samples that have not ended stay in the
              pool (partial rollouts, rl/step/partial.py) and resume at the next call, re-prefilled
              from their buffers under the parameters of that call (core.resume).

Refills happen inside the loop rather than between jitted chunks: a chunked host loop pays a device
-> host sync per chunk and idles slots until the chunk ends, and the whole rollout stays one compiled
program. The refill runs on every iteration as a masked row select (a no-op where no slot frees):
measured 2.3x faster than gating it with lax.cond, which made XLA copy the prompt cache into the
conditional on each iteration (128 prompts, 32 slots, CPU).

Each prompt is prefilled once and its cache row shared by its group (prefix sharing); with
attention.impl = "ring" on a sequence-split mesh the prefill is ring attention into a sequence-sharded
cache (core.prefill_prompts).

Axis legend: P prompts, G group size, B samples, C slots, Lp prompt columns, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation import core
from meshrl.rl.generation.core import Models, StepConfig
from meshrl.rl.generation.state import Counters, Pool, Slots, empty_slots

SCHEDULERS = ("static", "continuous", "budgeted", "episodic")


def _admission_order(pool: Pool):
  """Waiting samples (no token yet, not ended) by priority -> (order [B], how many wait [])."""
  waiting = (pool.generated == 0) & ~pool.done
  big = jnp.iinfo(jnp.int32).max
  order = jnp.argsort(jnp.where(waiting, pool.priority, big), stable=True).astype(jnp.int32)
  return order, jnp.sum(waiting)


def _admit(sid: jax.Array, next_pos: jax.Array, order: jax.Array, num_waiting: jax.Array, num: int):
  """Free slots (sid == B) take the next waiting samples (the first num_waiting of `order`) -> (sid
  [C], taken [C] bool, next position)."""
  free = sid >= num
  slot_pos = next_pos + jnp.cumsum(free) - 1
  new = jnp.where(free & (slot_pos < num_waiting), order[jnp.clip(slot_pos, 0, num - 1)], num)
  take = new < num
  return jnp.where(take, new, sid), take, next_pos + jnp.sum(take).astype(jnp.int32)


def run(models: Models, config: StepConfig, pool: Pool, prompts: jax.Array, prompt_mask: jax.Array, *,
        slots: int, cache_len: int, version: jax.Array, max_steps: int = 0,
        prefill_chunk: int = 0) -> tuple[Pool, Counters]:
  """Decodes the pool's samples on `slots` decode slots (pure; jit it) -> (pool, counters).

  prompts [P, Lp] left-padded (the pool's samples' prompts, sample b of prompt pool.group_of[b]);
  cache_len: the caches' columns (the pool's width plus a speculative window's slack); max_steps:
  at most this many decode steps (0: until every sample has ended). Samples that already have tokens
  and have not ended resume first (at most `slots`), then waiting ones are admitted by priority.
  Every prompt column's MoE routes come from this call's prefill.

  prefill_chunk (rl.prefill_chunk, 0 < it < Lp): the prompts are prefilled in chunks of that many
  tokens (core.fill_chunk). Static (lockstep): back to back before the first decode step. Otherwise
  one chunk of every unfinished prompt per iteration, between the decode steps of the slots whose
  prompts are in: a sample is admitted once its prompt is, so a long prompt stalls no other slot."""
  num = pool.num_samples
  prompt_len = prompts.shape[1]
  counters = Counters.zeros(num)
  lockstep = config.proposer.window == 0 and slots == num and max_steps == 0
  interleave = 0 < prefill_chunk < prompt_len and not lockstep
  fill = draft_prompt_cache = None
  if interleave:
    fill = core.fill_chunk(models, core.fill_prompts(models, prompts, prompt_mask, cache_len), prefill_chunk)
  else:
    prompt_cache, draft_prompt_cache, prompt_logits, prompt_routing = core.prefill_models(
        models, prompts, prompt_mask, cache_len, prefill_chunk)
    if pool.routing is not None and prompt_routing is not None:
      pool = pool.replace(routing=pool.routing.at[:, :, :prompt_len].set(prompt_routing[:, pool.group_of]))

  def keep_going(carry):
    step, state, p, _ = carry[:4]
    going = jnp.any(core.live_slots(state, p))
    if interleave:  # prompts still being prefilled have samples to admit
      going |= ~jnp.all(carry[-1].ready())
    return going & (step < max_steps) if max_steps else going

  if lockstep:  # static: sample b in slot b from the start, one shared write index
    group = num // prompts.shape[0]
    state = Slots(sid=jnp.arange(num, dtype=jnp.int32),
                  cache=core.per_layer(models, kvc.repeat_rows(prompt_cache, group)), draft_cache=None,
                  logits=jnp.repeat(prompt_logits, group, axis=0), position=pool.count - pool.pad,
                  window=None, sampling=None)

    def body(carry):
      step, s, p, c = carry
      s, p, c = core.decode_step(models, config, s, p, version, c, lockstep=True)
      return step + 1, s, p, c
    _, _, pool, counters = jax.lax.while_loop(keep_going, body, (jnp.zeros((), jnp.int32), state, pool, counters))
    return pool, counters

  if not interleave:
    prompt_cache = core.per_layer(models, kvc.with_row_index(prompt_cache))
    draft_prompt_cache = None if draft_prompt_cache is None else core.per_layer(
        models, kvc.with_row_index(draft_prompt_cache))
  empty = empty_slots(models.target.init_cache(slots, cache_len),
                      None if models.draft is None else models.draft.init_cache(slots, cache_len),
                      num_samples=num, vocab=models.target.config.vocab_size, window=config.window)
  empty = empty.replace(cache=core.per_layer(models, empty.cache),
                        draft_cache=None if empty.draft_cache is None else core.per_layer(models, empty.draft_cache))
  resuming = (pool.generated > 0) & ~pool.done
  resume_ids = jnp.nonzero(resuming, size=slots, fill_value=num)[0].astype(jnp.int32)  # [C]
  state = jax.lax.cond(jnp.any(resuming),
                       lambda: core.resume(models, empty, pool, jnp.arange(slots), resume_ids), lambda: empty)
  order, num_waiting = _admission_order(pool)
  waiting = (pool.generated == 0) & ~pool.done

  def refill(s: Slots, p: Pool, next_pos, fill):
    """Frees the slots whose samples ended and gives them (and empty ones) the next waiting samples.
    Chunked (`fill`): next_pos is the admitted samples [B] bool instead, and a waiting sample is
    admitted once its prompt is prefilled, by priority among those."""
    rows = jnp.clip(s.sid, 0, num - 1)
    sid = jnp.where((s.sid < num) & p.done[rows], num, s.sid)
    if fill is None:
      source, draft_source, logits = prompt_cache, draft_prompt_cache, prompt_logits
      sid, take, next_pos = _admit(sid, next_pos, order, num_waiting, num)
    else:
      source, draft_source, logits = fill.slots.cache, fill.slots.draft_cache, fill.slots.logits
      ready = waiting & ~next_pos & fill.ready()[p.group_of]
      now = jnp.argsort(jnp.where(ready, p.priority, jnp.iinfo(jnp.int32).max), stable=True).astype(jnp.int32)
      sid, take, _ = _admit(sid, jnp.zeros((), jnp.int32), now, jnp.sum(ready), num)
      next_pos = next_pos.at[jnp.where(take, sid, num)].set(True, mode="drop")
    rows = jnp.clip(sid, 0, num - 1)
    group = p.group_of[rows]
    s = s.replace(sid=sid, cache=kvc.copy_rows(s.cache, source, group, take),
                  draft_cache=None if s.draft_cache is None else kvc.copy_rows(
                      s.draft_cache, draft_source, group, take),
                  logits=jnp.where(take[:, None], logits[group], s.logits),
                  position=jnp.where(take, p.count[rows] - p.pad[rows], s.position),
                  window=None if s.window is None else jnp.where(take[:, None], -1, s.window))
    return s, next_pos

  refill_in_loop = slots < num or max_steps > 0 or interleave
  state, next_pos = refill(state, pool, jnp.zeros(num, bool) if interleave else jnp.zeros((), jnp.int32), fill)

  def body(carry):
    step, s, p, c, next_pos, f = carry
    s, p, c = core.decode_step(models, config, s, p, version, c)
    if interleave:  # the next chunk of the prompts not yet in
      f = jax.lax.cond(jnp.all(f.ready()), lambda x: x, lambda x: core.fill_chunk(models, x, prefill_chunk), f)
    if refill_in_loop:
      s, next_pos = refill(s, p, next_pos, f)
    return step + 1, s, p, c, next_pos, f
  start = (jnp.zeros((), jnp.int32), state, pool, counters, next_pos, fill)
  _, _, pool, counters, _, fill = jax.lax.while_loop(keep_going, body, start)
  if interleave and pool.routing is not None and fill.routing is not None:
    pool = pool.replace(routing=pool.routing.at[:, :, :prompt_len].set(fill.routing[:, pool.group_of]))
  return pool, counters
