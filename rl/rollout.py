"""Generation for RL: `make_rollout(cfg, mesh, ...) -> rollout(params, extra, prompts, prompt_mask, key)`,
one jitted call returning a `RolloutBatch`.

Each prompt is prefilled once; its KV cache (and last logits) are then repeated for the G samples of
its group, so a group shares its prompt's prefix. With attention.impl="ring" and mesh.sequence > 1 the
prefill is ring attention over the prompt split on `sequence`, written straight into a cache split the
same way (`prefill_prompts`: 1M-token prompts); decode steps read it with the log-sum-exp merge.
Decoding is a `lax.while_loop` over one token per step that stops when every sequence has finished
(EOS or a stop token, or its own `max_lengths` entry) or the budget is spent. Sample b (row b) draws
its t-th token with the per-sample key (key, b, t) (rl/sampling.py), exactly as the
continuous-batching engine (rl/engine.py) does.

Rollouts run on the same mesh and take the same parameter arrays as the update: only the activation
rules differ (ROLLOUT_RULES), so no parameter is copied or moved between the two (tests/rl/test_rollout.py).

Axis legend: P prompts, G group size, B = P * G sequences, Lp prompt length, N max new tokens,
S = Lp + N total length, L MoE layers, K experts per token, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from meshrl.model import kv_cache as kvc
from meshrl.model import quant
from meshrl.model.ring_attention import unzigzag_on_mesh, zigzag
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.rows import DeviceRows
from meshrl.rl.sampling import Sampler, sample_keys, token_keys
from meshrl.sharding import hosts
from meshrl.sharding.rules import generation_shardings, rules_from_config


@struct.dataclass
class RolloutBatch:
  """Prompts and completions laid out as one [B, S] sequence per sample (prompt left-padded)."""
  tokens: jax.Array  # [B, S] int32: prompt (left-padded with PAD) then response (PAD after the end)
  positions: jax.Array  # [B, S] int32: 0.. over real tokens (padding gets 0)
  segment_ids: jax.Array  # [B, S] int32: 1 on real tokens, 0 on padding
  prompt_mask: jax.Array  # [B, S] bool: real prompt tokens
  response_mask: jax.Array  # [B, S] bool: generated tokens up to and including the stop token
  logprobs: jax.Array  # [B, S] float32: behaviour log-prob of each generated token (0 elsewhere)
  lengths: jax.Array  # [B] int32: response lengths
  truncated: jax.Array  # [B] bool: hit the token budget (or its max_lengths entry) without a stop token
  policy_version: jax.Array  # [B, S] int32: version of the policy that generated each response token
  #                            (-1 on prompt and padding); segments of a carried rollout differ
  routing: Any  # [L, B, S, K] int32 expert choices (None for a dense model)


@struct.dataclass
class _DecodeState:
  step: jax.Array  # [] int32
  cache: kvc.KVCache
  logits: jax.Array  # [B, V] logits for the next token
  tokens: jax.Array  # [B, N] int32
  logprobs: jax.Array  # [B, N] float32
  valid: jax.Array  # [B, N] bool: token t was generated before the sequence ended
  done: jax.Array  # [B] bool: stopped or at its length limit
  stopped: jax.Array  # [B] bool: generated a stop token
  routing: Any  # [L, B, N, K] int32 or None


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  group_size: int
  max_new_tokens: int
  sampler: Sampler
  stop_tokens: tuple[int, ...]
  pad_id: int

  @classmethod
  def from_config(cls, cfg, *, stop_ids: tuple[int, ...], pad_id: int, group_size: int | None = None,
                  temperature: float | None = None) -> "RolloutSpec":
    """The rollout of cfg.rl; `group_size` / `temperature` override it (evaluation: 1 and 0).

    Stops at any of `stop_ids` (the tokenizer's end-of-sequence and end-of-turn tokens) and at the
    ids of rl.stop_tokens."""
    try:
      extra = tuple(int(t) for t in str(cfg.rl.stop_tokens).split(",") if t.strip())
    except ValueError:
      raise ValueError(f"rl.stop_tokens={cfg.rl.stop_tokens!r} must be comma-separated token ids.") from None
    group_size = cfg.rl.group_size if group_size is None else group_size
    temperature = cfg.rl.temperature if temperature is None else temperature
    if group_size < 1:
      raise ValueError(f"rl.group_size={group_size} must be at least 1.")
    if cfg.rl.max_new_tokens < 1:
      raise ValueError(f"rl.max_new_tokens={cfg.rl.max_new_tokens} must be at least 1.")
    return cls(group_size=group_size, max_new_tokens=cfg.rl.max_new_tokens,
               sampler=Sampler(temperature, cfg.rl.top_k, cfg.rl.top_p),
               stop_tokens=tuple(dict.fromkeys(tuple(stop_ids) + extra)), pad_id=pad_id)


def prompt_layout(prompt_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Positions (0.. over real tokens) and segment ids (1 real, 0 pad) of left-padded prompts [P, Lp]
  (numpy in, numpy out; jax in, jax out)."""
  xp = np if isinstance(prompt_mask, np.ndarray) else jnp
  positions = xp.maximum(xp.cumsum(prompt_mask.astype(xp.int32), axis=1) - 1, 0).astype(xp.int32)
  return positions, prompt_mask.astype(xp.int32)


# RolloutBatch's per-token fields, [B, S = Lp + N], and the fill of a blank sample's (a group kept
# only for the batch's static shape) where it is not 0 / False.
PER_TOKEN_FIELDS = ("tokens", "positions", "segment_ids", "prompt_mask", "response_mask", "logprobs",
                    "policy_version")
PAD_FILL = {"policy_version": -1}


def rollout_rows(fields: dict, rows: np.ndarray | None = None) -> dict:
  """A RolloutBatch's fields {name: device array} (routing left out) as the host side of an RL step
  holds them: the per-token fields [B, S] stay on the devices as rl/rows.DeviceRows (the host moves
  samples by row, pulls the response columns it scores, and the update batch is built on the
  devices), the per-sample fields (lengths, truncated [B]) come to every host (`hosts.to_host`).
  rows: the samples to keep (default all, in order)."""
  out = {}
  for name, value in fields.items():
    if name in PER_TOKEN_FIELDS:
      out[name] = DeviceRows.of(value, rows, fill=PAD_FILL.get(name, 0))
    else:
      out[name] = hosts.to_host(value) if rows is None else hosts.to_host(value)[rows]
  return out


def uses_ring_prefill(mc: ModelConfig) -> bool:
  """Whether prompts are prefilled by ring attention into a sequence-sharded cache: attention.impl
  = "ring" on a mesh whose `sequence` axis has more than one device."""
  mesh = mc.kernel.mesh
  return mc.kernel.impl == "ring" and mesh is not None and mesh.shape.get("sequence", 1) > 1


def ring_prefill_length(mc: ModelConfig, total: int) -> int:
  """The cache length of a ring prefill: `total` rounded up to a multiple of the `sequence` axis
  (of twice it with the zigzag layout, attention.zigzag: two chunks per device)."""
  shards = mc.kernel.mesh.shape["sequence"]
  multiple = 2 * shards if mc.kernel.zigzag else shards
  length = -(-total // multiple) * multiple
  if length > mc.max_seq_len:
    what = f"2 x mesh.sequence={multiple} (attention.zigzag)" if mc.kernel.zigzag else f"mesh.sequence={shards}"
    raise ValueError(f"ring prefill: a cache of {total} slots rounded up to a multiple of {what} is "
                     f"{length}, above model.max_seq_len={mc.max_seq_len}.")
  return length


def _prefill_model(model: Transformer) -> Transformer:
  """The same parameters under the rollout rules with `length` split over `sequence`, so the
  prompt's activations, queries, keys and values stay split like the cache (the decode steps keep
  the model as given: their one token per row cannot be split), and told whether its tokens arrive
  in the zigzag layout (KernelConfig.inputs_zigzag)."""
  mc = model.config
  rules = tuple((name, ("sequence",) if name == "length" else axes) for name, axes in mc.kernel.rules)
  return model.with_kernel(rules=rules, inputs_zigzag=mc.kernel.zigzag)


def prefill_prompts(model: Transformer, prompts: jax.Array, prompt_mask: jax.Array, total: int):
  """Prefills left-padded prompts [P, Lp] into a fresh KV cache of `total` slots.

  Returns (cache with index Lp, last-token logits [P, V] float32, routing [L, P, Lp, K] or None).

  Short path (default): the prompt runs through the model with the cache attached; its queries
  attend to the whole cache with the kernel of attention.impl.
  Ring path (`uses_ring_prefill`: impl="ring", mesh.sequence > 1; for 1M-token prompts): the prompt
  is padded to the cache length S (`ring_prefill_length`: `total` rounded up to the sequence axis)
  with empty slots (position kv_cache.EMPTY_POSITION, segment EMPTY_SEGMENT), so token j lands in
  cache slot j and the cache's `sequence` shard r holds exactly the tokens device r prefilled:
  attention is ring attention over the prompt (model/attention.py, queries/keys/values split over
  `sequence`, Liu et al. 2023) and the keys/values are written into the cache where they were made,
  with no gather of the prompt's keys, values or queries. Only the last real token's logits are
  projected (not [P, S, V]). The decode steps then read the sequence-sharded cache with the
  log-sum-exp merge of model/ring_attention.decode_attend; the tail slots are overwritten as they
  are generated. Tail tokens do pass through the MoE router (so they count against a capacity
  buffer, as prompt padding already does).
  With attention.zigzag (the default) the padded prompt runs in the zigzag layout (device r computes
  chunks r and 2n-1-r of 2n), so every device has the same causal work (a contiguous layout gives
  the last device 2n-1 times the first one's); each layer's keys and values are put back in token
  order as they are written (ring_attention.unzigzag_on_mesh: collective permutes of one
  chunk, no gather), so the cache and the decode steps are the same in both layouts.
  """
  num_prompts, prompt_len = prompts.shape
  positions, segment_ids = prompt_layout(prompt_mask)
  mc = model.config
  if not uses_ring_prefill(mc):
    out = model(prompts, positions=positions, segment_ids=segment_ids,
                cache=model.init_cache(num_prompts, total))
    return out.cache, out.logits[:, -1], out.aux.get("routing")
  length = ring_prefill_length(mc, total)
  tail = (num_prompts, length - prompt_len)
  tokens = jnp.concatenate([prompts.astype(jnp.int32), jnp.zeros(tail, jnp.int32)], axis=1)
  positions = jnp.concatenate([positions, jnp.full(tail, kvc.EMPTY_POSITION, jnp.int32)], axis=1)
  segment_ids = jnp.concatenate([segment_ids, jnp.full(tail, kvc.EMPTY_SEGMENT, jnp.int32)], axis=1)
  prefill = _prefill_model(model)
  last_slot = prompt_len - 1  # where the last prompt token is in the layout the model runs
  if mc.kernel.zigzag:
    shards = mc.kernel.mesh.shape["sequence"]
    tokens, positions, segment_ids = (zigzag(x, shards) for x in (tokens, positions, segment_ids))
    last_slot = int(np.flatnonzero(zigzag(np.arange(length), shards, axis=0) == prompt_len - 1)[0])
  out = prefill(tokens, positions=positions, segment_ids=segment_ids,
                cache=prefill.init_cache(num_prompts, length), return_hidden=True)
  last = out.hidden[:, last_slot]  # [P, D]
  logits = jnp.einsum("bd,dv->bv", last, prefill.output_projection()).astype(jnp.float32)
  logits = mc.kernel.constrain(logits, ("batch", "vocab"))
  cache = out.cache.replace(index=jnp.asarray(prompt_len, jnp.int32))
  routing = out.aux.get("routing")  # [L, P, S, K] in the layout the model ran
  if routing is None:
    return cache, logits, None
  if mc.kernel.zigzag:
    routing = unzigzag_on_mesh(routing, mc.kernel.mesh, axis=2)
  return cache, logits, routing[:, :, :prompt_len]


def generate(model: Transformer, spec: RolloutSpec, prompts: jax.Array, prompt_mask: jax.Array,
             key: jax.Array, max_lengths: jax.Array | None = None, version: jax.Array | int = 0
             ) -> RolloutBatch:
  """The rollout on a merged model (pure; jit it). prompts [P, Lp] left-padded, prompt_mask [P, Lp];
  max_lengths [B] int: each sample's own response limit (<= N; None: N); version: the policy version
  stamped on every generated token."""
  num_prompts, prompt_len = prompts.shape
  group, budget = spec.group_size, spec.max_new_tokens
  batch, total = num_prompts * group, prompt_len + budget
  positions, segment_ids = prompt_layout(prompt_mask)

  # Prefill each prompt once, then share its cache across the group.
  prompt_cache, prompt_logits, prefill_routing = prefill_prompts(model, prompts, prompt_mask, total)
  cache = kvc.repeat_rows(prompt_cache, group)
  weights, cache = model.decode_loop_inputs(cache)
  last_logits = jnp.repeat(prompt_logits, group, axis=0)  # [B, V]
  prompt_lengths = jnp.repeat(jnp.sum(prompt_mask, axis=1), group).astype(jnp.int32)  # [B]
  decode_routing = None
  if prefill_routing is not None:
    layers, _, _, k = prefill_routing.shape
    decode_routing = jnp.zeros((layers, batch, budget, k), jnp.int32)

  limits = jnp.full((batch,), budget, jnp.int32) if max_lengths is None else jnp.minimum(
      jnp.asarray(max_lengths, jnp.int32), budget)
  keys = sample_keys(key, jnp.arange(batch))  # [B]: sample b's tokens use (key, b, t)

  state = _DecodeState(
      step=jnp.zeros((), jnp.int32), cache=cache, logits=last_logits,
      tokens=jnp.full((batch, budget), spec.pad_id, jnp.int32),
      logprobs=jnp.zeros((batch, budget), jnp.float32), valid=jnp.zeros((batch, budget), bool),
      done=limits < 1, stopped=jnp.zeros((batch,), bool), routing=decode_routing)
  stop_tokens = jnp.asarray(spec.stop_tokens, jnp.int32)

  def keep_going(s: _DecodeState):
    return (s.step < budget) & ~jnp.all(s.done)

  def decode_one(s: _DecodeState) -> _DecodeState:
    token = spec.sampler.sample_rows(s.logits, token_keys(keys, s.step))  # [B]
    logprob = spec.sampler.log_probs(s.logits, token)
    live = ~s.done
    token = jnp.where(live, token, spec.pad_id)
    column = (0, s.step)
    tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None], column)
    logprobs = jax.lax.dynamic_update_slice(s.logprobs, jnp.where(live, logprob, 0.0)[:, None], column)
    valid = jax.lax.dynamic_update_slice(s.valid, live[:, None], column)
    stopped = s.stopped | (live & jnp.isin(token, stop_tokens))
    done = s.done | stopped | (s.step + 1 >= limits)
    out = model(token[:, None], positions=(prompt_lengths + s.step)[:, None],
                segment_ids=jnp.ones((batch, 1), jnp.int32), cache=s.cache, layer_weights=weights)
    routing = s.routing
    if routing is not None:
      chosen = jnp.where(live[None, :, None, None], out.aux["routing"], 0)  # ended rows: 0
      routing = jax.lax.dynamic_update_slice(routing, chosen, (0, 0, s.step, 0))
    return _DecodeState(step=s.step + 1, cache=out.cache, logits=out.logits[:, 0], tokens=tokens,
                        logprobs=logprobs, valid=valid, done=done, stopped=stopped, routing=routing)

  final = jax.lax.while_loop(keep_going, decode_one, state)

  rep = lambda a: jnp.repeat(a, group, axis=0)  # noqa: E731  [P, ...] -> [B, ...]
  lengths = jnp.sum(final.valid, axis=1).astype(jnp.int32)
  response_positions = prompt_lengths[:, None] + jnp.arange(budget, dtype=jnp.int32)
  routing = None
  if prefill_routing is not None:
    routing = jnp.concatenate([jnp.repeat(prefill_routing, group, axis=1), final.routing], axis=2)
  return RolloutBatch(
      tokens=jnp.concatenate([rep(prompts), final.tokens], axis=1),
      positions=jnp.concatenate([rep(positions), jnp.where(final.valid, response_positions, 0)], axis=1),
      segment_ids=jnp.concatenate([rep(segment_ids), final.valid.astype(jnp.int32)], axis=1),
      prompt_mask=jnp.concatenate([rep(prompt_mask).astype(bool), jnp.zeros((batch, budget), bool)], 1),
      response_mask=jnp.concatenate([jnp.zeros((batch, prompt_len), bool), final.valid], axis=1),
      logprobs=jnp.concatenate([jnp.zeros((batch, prompt_len)), final.logprobs], axis=1),
      lengths=lengths, truncated=~final.stopped,
      policy_version=jnp.concatenate([jnp.full((batch, prompt_len), -1, jnp.int32), jnp.where(
          final.valid, jnp.asarray(version, jnp.int32), -1)], axis=1),
      routing=routing)


def rollout_model_config(cfg, mesh: Mesh | None) -> ModelConfig:
  """The model numbers with the rollout activation rules (parameters are laid out as in training)
  and the KV cache of rl.kv_cache_dtype; checks rl.kv_cache_dtype / rl.generation_weights."""
  quant.check_generation_options(kv_cache_dtype=cfg.rl.kv_cache_dtype,
                                 generation_weights=cfg.rl.generation_weights, tis_level=cfg.rl.tis_level)
  check_generation_layout(cfg.rl.generation_layout)
  mc = ModelConfig.from_config(cfg, mesh, rules=rules_from_config(cfg.mesh, "rollout"))
  return dataclasses.replace(mc, kv_cache_dtype=cfg.rl.kv_cache_dtype)


GENERATION_LAYOUTS = ("train", "gathered")


def check_generation_layout(layout: str) -> None:
  """ValueError naming rl.generation_layout unless it is one of GENERATION_LAYOUTS."""
  if layout not in GENERATION_LAYOUTS:
    raise ValueError(f"rl.generation_layout={layout!r}; choose one of {', '.join(GENERATION_LAYOUTS)}.")


def with_generation_weights(cfg, mesh: Mesh | None, mc: ModelConfig, fn):
  """jit(fn) for `fn(params, ...)`, the params first made into the generation weights when asked:

  - rl.generation_weights = "int8": int8 weights + scales made from the (full-precision, train-layout)
    params by a jitted quantiser (model/quant.py);
  - rl.generation_layout = "gathered": the weights resharded to split over tensor/expert only
    (sharding/rules.generation_shardings), so the decode steps read them locally instead of
    all-gathering them over fsdp at every token; one reshard per call (per rollout), a copy of the
    weights less split than the train state's (scripts/aot_compile.py --step=reshard measures both).

  Both at once quantise first (less to move) and land the int8 weights in the generation layout.
  The returned function has `.jitted` (the generation program itself) and `.prepare` (params ->
  generation weights) when either option is on."""
  jitted = jax.jit(fn)
  check_generation_layout(cfg.rl.generation_layout)
  int8 = cfg.rl.generation_weights == "int8"
  gathered = cfg.rl.generation_layout == "gathered" and mesh is not None
  if not int8 and not gathered:
    return jitted
  quantize = None
  if int8:
    _, abstract_params, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
    quantize = quant.make_weight_quantizer(abstract_params, mesh, rules_from_config(cfg.mesh))
  relayouts = {}

  def relayout(params):
    """The params in the generation layout (a jitted identity with new out_shardings, built once)."""
    if "fn" not in relayouts:
      shardings = generation_shardings(jax.tree.map(lambda x: x.sharding, params))
      relayouts["fn"] = jax.jit(lambda p: p, out_shardings=shardings)
    return relayouts["fn"](params)

  def prepare(params):
    params = quantize(params) if quantize is not None else params
    return relayout(params) if gathered else params

  def call(params, *args, **kwargs):
    return jitted(prepare(params), *args, **kwargs)
  call.jitted = jitted  # the generation program itself (takes the generation weights)
  call.prepare = prepare
  call.quantize = quantize
  return call


def make_rollout(cfg, mesh: Mesh | None, *, stop_ids: tuple[int, ...], pad_id: int,
                 group_size: int | None = None, temperature: float | None = None):
  """Returns jitted `rollout(params, extra, prompts [P, Lp], prompt_mask [P, Lp], key, max_lengths=None,
  version=0) -> RolloutBatch` (max_lengths [B] per-sample response limits; version stamped on tokens).

  `params`/`extra` are the train state's own arrays (train/state.py); they are read, never copied.
  `group_size` and `temperature` override cfg.rl's (evaluation uses 1 and 0: greedy).
  rl.kv_cache_dtype / rl.generation_weights = "int8" quantise the cache / the weights (model/quant.py).
  rl.speculative != "none" returns rl/speculative.py's rollout (same call, same output).
  """
  if cfg.rl.speculative != "none":
    from meshrl.rl.speculative import make_speculative_rollout  # pylint: disable=import-outside-toplevel
    return make_speculative_rollout(cfg, mesh, stop_ids=stop_ids, pad_id=pad_id, group_size=group_size,
                                    temperature=temperature)
  mc = rollout_model_config(cfg, mesh)
  graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
  spec = RolloutSpec.from_config(cfg, stop_ids=stop_ids, pad_id=pad_id, group_size=group_size,
                                 temperature=temperature)
  if mc.max_seq_len < cfg.rl.max_prompt_len + spec.max_new_tokens:
    raise ValueError(f"rl.max_prompt_len={cfg.rl.max_prompt_len} + rl.max_new_tokens="
                     f"{spec.max_new_tokens} exceeds model.max_seq_len={mc.max_seq_len}.")

  def rollout(params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
    return generate(nnx.merge(graphdef, params, extra), spec, prompts, prompt_mask, key, max_lengths,
                    version)

  return with_generation_weights(cfg, mesh, mc, rollout)
