"""The continuous-batching rollout engine: a fixed number of decode slots that never wait for the
slowest sample, and partial rollouts carried from one RL step to the next.

  engine = make_engine(cfg, mesh, stop_ids=..., pad_id=...)        # rl.engine = "continuous"
  batch = engine(params, extra, prompts [P, Lp], prompt_mask, key)  # same RolloutBatch as rollout.py

How a call runs (`run_pool`, one jitted program):
  1. Every prompt is prefilled once ([P, Lp] into a cache of S = Lp + N columns): a group's G samples
     share it (prefix sharing). Samples carried in mid-sequence (partial rollouts) are re-prefilled,
     prompt + generated-so-far, under the current parameters straight into decode slots.
  2. A `lax.while_loop` decodes one token for every slot per iteration. A slot whose sample ends
     (stop token, its length limit, or N) is freed and, in the same iteration, refilled with the next
     waiting sample: its prompt's cache row is copied over the slot's row whole (entries, positions,
     segments, write index), so nothing of the previous occupant survives. Each cache row has its own
     write index (model/kv_cache.py), the slot's next column Lp + t.
  Refills happen inside the jitted loop rather than between jitted decode chunks: a chunked host loop
  pays a device -> host sync per chunk and idles slots until the chunk ends; in the loop a freed slot
  is busy again at the next token, and the whole rollout stays one compiled program (no recompiles
  as lengths vary). The refill runs on every iteration as a masked row select (a no-op where no slot
  frees): measured 2.3x faster than gating it with lax.cond, which made XLA copy the prompt cache into
  the conditional on each iteration (128 prompts, 32 slots, CPU).
  3. A sample's t-th token is drawn with the key (base key, sample id, t) (rl/sampling.py), so its
  tokens do not depend on its slot or on the other samples: with the same keys the engine and the
  static rollout (rl/rollout.py) give the same samples (tests/rl/test_engine.py).

Speculative decoding (rl.speculative = "draft" / "ngram", `run_pool_speculative`): the same slots and
refills, but each iteration every live slot proposes k tokens (the draft model from its own cache
rows, refilled and re-prefilled with the slot's; or n-gram lookup over the sample's prompt + tokens),
the target verifies them all in ONE forward of k + 1 tokens per slot, each slot commits its accepted
run plus one token (cut at a stop token or its limit), and both caches roll back the rejected slots.
The pieces (`verify`, `rollback`, `ngram_propose`, `draft_propose`) are rl/speculative.py's; so are the
per-token keys, so at temperature > 0 a sample draws what the static speculative rollout draws for it.
With rl.rollout_token_budget the budget counts verification forwards (up to k + 1 tokens per slot).

Partial rollouts (rl/partial.py, rl.rollout_token_budget > 0) run this pool with a step budget
(`run_pool(max_steps=...)`) and carry the samples that have not ended to the next RL step: a carried
sample is re-prefilled (step 1) under the parameters of that step, its tokens, behaviour log-probs
and policy versions kept (RolloutBatch.policy_version).

Axis legend: P prompts (groups), G group size, B = P * G samples, C decode slots, Lp prompt length,
N max new tokens, S = Lp + N, V vocab, L MoE layers, K experts per token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from meshrl.model import kv_cache as kvc
from meshrl.model.transformer import Transformer
from meshrl.rl.rollout import (RolloutBatch, RolloutSpec, prompt_layout, rollout_model_config,
                               with_generation_weights)
from meshrl.rl.sampling import sample_keys, token_keys
from meshrl.rl.speculative import (SpecConfig, SpecMetrics, draft_propose, ngram_propose, rollback,
                                   speculative_call, speculative_setup, verify)

ENGINES = ("static", "continuous")


@struct.dataclass
class Pool:
  """The samples an engine call works on and everything they carry between calls."""
  prompts: jax.Array  # [P, Lp] int32, left-padded
  prompt_mask: jax.Array  # [P, Lp] bool
  group_of: jax.Array  # [B] int32: the prompt row of each sample
  keys: jax.Array  # [B, ...] uint32 raw key data of each sample's PRNG key (jax.random.key_data)
  priority: jax.Array  # [B] int32: admission order of waiting samples (lowest first)
  max_lengths: jax.Array  # [B] int32: each sample's response limit (<= N)
  tokens: jax.Array  # [B, N] int32: generated tokens (PAD after `count`)
  logprobs: jax.Array  # [B, N] float32: behaviour log-probs (0 after `count`)
  versions: jax.Array  # [B, N] int32: policy version of each generated token (-1 after `count`)
  count: jax.Array  # [B] int32: tokens generated so far
  done: jax.Array  # [B] bool: ended (stop token or length limit)
  stopped: jax.Array  # [B] bool: ended on a stop token
  routing: Any  # [L, B, N, K] int32 decode expert choices, or None (dense model)

  @property
  def num_samples(self) -> int:
    return self.group_of.shape[0]


def new_pool(prompts, prompt_mask, keys, *, group_size: int, max_new_tokens: int, pad_id: int,
             max_lengths=None, routing_shape: tuple[int, int] | None = None) -> Pool:
  """A pool of fresh samples: G per prompt (sample b is prompt b // G), keys [B] typed PRNG keys.

  routing_shape: (L, K) of a MoE model (None: dense)."""
  num = prompts.shape[0] * group_size
  budget = max_new_tokens
  limits = jnp.full((num,), budget, jnp.int32) if max_lengths is None else jnp.minimum(
      jnp.asarray(max_lengths, jnp.int32), budget)
  routing = None
  if routing_shape is not None:
    routing = jnp.zeros((routing_shape[0], num, budget, routing_shape[1]), jnp.int32)
  return Pool(prompts=jnp.asarray(prompts, jnp.int32), prompt_mask=jnp.asarray(prompt_mask, bool),
              group_of=jnp.arange(num, dtype=jnp.int32) // group_size, keys=jax.random.key_data(keys),
              priority=jnp.arange(num, dtype=jnp.int32), max_lengths=limits,
              tokens=jnp.full((num, budget), pad_id, jnp.int32), logprobs=jnp.zeros((num, budget)),
              versions=jnp.full((num, budget), -1, jnp.int32), count=jnp.zeros((num,), jnp.int32),
              done=limits < 1, stopped=jnp.zeros((num,), bool), routing=routing)


@struct.dataclass
class _Loop:
  step: jax.Array  # [] int32: decode iterations so far in this call
  next: jax.Array  # [] int32: position in `order` of the next waiting sample
  cache: kvc.KVCache  # C rows, per-row write index
  logits: jax.Array  # [C, V] next-token logits of each slot
  sid: jax.Array  # [C] int32: the sample in each slot (B = empty)
  pool: Pool


def _resume_prefill(model: Transformer, pool: Pool, ids: jax.Array, total: int):
  """Re-prefills samples `ids` [C] (B = none) as prompt + generated-so-far under the current params.

  Returns (cache [C rows, write index Lp + count], logits [C, V] for each sample's next token)."""
  num, prompt_len = pool.num_samples, pool.prompts.shape[1]
  rows = jnp.clip(ids, 0, num - 1)
  group = pool.group_of[rows]
  positions, segments = prompt_layout(pool.prompt_mask[group])
  count = jnp.where(ids < num, pool.count[rows], 0)  # [C]
  budget = pool.tokens.shape[1]
  generated = jnp.arange(budget)[None, :] < count[:, None]  # [C, N]
  lengths = jnp.sum(pool.prompt_mask[group], axis=1).astype(jnp.int32)  # [C]
  tokens = jnp.concatenate([pool.prompts[group], pool.tokens[rows]], axis=1)  # [C, S]
  positions = jnp.concatenate([positions, jnp.where(generated, lengths[:, None] + jnp.arange(budget), 0)],
                              axis=1)
  segments = jnp.concatenate([segments, generated.astype(jnp.int32)], axis=1)
  out = model(tokens, positions=positions, segment_ids=segments, cache=model.init_cache(len(ids), total))
  last = prompt_len + count - 1  # [C] column of the last real token
  logits = jnp.take_along_axis(out.logits, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
  return out.cache.replace(index=(prompt_len + count).astype(jnp.int32)), logits


def _prefill_prompts(model: Transformer, pool: Pool, total: int):
  """Every prompt prefilled once into a cache of `total` columns -> (cache [P rows, per-row index Lp],
  next-token logits [P, V], the prefill's aux)."""
  positions, segments = prompt_layout(pool.prompt_mask)
  prefill = model(pool.prompts, positions=positions, segment_ids=segments,
                  cache=model.init_cache(pool.prompts.shape[0], total))
  return kvc.with_row_index(prefill.cache), prefill.logits[:, -1], prefill.aux


def _slot_start(model: Transformer, pool: Pool, slots: int, total: int, vocab: int, dtype):
  """The slots at the start of a call: samples carried mid-sequence (count > 0, not ended; at most
  `slots`) re-prefilled into them -> (sample ids [C] (B = empty), cache, next-token logits [C, V])."""
  num = pool.num_samples
  resuming = (pool.count > 0) & ~pool.done
  resume_ids = jnp.nonzero(resuming, size=slots, fill_value=num)[0].astype(jnp.int32)  # [C]

  def empty_slots(_):
    return kvc.with_row_index(model.init_cache(slots, total)), jnp.zeros((slots, vocab), dtype)

  cache, logits = jax.lax.cond(jnp.any(resuming),
                               lambda _: _resume_prefill(model, pool, resume_ids, total), empty_slots, None)
  return resume_ids, cache, logits


def _admission_order(pool: Pool):
  """Waiting samples (count == 0, not ended) by priority -> (order [B], how many wait [])."""
  waiting = (pool.count == 0) & ~pool.done
  big = jnp.iinfo(jnp.int32).max
  order = jnp.argsort(jnp.where(waiting, pool.priority, big), stable=True).astype(jnp.int32)  # [B]
  return order, jnp.sum(waiting)


def _admit(sid: jax.Array, next_pos: jax.Array, order: jax.Array, num_waiting: jax.Array, num: int):
  """Free slots (sid == B) take the next waiting samples -> (new sid [C], taken [C] bool, their
  prompt rows are the caller's to copy, next position in `order`)."""
  free = sid >= num
  rank = jnp.cumsum(free) - 1
  slot_pos = next_pos + rank
  new = jnp.where(free & (slot_pos < num_waiting), order[jnp.clip(slot_pos, 0, num - 1)], num)
  take = new < num
  return jnp.where(take, new, sid), take, next_pos + jnp.sum(take).astype(jnp.int32)


def _keep_going(num: int, max_steps: int):
  """The decode loops' condition: a slot still holds a sample (sid < B), and fewer than `max_steps`
  iterations ran (0: no bound)."""
  def keep_going(s) -> jax.Array:
    going = jnp.any(s.sid < num)
    return going & (s.step < max_steps) if max_steps else going
  return keep_going


def run_pool(model: Transformer, spec: RolloutSpec, pool: Pool, *, slots: int, max_steps: int = 0,
             version: jax.Array | int = 0) -> tuple[Pool, Any]:
  """Decodes the pool's samples on `slots` decode slots (pure; jit it) -> (pool, prompt routing).

  max_steps: at most this many decode iterations (0: until every sample has ended). Samples with
  count > 0 that have not ended resume in slots first (at most `slots` of them), then waiting ones
  (count == 0) are admitted by `priority`. version: stamped on the tokens generated in this call.
  prompt routing: [L, P, Lp, K] expert choices of the prompts' prefill (None for a dense model).
  """
  num, budget = pool.num_samples, pool.tokens.shape[1]
  prompt_len = pool.prompts.shape[1]
  total = prompt_len + budget
  prompt_cache, prompt_logits, prefill_aux = _prefill_prompts(model, pool, total)
  prompt_lengths = jnp.sum(pool.prompt_mask, axis=1).astype(jnp.int32)  # [P]
  keys = jax.random.wrap_key_data(pool.keys)  # [B]
  stop_tokens = jnp.asarray(spec.stop_tokens, jnp.int32)
  version = jnp.asarray(version, jnp.int32)
  resume_ids, cache, logits = _slot_start(model, pool, slots, total, prompt_logits.shape[-1],
                                          prompt_logits.dtype)
  weights, cache, prompt_cache = model.decode_loop_inputs(cache, prompt_cache)
  order, num_waiting = _admission_order(pool)

  def refill(s: _Loop) -> _Loop:
    sid, take, next_pos = _admit(s.sid, s.next, order, num_waiting, num)
    group = pool.group_of[jnp.clip(sid, 0, num - 1)]
    return s.replace(cache=kvc.copy_rows(s.cache, prompt_cache, group, take),
                     logits=jnp.where(take[:, None], prompt_logits[group], s.logits), sid=sid, next=next_pos)

  keep_going = _keep_going(num, max_steps)

  def decode_one(s: _Loop) -> _Loop:
    p = s.pool
    live = s.sid < num
    rows = jnp.clip(s.sid, 0, num - 1)
    t = p.count[rows]  # [C] index of the token drawn now
    token = spec.sampler.sample_rows(s.logits, token_keys(keys[rows], t))
    logprob = spec.sampler.log_probs(s.logits, token)
    token = jnp.where(live, token, spec.pad_id)
    stop = live & jnp.isin(token, stop_tokens)
    ended = live & (stop | (t + 1 >= p.max_lengths[rows]))
    at = (s.sid, t)  # empty slots have sid = B: their writes are dropped
    out = model(token[:, None], positions=(prompt_lengths[p.group_of[rows]] + t)[:, None],
                segment_ids=jnp.ones((slots, 1), jnp.int32), cache=s.cache, layer_weights=weights)
    routing = p.routing
    if routing is not None:
      routing = routing.at[:, s.sid, t].set(out.aux["routing"][:, :, 0], mode="drop")
    p = p.replace(tokens=p.tokens.at[at].set(token, mode="drop"),
                  logprobs=p.logprobs.at[at].set(logprob, mode="drop"),
                  versions=p.versions.at[at].set(version, mode="drop"),
                  count=p.count.at[s.sid].set(t + 1, mode="drop"),
                  done=p.done.at[s.sid].set(ended, mode="drop"),
                  stopped=p.stopped.at[s.sid].set(stop, mode="drop"), routing=routing)
    return refill(_Loop(step=s.step + 1, next=s.next, cache=out.cache, logits=out.logits[:, 0],
                        sid=jnp.where(ended, num, s.sid), pool=p))

  start = refill(_Loop(step=jnp.zeros((), jnp.int32), next=jnp.zeros((), jnp.int32), cache=cache,
                       logits=logits, sid=resume_ids, pool=pool))
  final = jax.lax.while_loop(keep_going, decode_one, start)
  return final.pool, prefill_aux.get("routing")


@struct.dataclass
class _SpecLoop:
  step: jax.Array  # [] int32: verification forwards so far in this call
  next: jax.Array  # [] int32: position in `order` of the next waiting sample
  cache: kvc.KVCache  # C rows, per-row write index; every committed token but `cur`
  draft_cache: Any  # the draft's C rows, the same slots (None for ngram)
  logits: jax.Array  # [C, V] next-token logits where `fresh` (the prefill's, after a refill or resume)
  fresh: jax.Array  # [C] bool: the slot's next token is drawn from `logits` (not yet drawn)
  cur: jax.Array  # [C] int32: last committed token (not yet in either cache) where not fresh
  sid: jax.Array  # [C] int32: the sample in each slot (B = empty)
  pool: Pool
  accepted: jax.Array  # [] int32 accepted proposals
  proposed: jax.Array  # [] int32 proposals made to speculating slots
  row_forwards: jax.Array  # [] int32 speculating slots summed over verification forwards
  committed: jax.Array  # [] int32 tokens committed by verification (the drawn first tokens not counted)
  row_accepted: jax.Array  # [B] int32 accepted proposals per sample


def run_pool_speculative(model: Transformer, draft: Transformer | None, spec: RolloutSpec, sc, pool: Pool, *,
                         slots: int, max_steps: int = 0, version: jax.Array | int = 0):
  """`run_pool` with speculative decoding (pure; jit it) -> (pool, prompt routing, SpecMetrics).

  Each iteration every live slot proposes sc.k tokens (the draft from its own cache rows, or n-gram
  lookup over the sample's prompt + generated tokens), the target verifies them in ONE forward of k+1
  tokens, each slot commits its accepted run plus one token, and both caches roll back the rejected
  slots (rl/speculative.py: `verify`, `rollback`, `ngram_propose`, `draft_propose`). A slot that was just
  refilled (or resumed) first draws its next token from the prefill's logits exactly as plain decoding
  does, then speculates in the same iteration. Ended samples free their slot, refilled as in `run_pool`
  (the draft's rows from the draft's own prompt prefill). Token t of a sample draws from the keys of
  (sample id, t), as in rl/speculative.py, so greedy output equals `run_pool`'s token for token.

  Caches hold S = Lp + N + k + 1 columns (the verified slots may run past a sample's end).
  """
  num, budget = pool.num_samples, pool.tokens.shape[1]
  prompt_len, k = pool.prompts.shape[1], sc.k
  total = prompt_len + budget + k + 1
  sampler = spec.sampler
  prompt_cache, prompt_logits, prefill_aux = _prefill_prompts(model, pool, total)
  vocab, dtype = prompt_logits.shape[-1], prompt_logits.dtype
  resume_ids, cache, logits = _slot_start(model, pool, slots, total, vocab, dtype)
  draft_prompt_cache = draft_cache = None
  if sc.method == "draft":
    draft_prompt_cache = _prefill_prompts(draft, pool, total)[0]
    draft_cache = _slot_start(draft, pool, slots, total, draft.config.vocab_size, dtype)[1]
  prompt_lengths = jnp.sum(pool.prompt_mask, axis=1).astype(jnp.int32)  # [P]
  history_prompts = jnp.where(pool.prompt_mask, pool.prompts, -1)  # [P, Lp] (-1: padding)
  keys = jax.random.wrap_key_data(pool.keys)  # [B]
  stop_tokens = jnp.asarray(spec.stop_tokens, jnp.int32)
  version = jnp.asarray(version, jnp.int32)
  order, num_waiting = _admission_order(pool)
  k1 = jnp.arange(k + 1)[None, :]  # [1, K1]

  def refill(s: _SpecLoop) -> _SpecLoop:
    sid, take, next_pos = _admit(s.sid, s.next, order, num_waiting, num)
    group = pool.group_of[jnp.clip(sid, 0, num - 1)]
    return s.replace(cache=kvc.copy_rows(s.cache, prompt_cache, group, take),
                     draft_cache=None if s.draft_cache is None else kvc.copy_rows(
                         s.draft_cache, draft_prompt_cache, group, take),
                     logits=jnp.where(take[:, None], prompt_logits[group], s.logits),
                     fresh=s.fresh | take, sid=sid, next=next_pos)

  keep_going = _keep_going(num, max_steps)

  def iterate(s: _SpecLoop) -> _SpecLoop:
    p = s.pool
    live = s.sid < num
    rows = jnp.clip(s.sid, 0, num - 1)
    group = p.group_of[rows]
    limit = p.max_lengths[rows]
    # 1. Fresh slots draw their next token from the prefill's logits, as plain decoding does.
    t0 = p.count[rows]
    draw = live & s.fresh
    token = sampler.sample_rows(s.logits, token_keys(keys[rows], t0))
    at = (jnp.where(draw, s.sid, num), t0)
    p = p.replace(tokens=p.tokens.at[at].set(token, mode="drop"),
                  logprobs=p.logprobs.at[at].set(sampler.log_probs(s.logits, token), mode="drop"),
                  versions=p.versions.at[at].set(version, mode="drop"))
    n = jnp.where(draw, t0 + 1, t0)  # [C] committed tokens
    stop0 = draw & jnp.isin(token, stop_tokens)
    ended0 = draw & (stop0 | (n >= limit))
    cur = jnp.where(draw, token, s.cur)
    go = live & ~ended0  # slots that speculate now
    # 2. Propose k tokens after cur; 3. the target verifies [cur, d_0..d_{k-1}] in one forward.
    start = s.cache.index  # [C]
    pos0 = prompt_lengths[group] + n - 1  # [C] position of cur
    step_keys = jax.vmap(lambda key, m: token_keys(jnp.broadcast_to(key, (k + 1,)), m + jnp.arange(k + 1)))(
        keys[rows], n)  # [C, K1]: keys of output tokens n .. n+k
    draft_cache = s.draft_cache
    if sc.method == "draft":
      proposals, probs, draft_cache = draft_propose(draft, draft_cache, cur, pos0, sampler, step_keys, k)
    else:
      history = jnp.concatenate([history_prompts[group], p.tokens[rows]], axis=1)  # [C, Lp + N]
      proposals = ngram_propose(history, prompt_len + n, sc.ngram_n, k)
      probs = None if sampler.temperature == 0 else jax.nn.one_hot(proposals, vocab)
    fed = jnp.concatenate([cur[:, None], proposals], axis=1)  # [C, K1]
    out = model(fed, positions=pos0[:, None] + k1, segment_ids=jnp.ones_like(fed), cache=s.cache)
    accepted, nxt = verify(out.logits, proposals, probs, sampler, step_keys)
    # 4. Commit the accepted run and the drawn token, up to a stop token or the sample's limit.
    extended = jnp.concatenate([proposals, jnp.zeros_like(proposals[:, :1])], axis=1)  # [C, K1]
    committed = jnp.where(k1 < accepted[:, None], extended, nxt[:, None])
    run_len = jnp.minimum(accepted + 1, limit - n)  # [C]
    is_stop = (k1 < run_len[:, None]) & jnp.isin(committed, stop_tokens)
    hit_stop = go & jnp.any(is_stop, axis=1)
    count = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, run_len)
    count = jnp.where(go, count, 0).astype(jnp.int32)
    log_p = jax.nn.log_softmax(sampler.scaled(out.logits), axis=-1)
    logprob = jnp.take_along_axis(log_p, committed[..., None], axis=-1)[..., 0]  # [C, K1]
    at = (jnp.where(k1 < count[:, None], s.sid[:, None], num), n[:, None] + k1)  # dropped unless written
    routing = p.routing
    if routing is not None:  # the forward that read output token n-1+i routed it
      fed_at = (jnp.where(go[:, None] & (k1 <= jnp.minimum(accepted, count)[:, None]), s.sid[:, None], num),
                n[:, None] - 1 + k1)
      routing = routing.at[:, fed_at[0], fed_at[1]].set(out.aux["routing"], mode="drop")
    new_n = n + count
    ended = ended0 | (go & (hit_stop | (new_n >= limit)))
    p = p.replace(tokens=p.tokens.at[at].set(committed, mode="drop"),
                  logprobs=p.logprobs.at[at].set(logprob, mode="drop"),
                  versions=p.versions.at[at].set(version, mode="drop"),
                  count=p.count.at[s.sid].set(new_n, mode="drop"),
                  done=p.done.at[s.sid].set(ended, mode="drop"),
                  stopped=p.stopped.at[s.sid].set(stop0 | hit_stop, mode="drop"), routing=routing)
    # 5. Both caches forget the rejected slots (and everything of slots that did not speculate).
    keep = start + jnp.where(go, accepted + 1, 0)
    got = jnp.where(go, accepted, 0)
    return refill(_SpecLoop(
        step=s.step + 1, next=s.next, cache=rollback(out.cache, keep),
        draft_cache=None if draft_cache is None else rollback(draft_cache, keep),
        logits=s.logits, fresh=s.fresh & ~live, cur=jnp.where(go, nxt, cur),
        sid=jnp.where(ended, num, s.sid), pool=p, accepted=s.accepted + jnp.sum(got),
        proposed=s.proposed + k * jnp.sum(go), row_forwards=s.row_forwards + jnp.sum(go),
        committed=s.committed + jnp.sum(count), row_accepted=s.row_accepted.at[s.sid].add(got, mode="drop")))

  zero = jnp.zeros((), jnp.int32)
  start = refill(_SpecLoop(step=zero, next=zero, cache=cache, draft_cache=draft_cache, logits=logits,
                           fresh=resume_ids < num, cur=jnp.zeros((slots,), jnp.int32), sid=resume_ids,
                           pool=pool, accepted=zero, proposed=zero, row_forwards=zero, committed=zero,
                           row_accepted=jnp.zeros((num,), jnp.int32)))
  final = jax.lax.while_loop(keep_going, iterate, start)
  metrics = SpecMetrics(
      acceptance_rate=final.accepted / jnp.maximum(final.proposed, 1),
      tokens_per_forward=final.committed / jnp.maximum(final.row_forwards, 1),
      target_forwards=final.step, accepted=final.accepted, proposed=final.proposed,
      row_accepted=final.row_accepted)
  return final.pool, prefill_aux.get("routing"), metrics


def to_rollout_batch(pool: Pool, prompt_routing, pad_id: int) -> RolloutBatch:
  """The pool's samples in the RolloutBatch layout [B, S = Lp + N] (prompt, then response columns)."""
  num, budget = pool.tokens.shape
  group = pool.group_of
  prompts, mask = pool.prompts[group], pool.prompt_mask[group]
  positions, segments = prompt_layout(mask)
  prompt_len = prompts.shape[1]
  lengths = jnp.sum(mask, axis=1).astype(jnp.int32)
  valid = jnp.arange(budget)[None, :] < pool.count[:, None]  # [B, N]
  routing = None
  if prompt_routing is not None:
    routing = jnp.concatenate([prompt_routing[:, group], pool.routing], axis=2)
  return RolloutBatch(
      tokens=jnp.concatenate([prompts, jnp.where(valid, pool.tokens, pad_id)], axis=1),
      positions=jnp.concatenate([positions, jnp.where(valid, lengths[:, None] + jnp.arange(budget), 0)], 1),
      segment_ids=jnp.concatenate([segments, valid.astype(jnp.int32)], axis=1),
      prompt_mask=jnp.concatenate([mask, jnp.zeros((num, budget), bool)], axis=1),
      response_mask=jnp.concatenate([jnp.zeros((num, prompt_len), bool), valid], axis=1),
      logprobs=jnp.concatenate([jnp.zeros((num, prompt_len)), jnp.where(valid, pool.logprobs, 0.0)], 1),
      lengths=pool.count, truncated=~pool.stopped,
      policy_version=jnp.concatenate([jnp.full((num, prompt_len), -1, jnp.int32),
                                      jnp.where(valid, pool.versions, -1)], axis=1),
      routing=routing)


def resolve_slots(requested: int, num_samples: int) -> int:
  """rl.decode_slots (0 = one slot per sample), capped at the number of samples."""
  if requested < 0:
    raise ValueError(f"rl.decode_slots={requested} must be >= 0 (0 = the whole batch).")
  return num_samples if requested == 0 else min(requested, num_samples)


def routing_shape(mc) -> tuple[int, int] | None:
  """(MoE layers, experts per token) of the routing a rollout records, None for a dense model."""
  moe_layers = mc.num_layers - mc.first_k_dense if mc.num_experts else 0
  return (moe_layers, mc.num_experts_per_tok) if moe_layers > 0 else None


def engine_setup(cfg, mesh, stop_ids, pad_id, group_size, temperature):
  """(rollout ModelConfig, the model's GraphDef, RolloutSpec) of an engine; the lengths checked."""
  mc = rollout_model_config(cfg, mesh)
  graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
  spec = RolloutSpec.from_config(cfg, stop_ids=stop_ids, pad_id=pad_id, group_size=group_size,
                                 temperature=temperature)
  if mc.max_seq_len < cfg.rl.max_prompt_len + spec.max_new_tokens:
    raise ValueError(f"rl.max_prompt_len={cfg.rl.max_prompt_len} + rl.max_new_tokens="
                     f"{spec.max_new_tokens} exceeds model.max_seq_len={mc.max_seq_len}.")
  return mc, graphdef, spec


def make_engine(cfg, mesh: Mesh | None, *, stop_ids: tuple[int, ...], pad_id: int, slots: int | None = None,
                group_size: int | None = None, temperature: float | None = None,
                draft: tuple[Any, Any] | None = None):
  """Returns jitted `engine(params, extra, prompts [P, Lp], prompt_mask, key, max_lengths=None,
  version=0) -> RolloutBatch`, every sample run to its end on `slots` decode slots (None:
  rl.decode_slots; 0: one per sample). Same signature and samples as rollout.make_rollout.

  rl.speculative != "none": the slots speculate (`run_pool_speculative`); the last call's SpecMetrics
  are in `engine.metrics`. draft: (draft ModelConfig, params State) for "draft" (default:
  rl.draft_config / rl.draft_checkpoint)."""
  mc, graphdef, spec = engine_setup(cfg, mesh, stop_ids, pad_id, group_size, temperature)
  requested = cfg.rl.decode_slots if slots is None else slots
  sc = None
  draft_graph = draft_params = draft_rest = None
  if cfg.rl.speculative != "none":
    sc = SpecConfig.from_config(cfg, need_checkpoint=draft is None)
    draft_graph, draft_params, draft_rest = speculative_setup(cfg, mesh, mc, spec, sc, draft)

  def engine_fn(params, extra, draft_state, prompts, prompt_mask, key, max_lengths, version):
    num = prompts.shape[0] * spec.group_size
    pool = new_pool(prompts, prompt_mask, sample_keys(key, jnp.arange(num)), group_size=spec.group_size,
                    max_new_tokens=spec.max_new_tokens, pad_id=pad_id, max_lengths=max_lengths,
                    routing_shape=routing_shape(mc))
    model = nnx.merge(graphdef, params, extra)
    num_slots = resolve_slots(requested, num)
    if sc is None:
      pool, prompt_routing = run_pool(model, spec, pool, slots=num_slots, version=version)
      return to_rollout_batch(pool, prompt_routing, pad_id)
    draft_model = None if draft_graph is None else nnx.merge(draft_graph, draft_state, draft_rest)
    pool, prompt_routing, metrics = run_pool_speculative(model, draft_model, spec, sc, pool, slots=num_slots,
                                                         version=version)
    return to_rollout_batch(pool, prompt_routing, pad_id), metrics

  if sc is None:
    def plain(params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
      return engine_fn(params, extra, None, prompts, prompt_mask, key, max_lengths, version)
    return with_generation_weights(cfg, mesh, mc, plain)
  return speculative_call(with_generation_weights(cfg, mesh, mc, engine_fn), draft_params)


def check_engine_config(rl, data_parallel: int | None = None) -> None:
  """Raises ValueError naming the field for a bad rl.engine / rl.decode_slots /
  rl.rollout_token_budget; with `data_parallel` (the batch axes' size) also the mesh checks."""
  if rl.engine not in ENGINES:
    raise ValueError(f"rl.engine={rl.engine!r}; choose one of {', '.join(ENGINES)}.")
  if rl.rollout_token_budget < 0:
    raise ValueError(f"rl.rollout_token_budget={rl.rollout_token_budget} must be >= 0 (0 = off).")
  batch = rl.prompts_per_step * rl.group_size
  slots = resolve_slots(rl.decode_slots, batch)
  if rl.engine == "static" and (rl.decode_slots or rl.rollout_token_budget):
    raise ValueError(f"rl.decode_slots={rl.decode_slots} and rl.rollout_token_budget="
                     f"{rl.rollout_token_budget} need rl.engine='continuous' (rl.engine='static').")
  if rl.rollout_token_budget:
    if rl.rollout_token_budget < slots:
      raise ValueError(f"rl.rollout_token_budget={rl.rollout_token_budget} is less than one token per "
                       f"decode slot (rl.decode_slots resolves to {slots}).")
    if rl.dynamic_sampling and rl.max_resample_rounds:
      raise ValueError(f"rl.rollout_token_budget={rl.rollout_token_budget} takes no extra rollout rounds: "
                       f"set rl.max_resample_rounds=0 (now {rl.max_resample_rounds}); dynamic sampling then "
                       "masks the uninformative groups among those that ended.")
  if data_parallel and slots % data_parallel:
    raise ValueError(f"rl.decode_slots={rl.decode_slots} ({slots} slots) is not divisible by the "
                     f"data-parallel axes data*fsdp*expert = {data_parallel}.")
