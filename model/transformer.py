"""The decoder: embed -> stacked, scanned blocks -> final norm -> LM head (and optional value head).

Blocks come in up to two stacks, each one compiled block scanned over its depth: `dense` (the first
`first_k_dense` layers, or all of them without experts) and `moe`. A stack's parameters carry a
leading `layers` axis. `Transformer.__call__` returns a `ModelOutput`: logits (or final hidden
states for a chunked loss), optional values, the MoE aux pytree (router losses, expert load, routing
decisions per layer) and the updated KV cache.

Axis legend: B batch, T length, D embed, V vocab, L layers, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from meshrl.model import kv_cache as kvc
from meshrl.model.attention import GQAttention, KernelConfig, MLAttention
from meshrl.model.layers import Dense, Embed, RMSNorm, RopeConfig, SwiGLU
from meshrl.model import expert_parallel, moe_dispatch, pipeline, quant
from meshrl.model.moe import MoE
from meshrl.model.config_checks import check_config_values, check_sizes
from meshrl.sharding import compress
from meshrl.sharding.rules import logical_to_spec, rules_from_config
from meshrl.sharding.mesh import FSDP_AXIS, SEQUENCE_AXIS, axis_size

DECODE_LAYERS = ("auto", "scan", "unrolled")

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every number the model needs, in one frozen record (built from a run config by `from_config`)."""
  vocab_size: int
  num_layers: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope: RopeConfig
  kernel: KernelConfig = KernelConfig()
  attention_type: str = "gqa"
  qk_norm: bool = False
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  value_head: bool = False
  init_std: float = 0.02
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: str = "none"
  scan_layers: bool = True
  decode_layers: str = "auto"  # generation loops: "scan", "unrolled" or "auto" (DECODE_LAYERS)
  # MoE (num_experts == 0: every layer dense)
  num_experts: int = 0
  num_experts_per_tok: int = 1
  expert_mlp_dim: int = 0
  num_shared_experts: int = 0
  shared_expert_mlp_dim: int = 0
  first_k_dense: int = 0
  score_func: str = "softmax"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  dispatch: str = "auto"
  capacity_factor: float = 1.25
  aux_free_bias: bool = False
  ep_exchange: str = "auto"
  ep_weights: str = "auto"
  ep_d_axes: tuple[str, ...] = (FSDP_AXIS,)  # mesh axes the parameter rules split the experts' D over
  kv_cache_dtype: str = "model"  # KV cache entries: "model" (dtype) or "int8" (model/quant.py)
  stages: int = 1  # pipeline stages (mesh.stage): each stack's layers split over them (model/pipeline.py)
  microbatches: int = 0  # pipeline microbatches per training forward (mesh.microbatches; 0 = auto)
  grad_collective_dtype: str = "float32"  # weight gradients' reductions (sharding/compress.py; float32 = off)

  def __post_init__(self):
    check_sizes(self)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} is not divisible by "
                       f"model.num_kv_heads={self.num_kv_heads}.")
    if self.attention_type not in ("gqa", "mla"):
      raise ValueError(f"model.attention_type={self.attention_type!r}; choose gqa or mla.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}.")
    if self.decode_layers not in DECODE_LAYERS:
      raise ValueError(f"model.decode_layers={self.decode_layers!r}; choose one of "
                       f"{', '.join(DECODE_LAYERS)}.")
    if self.num_experts and self.num_experts_per_tok > self.num_experts:
      raise ValueError(f"moe.num_experts_per_tok={self.num_experts_per_tok} is larger than "
                       f"moe.num_experts={self.num_experts}.")
    if self.num_experts:
      moe_dispatch.check_dispatch(self.dispatch, self.capacity_factor)
      expert_parallel.check_exchange(self.ep_exchange, self.kernel.backend, self.ep_weights)
    if self.kv_cache_dtype not in quant.KV_CACHE_DTYPES:
      raise ValueError(f"rl.kv_cache_dtype={self.kv_cache_dtype!r}; choose one of "
                       f"{', '.join(quant.KV_CACHE_DTYPES)}.")
    if self.num_experts and not 0 <= self.first_k_dense <= self.num_layers:
      raise ValueError(f"moe.first_k_dense={self.first_k_dense} must be in [0, {self.num_layers}].")
    self._check_pipeline()
    compress.check_grad_dtype(self.grad_collective_dtype, self.kernel.backend)

  def _check_pipeline(self):
    """mesh.stage must split each stack evenly, agree with the mesh, and come with scanned layers."""
    if self.stages < 1:
      raise ValueError(f"mesh.stage={self.stages} must be at least 1 (1 = no pipeline).")
    if self.microbatches < 0:
      raise ValueError(f"mesh.microbatches={self.microbatches} must be >= 0 (0 = auto).")
    uneven = [f"{n} {name}" for name, n in (("dense", self.num_dense_layers), ("MoE", self.num_moe_layers))
              if n % self.stages]
    if uneven:
      raise ValueError(
          f"mesh.stage={self.stages} does not divide the layers: model.num_layers={self.num_layers} with "
          f"moe.first_k_dense={self.first_k_dense} gives {' and '.join(uneven)} blocks, and every stack is "
          f"split evenly over the stages; choose a stage count that divides "
          f"{self.num_dense_layers or ''}{' and ' if self.num_dense_layers and self.num_moe_layers else ''}"
          f"{self.num_moe_layers or ''}.")
    mesh = self.kernel.mesh
    on_mesh = 1 if mesh is None else mesh.shape.get(pipeline.STAGE_AXIS, 1)
    if mesh is not None and on_mesh != self.stages:
      raise ValueError(f"mesh.stage={self.stages} but the mesh's stage axis has {on_mesh} device(s); "
                       "build the mesh from the same config (sharding.make_mesh).")

  @property
  def num_dense_layers(self) -> int:
    return self.num_layers if not self.num_experts else self.first_k_dense

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.num_dense_layers

  @classmethod
  def from_config(cls, cfg, mesh: Mesh | None = None, rules=None) -> "ModelConfig":
    """The one place a run config becomes model numbers (rules: activation layout, default train).
    Raises ValueError naming the model.* / moe.* / attention.* field of any value it cannot use."""
    m, moe, att = cfg.model, cfg.moe, cfg.attention
    check_config_values(m, att)
    rope_dim = m.qk_rope_head_dim if m.attention_type == "mla" else m.head_dim
    rope = RopeConfig(head_dim=rope_dim, theta=m.rope_theta, scaling=m.rope_scaling, factor=m.rope_factor,
                      original_max_len=m.rope_original_max_len, beta_fast=m.rope_beta_fast,
                      beta_slow=m.rope_beta_slow, mscale=m.rope_mscale,
                      mscale_all_dim=m.rope_mscale_all_dim, interleave=m.rope_interleave)
    return cls(
        vocab_size=m.vocab_size, num_layers=m.num_layers, embed_dim=m.embed_dim, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim, max_seq_len=m.max_seq_len,
        rope=rope, kernel=KernelConfig(att.impl, att.block_q, att.block_kv, mesh,
                                       rules if rules is not None else rules_from_config(cfg.mesh),
                                       local_kernel=att.get("local_kernel", "auto"),
                                       zigzag=bool(att.get("zigzag", False))),
        attention_type=m.attention_type, qk_norm=m.qk_norm, q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings, value_head=m.value_head, init_std=m.init_std,
        dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype), remat=m.remat,
        scan_layers=m.scan_layers, decode_layers=m.get("decode_layers", "auto"), num_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok, expert_mlp_dim=moe.expert_mlp_dim,
        num_shared_experts=moe.num_shared_experts, shared_expert_mlp_dim=moe.shared_expert_mlp_dim,
        first_k_dense=moe.first_k_dense, score_func=moe.score_func, norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group, topk_group=moe.topk_group,
        dispatch=moe.dispatch, capacity_factor=moe.capacity_factor, aux_free_bias=moe.aux_free_bias,
        ep_exchange=moe.get("ep_exchange", "auto"), ep_weights=moe.get("ep_weights", "auto"),
        ep_d_axes=tuple(dict(rules_from_config(cfg.mesh))["embed"]),
        stages=int(cfg.mesh.get("stage", 1)), microbatches=int(cfg.mesh.get("microbatches", 0)),
        grad_collective_dtype=cfg.optim.get("grad_collective_dtype", "float32"))

  @property
  def grad_reduce(self) -> compress.GradReduce | None:
    """The explicit weight-gradient reductions of the blocks' Dense layers and experts
    (optim.grad_collective_dtype), on the kernel's mesh and rules; None when off or without a mesh."""
    grad = compress.GradReduce.from_name(self.grad_collective_dtype, self.kernel.backend)
    if grad is None or self.kernel.mesh is None:
      return None
    return dataclasses.replace(grad, mesh=self.kernel.mesh, rules=self.kernel.rules)

  @property
  def unrolled_decode(self) -> bool:
    """Whether generation loops run the layers unrolled on per-layer weights (`decode_layers`):
    "auto" does on CPU, where a scan's per-layer slice of the stacked weights is a copy that XLA:CPU
    repeats at every decode step; TPU and GPU programs keep the scan (one compiled block)."""
    if self.decode_layers != "auto":
      return self.decode_layers == "unrolled"
    return self.kernel.backend == "cpu"

  @property
  def merge_dense_axes(self) -> bool:
    """Whether Dense layers merge an input's leading axes for the matmul (layers.Dense): on CPU,
    where the backward of a contraction over several axes copies both operands into transposed
    layouts, unless the mesh splits the sequence (merging a split length axis with the batch made a
    TPU compile gather more)."""
    mesh = self.kernel.mesh
    return self.kernel.backend == "cpu" and axis_size(mesh, SEQUENCE_AXIS) == 1

  def cache_entry_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
    """{stack: {entry: (layers, *per-token shape)}} for kv_cache.init_cache."""
    if self.attention_type == "mla":
      entries = {"latent": (self.kv_lora_rank,), "k_rope": (self.qk_rope_head_dim,)}
    else:
      entries = {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}
    stacks = {"dense": self.num_dense_layers, "moe": self.num_moe_layers}
    return {stack: {name: (n,) + shape for name, shape in entries.items()}
            for stack, n in stacks.items() if n}


def phase_of(cached: bool, length: int) -> str:
  """The phase a call is in, from static facts: "train" without a KV cache, "decode" for one new token
  per row with one, else "prefill". The MoE's dispatch="auto" picks its implementation by it."""
  if not cached:
    return "train"
  return "decode" if length == 1 else "prefill"


def combine_microbatches(aux: dict) -> dict:
  """A MoE stack's per-layer aux [L, M, ...] from M equal microbatches -> [L, ...] as one call on the
  whole batch gives it: means over the microbatches (fractions and means of equal-sized parts), the
  routes put back in row order, and the load-balancing loss rebuilt from the batch's expert load and
  mean routing probabilities (a mean of per-microbatch losses would not be the batch's loss)."""
  if not aux:
    return aux
  out = {name: jnp.mean(value, axis=1) for name, value in aux.items() if name != "routing"}
  out["routing"] = jax.vmap(pipeline.merge_rows)(aux["routing"])  # [L, B, T, K]
  num_experts = out["expert_load"].shape[-1]
  out["aux_loss"] = num_experts * jnp.sum(out["expert_load"] * out["router_prob_mean"], axis=-1)  # [L]
  return out


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp_or_moe(norm(x))."""

  def __init__(self, mc: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
    kw = dict(std=mc.init_std, dtype=mc.dtype, param_dtype=mc.param_dtype, merge_leading=mc.merge_dense_axes,
              grad_reduce=mc.grad_reduce, rngs=rngs)
    self.attn_norm = RMSNorm(mc.embed_dim, eps=mc.norm_eps, param_dtype=mc.param_dtype, rngs=rngs)
    self.mlp_norm = RMSNorm(mc.embed_dim, eps=mc.norm_eps, param_dtype=mc.param_dtype, rngs=rngs)
    if mc.attention_type == "mla":
      self.attn = MLAttention(
          mc.embed_dim, mc.num_heads, q_lora_rank=mc.q_lora_rank, kv_lora_rank=mc.kv_lora_rank,
          qk_nope_head_dim=mc.qk_nope_head_dim, qk_rope_head_dim=mc.qk_rope_head_dim,
          v_head_dim=mc.v_head_dim, rope=mc.rope, kernel=mc.kernel, norm_eps=mc.norm_eps, **kw)
    else:
      self.attn = GQAttention(mc.embed_dim, mc.num_heads, mc.num_kv_heads, mc.head_dim, rope=mc.rope,
                              kernel=mc.kernel, qk_norm=mc.qk_norm, norm_eps=mc.norm_eps, **kw)
    if moe:
      self.mlp = MoE(
          mc.embed_dim, mc.expert_mlp_dim, mc.num_experts, mc.num_experts_per_tok,
          num_shared_experts=mc.num_shared_experts, shared_expert_mlp_dim=mc.shared_expert_mlp_dim,
          score_func=mc.score_func, norm_topk_prob=mc.norm_topk_prob,
          routed_scaling_factor=mc.routed_scaling_factor, n_group=mc.n_group, topk_group=mc.topk_group,
          dispatch=mc.dispatch, capacity_factor=mc.capacity_factor, aux_free_bias=mc.aux_free_bias,
          ep_exchange=mc.ep_exchange, ep_weights=mc.ep_weights, ep_d_axes=mc.ep_d_axes,
          mesh=mc.kernel.mesh, grad_reduce=mc.grad_reduce, dtype=mc.dtype,
          param_dtype=mc.param_dtype, rngs=rngs)
    else:
      self.mlp = SwiGLU(mc.embed_dim, mc.mlp_dim, **kw)
    self.is_moe = moe
    self.kernel = mc.kernel

  def __call__(self, x, positions, segment_ids, cache=None, cache_meta=None, routing=None,
               phase="train"):
    """x [B, T, D] -> (x [B, T, D], aux dict, updated cache layer); phase: see `phase_of`."""
    attn_out, cache = self.attn(self.attn_norm(x), positions, segment_ids, cache, cache_meta)
    attn_out = checkpoint_name(attn_out, "attention_out")
    x = self.kernel.constrain(x + attn_out, ("batch", "length", "embed"))
    if self.is_moe:
      mlp_out, aux = self.mlp(self.mlp_norm(x), routing=routing, phase=phase)
    else:
      mlp_out, aux = self.mlp(self.mlp_norm(x)), {}
    x = self.kernel.constrain(x + mlp_out, ("batch", "length", "embed"))
    return x, aux, cache


def _stack(mc: ModelConfig, n: int, *, moe: bool, rngs: nnx.Rngs) -> Block:
  """n Blocks with parameters stacked on a leading `layers` axis."""
  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(layer_rngs):
    return Block(mc, moe=moe, rngs=layer_rngs)
  stack = make(rngs)
  for _, variable in nnx.iter_graph(stack):
    if isinstance(variable, nnx.Variable):
      variable.set_metadata(axes=("layers",) + tuple(variable.get_metadata()["axes"]))
  return stack


@struct.dataclass
class ModelOutput:
  logits: jax.Array | None  # [B, T, V] (None when hidden states were asked for)
  hidden: jax.Array | None  # [B, T, D] final normed hidden states (return_hidden=True)
  values: jax.Array | None  # [B, T] value-head output
  aux: dict  # aux_loss, z_loss, dropped_fraction, route_mismatch (means over MoE layers), expert_load [L, E], routing [L, B, T, K]
  cache: Any  # updated KVCache or None


class Transformer(nnx.Module):
  """The MoE decoder. Build it sharded with `build_model`; call it with tokens [B, T]."""

  def __init__(self, mc: ModelConfig, *, rngs: nnx.Rngs):
    self.config = mc
    self.embed = Embed(mc.vocab_size, mc.embed_dim, std=mc.init_std, dtype=mc.dtype,
                       param_dtype=mc.param_dtype, rngs=rngs)
    self.dense_stack = _stack(mc, mc.num_dense_layers, moe=False, rngs=rngs) if mc.num_dense_layers else None
    self.moe_stack = _stack(mc, mc.num_moe_layers, moe=True, rngs=rngs) if mc.num_moe_layers else None
    self.final_norm = RMSNorm(mc.embed_dim, eps=mc.norm_eps, param_dtype=mc.param_dtype, rngs=rngs)
    kw = dict(std=mc.init_std, dtype=mc.dtype, param_dtype=mc.param_dtype, merge_leading=mc.merge_dense_axes,
              rngs=rngs)
    self.lm_head = None if mc.tie_embeddings else Dense(mc.embed_dim, mc.vocab_size, ("embed", "vocab"), **kw)
    self.value_head = Dense(mc.embed_dim, 1, ("embed", None), **kw) if mc.value_head else None

  def output_projection(self) -> jax.Array:
    """The [D, V] matrix that turns final hidden states into logits, gathered over `embed`.

    The stored weight has D on `fsdp`, which the batch of the hidden states uses too; contracting D
    as stored would reshard the activations. Gathering the weight (FSDP's all-gather) leaves the
    logits [B, T, V] split on batch and vocab, the layout the log-softmax and loss keep.
    """
    if self.lm_head is None:
      weight = self.embed.embedding[...].T  # [D, V]
    else:
      weight = self.lm_head.kernel[...]  # [D, V]
    return self.config.kernel.constrain(weight, (None, "vocab")).astype(self.config.dtype)

  def layer_weights(self) -> dict[str, tuple]:
    """The blocks' parameters one layer at a time: {stack name: (layer 0's state, layer 1's, ...)}.

    Generation loops (rl/generation) take these once, outside their decode loop, and
    pass them as `layer_weights=` at every step: the step then reads each layer's weights as they are
    instead of slicing them out of the stacked [L, ...] arrays (a copy per layer per step on XLA:CPU).
    Costs one copy of the blocks' weights for the loop's lifetime (`ModelConfig.unrolled_decode`).
    """
    out = {}
    for name, stack in (("dense", self.dense_stack), ("moe", self.moe_stack)):
      if stack is not None:
        _, state = nnx.split(stack)
        num = jax.tree.leaves(state)[0].shape[0]
        out[name] = tuple(jax.tree.map(lambda a, i=i: a[i], state) for i in range(num))
    return out

  def _layer_body(self, graphdef, positions, segment_ids, meta, phase):
    """The scan body of one stack: (x, (layer state, layer cache, layer routes)) -> (x, (aux, cache)),
    checkpointed by the model's remat policy."""
    mc = self.config

    def body(carry, layer):
      layer_state, layer_cache_, layer_routing = layer
      # int8 generation weights (model/quant.py) become full precision here, one layer at a time.
      layer_state, carry = quant.dequantize_layer(layer_state, carry, mc.param_dtype)
      block = nnx.merge(graphdef, layer_state)
      out, aux, new_cache = block(carry, positions, segment_ids, layer_cache_, meta, layer_routing,
                                  phase)
      return out, (aux, new_cache)

    if mc.remat != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[mc.remat], prevent_cse=not mc.scan_layers)
    return body

  def _run_stack(self, stack, name, x, positions, segment_ids, cache, meta, routing, phase,
                 layer_weights=None):
    """One stack of blocks: scanned (model.scan_layers), looped over slices of the stacked weights, or
    looped over `layer_weights` and a per-layer cache (kv_cache.unstack), where nothing is sliced; a
    training call (no cache) with pipeline stages or microbatches runs through `_run_pipelined`.
    Returns (x, (aux stacked over layers, the updated cache: stacked, or per layer as given))."""
    mc = self.config
    graphdef, state = nnx.split(stack)
    if cache is None and layer_weights is None and (mc.stages > 1 or mc.microbatches > 1):
      return self._run_pipelined(graphdef, state, x, positions, segment_ids, routing, phase)
    layer_cache = None if cache is None else cache.layers[name]
    body = self._layer_body(graphdef, positions, segment_ids, meta, phase)
    xs = (state, layer_cache, routing)
    if layer_weights is not None:
      layers = [(weights, None if layer_cache is None else layer_cache[i],
                 None if routing is None else routing[i]) for i, weights in enumerate(layer_weights[name])]
    elif mc.scan_layers:
      return jax.lax.scan(body, x, xs)
    else:
      num = jax.tree.leaves(state)[0].shape[0]
      layers = [jax.tree.map(lambda a, i=i: a[i], xs) for i in range(num)]
    auxes, caches = [], []
    for layer in layers:
      x, (aux, new_cache) = body(x, layer)
      auxes.append(aux)
      caches.append(new_cache)
    stacked = lambda outs: jax.tree.map(lambda *a: jnp.stack(a), *outs)  # noqa: E731
    return x, (stacked(auxes), tuple(caches) if layer_weights is not None else stacked(caches))

  def microbatches_for(self, rows: int) -> int:
    """The pipeline's microbatch count for a training call on `rows` rows (mesh.microbatches, or
    its auto choice), checked against the rows' batch shards (pipeline.resolve_microbatches)."""
    mc = self.config
    mesh = mc.kernel.mesh
    shards = 1
    if mesh is not None:
      entry = logical_to_spec(("batch",), mc.kernel.rules, mesh, shape=(rows,))[0]
      for axis in (() if entry is None else entry if isinstance(entry, tuple) else (entry,)):
        shards *= mesh.shape[axis]
    return pipeline.resolve_microbatches(mc.microbatches, rows=rows, row_shards=shards, stages=mc.stages)

  def _run_pipelined(self, graphdef, state, x, positions, segment_ids, routing, phase):
    """One stack through the pipeline (model/pipeline.py): mc.stages stages of its layers, the rows
    in microbatches; each stage scans its layers as `_run_stack` does. Returns what `_run_stack`
    returns, the per-layer aux combined over the microbatches as the whole batch gives it."""
    mc = self.config

    def stage_fn(stage_state, x_, rows, stage_routing):
      body = self._layer_body(graphdef, rows["positions"], rows["segment_ids"], None, phase)
      xs = (stage_state, None, stage_routing)
      if mc.scan_layers:
        x_, (aux, _) = jax.lax.scan(body, x_, xs)
        return x_, aux
      auxes = []
      for i in range(jax.tree.leaves(stage_state)[0].shape[0]):
        x_, (aux, _) = body(x_, jax.tree.map(lambda a, i=i: a[i], xs))
        auxes.append(aux)
      return x_, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    microbatches = self.microbatches_for(x.shape[0])
    x, aux = pipeline.run(stage_fn, state, x, {"positions": positions, "segment_ids": segment_ids},
                          routing, stages=mc.stages, microbatches=microbatches, mesh=mc.kernel.mesh,
                          remat=mc.remat != "none")
    return x, (combine_microbatches(aux), None)

  def decode_loop_inputs(self, *caches: kvc.KVCache) -> tuple:
    """What a decode loop passes the model at every step, made once before the loop:
    (layer_weights or None, *caches). Per-layer weights (`layer_weights`) and per-layer caches
    (kv_cache.unstack) when `ModelConfig.unrolled_decode`; else None and the caches as given."""
    if not self.config.unrolled_decode:
      return (None, *caches)
    return (self.layer_weights(), *(kvc.unstack(c) for c in caches))

  def __call__(self, tokens, *, positions=None, segment_ids=None, cache: kvc.KVCache | None = None,
               routing=None, return_hidden: bool = False, layer_weights: dict | None = None) -> ModelOutput:
    """Runs the decoder.

    Args:
      tokens: [B, T] int token ids (batch on `batch`, length on `length`).
      positions: [B, T] int positions (default 0..T-1; with a cache, cache.index + 0..T-1). They
        decide the causal mask, so packed layouts need no other change; tokens laid out zigzag over
        `sequence` for ring attention need a model told so when splash computes the ring
        (`with_kernel(inputs_zigzag=True)`: its masks are by index).
      segment_ids: [B, T] int; tokens attend only within their segment (default: all ones).
      cache: a KVCache to write the new tokens into and attend over (prefill or decode).
      routing: [L_moe, B, T, K] expert choices to replay in the MoE layers (from a rollout).
      return_hidden: return final normed hidden states instead of logits (for a chunked loss).
      layer_weights: `self.layer_weights()`, taken outside a decode loop: the blocks run unrolled on
        them, and the cache must be per layer (kv_cache.unstack); None: the stacked blocks as stored.
    """
    mc = self.config
    if cache is not None and pipeline.needs_stage_region(mc.kernel.mesh):
      # Generation on a mesh with pipeline stages: every stage group runs the call as one slice would.
      graphdef, state = nnx.split(self)

      def call(state, tokens, positions, segment_ids, cache, routing, layer_weights):
        return nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segment_ids, cache=cache,
                                          routing=routing, return_hidden=return_hidden,
                                          layer_weights=layer_weights)
      return pipeline.on_every_stage(call, mc.kernel.mesh)(state, tokens, positions, segment_ids, cache, routing,
                                                          layer_weights)
    batch, length = tokens.shape
    if length > mc.max_seq_len:
      raise ValueError(f"sequence of {length} tokens is longer than model.max_seq_len={mc.max_seq_len}.")
    if cache is not None and cache.max_len > mc.max_seq_len:
      raise ValueError(f"KV cache of {cache.max_len} slots exceeds model.max_seq_len={mc.max_seq_len}.")
    if positions is None:  # 0..T-1, or from each row's write index ([] or per-row [B]) of the cache
      start = jnp.zeros((), jnp.int32) if cache is None else cache.index
      start = start[:, None] if start.ndim == 1 else start
      positions = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))
    if segment_ids is None:
      segment_ids = jnp.ones((batch, length), jnp.int32)
    phase = phase_of(cache is not None, length)
    meta = None
    if cache is not None:
      if (layer_weights is not None) != kvc.is_unstacked(cache):
        raise ValueError("layer_weights= and a per-layer KV cache (kv_cache.unstack) go together.")
      # The cache records slots in token order; a ring prefill's zigzag inputs are put back first.
      ordered = mc.kernel.to_token_order({"positions": positions, "segment_ids": segment_ids})
      cache, meta = kvc.begin_write(cache, ordered["positions"], ordered["segment_ids"])
    x = mc.kernel.constrain(self.embed(tokens, mc.kernel.constrain), ("batch", "length", "embed"))

    new_layers, aux = {}, {}
    if self.dense_stack is not None:
      x, (_, new_layers["dense"]) = self._run_stack(self.dense_stack, "dense", x, positions, segment_ids,
                                                    cache, meta, None, phase, layer_weights)
    if self.moe_stack is not None:
      x, (moe_aux, new_layers["moe"]) = self._run_stack(self.moe_stack, "moe", x, positions, segment_ids,
                                                        cache, meta, routing, phase, layer_weights)
      aux = {"aux_loss": jnp.mean(moe_aux["aux_loss"]), "z_loss": jnp.mean(moe_aux["z_loss"]),
             "dropped_fraction": jnp.mean(moe_aux["dropped_fraction"]),
             "route_mismatch": jnp.mean(moe_aux["route_mismatch"]),
             "expert_load": moe_aux["expert_load"], "routing": moe_aux["routing"]}
    if cache is not None:
      cache = kvc.end_write(cache, new_layers, length)

    hidden = self.final_norm(x)
    values = None if self.value_head is None else self.value_head(hidden)[..., 0].astype(jnp.float32)
    if return_hidden:
      return ModelOutput(logits=None, hidden=hidden, values=values, aux=aux, cache=cache)
    logits = jnp.einsum("btd,dv->btv", hidden, self.output_projection())
    logits = mc.kernel.constrain(logits, ("batch", "length", "vocab"))
    return ModelOutput(logits=logits.astype(jnp.float32), hidden=None, values=values, aux=aux, cache=cache)

  def with_kernel(self, **changes) -> "Transformer":
    """The same parameters with KernelConfig fields replaced (static: how attention runs, never what
    the parameters are). E.g. inputs_zigzag=True for callers that lay their tokens out zigzag over
    `sequence` (the RL update, SFT, the ring prefill), which splash's ring needs to be told
    (model/attention.py `KernelConfig`)."""
    mc = self.config
    changed = dataclasses.replace(mc, kernel=dataclasses.replace(mc.kernel, **changes))
    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(changed, rngs=nnx.Rngs(0))), nnx.Param, ...)
    _, params, extra = nnx.split(self, nnx.Param, ...)
    return nnx.merge(graphdef, params, extra)

  def init_cache(self, batch: int, max_len: int | None = None) -> kvc.KVCache:
    mc = self.config
    max_len = mc.max_seq_len if max_len is None else max_len
    return kvc.init_cache(mc.cache_entry_shapes(), batch, max_len,
                          "int8" if mc.kv_cache_dtype == "int8" else mc.dtype)
