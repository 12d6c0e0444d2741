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
cache (prefill.prefill_prompts).

Axis legend: P prompts, G group size, B samples, C slots, Lp prompt columns, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation import core
from meshrl.rl.generation.core import Models, StepConfig
from meshrl.rl.generation.prefill import fill_chunk, fill_prompts, prefill_models
from meshrl.rl.generation.state import Counters, Pool, Slots

SCHEDULERS = ("static", "continuous", "budgeted", "episodic")


def _by_priority(waiting: jax.Array, priority: jax.Array):
  """Samples where waiting [B] by priority, lowest first -> (order [B], how many wait [])."""
  order = jnp.argsort(jnp.where(waiting, priority, jnp.iinfo(jnp.int32).max), stable=True).astype(jnp.int32)
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
  tokens (prefill.fill_chunk). Static (lockstep): back to back before the first decode step. Otherwise
  one chunk of every unfinished prompt per iteration, between the decode steps of the slots whose
  prompts are in: a sample is admitted once its prompt is, so a long prompt stalls no other slot."""
  num = pool.num_samples
  prompt_len = prompts.shape[1]
  lockstep = config.proposer.window == 0 and slots == num and max_steps == 0
  interleave = 0 < prefill_chunk < prompt_len and not lockstep
  fill = None
  if interleave:
    fill = fill_chunk(models, fill_prompts(models, prompts, prompt_mask, cache_len), prefill_chunk)
  else:
    prompt_cache, draft_prompt_cache, prompt_logits, prompt_routing = prefill_models(
        models, prompts, prompt_mask, cache_len, prefill_chunk)
    if pool.routing is not None and prompt_routing is not None:
      pool = pool.replace(routing=pool.routing.at[:, :, :prompt_len].set(prompt_routing[:, pool.group_of]))

  if lockstep:  # static: sample b in slot b from the start, one shared write index
    group = num // prompts.shape[0]
    state = Slots(sid=jnp.arange(num, dtype=jnp.int32),
                  cache=core.per_layer(models, kvc.repeat_rows(prompt_cache, group)), draft_cache=None,
                  logits=jnp.repeat(prompt_logits, group, axis=0), position=pool.count - pool.pad,
                  window=None, sampling=None)
    return core.decode_loop(models, config, state, pool, version, lockstep=True)[1:]

  if not interleave:
    prompt_rows = (core.as_rows(models, prompt_cache), core.as_rows(models, draft_prompt_cache), prompt_logits)
  empty = core.new_slots(models, slots, cache_len, num_samples=num, vocab=models.target.config.vocab_size,
                         window=config.window)
  resuming = (pool.generated > 0) & ~pool.done
  resume_ids = jnp.nonzero(resuming, size=slots, fill_value=num)[0].astype(jnp.int32)  # [C]
  state = jax.lax.cond(jnp.any(resuming),
                       lambda: core.resume(models, empty, pool, jnp.arange(slots), resume_ids), lambda: empty)
  waiting = (pool.generated == 0) & ~pool.done
  order, num_waiting = _by_priority(waiting, pool.priority)

  def refill(s: Slots, p: Pool, next_pos, fill):
    """Frees the slots whose samples ended and gives them (and empty ones) the next waiting samples.
    Chunked (`fill`): next_pos is the admitted samples [B] bool instead, and a waiting sample is
    admitted once its prompt is prefilled, by priority among those."""
    sid = jnp.where((s.sid < num) & p.done[jnp.clip(s.sid, 0, num - 1)], num, s.sid)
    if fill is None:
      sid, take, next_pos = _admit(sid, next_pos, order, num_waiting, num)
      return core.admit(s, p, sid, take, prompt_rows), next_pos
    ready = waiting & ~next_pos & fill.ready()[p.group_of]
    sid, take, _ = _admit(sid, jnp.zeros((), jnp.int32), *_by_priority(ready, p.priority), num)
    next_pos = next_pos.at[jnp.where(take, sid, num)].set(True, mode="drop")
    return core.admit(s, p, sid, take, (fill.slots.cache, fill.slots.draft_cache, fill.slots.logits)), next_pos

  def keep_going(carry):
    step, s, p, _, _, f = carry
    going = jnp.any(core.live_slots(s, p))
    if interleave:  # prompts still being prefilled have samples to admit
      going |= ~jnp.all(f.ready())
    return going & (step < max_steps) if max_steps else going

  refill_in_loop = slots < num or max_steps > 0 or interleave
  state, next_pos = refill(state, pool, jnp.zeros(num, bool) if interleave else jnp.zeros((), jnp.int32), fill)

  def body(carry):
    step, s, p, c, next_pos, f = carry
    s, p, c = core.decode_step(models, config, s, p, version, c)
    if interleave:  # the next chunk of the prompts not yet in
      f = jax.lax.cond(jnp.all(f.ready()), lambda x: x, lambda x: fill_chunk(models, x, prefill_chunk), f)
    if refill_in_loop:
      s, next_pos = refill(s, p, next_pos, f)
    return step + 1, s, p, c, next_pos, f
  start = (jnp.zeros((), jnp.int32), state, pool, Counters.zeros(num), next_pos, fill)
  _, _, pool, counters, _, fill = jax.lax.while_loop(keep_going, body, start)
  if interleave and pool.routing is not None and fill.routing is not None:
    pool = pool.replace(routing=pool.routing.at[:, :, :prompt_len].set(fill.routing[:, pool.group_of]))
  return pool, counters
