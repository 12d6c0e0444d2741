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
  """Free slots (sid == B) take the next waiting samples -> (sid [C], taken [C] bool, next position)."""
  free = sid >= num
  slot_pos = next_pos + jnp.cumsum(free) - 1
  new = jnp.where(free & (slot_pos < num_waiting), order[jnp.clip(slot_pos, 0, num - 1)], num)
  take = new < num
  return jnp.where(take, new, sid), take, next_pos + jnp.sum(take).astype(jnp.int32)


def run(models: Models, config: StepConfig, pool: Pool, prompts: jax.Array, prompt_mask: jax.Array, *,
        slots: int, cache_len: int, version: jax.Array, max_steps: int = 0) -> tuple[Pool, Counters]:
  """Decodes the pool's samples on `slots` decode slots (pure; jit it) -> (pool, counters).

  prompts [P, Lp] left-padded (the pool's samples' prompts, sample b of prompt pool.group_of[b]);
  cache_len: the caches' columns (the pool's width plus a speculative window's slack); max_steps:
  at most this many decode steps (0: until every sample has ended). Samples that already have tokens
  and have not ended resume first (at most `slots`), then waiting ones are admitted by priority.
  Every prompt column's MoE routes come from this call's prefill."""
  num = pool.num_samples
  prompt_len = prompts.shape[1]
  prompt_cache, prompt_logits, prompt_routing = core.prefill_prompts(models.target, prompts, prompt_mask,
                                                                     cache_len)
  if pool.routing is not None and prompt_routing is not None:
    pool = pool.replace(routing=pool.routing.at[:, :, :prompt_len].set(prompt_routing[:, pool.group_of]))
  draft_prompt_cache = None
  if models.draft is not None:
    positions, segments = core.prompt_layout(prompt_mask)
    draft_prompt_cache = models.draft(prompts, positions=positions, segment_ids=segments,
                                      cache=models.draft.init_cache(prompts.shape[0], cache_len)).cache
  counters = Counters.zeros(num)
  lockstep = config.proposer.window == 0 and slots == num and max_steps == 0

  def keep_going(carry):
    step, state, p, _ = carry[:4]
    going = jnp.any(core.live_slots(state, p))
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

  prompt_cache = core.per_layer(models, kvc.with_row_index(prompt_cache))
  draft_prompt_cache = None if draft_prompt_cache is None else core.per_layer(
      models, kvc.with_row_index(draft_prompt_cache))
  empty = empty_slots(models.target.init_cache(slots, cache_len),
                      None if models.draft is None else models.draft.init_cache(slots, cache_len),
                      num_samples=num, vocab=prompt_logits.shape[-1], window=config.window)
  empty = empty.replace(cache=core.per_layer(models, empty.cache),
                        draft_cache=None if empty.draft_cache is None else core.per_layer(models, empty.draft_cache))
  resuming = (pool.generated > 0) & ~pool.done
  resume_ids = jnp.nonzero(resuming, size=slots, fill_value=num)[0].astype(jnp.int32)  # [C]
  state = jax.lax.cond(jnp.any(resuming),
                       lambda: core.resume(models, empty, pool, jnp.arange(slots), resume_ids), lambda: empty)
  order, num_waiting = _admission_order(pool)

  def refill(s: Slots, p: Pool, next_pos):
    """Frees the slots whose samples ended and gives them (and empty ones) the next waiting samples."""
    rows = jnp.clip(s.sid, 0, num - 1)
    sid = jnp.where((s.sid < num) & p.done[rows], num, s.sid)
    sid, take, next_pos = _admit(sid, next_pos, order, num_waiting, num)
    rows = jnp.clip(sid, 0, num - 1)
    group = p.group_of[rows]
    s = s.replace(sid=sid, cache=kvc.copy_rows(s.cache, prompt_cache, group, take),
                  draft_cache=None if s.draft_cache is None else kvc.copy_rows(
                      s.draft_cache, draft_prompt_cache, group, take),
                  logits=jnp.where(take[:, None], prompt_logits[group], s.logits),
                  position=jnp.where(take, p.count[rows] - p.pad[rows], s.position),
                  window=None if s.window is None else jnp.where(take[:, None], -1, s.window))
    return s, next_pos

  refill_in_loop = slots < num or max_steps > 0
  state, next_pos = refill(state, pool, jnp.zeros((), jnp.int32))

  def body(carry):
    step, s, p, c, next_pos = carry
    s, p, c = core.decode_step(models, config, s, p, version, c)
    if refill_in_loop:
      s, next_pos = refill(s, p, next_pos)
    return step + 1, s, p, c, next_pos
  start = (jnp.zeros((), jnp.int32), state, pool, counters, next_pos)
  _, _, pool, counters, _ = jax.lax.while_loop(keep_going, body, start)
  return pool, counters
