"""Expert computation for routed tokens: dropless, capacity and expert-parallel dispatch.

Each dispatcher takes routed tokens and returns their combined expert output:

  (xs [N, D], expert_choices [N, K], combine_weights [N, K], ExpertWeights) -> (ys [N, D], dropped)

where `dropped` is the number of token-slots (out of N * K) that got no expert output. Routing itself
(router, top-k, balancing) lives in moe.py; everything here is gather, scatter, grouped matmul and, for
expert parallelism, all-to-all.

Axes:
  N  tokens (batch x length, flattened)    n  tokens on one device (inside shard_map)
  D  embed                                  F  expert hidden (expert_mlp)
  E  experts                                L  experts on one device (E / P)
  K  experts per token (top-k)              P  devices on the mesh's 'expert' axis
  C  capacity: rows per expert (capacity mode) or per destination device (expert parallel)
  S  token-slots (N * K, or n * K on one device)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshrl.sharding.mesh import MESH_AXES

EXPERT_AXIS = "expert"


class ExpertWeights(NamedTuple):
  """The routed experts' SwiGLU weights, in the compute dtype.

  gate, up: [E, D, F] sharded ('experts', 'embed', 'expert_mlp'); down: [E, F, D].
  """
  gate: jax.Array
  up: jax.Array
  down: jax.Array


def _grouped_swiglu(sorted_xs: jax.Array, group_sizes: jax.Array, w: ExpertWeights) -> jax.Array:
  """down(silu(gate(x)) * up(x)) for rows grouped by expert: sorted_xs [M, D] -> [M, D].

  Rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])) go to expert e; rows past the last group give 0.
  """
  gate = jax.lax.ragged_dot(sorted_xs, w.gate, group_sizes)  # [M, F]
  up = jax.lax.ragged_dot(sorted_xs, w.up, group_sizes)  # [M, F]
  return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w.down, group_sizes)  # [M, D]


def _rank_in_group(group_ids: jax.Array, num_groups: int) -> jax.Array:
  """For each element, how many earlier elements share its group: [S] int -> [S] int32.

  Ids equal to `num_groups` (a sentinel) are allowed and ranked among themselves.
  """
  order = jnp.argsort(group_ids, stable=True)  # [S]
  sorted_ids = group_ids[order]  # [S]
  counts = jnp.bincount(group_ids, length=num_groups + 1)  # [G+1]
  starts = jnp.cumsum(counts) - counts  # [G+1]
  sorted_rank = jnp.arange(group_ids.shape[0]) - starts[sorted_ids]  # [S]
  return jnp.zeros_like(group_ids).at[order].set(sorted_rank.astype(group_ids.dtype))


def _combine(slot_outputs: jax.Array, combine_weights: jax.Array) -> jax.Array:
  """Weighted sum over each token's K slots: [N, K, D], [N, K] -> [N, D]."""
  weights = combine_weights.astype(slot_outputs.dtype)
  return jnp.einsum("nk,nkd->nd", weights, slot_outputs)


def dropless(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
             w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
  """Sort token-slots by expert, one grouped matmul (ragged_dot) per projection, unsort, combine.

  Args:
    xs: [N, D] tokens.
    expert_choices: [N, K] int32 expert of each slot.
    combine_weights: [N, K] routing weights.
    w: expert weights with all E experts present.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  with jax.named_scope("dispatch"):
    slot_experts = expert_choices.reshape(-1)  # [S]
    order = jnp.argsort(slot_experts, stable=True)  # [S]
    sorted_xs = xs[order // k]  # [S, D]
    group_sizes = jnp.bincount(slot_experts, length=num_experts).astype(jnp.int32)  # [E]
  with jax.named_scope("expert_compute"):
    sorted_out = _grouped_swiglu(sorted_xs, group_sizes, w)  # [S, D]
  with jax.named_scope("combine"):
    slot_out = sorted_out[jnp.argsort(order)].reshape(num_tokens, k, -1)  # [N, K, D]
    ys = _combine(slot_out, combine_weights)
  return ys, jnp.zeros((), jnp.int32)


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
  """Static rows per expert: ceil(capacity_factor * N * K / E)."""
  return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


def capacity(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
             w: ExpertWeights, *, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Fixed buffer of C = ceil(capacity_factor * N * K / E) rows per expert; the rest are dropped.

  Priority inside an expert is choice-major: every token's first choice comes before any second choice,
  then token order. A dropped slot contributes 0 to its token's output.

  Returns:
    ys [N, D] and the dropped slot count (int32 scalar).
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  cap = expert_capacity(num_tokens, k, num_experts, capacity_factor)
  with jax.named_scope("dispatch"):
    slot_experts = expert_choices.T.reshape(-1)  # [S] slot j = choice j // N of token j % N
    rank = _rank_in_group(slot_experts, num_experts)  # [S]
    kept = rank < cap
    row = jnp.where(kept, slot_experts * cap + rank, num_experts * cap)  # [S]; last row = dropped
    slot_tokens = jnp.arange(k * num_tokens) % num_tokens  # [S]
    buffer = jnp.zeros((num_experts * cap + 1, xs.shape[1]), xs.dtype).at[row].add(xs[slot_tokens])
    expert_in = buffer[:-1].reshape(num_experts, cap, -1)  # [E, C, D]
  with jax.named_scope("expert_compute"):
    gate = jnp.einsum("ecd,edf->ecf", expert_in, w.gate)
    up = jnp.einsum("ecd,edf->ecf", expert_in, w.up)
    expert_out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w.down)  # [E, C, D]
  with jax.named_scope("combine"):
    out_rows = jnp.concatenate([expert_out.reshape(num_experts * cap, -1),
                                jnp.zeros((1, expert_out.shape[-1]), expert_out.dtype)])  # [E*C+1, D]
    slot_out = out_rows[row].reshape(k, num_tokens, -1).transpose(1, 0, 2)  # [N, K, D]
    ys = _combine(slot_out, combine_weights)
  return ys, jnp.sum(~kept).astype(jnp.int32)


def token_axes(mesh: Mesh, num_tokens: int) -> tuple[str, ...]:
  """Mesh axes that split the N tokens inside the expert-parallel shard_map.

  Every axis of size > 1 that keeps N divisible, in mesh order; 'expert' is required, so tokens are
  spread over the expert owners. Tokens not split over an axis are computed redundantly along it.
  """
  axes, split = [], 1
  for axis in MESH_AXES:
    size = mesh.shape[axis]
    if size > 1 and num_tokens % (split * size) == 0:
      axes.append(axis)
      split *= size
  if EXPERT_AXIS not in axes:
    raise ValueError(f"expert parallelism needs the token count (batch x length = {num_tokens}) to be "
                     f"divisible by the mesh's expert axis ({mesh.shape[EXPERT_AXIS]}) times the "
                     f"other token axes it uses ({split}).")
  return tuple(axes)


def expert_parallel(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
                    w: ExpertWeights, *, mesh: Mesh,
                    capacity_factor: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Experts sharded over the mesh's 'expert' axis; tokens exchanged by two all-to-alls.

  Inside `jax.shard_map` each device holds n = N / (token shards) tokens and L = E / P experts. It
  sends every slot to the device owning its expert, in a fixed buffer of C rows per destination,
  runs a grouped matmul over its L local experts, and sends the results back the same way.

  Args:
    xs: [N, D] tokens, any sharding (resharded to split N over `token_axes`).
    expert_choices: [N, K] int32 global expert ids.
    combine_weights: [N, K].
    w: expert weights [E, ...], sharded (or resharded) on 'expert' over axis 0.
    mesh: the mesh; mesh.shape['expert'] must divide E.
    capacity_factor: None: C = n * K, the worst case, so nothing is ever dropped and the result equals
      `dropless`. Otherwise C = ceil(capacity_factor * n * K / P) per destination device (a per-device
      budget, not the per-expert one of `capacity`); overflow slots, in choice-major order, are dropped.

  Returns:
    ys [N, D] sharded like the tokens, and the dropped slot count over the whole mesh.
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  num_shards = mesh.shape[EXPERT_AXIS]
  if num_experts % num_shards:
    raise ValueError(f"num_experts={num_experts} must be divisible by the mesh's expert axis "
                     f"({num_shards}).")
  axes = token_axes(mesh, num_tokens)
  local_slots = num_tokens // math.prod(mesh.shape[a] for a in axes) * k
  cap = local_slots if capacity_factor is None else min(
      local_slots, max(1, math.ceil(capacity_factor * local_slots / num_shards)))
  tokens = PartitionSpec(axes)
  experts = PartitionSpec(EXPERT_AXIS)

  def local(xs_, choices_, weights_, gate_, up_, down_):
    n, d = xs_.shape
    local_experts = gate_.shape[0]
    with jax.named_scope("dispatch"):
      slot_experts_ = choices_.T.reshape(-1)  # [S] choice-major, like `capacity`
      dest_ = slot_experts_ // local_experts  # [S] destination device on the expert axis
      rank_ = _rank_in_group(dest_, num_shards)  # [S]
      kept_ = rank_ < cap
      row_ = jnp.where(kept_, dest_ * cap + rank_, num_shards * cap)  # [S]; last row = dropped
      slot_tokens_ = jnp.arange(k * n) % n  # [S]
      send_x_ = jnp.zeros((num_shards * cap + 1, d), xs_.dtype).at[row_].add(xs_[slot_tokens_])
      send_e_ = jnp.full((num_shards * cap + 1,), local_experts, jnp.int32).at[row_].set(
          (slot_experts_ % local_experts).astype(jnp.int32))  # [P*C+1]; L marks an empty row
    with jax.named_scope("all_to_all_in"):
      recv_x_ = jax.lax.all_to_all(send_x_[:-1], EXPERT_AXIS, 0, 0, tiled=True)  # [P*C, D] by source
      recv_e_ = jax.lax.all_to_all(send_e_[:-1], EXPERT_AXIS, 0, 0, tiled=True)  # [P*C]
    with jax.named_scope("expert_compute"):
      order_ = jnp.argsort(recv_e_, stable=True)  # [P*C]; empty rows last
      group_sizes_ = jnp.bincount(recv_e_, length=local_experts + 1)[:-1].astype(jnp.int32)  # [L]
      sorted_out_ = _grouped_swiglu(recv_x_[order_], group_sizes_, ExpertWeights(gate_, up_, down_))
      valid_ = (recv_e_[order_] < local_experts)[:, None]
      sorted_out_ = jnp.where(valid_, sorted_out_, 0)  # [P*C, D]
      out_ = sorted_out_[jnp.argsort(order_)]  # [P*C, D] in received order
    with jax.named_scope("all_to_all_out"):
      back_ = jax.lax.all_to_all(out_, EXPERT_AXIS, 0, 0, tiled=True)  # [P*C, D] by destination
    with jax.named_scope("combine"):
      back_ = jnp.concatenate([back_, jnp.zeros((1, d), back_.dtype)])  # [P*C+1, D]
      slot_out_ = back_[row_].reshape(k, n, d).transpose(1, 0, 2)  # [n, K, D]
      ys_ = _combine(slot_out_, weights_)
      dropped_ = jax.lax.psum(jnp.sum(~kept_).astype(jnp.int32), axes)
    return ys_, dropped_

  run = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts),
                      out_specs=(tokens, PartitionSpec()))
  return run(xs, expert_choices, combine_weights, w.gate, w.up, w.down)
