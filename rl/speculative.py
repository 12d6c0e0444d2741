"""Speculative decoding: cheap proposals of k tokens, verified by the target in one forward.

Two proposers:
  draft  a small meshrl model (its own ModelConfig, params and KV cache) decodes k tokens greedily or by
         sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
         Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").
  ngram  prompt lookup, draft-free: the k tokens that followed the latest earlier occurrence of the
         row's last n tokens in its own context (prompt + generated), proposed with probability one
         (Saxena 2023, "Prompt Lookup Decoding").

One iteration, per row, with `cur` the last committed token (not yet in either cache):
  1. propose d_0..d_{k-1} (the draft reads cur, d_0..d_{k-1}: k+1 single-token steps, so its cache
     holds the same slots as the target's afterwards);
  2. the target reads [cur, d_0..d_{k-1}] in ONE forward (k+1 tokens written at the row's own cache
     index) and gives the k+1 next-token distributions p_0..p_k;
  3. `verify` accepts a leading run of a drafts and draws one more token (a correction from the
     residual, or the bonus from p_k when all k were accepted): a+1 committed tokens;
  4. both caches roll back to index + 1 + a: the rejected slots get EMPTY_POSITION again.
Greedy (temperature 0) output equals plain greedy decoding token for token; with temperature > 0 the
modified rejection sampling keeps the output distribution the target's. Rows accept different
counts, so the caches use per-row write indices. Everything runs in one jitted `lax.while_loop`.

Randomness: the token at output index t draws from keys derived from (rollout key, sample id, t) only
(rl/sampling.py): fold_in(token key, 1) for the draft's proposal, 2 for the acceptance test, 3 for the
correction / bonus. Token 0 (from the prefill) is drawn exactly as plain decoding draws it.

The continuous-batching engine speculates with the same pieces (`verify`, `rollback`, `ngram_propose`,
`draft_propose`) in its decode slots: rl/engine.py `run_pool_speculative`.

Axis legend: P prompts, G group size, B = P * G rows, Lp prompt length, N max new tokens, k proposals,
K1 = k + 1 verified slots, S cache length, V vocab, H history length, L MoE layers, E top-k experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from meshrl.model import kv_cache as kvc
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.rollout import (RolloutBatch, RolloutSpec, prompt_layout, rollout_model_config,
                               with_generation_weights)
from meshrl.rl.sampling import Sampler, sample_keys, token_keys

METHODS = ("none", "draft", "ngram")
_DRAFT_KEY, _ACCEPT_KEY, _RESIDUAL_KEY = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """method "draft" or "ngram"; k proposals per target forward; ngram_n tokens matched by "ngram"."""
  method: str = "draft"
  k: int = 4
  ngram_n: int = 3

  def __post_init__(self):
    if self.method not in METHODS[1:]:
      raise ValueError(f"rl.speculative={self.method!r}; choose one of {METHODS}.")
    if self.k < 1:
      raise ValueError(f"rl.speculative_k={self.k} must be at least 1.")
    if self.ngram_n < 1:
      raise ValueError(f"rl.ngram_n={self.ngram_n} must be at least 1.")

  @classmethod
  def from_config(cls, cfg, *, need_checkpoint: bool = True) -> "SpecConfig":
    """cfg.rl's speculative fields, checked against the options they cannot compose with
    (need_checkpoint: the draft comes from rl.draft_checkpoint, not from the caller)."""
    rl = cfg.rl
    spec = cls(method=rl.speculative, k=rl.speculative_k, ngram_n=rl.ngram_n)
    if cfg.attention.impl == "ring":
      raise ValueError("rl.speculative needs a cached multi-token forward; attention.impl='ring' "
                       "decodes one token at a time (choose 'reference' or 'blockwise').")
    if spec.method == "draft" and need_checkpoint and not (rl.draft_checkpoint and rl.draft_config):
      raise ValueError("rl.speculative='draft' needs rl.draft_checkpoint (a meshrl checkpoint of the "
                       "draft, e.g. from scripts/distill_draft.py) and rl.draft_config.")
    return spec


def check_compatible(target: ModelConfig, draft: ModelConfig) -> None:
  """Raises unless the draft can propose tokens the target reads (same vocabulary)."""
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"draft model vocab_size={draft.vocab_size} differs from the target's "
                     f"vocab_size={target.vocab_size}: speculative decoding needs one tokenizer.")


def check_sampler(sampler: Sampler) -> None:
  """Top-k / top-p change the target distribution the rejection test must reproduce: refused at T>0."""
  if sampler.temperature > 0 and (sampler.top_k or sampler.top_p < 1.0):
    raise ValueError(f"speculative sampling at rl.temperature={sampler.temperature} cannot compose with "
                     f"rl.top_k={sampler.top_k} / rl.top_p={sampler.top_p}; set top_k=0 and top_p=1.")


@struct.dataclass
class SpecMetrics:
  acceptance_rate: jax.Array  # [] accepted proposals / proposed (over live rows)
  tokens_per_forward: jax.Array  # [] committed tokens per row per verification forward
  target_forwards: jax.Array  # [] verification forwards of the batch (the prefill not counted)
  accepted: jax.Array  # [] int32 accepted proposals
  proposed: jax.Array  # [] int32 proposals made to live rows
  row_accepted: jax.Array  # [B] int32 accepted proposals per row


# --- the pieces (module level, tested directly) ------------------------------------------------------


def rollback(cache: kvc.KVCache, keep: jax.Array) -> kvc.KVCache:
  """Forgets every slot at or after keep [B] that was written since (up to cache.index [B]): their
  positions go back to EMPTY_POSITION (segments EMPTY_SEGMENT) so no query attends them, and the
  write index returns to keep. Entries stay; the next write overwrites them."""
  slots = jnp.arange(cache.max_len)[None, :]  # [1, S]
  stale = (slots >= keep[:, None]) & (slots < cache.index[:, None])  # [B, S]
  return cache.replace(positions=jnp.where(stale, kvc.EMPTY_POSITION, cache.positions),
                       segment_ids=jnp.where(stale, kvc.EMPTY_SEGMENT, cache.segment_ids),
                       index=keep.astype(jnp.int32))


def verify(target_logits: jax.Array, proposals: jax.Array, proposal_probs: jax.Array | None,
           sampler: Sampler, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """How many proposals each row accepts, and the token drawn after them.

  Args:
    target_logits: [B, K1, V] the target's next-token logits at cur, d_0, .., d_{k-1}.
    proposals: [B, k] int32 proposed tokens d_i.
    proposal_probs: [B, k, V] the distributions q_i the proposals were drawn from (temperature > 0).
    sampler: the target's sampler (temperature 0: greedy).
    keys: [B, K1] the token keys of output slots n .. n+k.
  Returns:
    accepted [B] int32 in [0, k]; next_token [B] int32: at temperature 0 the target's argmax after the
    accepted run; else drawn from norm(max(0, p_a - q_a)) (a < k) or from p_k (a = k).
  """
  k = proposals.shape[1]
  if sampler.temperature == 0:
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K1]
    accepted = jnp.sum(jnp.cumprod(proposals == best[:, :k], axis=1), axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]
  p = jax.nn.softmax(sampler.scaled(target_logits), axis=-1)  # [B, K1, V]
  p_d = jnp.take_along_axis(p[:, :k], proposals[..., None], axis=-1)[..., 0]  # [B, k]
  q_d = jnp.take_along_axis(proposal_probs, proposals[..., None], axis=-1)[..., 0]  # [B, k]
  accept_keys = jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, _ACCEPT_KEY)))(keys[:, :k])
  u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys)  # [B, k]
  ok = u * q_d < p_d  # u < min(1, p/q)
  accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
  # q is zero at the bonus slot, so one formula gives both the residual and the bonus distribution.
  q = jnp.concatenate([proposal_probs, jnp.zeros_like(p[:, :1])], axis=1)  # [B, K1, V]
  pick = lambda a: jnp.take_along_axis(a, accepted[:, None, None], axis=1)[:, 0]  # noqa: E731
  p_a, q_a = pick(p), pick(q)  # [B, V]
  residual = jnp.maximum(p_a - q_a, 0.0)
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_a)  # p == q: draw from p
  draw_keys = jax.vmap(lambda key: jax.random.fold_in(key, _RESIDUAL_KEY))(
      jnp.take_along_axis(keys, accepted[:, None], axis=1)[:, 0])
  draw = jax.vmap(lambda key, w: jax.random.categorical(key, jnp.log(w)))(draw_keys, residual)
  return accepted, draw.astype(jnp.int32)


def ngram_propose(history: jax.Array, length: jax.Array, n: int, k: int) -> jax.Array:
  """Prompt lookup: for each row the k tokens that followed the latest earlier occurrence of its last n
  tokens. history [B, H] int32 (negative where there is no token: prompt padding), length [B] its used
  length -> proposals [B, k] int32 (0 where nothing matched or the continuation runs out)."""
  width = history.shape[1]
  suffix_at = jnp.clip(length[:, None] - n + jnp.arange(n), 0, width - 1)  # [B, n]
  suffix = jnp.take_along_axis(history, suffix_at, axis=1)  # [B, n]
  starts = jnp.arange(width - n + 1)  # [W]
  windows = history[:, starts[:, None] + jnp.arange(n)]  # [B, W, n]
  match = jnp.all(windows == suffix[:, None, :], axis=-1)  # [B, W]
  match &= (starts[None, :] + n < length[:, None]) & jnp.all(suffix >= 0, axis=1, keepdims=True)
  latest = jnp.max(jnp.where(match, starts[None, :], -1), axis=1)  # [B]
  follow_at = latest[:, None] + n + jnp.arange(k)  # [B, k]
  follow = jnp.take_along_axis(history, jnp.clip(follow_at, 0, width - 1), axis=1)
  known = (latest[:, None] >= 0) & (follow_at < length[:, None]) & (follow >= 0)
  return jnp.where(known, follow, 0).astype(jnp.int32)


def _write_at(buffer: jax.Array, chunk: jax.Array, column: jax.Array, axis: int = 1) -> jax.Array:
  """buffer [.., B, W, ..] with chunk [.., B, T, ..] written at each row's own column [B] (axis = W)."""
  def row(b, c, i):
    return jax.lax.dynamic_update_slice_in_dim(b, c, i, axis=axis - 1)
  return jax.vmap(row, in_axes=(axis - 1, axis - 1, 0), out_axes=axis - 1)(buffer, chunk, column)


@struct.dataclass
class _SpecState:
  iters: jax.Array  # [] int32 verification forwards
  cache: kvc.KVCache  # target cache, per-row index; holds every committed token but cur
  draft_cache: Any  # the draft's cache, same slots (None for ngram)
  cur: jax.Array  # [B] int32 last committed token
  n: jax.Array  # [B] int32 committed tokens
  tokens: jax.Array  # [B, N + K1] int32
  logprobs: jax.Array  # [B, N + K1] float32
  routing: Any  # [L, B, N + K1, E] int32 or None
  done: jax.Array  # [B] bool
  stopped: jax.Array  # [B] bool
  accepted: jax.Array  # [] int32
  proposed: jax.Array  # [] int32
  row_forwards: jax.Array  # [] int32 live rows summed over verification forwards
  row_accepted: jax.Array  # [B] int32


def draft_propose(draft: Transformer, cache: kvc.KVCache, cur, pos0, sampler: Sampler, keys, k: int):
  """k+1 single-token draft steps reading cur, d_0, .., d_{k-1} -> (d [B, k], q [B, k, V] or None, cache)."""
  def step(carry, i):
    c, tok = carry
    out = draft(tok[:, None], positions=(pos0 + i)[:, None], segment_ids=jnp.ones_like(tok)[:, None],
                cache=c)
    logits = out.logits[:, 0]  # [B, V]
    if sampler.temperature == 0:
      nxt, probs = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    else:
      step_keys = jax.vmap(lambda key: jax.random.fold_in(key, _DRAFT_KEY))(
          jax.lax.dynamic_index_in_dim(keys, jnp.minimum(i, k - 1), axis=1, keepdims=False))
      scaled = sampler.scaled(logits)
      nxt = jax.vmap(jax.random.categorical)(step_keys, scaled).astype(jnp.int32)
      probs = jax.nn.softmax(scaled, axis=-1)
    return (out.cache, nxt), (nxt, probs)
  (cache, _), (proposals, probs) = jax.lax.scan(step, (cache, cur), jnp.arange(k + 1))
  proposals = proposals[:k].T  # [B, k]
  probs = None if probs is None else jnp.swapaxes(probs[:k], 0, 1)  # [B, k, V]
  return proposals, probs, cache


def speculative_generate(model: Transformer, draft: Transformer | None, spec: RolloutSpec, sc: SpecConfig,
                         prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array,
                         max_lengths: jax.Array | None = None, version: jax.Array | int = 0,
                         return_caches: bool = False):
  """`rollout.generate` with speculation (pure; jit it): prompts [P, Lp] left-padded -> (RolloutBatch,
  SpecMetrics) [, (target cache, draft cache, committed counts [B]) when return_caches]. draft: the draft model for
  sc.method == "draft" (None for ngram)."""
  if sc.method == "draft":
    if draft is None:
      raise ValueError("speculative method 'draft' needs a draft model.")
    check_compatible(model.config, draft.config)
  check_sampler(spec.sampler)
  num_prompts, prompt_len = prompts.shape
  group, budget, k = spec.group_size, spec.max_new_tokens, sc.k
  batch, width = num_prompts * group, budget + k + 1
  cache_len = prompt_len + budget + k + 1
  positions, segment_ids = prompt_layout(prompt_mask)
  sampler = spec.sampler

  def prefill(m: Transformer):
    out = m(prompts, positions=positions, segment_ids=segment_ids, cache=m.init_cache(num_prompts, cache_len))
    return kvc.with_row_index(kvc.repeat_rows(out.cache, group)), out
  cache, first = prefill(model)
  draft_cache = prefill(draft)[0] if sc.method == "draft" else None
  last_logits = jnp.repeat(first.logits[:, -1], group, axis=0)  # [B, V]
  prompt_lengths = jnp.repeat(jnp.sum(prompt_mask, axis=1), group).astype(jnp.int32)  # [B]
  limits = jnp.full((batch,), budget, jnp.int32) if max_lengths is None else jnp.minimum(
      jnp.asarray(max_lengths, jnp.int32), budget)
  keys = sample_keys(key, jnp.arange(batch))  # [B]
  stop_tokens = jnp.asarray(spec.stop_tokens, jnp.int32)
  history_prompt = jnp.where(jnp.repeat(prompt_mask, group, axis=0), jnp.repeat(prompts, group, axis=0), -1)

  token0 = sampler.sample_rows(last_logits, token_keys(keys, jnp.zeros((), jnp.int32)))  # as plain decoding
  live0 = limits >= 1
  stopped0 = live0 & jnp.isin(token0, stop_tokens)
  routing = None
  if first.aux.get("routing") is not None:
    layers, _, _, experts = first.aux["routing"].shape
    routing = jnp.zeros((layers, batch, width, experts), jnp.int32)
  state = _SpecState(
      iters=jnp.zeros((), jnp.int32), cache=cache, draft_cache=draft_cache, cur=token0,
      n=live0.astype(jnp.int32),
      tokens=jnp.full((batch, width), spec.pad_id, jnp.int32).at[:, 0].set(token0),
      logprobs=jnp.zeros((batch, width), jnp.float32).at[:, 0].set(sampler.log_probs(last_logits, token0)),
      routing=routing, done=~live0 | stopped0 | (limits <= 1), stopped=stopped0,
      accepted=jnp.zeros((), jnp.int32), proposed=jnp.zeros((), jnp.int32),
      row_forwards=jnp.zeros((), jnp.int32), row_accepted=jnp.zeros((batch,), jnp.int32))
  slots = jnp.arange(k + 1)[None, :]  # [1, K1]

  def keep_going(s: _SpecState):
    return ~jnp.all(s.done)

  def iterate(s: _SpecState) -> _SpecState:
    live = ~s.done
    start = s.cache.index  # [B]
    pos0 = prompt_lengths + s.n - 1  # [B] position of cur
    step_keys = jax.vmap(lambda key, n: token_keys(jnp.broadcast_to(key, (k + 1,)), n + jnp.arange(k + 1)))(
        keys, s.n)  # [B, K1]: keys of output slots n .. n+k
    draft_cache = s.draft_cache
    if sc.method == "draft":
      proposals, probs, draft_cache = draft_propose(draft, draft_cache, s.cur, pos0, sampler, step_keys, k)
    else:
      history = jnp.concatenate([history_prompt, s.tokens], axis=1)
      proposals = ngram_propose(history, prompt_len + s.n, sc.ngram_n, k)
      probs = None if sampler.temperature == 0 else jax.nn.one_hot(proposals, last_logits.shape[-1])
    fed = jnp.concatenate([s.cur[:, None], proposals], axis=1)  # [B, K1]
    out = model(fed, positions=pos0[:, None] + slots, segment_ids=jnp.ones_like(fed), cache=s.cache)
    accepted, nxt = verify(out.logits, proposals, probs, sampler, step_keys)
    extended = jnp.concatenate([proposals, jnp.zeros_like(proposals[:, :1])], axis=1)  # [B, K1]
    committed = jnp.where(slots < accepted[:, None], extended, nxt[:, None])  # slots <= a are real
    in_run = slots <= accepted[:, None]
    run_len = jnp.minimum(accepted + 1, limits - s.n)  # a stop token past the row's limit does not count
    is_stop = (slots < run_len[:, None]) & jnp.isin(committed, stop_tokens)
    hit_stop = jnp.any(is_stop, axis=1)
    count = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, run_len)
    count = jnp.where(live, count, 0).astype(jnp.int32)
    log_p = jax.nn.log_softmax(sampler.scaled(out.logits), axis=-1)
    logprob = jnp.take_along_axis(log_p, committed[..., None], axis=-1)[..., 0]  # [B, K1]
    written = slots < count[:, None]
    keep_rows = live[:, None]
    tokens = jnp.where(keep_rows, _write_at(s.tokens, jnp.where(written, committed, spec.pad_id), s.n), s.tokens)
    logprobs = jnp.where(keep_rows, _write_at(s.logprobs, jnp.where(written, logprob, 0.0), s.n), s.logprobs)
    routing = s.routing
    if routing is not None:  # the forward that read output token n-1+i routed it: column n-1+i
      chosen = jnp.where((live[:, None] & in_run)[None, :, :, None], out.aux["routing"], 0)
      routing = jnp.where(live[None, :, None, None], _write_at(routing, chosen, s.n - 1, axis=2), routing)
    n = s.n + count
    stopped = s.stopped | (live & hit_stop)
    keep = start + jnp.where(live, accepted + 1, 0)
    return _SpecState(
        iters=s.iters + 1, cache=rollback(out.cache, keep),
        draft_cache=None if draft_cache is None else rollback(draft_cache, keep),
        cur=jnp.where(live, nxt, s.cur), n=n, tokens=tokens, logprobs=logprobs, routing=routing,
        done=s.done | stopped | (n >= limits), stopped=stopped,
        accepted=s.accepted + jnp.sum(jnp.where(live, accepted, 0)),
        proposed=s.proposed + k * jnp.sum(live), row_forwards=s.row_forwards + jnp.sum(live),
        row_accepted=s.row_accepted + jnp.where(live, accepted, 0))

  final = jax.lax.while_loop(keep_going, iterate, state)

  lengths = jnp.minimum(final.n, limits)  # [B]
  valid = jnp.arange(budget)[None, :] < lengths[:, None]  # [B, N]
  rep = lambda a: jnp.repeat(a, group, axis=0)  # noqa: E731
  response_positions = prompt_lengths[:, None] + jnp.arange(budget, dtype=jnp.int32)
  routing = None
  if final.routing is not None:
    decode = jnp.where(valid[None, :, :, None], final.routing[:, :, :budget], 0)
    routing = jnp.concatenate([jnp.repeat(first.aux["routing"], group, axis=1), decode], axis=2)
  batch_out = RolloutBatch(
      tokens=jnp.concatenate([rep(prompts), jnp.where(valid, final.tokens[:, :budget], spec.pad_id)], 1),
      positions=jnp.concatenate([rep(positions), jnp.where(valid, response_positions, 0)], axis=1),
      segment_ids=jnp.concatenate([rep(segment_ids), valid.astype(jnp.int32)], axis=1),
      prompt_mask=jnp.concatenate([rep(prompt_mask).astype(bool), jnp.zeros((batch, budget), bool)], 1),
      response_mask=jnp.concatenate([jnp.zeros((batch, prompt_len), bool), valid], axis=1),
      logprobs=jnp.concatenate([jnp.zeros((batch, prompt_len)),
                                jnp.where(valid, final.logprobs[:, :budget], 0.0)], axis=1),
      lengths=lengths, truncated=~final.stopped,
      policy_version=jnp.concatenate([jnp.full((batch, prompt_len), -1, jnp.int32), jnp.where(
          valid, jnp.asarray(version, jnp.int32), -1)], axis=1),
      routing=routing)
  proposed = jnp.maximum(final.proposed, 1)
  metrics = SpecMetrics(
      acceptance_rate=final.accepted / proposed,
      tokens_per_forward=jnp.sum(jnp.maximum(final.n - 1, 0)) / jnp.maximum(final.row_forwards, 1),
      target_forwards=final.iters, accepted=final.accepted, proposed=final.proposed,
      row_accepted=final.row_accepted)
  if return_caches:
    return batch_out, metrics, (final.cache, final.draft_cache, final.n)
  return batch_out, metrics


# --- the rollout entry point -----------------------------------------------------------------------


def draft_run_config(spec: str):
  """The draft's run config from rl.draft_config: "preset[:arg]" then ";"-separated a.b=value overrides,
  e.g. "configs/tiny.py:dense;model.num_layers=1"."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  preset, *overrides = [part.strip() for part in spec.split(";") if part.strip()] or [""]
  if not preset:
    raise ValueError("rl.speculative='draft' needs rl.draft_config (the draft's preset).")
  return configs.load(preset, overrides)


def load_draft(cfg, mesh: Mesh | None):
  """(draft ModelConfig, params State) from rl.draft_config and rl.draft_checkpoint (a meshrl
  checkpoint or work directory holding the draft's params, e.g. from scripts/distill_draft.py)."""
  from meshrl.train.checkpoint import from_nested_dict, load_params  # pylint: disable=import-outside-toplevel
  mc = rollout_model_config(draft_run_config(cfg.rl.draft_config), mesh)
  abstract = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0)))
  nested = load_params(cfg.rl.draft_checkpoint)["params"]
  return mc, from_nested_dict(nested, nnx.state(abstract, nnx.Param))


def speculative_setup(cfg, mesh: Mesh | None, mc: ModelConfig, spec: RolloutSpec, sc: SpecConfig,
                      draft: tuple[ModelConfig, Any] | None):
  """The checks every speculative generator shares (sampler, sequence length, draft vocabulary) and the
  draft's pieces -> (graphdef, params, non-param state), all None for ngram. draft: (ModelConfig,
  params State), default load_draft(cfg, mesh)."""
  check_sampler(spec.sampler)
  extra_len = sc.k + 1
  if mc.max_seq_len < cfg.rl.max_prompt_len + spec.max_new_tokens + extra_len:
    raise ValueError(f"rl.max_prompt_len={cfg.rl.max_prompt_len} + rl.max_new_tokens={spec.max_new_tokens}"
                     f" + rl.speculative_k+1={extra_len} exceeds model.max_seq_len={mc.max_seq_len}.")
  if sc.method != "draft":
    return None, None, None
  draft_mc, draft_params = draft if draft is not None else load_draft(cfg, mesh)
  check_compatible(mc, draft_mc)
  draft_graph, _, draft_rest = nnx.split(
      nnx.eval_shape(lambda: Transformer(draft_mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
  if jax.tree.leaves(draft_rest):
    raise ValueError("the draft model carries non-parameter state (moe.aux_free_bias); use a draft "
                     "without it.")
  return draft_graph, draft_params, draft_rest


def make_speculative_rollout(cfg, mesh: Mesh | None, *, stop_ids: tuple[int, ...], pad_id: int,
                             group_size: int | None = None, temperature: float | None = None,
                             draft: tuple[ModelConfig, Any] | None = None):
  """`make_rollout` with speculation: the same call, `rollout(params, extra, prompts, prompt_mask, key,
  max_lengths=None, version=0) -> RolloutBatch`; the last call's SpecMetrics are in `rollout.metrics`.

  draft: (draft ModelConfig, draft params State) for rl.speculative == "draft" (default: load_draft).
  """
  sc = SpecConfig.from_config(cfg, need_checkpoint=draft is None)
  mc = rollout_model_config(cfg, mesh)
  graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
  spec = RolloutSpec.from_config(cfg, stop_ids=stop_ids, pad_id=pad_id, group_size=group_size,
                                 temperature=temperature)
  draft_graph, draft_params, draft_rest = speculative_setup(cfg, mesh, mc, spec, sc, draft)

  def generate_fn(params, extra, draft_state, prompts, prompt_mask, key, max_lengths, version):
    draft_model = None if draft_graph is None else nnx.merge(draft_graph, draft_state, draft_rest)
    return speculative_generate(nnx.merge(graphdef, params, extra), draft_model, spec, sc, prompts,
                                prompt_mask, key, max_lengths, version)
  run = with_generation_weights(cfg, mesh, mc, generate_fn)  # jitted; int8 target weights if asked
  return speculative_call(run, draft_params)


def speculative_call(run, draft_params):
  """The rollout interface over `run(params, extra, draft_params, prompts, prompt_mask, key,
  max_lengths, version) -> (RolloutBatch, SpecMetrics)`: a function of (params, extra, prompts,
  prompt_mask, key, max_lengths=None, version=0) -> RolloutBatch whose last call's SpecMetrics are in
  its `.metrics`, with `.lower` when `run` is a plain jitted program (rl/loop.py counts its FLOPs)."""
  def rollout(params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
    batch, rollout.metrics = run(params, extra, draft_params, prompts, prompt_mask, key, max_lengths, version)
    return batch

  def lower(params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
    return run.lower(params, extra, draft_params, prompts, prompt_mask, key, max_lengths, version)

  rollout.metrics = None
  if hasattr(run, "lower"):
    rollout.lower = lower
  return rollout
