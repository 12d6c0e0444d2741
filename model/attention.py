"""Attention layers: grouped-query attention (GQA) and multi-head latent attention (MLA).

Both project the residual stream to queries, keys and values, rotate them by position, and call
one kernel function, `attend(q, k, v, *, impl, ...)`, chosen by `cfg.attention.impl`
("reference", "blockwise", "ring"; see ring_attention.py). With impl="blockwise" a self-attention
call (no cache) runs the Pallas splash kernel instead where `cfg.attention.local_kernel` asks for it
("auto": on TPU; model/splash.py); with impl="ring" splash computes the ring's block pairs of a
self-attention call and of the ring prefill (model/splash_ring.py). With a KV cache the new keys/values are
written into it first and the queries attend to the whole cache; with impl="ring" a call whose
queries fill the whole cache (the ring prefill of rl/generation/prefill.py `prefill_prompts`) runs ring
attention over the sequence-split prompt. Every cache write is pinned to kv_cache.CACHE_AXES.

Axis legend: B batch, T query length, S key length (cache), D embed, N heads, K kv heads,
H head dim, R latent rank (MLA).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshrl.model import kv_cache, splash, splash_ring
from meshrl.model.layers import Dense, RMSNorm, RopeConfig, apply_rope, yarn_softmax_scale_multiplier
from meshrl.model.ring_attention import attend, decode_attend, unzigzag_on_mesh, zigzag_on_mesh
from meshrl.sharding.mesh import platform
from meshrl.sharding.rules import TRAIN_RULES, Rules, constrain

__all__ = ["attend", "KernelConfig", "GQAttention", "MLAttention"]

# The reference kernel's uncached self-attention (training, log-probs) of at least this many tokens
# scores two query halves, the first against the first half of the keys only: 3/4 of the score
# matrix. The update's forward and backward at the agent preset's 32 x 120 tokens took 0.83x the time
# of the earlier kernel (one block, queries [B, T, K, G, H]), 0.94x with the batch-first layout alone
# (docs/benchmarks.md "The multi-turn agent demo"); 3 or 4 blocks were no faster than 2.
REFERENCE_SPLIT_MIN_LEN = 64


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which attention kernel runs and how it is blocked, and the layout the activations follow.

  `mesh` (needed by impl="ring") and `rules` (TRAIN_RULES or ROLLOUT_RULES) decide how activations
  are constrained; the parameters' layout does not depend on them. `local_kernel` ("auto", "jnp",
  "splash") picks what computes impl="blockwise" self-attention and impl="ring"'s block pairs
  (`local_kernel_name`).

  `zigzag` (attention.zigzag) asks ring attention to run causal sequences in the zigzag layout
  (ring_attention.zigzag) for load balance: training batches are laid out so by their callers
  (rl/step/program.py, train/sft.py), the ring prefill by rl/generation/prefill.py. `inputs_zigzag` says that this copy
  of the model gets its tokens in the zigzag layout over `sequence` (`Transformer.with_kernel`): set
  by the callers that lay them out so (the RL update and log-probs, rl/algo/update.py; SFT; the ring
  prefill, rl/generation/prefill.py `prefill_prompts`, whose cache is written in token order: positions, segment
  ids and each layer's keys/values put back by ring_attention.unzigzag_on_mesh, no gather). Splash's
  ring (`_ring_splash`) masks by index, so it reads the layout from this flag; a model called
  without it gets token order, as every caller that does not zigzag (distillation, benchmarks) uses.
  """
  impl: str = "reference"
  block_q: int = 512
  block_kv: int = 256
  mesh: Mesh | None = None
  rules: Rules = TRAIN_RULES
  local_kernel: str = "auto"
  zigzag: bool = False
  inputs_zigzag: bool = False

  def __post_init__(self):
    splash.check_local_kernel(self.local_kernel, self.impl)
    if self.inputs_zigzag and (self.impl != "ring" or self.mesh is None):
      raise ValueError("KernelConfig.inputs_zigzag (the ring prefill's zigzag layout) needs "
                       f"impl='ring' and a mesh; got impl={self.impl!r}, mesh={self.mesh}.")

  @property
  def backend(self) -> str:
    """The platform the kernel compiles for: the mesh's devices, else JAX's default backend."""
    return platform(self.mesh)

  @property
  def local_kernel_name(self) -> str:
    """"splash" or "jnp": what a supported blockwise self-attention call runs (model/splash.py)."""
    return splash.resolve(self.local_kernel, self.impl, self.backend)

  def summary(self) -> str:
    """One line for a run's console summary: which attention kernel runs (model/splash.py)."""
    return splash.summary(self.impl, self.local_kernel, self.backend)

  def constrain(self, x, names):
    return constrain(x, names, self.mesh, self.rules)

  def __call__(self, q, k, v, *, q_positions, kv_positions, segment_ids, scale, cached=False):
    """q [B, T, N, H] against k/v [B, S, K, .]; `cached`: k/v are a KV cache (generation).

    With impl="ring" a cached call uses the sequence-sharded decode (each shard attends to its
    slice of the cache, merged by log-sum-exp): the cache never travels around the ring. A cached
    call whose queries fill the whole cache (T == S: the ring prefill of rl/generation/prefill.py, which pads
    the prompt to the cache length) is ordinary ring attention instead: queries, keys and values
    all split over `sequence` exactly as the cache is, so nothing is gathered.
    """
    ring_prefill = cached and self.impl == "ring" and q.shape[1] > 1 and q.shape[1] == k.shape[1]
    if self.impl == "ring" and (ring_prefill or not cached):
      out = self._ring_splash(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                              segment_ids=segment_ids, scale=scale, prefill=ring_prefill)
      if out is not None:
        return out
    if ring_prefill:
      return attend(q, k, v, impl="ring", mesh=self.mesh, causal=True, q_positions=q_positions,
                    kv_positions=kv_positions, segment_ids=segment_ids, scale=scale,
                    block_q=self.block_q, block_kv=self.block_kv)
    if cached and self.impl == "ring":
      return decode_attend(q, k, v, mesh=self.mesh, q_positions=q_positions, kv_positions=kv_positions,
                           segment_ids=segment_ids, scale=scale, block_kv=self.block_kv)
    if self.impl == "blockwise" and self.local_kernel_name == "splash" and splash.unsupported_reason(
        q, k, q_positions=q_positions, kv_positions=kv_positions, segment_ids=segment_ids,
        cached=cached) is None:
      return splash.splash_attend(q, k, v, segment_ids, scale=scale, block_q=self.block_q,
                                  block_kv=self.block_kv, mesh=self.mesh,
                                  interpret=self.backend != "tpu")
    kwargs = dict(impl=self.impl, mesh=self.mesh, causal=True, q_positions=q_positions,
                  kv_positions=kv_positions, segment_ids=segment_ids, scale=scale)
    if self.impl != "reference":
      kwargs.update(block_q=self.block_q, block_kv=self.block_kv)
    elif not cached and q.shape[1] >= REFERENCE_SPLIT_MIN_LEN:  # self-attention in token order
      kwargs.update(causal_blocks=2)
    return attend(q, k, v, **kwargs)

  def _ring_splash(self, q, k, v, *, q_positions, kv_positions, segment_ids, scale, prefill: bool):
    """Ring self-attention by splash (model/splash_ring.py) where `local_kernel_name` is "splash" and
    the call is supported; None: the caller runs the jnp ring.

    The block pairs' masks are by index, so they follow the layout the caller declares:
    `inputs_zigzag` (set on the model copies of the RL update and log-probs, SFT and the ring prefill,
    `Transformer.with_kernel`, which lay their tokens out zigzag), else token order; the jnp ring's
    masks come from the positions alone and need no declaration. The ring prefill's keys and values
    come from the cache, in token order: they are put in the queries' layout (`zigzag_on_mesh`, two
    collective permutes of one chunk) and, since the call fills the whole cache, carry the queries'
    positions and segment ids.
    """
    if self.local_kernel_name != "splash":
      return None
    zigzag = self.inputs_zigzag  # declared by the caller: a plain call is in token order
    if prefill:
      segment_ids = segment_ids[0]
      kv_positions = q_positions
    if splash_ring.unsupported_reason(q, k, mesh=self.mesh, q_positions=q_positions,
                                      kv_positions=kv_positions, segment_ids=segment_ids,
                                      zigzag=zigzag) is not None:
      return None
    if prefill and zigzag:
      k, v = zigzag_on_mesh(k, self.mesh, axis=1), zigzag_on_mesh(v, self.mesh, axis=1)
    return splash_ring.ring_splash_attend(q, k, v, segment_ids, mesh=self.mesh, zigzag=zigzag,
                                          scale=scale, block_q=self.block_q, block_kv=self.block_kv,
                                          interpret=self.backend != "tpu")

  def pin_cache(self, layer_cache: dict, per_layer: bool = False) -> dict:
    """One layer's cache entries {name: [B, S, ...]} constrained to kv_cache.CACHE_AXES by the
    rules (`cache_length` -> `sequence`), so the compiler never picks another layout for them;
    per_layer: the entries are in the per-layer form's layouts (kv_cache.entry_axes)."""
    return {name: self.constrain(x, kv_cache.entry_axes(name, per_layer)) for name, x in layer_cache.items()}

  def to_token_order(self, entries: dict) -> dict:
    """New cache entries {name: [B, T, ...]} in token order: put back from the zigzag layout when
    `inputs_zigzag` (the ring prefill, whose T is the whole cache), else as given."""
    if not self.inputs_zigzag:
      return entries
    return {name: unzigzag_on_mesh(x, self.mesh, axis=1) for name, x in entries.items()}


def _write_cache(kernel: KernelConfig, cache: dict, cache_meta, new_entries: dict) -> dict:
  """One layer's cache with `new_entries` {name: [B, T, ...]} written at the write index, in token
  order (the ring prefill's zigzag put back), pinned to kv_cache.CACHE_AXES."""
  length = next(iter(new_entries.values())).shape[1]
  if kernel.inputs_zigzag and length != cache_meta.length:
    raise ValueError(f"a zigzag-laid-out call (the ring prefill) must fill the whole cache: {length} "
                     f"tokens into {cache_meta.length} slots.")
  written = kv_cache.write_layer(cache, kernel.to_token_order(new_entries), _write_index(cache_meta, length),
                                 per_layer=cache_meta.per_layer)
  return kernel.pin_cache(written, cache_meta.per_layer)


def _write_index(cache_meta, new_len: int):
  """The slot the new entries go to: 0 when they fill the whole cache (a ring prefill), which is
  where dynamic_update_slice's clamping puts them anyway; a static 0 lets the compiler see the
  write is a plain replacement and keep the entries' sharding."""
  return jnp.zeros((), jnp.int32) if new_len == cache_meta.length else cache_meta.index


class GQAttention(nnx.Module):
  """Grouped-query attention with optional per-head RMSNorm on q and k (Qwen3)."""

  def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rope: RopeConfig, kernel: KernelConfig, qk_norm: bool = False, norm_eps: float = 1e-6,
               std: float = 0.02, dtype=jnp.float32, param_dtype=jnp.float32,
               merge_leading: bool = False, grad_reduce=None, rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}.")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope, self.kernel, self.dtype = rope, kernel, dtype
    kw = dict(std=std, dtype=dtype, param_dtype=param_dtype, merge_leading=merge_leading,
              grad_reduce=grad_reduce, rngs=rngs)
    self.q_proj = Dense(embed_dim, num_heads * head_dim, ("embed", "heads"), **kw)
    self.k_proj = Dense(embed_dim, num_kv_heads * head_dim, ("embed", "kv_heads"), **kw)
    self.v_proj = Dense(embed_dim, num_kv_heads * head_dim, ("embed", "kv_heads"), **kw)
    self.o_proj = Dense(num_heads * head_dim, embed_dim, ("heads", "embed"), **kw)
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=norm_eps, axes=("head_dim",), param_dtype=param_dtype,
                            rngs=rngs)
      self.k_norm = RMSNorm(head_dim, eps=norm_eps, axes=("head_dim",), param_dtype=param_dtype,
                            rngs=rngs)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, segment_ids, cache=None, cache_meta=None):
    """x [B, T, D], positions/segment_ids [B, T] -> ([B, T, D], updated cache layer or None)."""
    batch, length, _ = x.shape
    q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)  # [B, T, N, H]
    k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)  # [B, T, K, H]
    v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)  # [B, T, K, H]
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
    q = self.kernel.constrain(q, ("batch", "length", "heads", "head_dim"))
    kv_positions, seg = positions, segment_ids
    if cache is not None:
      k = self.kernel.constrain(k, ("batch", "length", "kv_heads", "head_dim"))
      v = self.kernel.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
      cache = _write_cache(self.kernel, cache, cache_meta, {"k": k, "v": v})
      k, v = (kv_cache.read_entry(cache, name, self.dtype, cache_meta.per_layer) for name in ("k", "v"))
      kv_positions = cache_meta.positions
      seg = (segment_ids, cache_meta.segment_ids)
    out = self.kernel(q, k, v, q_positions=positions, kv_positions=kv_positions, segment_ids=seg,
                      scale=self.head_dim ** -0.5, cached=cache is not None)  # [B, T, N, H]
    out = self.kernel.constrain(out, ("batch", "length", "heads", "head_dim"))
    return self.o_proj(out.reshape(batch, length, -1)), cache


class MLAttention(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a low-rank latent.

  Queries: x -> [q_a -> norm ->] q_b -> per head (nope part | rope part). Keys/values: x -> latent
  [R] (normed) + one shared rope key [H_rope]; the latent expands to per-head (k_nope | v). The cache
  keeps the latent and the rotated rope key only: R + H_rope numbers per token instead of
  N * (H_qk + H_v).
  """

  def __init__(self, embed_dim: int, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: RopeConfig,
               kernel: KernelConfig, norm_eps: float = 1e-6, std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, merge_leading: bool = False, grad_reduce=None, rngs: nnx.Rngs):
    if rope.head_dim != qk_rope_head_dim:
      raise ValueError(f"MLA rope head_dim={rope.head_dim} must equal qk_rope_head_dim={qk_rope_head_dim}.")
    self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
    self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    self.rope, self.kernel, self.dtype = rope, kernel, dtype
    qk_dim = qk_nope_head_dim + qk_rope_head_dim
    kw = dict(std=std, dtype=dtype, param_dtype=param_dtype, merge_leading=merge_leading,
              grad_reduce=grad_reduce, rngs=rngs)
    norm_kw = dict(eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
    if q_lora_rank:
      self.q_a_proj = Dense(embed_dim, q_lora_rank, ("embed", None), **kw)
      self.q_a_norm = RMSNorm(q_lora_rank, axes=(None,), **norm_kw)
      self.q_b_proj = Dense(q_lora_rank, num_heads * qk_dim, (None, "heads"), **kw)
      self.q_proj = None
    else:
      self.q_a_proj = self.q_a_norm = self.q_b_proj = None
      self.q_proj = Dense(embed_dim, num_heads * qk_dim, ("embed", "heads"), **kw)
    self.kv_a_proj = Dense(embed_dim, kv_lora_rank + qk_rope_head_dim, ("embed", None), **kw)
    self.kv_a_norm = RMSNorm(kv_lora_rank, axes=(None,), **norm_kw)
    self.kv_b_proj = Dense(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), (None, "heads"),
                           **kw)
    self.o_proj = Dense(num_heads * v_head_dim, embed_dim, ("heads", "embed"), **kw)
    self.scale = qk_dim ** -0.5 * yarn_softmax_scale_multiplier(rope)

  def __call__(self, x, positions, segment_ids, cache=None, cache_meta=None):
    """x [B, T, D], positions/segment_ids [B, T] -> ([B, T, D], updated cache layer or None)."""
    batch, length, _ = x.shape
    if self.q_proj is not None:
      q = self.q_proj(x)
    else:
      q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    q = q.reshape(batch, length, self.num_heads, self.nope_dim + self.rope_dim)  # [B, T, N, Hqk]
    q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
    q = jnp.concatenate([q_nope, apply_rope(q_rope, positions, self.rope)], axis=-1)

    compressed = self.kv_a_proj(x)  # [B, T, R + H_rope]
    latent = self.kv_a_norm(compressed[..., :self.kv_lora_rank])  # [B, T, R]
    k_rope = apply_rope(compressed[..., None, self.kv_lora_rank:], positions, self.rope)  # [B, T, 1, Hr]
    kv_positions, seg = positions, segment_ids
    if cache is not None:
      cache = _write_cache(self.kernel, cache, cache_meta, {"latent": latent, "k_rope": k_rope[:, :, 0]})
      latent = kv_cache.read_entry(cache, "latent", self.dtype)  # [B, S, R]
      k_rope = kv_cache.read_entry(cache, "k_rope", self.dtype)[:, :, None]  # [B, S, 1, Hr]
      kv_positions = cache_meta.positions
      seg = (segment_ids, cache_meta.segment_ids)
    kv_len = latent.shape[1]
    kv = self.kv_b_proj(latent).reshape(batch, kv_len, self.num_heads, self.nope_dim + self.v_dim)
    k_nope, v = kv[..., :self.nope_dim], kv[..., self.nope_dim:]  # [B, S, N, Hn], [B, S, N, Hv]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + (self.rope_dim,))],
                        axis=-1)  # [B, S, N, Hqk]
    out = self.kernel(q, k, v, q_positions=positions, kv_positions=kv_positions, segment_ids=seg,
                      scale=self.scale, cached=cache is not None)  # [B, T, N, Hv]
    return self.o_proj(out.reshape(batch, length, -1)), cache
