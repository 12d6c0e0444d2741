"""Mixture-of-experts layer: router, top-k routing, balancing, and the routed + shared experts.

Routing follows Hugging Face exactly, so converted checkpoints route the same tokens the same way:

  Qwen3-MoE    score_func="softmax": probabilities over float32 router logits, top-k, renormalised
               over the k when norm_topk_prob; no bias, no groups, routed_scaling_factor 1.
  DeepSeek-V3  score_func="sigmoid": sigmoid scores; a selection bias (RouterBias, HF's
               `e_score_correction_bias`) is added only to choose experts; experts fall into n_group
               groups scored by the sum of their top-2 biased scores, the best topk_group groups are
               kept and top-k is taken among their experts; the weights are the unbiased scores at
               the chosen experts, normalised (+1e-20) when norm_topk_prob, times
               routed_scaling_factor. Shared experts are added.
Two deliberate details: router logits are always float32 (HF Qwen3-MoE multiplies in the model
dtype and upcasts before the softmax, so bf16 runs can differ in the last bits), and indices come best
first (HF DeepSeek-V3 uses an unsorted top-k, so compare the chosen sets, not their order).

The chosen experts can be replayed (`routing=`), as the RL loop does with rollout routing: the weights
are still recomputed from the router at the replayed experts, so they carry gradient.

Axes:
  B  batch          T  length           N  tokens (B * T)
  D  embed          E  experts          K  experts per token (top-k)
  F  expert hidden  G  expert groups    H  shared-expert hidden
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshrl.model import expert_parallel, moe_dispatch, moe_local
from meshrl.model.moe_dispatch import ExpertWeights
from meshrl.model.params import param
from meshrl.sharding.mesh import EXPERT_AXIS, axis_size, platform

SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCH_MODES = moe_dispatch.DISPATCHES


class RouterBias(nnx.Variable):
  """DeepSeek-V3's aux-loss-free selection bias [E] (float32): state, not a trained parameter.

  It only shifts which experts are chosen; `update_router_bias` moves it outside the gradient.
  """


def route(router_logits: jax.Array, bias: jax.Array | None, *, k: int, score_func: str = "softmax",
          norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, n_group: int = 1,
          topk_group: int = 1, indices: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Chooses k experts per token (or takes `indices`) and computes their combine weights.

  Args:
    router_logits: [N, E] router logits (computed in float32).
    bias: [E] selection bias added to the scores only to choose experts, or None.
    k: experts per token.
    score_func: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
    norm_topk_prob: renormalise the k weights to sum to 1 (sigmoid: denominator + 1e-20).
    routed_scaling_factor: multiplies the weights.
    n_group: expert groups for group-limited routing (1: none).
    topk_group: groups kept per token.
    indices: [N, K] int32 experts to use instead of choosing (routing replay).

  Returns:
    weights [N, K] float32, indices [N, K] int32 (best first when chosen here), scores [N, E] float32
    (softmax probabilities or sigmoid scores, without the bias).
  """
  num_experts = router_logits.shape[-1]
  _check_routing(num_experts, k, score_func, n_group, topk_group)
  logits = router_logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
  if indices is None:
    indices = _choose(scores if bias is None else scores + bias.astype(jnp.float32), k=k,
                      n_group=n_group, topk_group=topk_group)
  elif indices.shape != (*scores.shape[:-1], k):
    raise ValueError(f"replayed routing has shape {indices.shape}; expected {(*scores.shape[:-1], k)}.")
  indices = indices.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, indices, axis=-1)  # [N, K]
  if norm_topk_prob:
    denominator = weights.sum(axis=-1, keepdims=True)
    weights = weights / (denominator + 1e-20 if score_func == "sigmoid" else denominator)
  if routed_scaling_factor != 1.0:
    weights = weights * routed_scaling_factor
  return weights, indices, scores


def _choose(choice_scores: jax.Array, *, k: int, n_group: int, topk_group: int) -> jax.Array:
  """Top-k experts of [N, E] scores, limited to the topk_group best of n_group groups: [N, K]."""
  if n_group > 1:
    num_tokens, num_experts = choice_scores.shape
    grouped = choice_scores.reshape(num_tokens, n_group, num_experts // n_group)  # [N, G, E/G]
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [N, G]
    kept_groups = jax.lax.top_k(group_scores, topk_group)[1]  # [N, topk_group]
    group_mask = jax.nn.one_hot(kept_groups, n_group, dtype=jnp.bool_).any(axis=1)  # [N, G]
    expert_mask = jnp.repeat(group_mask, num_experts // n_group, axis=1)  # [N, E]
    choice_scores = jnp.where(expert_mask, choice_scores, -jnp.inf)
    return jax.lax.top_k(choice_scores, k)[1]
  return top_k_indices(choice_scores, k)


def top_k_indices(scores: jax.Array, k: int) -> jax.Array:
  """`jax.lax.top_k(scores, k)[1]` for finite [N, E] scores, as k argmax passes: [N, K] int32, best
  first, ties to the lower index (as top_k).

  XLA's CPU partitioner all-gathers the tokens of a token-sharded top_k: on an fsdp mesh every decode
  step gathered every layer's router scores. The argmax reductions stay split over the tokens
  (measured 8-9% faster on the peer rollout, scripts/bench_rollout.py's shape). Group-limited routing
  (-inf for the experts of dropped groups) keeps top_k."""
  chosen = []
  for _ in range(k):
    best = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    chosen.append(best)
    scores = jnp.where(jnp.arange(scores.shape[-1]) == best[..., None], -jnp.inf, scores)
  return jnp.stack(chosen, axis=-1)


def _check_routing(num_experts: int, k: int, score_func: str, n_group: int, topk_group: int):
  if score_func not in SCORE_FUNCS:
    raise ValueError(f"score_func={score_func!r} is unknown; choose one of {SCORE_FUNCS}.")
  if not 1 <= k <= num_experts:
    raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={num_experts}.")
  if n_group < 1 or num_experts % n_group:
    raise ValueError(f"n_group={n_group} must be at least 1 and divide num_experts={num_experts}.")
  if not 1 <= topk_group <= n_group:
    raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}.")
  if n_group > 1 and num_experts // n_group < 2:
    raise ValueError(f"group-limited routing scores a group by its top-2 experts, so each group needs "
                     f"at least 2; num_experts={num_experts} / n_group={n_group} gives "
                     f"{num_experts // n_group}.")
  if n_group > 1 and k > topk_group * (num_experts // n_group):
    raise ValueError(f"num_experts_per_tok={k} exceeds the {topk_group * (num_experts // n_group)} "
                     f"experts in topk_group={topk_group} groups of {num_experts // n_group}.")


def expert_load(indices: jax.Array, num_experts: int) -> jax.Array:
  """Fraction of token-slots routed to each expert: [N, K] -> [E] float32, summing to 1."""
  counts = jnp.bincount(indices.reshape(-1), length=num_experts).astype(jnp.float32)
  return counts / indices.size


def load_balancing_loss(router_probs: jax.Array, indices: jax.Array) -> jax.Array:
  """Switch / DeepSeek load-balancing loss E * sum_e load_e * mean_prob_e (1 when balanced).

  Args:
    router_probs: [N, E] per-token probabilities over experts (rows sum to 1; for sigmoid scores
      divide by their sum first, as DeepSeek does).
    indices: [N, K] chosen experts.

  Returns:
    Scalar float32, unweighted. Hugging Face's `load_balancing_loss_func` (Qwen3-MoE) computes K times
    this value over one layer's tokens, so its `router_aux_loss_coef` maps to K * coef here.
  """
  num_experts = router_probs.shape[-1]
  mean_probs = router_probs.astype(jnp.float32).mean(axis=0)  # [E]
  return num_experts * jnp.sum(expert_load(indices, num_experts) * mean_probs)


def router_z_loss(router_logits: jax.Array) -> jax.Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2. [N, E] -> scalar float32."""
  lse = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)  # [N]
  return jnp.mean(lse ** 2)


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free update: bias + rate * sign(mean load - load), per expert.

  Args:
    bias: [E] float32 current RouterBias value.
    load: [E] expert load of the last step(s) (aux["expert_load"], or any per-expert counts).
    rate: the bias update speed (DeepSeek-V3 uses 1e-3).

  Returns:
    The new [E] float32 bias: underloaded experts rise, overloaded ones fall. Applied by the trainer
    outside the gradient.
  """
  load = load.astype(jnp.float32)
  return (bias + rate * jnp.sign(load.mean() - load)).astype(jnp.float32)


def ep_weights_plan(mc, mesh: Mesh, tokens_by_phase: dict[str, int]
                    ) -> dict[str, tuple[str, dict[str, int]]]:
  """{phase: (weight layout, ep_weight_bytes)} of the expert-parallel calls of N tokens per phase that
  a model config `mc` (transformer.ModelConfig: its moe fields, embed_dim, dtype) makes on `mesh`:
  what run summaries print for moe.ep_weights (the experts' weights and activations are both in
  mc.dtype when they meet)."""
  backend = platform(mesh)
  shapes = dict(k=mc.num_experts_per_tok, num_experts=mc.num_experts, embed=mc.embed_dim,
                hidden=mc.expert_mlp_dim,
                capacity_factor=mc.capacity_factor if mc.dispatch == "capacity" else None,
                act_bytes=jnp.dtype(mc.dtype).itemsize, weight_bytes=jnp.dtype(mc.dtype).itemsize,
                d_axes=mc.ep_d_axes)

  def plan(phase, tokens):
    exchange = expert_parallel.resolve_exchange(mc.ep_exchange, backend, phase)
    return (expert_parallel.resolve_weights(mc.ep_weights, mesh, num_tokens=tokens, exchange=exchange, **shapes),
            expert_parallel.ep_weight_bytes(mesh, num_tokens=tokens, exchange=exchange, **shapes))
  return {phase: plan(phase, tokens) for phase, tokens in tokens_by_phase.items()}


class MoE(nnx.Module):
  """Routed SwiGLU experts plus optional shared experts, with expert parallelism on 'expert'.

  Routing (router matmul, scores, top-k, aux losses) is per token and runs as ordinary SPMD code, so
  under jit each device routes its own tokens; only the expert computation differs by mode: one of
  moe_dispatch.IMPLEMENTATIONS, picked per call by `moe_dispatch.choose` ("auto": the fastest exact
  one for the backend, the phase and the token count), or, when mesh.shape['expert'] > 1,
  expert_parallel.expert_parallel inside shard_map: expert weights stay sharded over 'expert' and
  'tensor', and over 'fsdp' unless `ep_weights` gathers their D per call ("auto": the layout that
  moves/holds fewer bytes for the call's static shapes, expert_parallel.ep_weight_bytes), tokens move
  by all_to_all or ragged_all_to_all (`ep_exchange`), any token count is padded to the token
  shards, and no slot is ever dropped unless dispatch="capacity": then buffers
  of ceil(capacity_factor * n * K / P) rows per destination device (all_to_all) or
  ceil(capacity_factor * n * K) rows per receiving device (ragged), not per expert.

  Parameters (logical axes):
    router [D, E] ('embed', None); gate, up [E, D, F] ('experts', 'embed', 'expert_mlp');
    down [E, F, D] ('experts', 'expert_mlp', 'embed'); with shared experts shared_gate, shared_up
    [D, H] ('embed', 'mlp') and shared_down [H, D] ('mlp', 'embed'), H = num_shared_experts *
    shared_expert_mlp_dim; with aux_free_bias a RouterBias [E] (None,), zeros.
  """

  def __init__(self, embed_dim: int, expert_mlp_dim: int, num_experts: int,
               num_experts_per_tok: int, *, num_shared_experts: int = 0,
               shared_expert_mlp_dim: int = 0, score_func: str = "softmax",
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, n_group: int = 1,
               topk_group: int = 1, dispatch: str = "auto", capacity_factor: float = 1.25,
               aux_free_bias: bool = False, ep_exchange: str = "auto", ep_weights: str = "auto",
               ep_d_axes: tuple[str, ...] = (expert_parallel.FSDP_AXIS,), mesh: Mesh | None = None,
               grad_reduce=None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    """Validates the numbers and creates the weights.

    Args:
      embed_dim: D.
      expert_mlp_dim: F, each routed expert's hidden size.
      num_experts: E.
      num_experts_per_tok: K.
      num_shared_experts: shared experts, fused into one SwiGLU of hidden H (0: none).
      shared_expert_mlp_dim: each shared expert's hidden size (0: expert_mlp_dim).
      score_func: "softmax" or "sigmoid" (see `route`).
      norm_topk_prob, routed_scaling_factor, n_group, topk_group: see `route`.
      dispatch: "auto" or an implementation of moe_dispatch.IMPLEMENTATIONS ("capacity" alone drops
        overflow slots).
      capacity_factor: rows per expert = ceil(capacity_factor * N * K / E) of the "capacity" buffer
        (overflow dropped) and of the "buffered" fast path (overflow sends the batch to "blocks").
      aux_free_bias: keep a RouterBias for aux-loss-free balancing (DeepSeek-V3).
      ep_exchange: how expert parallelism moves tokens: "all_to_all", "ragged" (TPU only) or "auto".
      ep_weights: "sharded" (expert weights never gathered), "gathered" (D gathered over fsdp) or
        "auto" (per call, the one that moves/holds fewer bytes: expert_parallel.ep_weight_bytes).
      ep_d_axes: the mesh axes the parameter rules split the experts' D ('embed') over: the peers that
        trade D-slices under ep_weights="sharded" (expert_parallel.d_split_axes).
      mesh: with mesh.shape['expert'] > 1 the experts run expert-parallel inside shard_map.
      grad_reduce: sharding/compress.GradReduce (optim.grad_collective_dtype) or None: the experts'
        weight gradients reduced explicitly in its wire dtype where they are gathered for use.
      dtype: compute dtype of the experts (routing is always float32).
      param_dtype: storage dtype of the weights.
      rngs: supplies the "params" keys.
    """
    _check_routing(num_experts, num_experts_per_tok, score_func, n_group, topk_group)
    moe_dispatch.check_dispatch(dispatch, capacity_factor)
    for name, value in (("embed_dim", embed_dim), ("expert_mlp_dim", expert_mlp_dim)):
      if value < 1:
        raise ValueError(f"{name}={value} must be at least 1.")
    if num_shared_experts < 0 or shared_expert_mlp_dim < 0:
      raise ValueError(f"num_shared_experts={num_shared_experts} and shared_expert_mlp_dim="
                       f"{shared_expert_mlp_dim} must not be negative.")
    if mesh is not None and num_experts % axis_size(mesh, EXPERT_AXIS):
      raise ValueError(f"num_experts={num_experts} must be divisible by the mesh's expert axis "
                       f"({axis_size(mesh, EXPERT_AXIS)}).")
    self.embed_dim, self.num_experts, self.k = embed_dim, num_experts, num_experts_per_tok
    self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
    self.routed_scaling_factor = routed_scaling_factor
    self.n_group, self.topk_group = n_group, topk_group
    self.dispatch, self.capacity_factor = dispatch, capacity_factor
    self.mesh, self.dtype = mesh, dtype
    self.ep_exchange, self.ep_weights, self.ep_d_axes = ep_exchange, ep_weights, tuple(ep_d_axes)
    self.grad_reduce = grad_reduce
    expert_parallel.check_exchange(ep_exchange, self.backend(), ep_weights)

    def make(shape, axes):
      return param(rngs.params(), shape, axes, dtype=param_dtype)

    e, d, f = num_experts, embed_dim, expert_mlp_dim
    self.router = make((d, e), ("embed", None))
    self.gate = make((e, d, f), ("experts", "embed", "expert_mlp"))
    self.up = make((e, d, f), ("experts", "embed", "expert_mlp"))
    self.down = make((e, f, d), ("experts", "expert_mlp", "embed"))
    self.router_bias = (RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,)) if aux_free_bias
                        else None)
    shared = num_shared_experts * (shared_expert_mlp_dim or expert_mlp_dim)
    if shared:
      self.shared_gate = make((d, shared), ("embed", "mlp"))
      self.shared_up = make((d, shared), ("embed", "mlp"))
      self.shared_down = make((shared, d), ("mlp", "embed"))
    else:
      self.shared_gate = self.shared_up = self.shared_down = None

  @property
  def expert_parallel(self) -> bool:
    return self.mesh is not None and axis_size(self.mesh, EXPERT_AXIS) > 1

  def _route_mismatch(self, router_logits: jax.Array, used: jax.Array, replayed) -> jax.Array:
    """Fraction of tokens whose replayed experts differ (as a set) from what this router would choose
    now: how far routing replay moves the update off its own routes (0 without replay)."""
    if replayed is None:
      return jnp.zeros((), jnp.float32)
    _, fresh, _ = route(jax.lax.stop_gradient(router_logits),
                        None if self.router_bias is None else self.router_bias[...], k=self.k,
                        score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
                        routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                        topk_group=self.topk_group)
    same = jnp.all(jnp.sort(fresh, axis=-1) == jnp.sort(used, axis=-1), axis=-1)  # [N]
    return 1.0 - jnp.mean(same.astype(jnp.float32))

  def backend(self) -> str:
    """The platform the experts run on: the mesh's devices, else JAX's default backend."""
    return platform(self.mesh)

  def implementation(self, phase: str, num_tokens: int) -> str:
    """The dispatch a call of N tokens in `phase` runs ("expert_parallel" on an expert mesh)."""
    if self.expert_parallel:
      return "expert_parallel"
    return moe_dispatch.choose(self.dispatch, backend=self.backend(), phase=phase,
                               num_tokens=num_tokens, k=self.k, num_experts=self.num_experts)

  def __call__(self, x: jax.Array, *, routing: jax.Array | None = None, phase: str = "train"
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routes every token to K experts and sums their weighted outputs (plus the shared experts).

    Args:
      x: [B, T, D] activations, batch possibly sharded over ('data', 'fsdp', 'expert').
      routing: [B, T, K] int32 experts to replay instead of choosing.
      phase: "train", "prefill" or "decode": with dispatch="auto" it helps pick the implementation.

    Returns:
      y [B, T, D] in `dtype`, and aux: aux_loss (load balancing, unweighted), z_loss (router z-loss,
      unweighted), expert_load [E] (fraction of routed slots per expert, before any drop; sums to 1),
      routing [B, T, K] int32, dropped_fraction (dropped slots / (N * K); 0 when dropless),
      router_prob_mean [E] (the mean routing probabilities aux_loss weighs the load by, so a caller
      that splits the batch into microbatches can rebuild the batch's aux_loss: model/pipeline.py).
    """
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"MoE input has shape {x.shape}; expected [B, T, {self.embed_dim}].")
    batch, length, _ = x.shape
    if routing is not None and routing.shape != (batch, length, self.k):
      raise ValueError(f"routing has shape {routing.shape}; expected {(batch, length, self.k)}.")
    xs = x.reshape(batch * length, self.embed_dim).astype(self.dtype)  # [N, D]

    with jax.named_scope("route"):
      router_logits = xs.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [N, E]
      weights, indices, scores = route(
          router_logits, None if self.router_bias is None else self.router_bias[...], k=self.k,
          score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
          routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
          topk_group=self.topk_group,
          indices=None if routing is None else routing.reshape(batch * length, self.k))

    experts = ExpertWeights(*(w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)))
    per_device = (moe_local.local_token_count(self.mesh, batch * length)
                  if phase == "train" and not self.expert_parallel else None)
    implementation = self.implementation(phase, batch * length if per_device is None else per_device)
    if implementation == "expert_parallel":
      capacity_factor = self.capacity_factor if self.dispatch == "capacity" else None
      exchange = expert_parallel.resolve_exchange(self.ep_exchange, self.backend(), phase)
      ys, dropped = expert_parallel.expert_parallel(xs, indices, weights, experts, mesh=self.mesh,
                                                 capacity_factor=capacity_factor, exchange=exchange,
                                                 weights=self.ep_weights, d_axes=self.ep_d_axes,
                                                 grad_reduce=self.grad_reduce)
    elif per_device is not None:  # each device dispatches its own tokens (model/moe_local.py)
      ys, dropped = moe_local.run_per_device(implementation, xs, indices, weights, experts, mesh=self.mesh,
                                             capacity_factor=self.capacity_factor, d_axes=self.ep_d_axes,
                                             grad_reduce=self.grad_reduce)
    else:
      ys, dropped = moe_dispatch.run(implementation, xs, indices, weights, experts,
                                     capacity_factor=self.capacity_factor)

    if self.shared_gate is not None:
      with jax.named_scope("shared_experts"):
        gate = xs @ self.shared_gate[...].astype(self.dtype)  # [N, H]
        up = xs @ self.shared_up[...].astype(self.dtype)  # [N, H]
        ys = ys + (jax.nn.silu(gate) * up) @ self.shared_down[...].astype(self.dtype)

    with jax.named_scope("balance"):
      probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdims=True)
      aux = dict(aux_loss=load_balancing_loss(probs, indices),
                 router_prob_mean=probs.astype(jnp.float32).mean(axis=0),  # [E]: aux_loss's mean_probs
                 z_loss=router_z_loss(router_logits),
                 expert_load=expert_load(indices, self.num_experts),
                 routing=indices.reshape(batch, length, self.k),  # [B, T, K]
                 dropped_fraction=dropped.astype(jnp.float32) / indices.size,
                 route_mismatch=self._route_mismatch(router_logits, indices, routing))
    return ys.reshape(batch, length, self.embed_dim).astype(self.dtype), aux
