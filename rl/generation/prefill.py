"""Prompt prefill: left-padded prompts [P, Lp] into fresh KV caches, in one pass, in chunks, or by
ring attention into a sequence-sharded cache (1M-token prompts).

  cache, logits, routing = prefill_prompts(model, prompts, prompt_mask, total, chunk)
  cache, draft_cache, logits, routing = prefill_models(models, prompts, prompt_mask, total, chunk)
  fill = fill_prompts(models, prompts, prompt_mask, total); fill = fill_chunk(models, fill, chunk)

The chunked forms feed the prompts through core.extend_chunk ("extend rows at their own index"), so a
chunk attends through the cache as a decode step does; the continuous scheduler runs one chunk per
loop iteration between the other slots' decode steps (rl/generation/loop.py). Each returns what the
decode core starts from: caches with the prompt's columns, the last token's logits and the prompt's
MoE routes (routing replay).

Axis legend: P prompts, Lp prompt columns, V vocab, L MoE layers, K experts per token, S cache columns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from meshrl.model import kv_cache as kvc
from meshrl.model.ring_attention import unzigzag_on_mesh, zigzag
from meshrl.rl.generation.core import Models, extend_chunk, laid_out_cache, per_layer, write_routes
from meshrl.rl.generation.state import Slots
from meshrl.sharding.mesh import SEQUENCE_AXIS, axis_size


def prompt_layout(prompt_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Positions (0.. over real tokens) and segment ids (1 real, 0 pad) of left-padded prompts [P, Lp]
  (numpy in, numpy out; jax in, jax out)."""
  xp = np if isinstance(prompt_mask, np.ndarray) else jnp
  positions = xp.maximum(xp.cumsum(prompt_mask.astype(xp.int32), axis=1) - 1, 0).astype(xp.int32)
  return positions, prompt_mask.astype(xp.int32)


def uses_ring_prefill(mc) -> bool:
  """Whether prompts are prefilled by ring attention into a sequence-sharded cache: attention.impl
  = "ring" on a mesh whose `sequence` axis has more than one device."""
  mesh = mc.kernel.mesh
  return mc.kernel.impl == "ring" and axis_size(mesh, SEQUENCE_AXIS) > 1


def ring_prefill_length(mc, total: int) -> int:
  """The cache length of a ring prefill: `total` rounded up to a multiple of the `sequence` axis
  (of twice it with the zigzag layout, attention.zigzag: two chunks per device)."""
  shards = axis_size(mc.kernel.mesh, SEQUENCE_AXIS)
  multiple = 2 * shards if mc.kernel.zigzag else shards
  length = -(-total // multiple) * multiple
  if length > mc.max_seq_len:
    what = f"2 x mesh.sequence={multiple} (attention.zigzag)" if mc.kernel.zigzag else f"mesh.sequence={shards}"
    raise ValueError(f"ring prefill: a cache of {total} slots rounded up to a multiple of {what} is "
                     f"{length}, above model.max_seq_len={mc.max_seq_len}.")
  return length


@struct.dataclass
class PromptFill:
  """Prompts being prefilled chunk by chunk (`fill_prompts`, `fill_chunk`): P rows of the caches,
  row p's real tokens packed first in `tokens` and written into the cache from column pad[p] on, so
  its cache columns are the one-pass prefill's (the left padding stays empty)."""
  slots: Slots  # P rows: caches (per-row index), last-token logits, positions
  tokens: jax.Array  # [P, Lp] int32: row p's real tokens first
  lengths: jax.Array  # [P] int32: real tokens
  fed: jax.Array  # [P] int32: tokens in the caches so far
  routing: Any  # [L, P, Lp, K] int32 routes of the prompt columns fed so far, or None (dense model)

  def ready(self) -> jax.Array:
    """[P] bool: the prompt is in the cache whole (its logits are the next token's)."""
    return self.fed >= self.lengths


def fill_prompts(models: Models, prompts: jax.Array, prompt_mask: jax.Array, total: int) -> PromptFill:
  """Left-padded prompts [P, Lp] about to be prefilled in chunks into fresh caches of `total` columns
  (in the form `models` decodes with; a draft's too)."""
  num_prompts, prompt_len = prompts.shape
  lengths = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)
  pad = prompt_len - lengths
  columns = jnp.minimum(pad[:, None] + jnp.arange(prompt_len)[None, :], prompt_len - 1)
  tokens = jnp.take_along_axis(prompts.astype(jnp.int32), columns, axis=1)

  def fresh(model):
    if model is None:
      return None
    return per_layer(models, model.init_cache(num_prompts, total)).replace(index=pad)
  mc = models.target.config
  slots = Slots(sid=jnp.zeros((num_prompts,), jnp.int32), cache=fresh(models.target),
                draft_cache=fresh(models.draft), logits=jnp.zeros((num_prompts, mc.vocab_size), jnp.float32),
                position=jnp.zeros((num_prompts,), jnp.int32), window=None, sampling=None)
  routing = None
  if mc.num_experts and mc.num_moe_layers:
    routing = jnp.zeros((mc.num_moe_layers, num_prompts, prompt_len, mc.num_experts_per_tok), jnp.int32)
  return PromptFill(slots=slots, tokens=tokens, lengths=lengths, fed=jnp.zeros_like(lengths), routing=routing)


def fill_chunk(models: Models, fill: PromptFill, chunk: int) -> PromptFill:
  """The next chunk of every prompt not yet in the caches (`extend_chunk`); their routes recorded at
  the prompt columns (pad + token)."""
  num_prompts, prompt_len = fill.tokens.shape
  rows = jnp.arange(num_prompts, dtype=jnp.int32)
  slots, fed, routes, start = extend_chunk(models, fill.slots, rows, fill.tokens, fill.lengths, fill.fed, chunk)
  token = start[:, None] + jnp.arange(chunk)[None, :]  # [P, chunk]: the prompt token at each chunk column
  new = (fill.fed < fill.lengths)[:, None] & (token >= 0) & (token < fed[:, None])
  columns = jnp.where(new, prompt_len - fill.lengths[:, None] + token, prompt_len)
  return fill.replace(slots=slots, fed=fed, routing=write_routes(fill.routing, rows, columns, routes))


def prefill_in_chunks(models: Models, prompts: jax.Array, prompt_mask: jax.Array, total: int, chunk: int):
  """`prefill_prompts` in chunks of `chunk` tokens back to back (rl.prefill_chunk; the static
  scheduler): the same cache columns, logits and routes as the one-pass prefill (up to float
  rounding), with activations of P x chunk tokens at a time instead of P x Lp. The draft of `models`
  (when it has one) is fed the same chunks. Returns (cache, draft cache or None, logits, routing)."""
  def laid_out(f: PromptFill) -> PromptFill:  # the caches kept split like the one-pass prefill's
    draft = None if models.draft is None else laid_out_cache(models.draft.config, f.slots.draft_cache)
    cache = laid_out_cache(models.target.config, f.slots.cache)
    return f.replace(slots=f.slots.replace(cache=cache, draft_cache=draft))
  fill = laid_out(fill_prompts(models, prompts, prompt_mask, total))
  steps = -(-prompts.shape[1] // chunk)
  fill = jax.lax.fori_loop(0, steps, lambda _, f: laid_out(fill_chunk(models, f, chunk)), fill)
  done = lambda c: None if c is None else c.replace(index=jnp.asarray(prompts.shape[1], jnp.int32))  # noqa: E731
  return done(fill.slots.cache), done(fill.slots.draft_cache), fill.slots.logits, fill.routing




def prefill_models(models: Models, prompts: jax.Array, prompt_mask: jax.Array, total: int, chunk: int = 0):
  """`prefill_prompts` of the target and of the (speculative) draft, both chunked alike (chunk: as
  there; one pass otherwise). Caches stacked, as `prefill_prompts` returns them -> (cache, draft
  cache or None, logits [P, V], routing or None)."""
  if 0 < chunk < prompts.shape[1]:
    return prefill_in_chunks(Models(models.target, draft=models.draft), prompts, prompt_mask, total, chunk)
  cache, logits, routing = prefill_prompts(models.target, prompts, prompt_mask, total)
  draft_cache = None
  if models.draft is not None:
    positions, segments = prompt_layout(prompt_mask)
    draft_cache = models.draft(prompts, positions=positions, segment_ids=segments,
                               cache=models.draft.init_cache(prompts.shape[0], total)).cache
  return cache, draft_cache, logits, routing


def prefill_prompts(model, prompts: jax.Array, prompt_mask: jax.Array, total: int, chunk: int = 0):
  """Prefills left-padded prompts [P, Lp] into a fresh KV cache of `total` columns.

  chunk (rl.prefill_chunk): 0 < chunk < Lp prefills in chunks of that many tokens back to back
  (`prefill_in_chunks`), on any mesh (the chunks attend through the cache, as decode steps do).

  Returns (cache with index Lp, last-token logits [P, V] float32, routing [L, P, Lp, K] or None).

  Short path (default): the prompt runs through the model with the cache attached.
  Ring path (`uses_ring_prefill`: impl="ring", mesh.sequence > 1; for 1M-token prompts): the prompt
  is padded to the cache length (`ring_prefill_length`) with empty columns, so token j lands in
  cache column j and the cache's `sequence` shard r holds exactly the tokens device r prefilled:
  attention is ring attention over the prompt (Liu et al. 2023) and the keys/values are written into
  the cache where they were made, with no gather. Only the last real token's logits are projected.
  With attention.zigzag the padded prompt runs in the zigzag layout (every device the same causal
  work); each layer's keys and values are put back in token order as they are written
  (ring_attention.unzigzag_on_mesh: collective permutes of one chunk, no gather), so the cache and
  the decode steps are the same in both layouts.
  """
  num_prompts, prompt_len = prompts.shape
  if 0 < chunk < prompt_len:
    cache, _, logits, routing = prefill_in_chunks(Models(model), prompts, prompt_mask, total, chunk)
    return cache, logits, routing
  positions, segment_ids = prompt_layout(prompt_mask)
  mc = model.config
  if not uses_ring_prefill(mc):
    out = model(prompts, positions=positions, segment_ids=segment_ids, cache=model.init_cache(num_prompts, total))
    return out.cache, out.logits[:, -1], out.aux.get("routing")
  length = ring_prefill_length(mc, total)
  tail = (num_prompts, length - prompt_len)
  tokens = jnp.concatenate([prompts.astype(jnp.int32), jnp.zeros(tail, jnp.int32)], axis=1)
  positions = jnp.concatenate([positions, jnp.full(tail, kvc.EMPTY_POSITION, jnp.int32)], axis=1)
  segment_ids = jnp.concatenate([segment_ids, jnp.full(tail, kvc.EMPTY_SEGMENT, jnp.int32)], axis=1)
  rules = tuple((name, (SEQUENCE_AXIS,) if name == "length" else axes) for name, axes in mc.kernel.rules)
  prefill = model.with_kernel(rules=rules, inputs_zigzag=mc.kernel.zigzag)  # length split like the cache
  last_column = prompt_len - 1  # where the last prompt token is in the layout the model runs
  if mc.kernel.zigzag:
    shards = axis_size(mc.kernel.mesh, SEQUENCE_AXIS)
    tokens, positions, segment_ids = (zigzag(x, shards) for x in (tokens, positions, segment_ids))
    last_column = int(np.flatnonzero(zigzag(np.arange(length), shards, axis=0) == prompt_len - 1)[0])
  out = prefill(tokens, positions=positions, segment_ids=segment_ids, cache=prefill.init_cache(num_prompts, length),
                return_hidden=True)
  logits = jnp.einsum("bd,dv->bv", out.hidden[:, last_column], prefill.output_projection()).astype(jnp.float32)
  logits = mc.kernel.constrain(logits, ("batch", "vocab"))
  cache = out.cache.replace(index=jnp.asarray(prompt_len, jnp.int32))
  routing = out.aux.get("routing")  # [L, P, S, K] in the layout the model ran
  if routing is None:
    return cache, logits, None
  if mc.kernel.zigzag:
    routing = unzigzag_on_mesh(routing, mc.kernel.mesh, axis=2)
  return cache, logits, routing[:, :, :prompt_len]
