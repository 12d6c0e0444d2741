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
  G  blocks of b rows (blocks dispatch)     R  rows of the padded, expert-sorted layout (G * b)

Implementations (`IMPLEMENTATIONS`; every one but `capacity` is exact: no slot is ever dropped):

  dropless  sort + `jax.lax.ragged_dot` (a grouped-matmul kernel on TPU; slow on CPU, above all its
            backward pass).
  blocks    sort slots by expert, pad each expert's group to a multiple of b rows, one batched matmul
            over [G, b, D] with each block's expert weights (MegaBlocks' block-sparse layout, Gale et
            al. 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", written in jnp).
  buffered  the capacity buffer of C = ceil(capacity_factor * N * K / E) rows per expert when every
            expert fits, else `blocks`, chosen at run time by `lax.cond`: pays only when routing is
            balanced within capacity_factor (at init it is not: the busiest expert gets 1.7-2.8x the
            mean, and the cond then costs more than it saves).
  ladder    `capacity`'s buffers at the smallest of a few static sizes that holds the busiest expert,
            picked at run time by `lax.switch` (`blocks` past the last size): no weight gather, at
            most 2x the busiest expert's rows; for generation (a switch's backward would keep every
            branch's residuals).
  dense     every expert on every token, weighted by a [N, E] combine matrix (E / K times the FLOPs).
  gather    each slot multiplies its own expert's weights, gathered [N, K, D, F]: a decode step of a
            few tokens touches only the experts they chose.
  capacity  the fixed buffer alone; overflow slots are dropped (only when asked for).

`choose` is the `auto` policy: per backend and per phase (train, prefill, decode), from static shapes.

`expert_parallel` runs the experts sharded over the mesh's 'expert' axis (weights also split over
'fsdp' on D and 'tensor' on F, never gathered by default), moving tokens by all-to-all with fixed
buffers or by `ragged_all_to_all` (TPU), for any token count (padded to the token shards).
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
  return _capacity_rows(xs, expert_choices, combine_weights, w,
                        expert_capacity(num_tokens, k, w.gate.shape[0], capacity_factor))


def _capacity_rows(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
                   w: ExpertWeights, cap: int) -> tuple[jax.Array, jax.Array]:
  """`capacity` with C = `cap` rows per expert -> (ys [N, D], dropped slot count)."""
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
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


def dense(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
          w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
  """Every expert on every token, weighted by the [N, E] combine matrix (zero off the chosen experts).

  E / K times the routed FLOPs but three plain matmuls and no gather or sort: on one CPU device the
  fastest exact path for up to about 64 tokens (not under fsdp sharding, where `blocks` wins). A slot
  chosen twice counts twice, as in the other paths.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_experts = w.gate.shape[0]
  with jax.named_scope("dispatch"):
    choice_mask = jax.nn.one_hot(expert_choices, num_experts, dtype=xs.dtype)  # [N, K, E]
    combine = jnp.einsum("nk,nke->ne", combine_weights.astype(xs.dtype), choice_mask)  # [N, E]
  with jax.named_scope("expert_compute"):
    gate = jnp.einsum("nd,edf->nef", xs, w.gate)  # [N, E, F]
    up = jnp.einsum("nd,edf->nef", xs, w.up)  # [N, E, F]
    hidden = jax.nn.silu(gate) * up * combine[:, :, None]  # [N, E, F]
    ys = jnp.einsum("nef,efd->nd", hidden, w.down)  # [N, D]
  return ys, jnp.zeros((), jnp.int32)


def gather(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
           w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
  """Each slot multiplies its own expert's weights, gathered [N, K, D, F]; no sort, no buffer.

  Reads only the chosen experts, once per slot: the decode path when N * K < E.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  with jax.named_scope("dispatch"):
    gate_w, up_w, down_w = (weight[expert_choices] for weight in w)  # [N, K, D, F], ..., [N, K, F, D]
  with jax.named_scope("expert_compute"):
    gate = jnp.einsum("nd,nkdf->nkf", xs, gate_w)  # [N, K, F]
    up = jnp.einsum("nd,nkdf->nkf", xs, up_w)  # [N, K, F]
    slot_out = jnp.einsum("nkf,nkfd->nkd", jax.nn.silu(gate) * up, down_w)  # [N, K, D]
  with jax.named_scope("combine"):
    ys = _combine(slot_out, combine_weights)
  return ys, jnp.zeros((), jnp.int32)


def block_size(num_slots: int, num_experts: int) -> int:
  """Rows per block b: the power of two at or below S / (2E), kept within [8, 128].

  Bigger blocks make bigger matmuls but pad each expert by up to b - 1 rows; 128 measured best for
  S / E of 256 to 640 on CPU (fp32, D 256-512, F 512).
  """
  target = max(1, num_slots // (2 * num_experts))
  return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def _block_layout(slot_experts: jax.Array, num_experts: int, block: int
                  ) -> tuple[jax.Array, jax.Array, int]:
  """Rows of the expert-sorted layout in which each expert's group is padded to a multiple of b.

  Args:
    slot_experts: [S] int expert of each slot.

  Returns:
    row [S] int32 (each slot's row in [0, G * b)), block_experts [G] int32 (the expert of each block;
    blocks past the last group hold only padding), and the static block count G, the most any routing
    can need: sum_e ceil(count_e / b) <= (S + E * (b - 1)) / b.
  """
  num_blocks = (slot_experts.shape[0] + num_experts * (block - 1)) // block
  counts = jnp.bincount(slot_experts, length=num_experts)  # [E]
  padded = (counts + block - 1) // block * block  # [E]
  ends = jnp.cumsum(padded)  # [E]
  row = ends[slot_experts] - padded[slot_experts] + _rank_in_group(slot_experts, num_experts)  # [S]
  block_starts = jnp.arange(num_blocks) * block  # [G]
  block_experts = jnp.minimum(jnp.searchsorted(ends, block_starts, side="right"), num_experts - 1)
  return row.astype(jnp.int32), block_experts.astype(jnp.int32), num_blocks


def blocks(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
           w: ExpertWeights, *, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Grouped matmul as a batched matmul over blocks of b rows, each block owned by one expert.

  Slots are laid out sorted by expert with each expert's group padded to a multiple of b (padding
  rows read a zero token and are never read back), so [G, b, D] x [G, D, F] computes every routed slot
  exactly once, plus at most E * (b - 1) padding rows.

  Args:
    block: rows per block (default `block_size(S, E)`).

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_tokens, k = expert_choices.shape
  num_experts, embed = w.gate.shape[:2]
  block = block or block_size(num_tokens * k, num_experts)
  with jax.named_scope("dispatch"):
    row, block_experts, num_blocks = _block_layout(expert_choices.reshape(-1), num_experts, block)
    slot_tokens = jnp.arange(num_tokens * k, dtype=jnp.int32) // k  # [S] token-major
    row_tokens = jnp.full((num_blocks * block,), num_tokens, jnp.int32).at[row].set(slot_tokens)  # [R]
    padded_xs = jnp.concatenate([xs, jnp.zeros((1, embed), xs.dtype)])  # [N + 1, D]; row N is zero
    block_xs = padded_xs[row_tokens].reshape(num_blocks, block, embed)  # [G, b, D]
    gate_w, up_w, down_w = (weight[block_experts] for weight in w)  # [G, D, F], [G, D, F], [G, F, D]
  with jax.named_scope("expert_compute"):
    gate = jnp.einsum("gbd,gdf->gbf", block_xs, gate_w)  # [G, b, F]
    up = jnp.einsum("gbd,gdf->gbf", block_xs, up_w)  # [G, b, F]
    block_out = jnp.einsum("gbf,gfd->gbd", jax.nn.silu(gate) * up, down_w)  # [G, b, D]
  with jax.named_scope("combine"):
    slot_out = block_out.reshape(num_blocks * block, embed)[row].reshape(num_tokens, k, embed)
    ys = _combine(slot_out, combine_weights)
  return ys, jnp.zeros((), jnp.int32)


def buffered(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
             w: ExpertWeights, *, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """`capacity`'s static buffers when every expert fits in C rows, else `blocks`: never drops.

  The branch is taken at run time (`lax.cond`; only one runs), so balanced batches get the speed of
  E plain [C, D] x [D, F] matmuls and a skewed batch pays the block layout's padding, not a drop.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  cap = expert_capacity(num_tokens, k, num_experts, capacity_factor)
  if cap >= num_tokens * k:  # the buffer holds every slot: nothing can overflow
    return capacity(xs, expert_choices, combine_weights, w, capacity_factor=capacity_factor)
  counts = jnp.bincount(expert_choices.reshape(-1), length=num_experts)  # [E]
  operands = (xs, expert_choices, combine_weights, w)
  ys = jax.lax.cond(jnp.max(counts) <= cap,
                    lambda a: capacity(*a, capacity_factor=capacity_factor)[0],
                    lambda a: blocks(*a)[0], operands)
  return ys, jnp.zeros((), jnp.int32)


def ladder_rungs(num_tokens: int, k: int, num_experts: int, first: float = 1.25, step: float = 2.0,
                 most: float = 4.0, small_rows: int = 4096) -> tuple[int, ...]:
  """The static capacities `ladder` chooses from: C_0 = ceil(first * N * K / E) rows per expert, then
  x `step` per rung, while the buffers' E x C rows stay within max(`most` x the N * K slots,
  `small_rows`) (every branch's buffers are allocated); the last rung is N * K (every slot on one
  expert) when that is still within the bound, as it is for a decode step or a short prefill."""
  slots = num_tokens * k
  bound = max(most * slots, small_rows) // num_experts
  rung = expert_capacity(num_tokens, k, num_experts, first)
  rungs = []
  while rung < slots and rung <= bound:
    rungs.append(rung)
    rung = max(rung + 1, math.ceil(rung * step))
  if slots <= bound:
    rungs.append(slots)
  return tuple(rungs) or (slots,)


def ladder(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
           w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
  """`capacity`'s per-expert buffers [E, C, D] at the smallest rung C of `ladder_rungs` that holds the
  busiest expert, picked at run time by `lax.switch` (one branch runs); `blocks` when the busiest
  expert outgrows the last rung. Exact: no slot is ever dropped.

  The buffers multiply the weights as they lie ([C, D] x [D, F] per expert), where `blocks` gathers
  each block's expert weights and `dense` computes every expert on every token: on CPU the fastest
  exact path for generation (a decode step of a batch, a prompt prefill). Meant for calls without
  gradients: a switch's backward keeps every branch's residuals.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  rungs = ladder_rungs(num_tokens, k, num_experts)
  branches = [lambda a, c=c: _capacity_rows(*a, c)[0] for c in rungs]
  if rungs[-1] < num_tokens * k:
    branches.append(lambda a: blocks(*a)[0])
  counts = jnp.bincount(expert_choices.reshape(-1), length=num_experts)  # [E]
  rung = jnp.searchsorted(jnp.asarray(rungs, jnp.int32), jnp.max(counts).astype(jnp.int32))
  ys = jax.lax.switch(rung, branches, (xs, expert_choices, combine_weights, w))
  return ys, jnp.zeros((), jnp.int32)


# --------------------------------------------------------------------------------------------------
# Choosing an implementation.

IMPLEMENTATIONS = {"dropless": dropless, "blocks": blocks, "buffered": buffered, "ladder": ladder, "dense": dense,
                   "gather": gather, "capacity": capacity}
EXACT = ("dropless", "blocks", "buffered", "ladder", "dense", "gather")
DISPATCHES = ("auto",) + tuple(IMPLEMENTATIONS)
PHASES = ("train", "prefill", "decode")


def check_dispatch(dispatch: str, capacity_factor: float) -> None:
  """Raises ValueError naming the field for an unknown dispatch or a capacity factor <= 0."""
  if dispatch not in DISPATCHES:
    raise ValueError(f"moe.dispatch={dispatch!r} is unknown; choose one of {DISPATCHES}.")
  if not capacity_factor > 0:
    raise ValueError(f"moe.capacity_factor={capacity_factor} must be positive (rows per expert = "
                     f"capacity_factor * tokens * k / experts, for dispatch 'capacity' and 'buffered').")


def choose(dispatch: str, *, backend: str, phase: str, num_tokens: int, k: int,
           num_experts: int) -> str:
  """The implementation `dispatch` runs: itself, or for "auto" the fastest exact one measured.

  auto: on TPU and GPU "dropless" (ragged_dot lowers to a grouped-matmul kernel that skips empty
  groups). On CPU: "blocks" for training (measured fastest of the exact ones for the forward and
  backward of a width-256, 8-expert model: scripts/bench_model.py); "ladder" for generation, prefill
  and decode (no gradients; "blocks" gathers each block's expert weights at every decode step: at
  the issue-9 peer shape the rollout took 1.6-2.6 s with "ladder" and 2.2-2.9 s with "blocks" in
  separate noisy runs, scripts/bench_rl.py --config=configs/tiny.py:peer); a decode step with fewer slots than experts runs
  "gather" and so touches only the experts its tokens chose. Never "capacity": only an explicit
  `capacity` drops tokens.

  Args:
    backend: the platform the experts run on ("cpu", "tpu", "gpu").
    phase: "train" (forward and backward), "prefill" (a prompt into the KV cache) or "decode".
    num_tokens: N, the tokens of the call (batch x length, the global count under jit).
  """
  if dispatch not in DISPATCHES:
    raise ValueError(f"moe.dispatch={dispatch!r} is unknown; choose one of {DISPATCHES}.")
  if phase not in PHASES:
    raise ValueError(f"phase={phase!r} is unknown; choose one of {PHASES}.")
  if dispatch != "auto":
    return dispatch
  if backend != "cpu":
    return "dropless"
  if phase == "decode" and num_tokens * k < num_experts:
    return "gather"
  return "blocks" if phase == "train" else "ladder"


def plan(dispatch: str, *, backend: str, k: int, num_experts: int,
         tokens_by_phase: dict[str, int]) -> dict[str, str]:
  """{phase: implementation} for calls of the given token counts: what a run's summary prints."""
  return {phase: choose(dispatch, backend=backend, phase=phase, num_tokens=tokens, k=k,
                        num_experts=num_experts) for phase, tokens in tokens_by_phase.items()}


def run(name: str, xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
        w: ExpertWeights, *, capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Runs implementation `name` (a key of IMPLEMENTATIONS) -> (ys [N, D], dropped slot count)."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"dispatch implementation {name!r} is unknown; choose one of "
                     f"{tuple(IMPLEMENTATIONS)}.")
  if name in ("capacity", "buffered"):
    return IMPLEMENTATIONS[name](xs, expert_choices, combine_weights, w,
                                 capacity_factor=capacity_factor)
  return IMPLEMENTATIONS[name](xs, expert_choices, combine_weights, w)


# --------------------------------------------------------------------------------------------------
# Expert parallelism.

FSDP_AXIS, TENSOR_AXIS = "fsdp", "tensor"
EXCHANGES = ("auto", "all_to_all", "ragged")
WEIGHT_LAYOUTS = ("auto", "sharded", "gathered")


def check_weights(weights: str) -> None:
  """Raises ValueError naming `moe.ep_weights` and its choices for an unknown weight layout."""
  if weights not in WEIGHT_LAYOUTS:
    raise ValueError(f"moe.ep_weights={weights!r} is unknown; choose one of {WEIGHT_LAYOUTS}.")


def check_exchange(exchange: str, backend: str, weights: str = "sharded") -> None:
  """Raises ValueError naming the field for an unknown exchange or weight layout, or for `ragged` on
  a CPU backend."""
  check_weights(weights)
  if exchange not in EXCHANGES:
    raise ValueError(f"moe.ep_exchange={exchange!r} is unknown; choose one of {EXCHANGES}.")
  if exchange == "ragged" and backend == "cpu":
    raise ValueError("moe.ep_exchange='ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU lacks "
                     "(the experts' backend is 'cpu'); use 'all_to_all' (fixed buffers) or 'auto'.")


def resolve_exchange(exchange: str, backend: str) -> str:
  """The exchange an expert-parallel call runs: `auto` is `ragged` on TPU, `all_to_all` elsewhere."""
  check_exchange(exchange, backend)
  if exchange != "auto":
    return exchange
  return "ragged" if backend == "tpu" else "all_to_all"


def token_axes(mesh: Mesh) -> tuple[str, ...]:
  """Mesh axes that split the tokens inside the expert-parallel shard_map: every axis of size > 1
  but 'tensor' (whose devices share their tokens and split each expert's hidden F), in mesh order."""
  return tuple(a for a in MESH_AXES if a != TENSOR_AXIS and mesh.shape[a] > 1)


def padded_tokens(mesh: Mesh, num_tokens: int) -> int:
  """N rounded up to a multiple of the token shards (the product of `token_axes`' sizes)."""
  shards = math.prod(mesh.shape[a] for a in token_axes(mesh))
  return -(-num_tokens // shards) * shards


def buffer_rows(mesh: Mesh, num_tokens: int, k: int, capacity_factor: float | None = None
                ) -> tuple[int, int, int]:
  """(S, C, R) of one device, from static shapes: S = n * K slots of its n tokens (N padded to the
  token shards), C rows per destination device of the all_to_all exchange and R receive rows of the
  ragged one. capacity_factor None: the worst case, C = S and R = P * S (nothing dropped)."""
  shards = math.prod(mesh.shape[a] for a in token_axes(mesh))
  slots = padded_tokens(mesh, num_tokens) // shards * k
  num_shards = mesh.shape[EXPERT_AXIS]
  if capacity_factor is None:
    return slots, slots, num_shards * slots
  cap = min(slots, max(1, math.ceil(capacity_factor * slots / num_shards)))
  return slots, cap, min(num_shards * slots, max(1, math.ceil(capacity_factor * slots)))


def d_split_axes(mesh: Mesh, embed: int, d_axes: tuple[str, ...] = (FSDP_AXIS,)) -> tuple[str, ...]:
  """The mesh axes the experts' D is split over inside the expert-parallel shard_map: those of
  `d_axes` (the axes the parameter rules put `embed` on: 'fsdp' in TRAIN_RULES, 'fsdp' and 'sequence'
  in configs/paper_3t.py) of size > 1, but 'expert' and 'tensor'; () when they do not divide D (the
  weights are then gathered over them). Each of these axes also splits the tokens (`token_axes`), so
  the devices along them hold different D-slices of the same experts and different rows: the peers
  that trade D-slices in `_sharded_swiglu`."""
  axes = _d_candidates(mesh, d_axes)
  return axes if axes and embed % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _d_candidates(mesh: Mesh, d_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of `d_axes` that could split the experts' D: size > 1, not 'expert' or 'tensor'."""
  return tuple(a for a in MESH_AXES if a in d_axes and a not in (EXPERT_AXIS, TENSOR_AXIS)
               and mesh.shape[a] > 1)


def ep_weight_bytes(mesh: Mesh, *, num_tokens: int, k: int, num_experts: int, embed: int, hidden: int,
                    capacity_factor: float | None = None, exchange: str = "all_to_all",
                    act_bytes: int = 4, weight_bytes: int = 4,
                    d_axes: tuple[str, ...] = (FSDP_AXIS,)) -> dict[str, int]:
  """The bytes each weight layout moves or holds beyond the other, per device and per expert-parallel
  call, from static shapes (the rule of `ep_weights="auto"`, which takes the smaller).

  With M the rows the device's experts receive (the static buffer: P * C for all_to_all, R for
  ragged; `buffer_rows`), Pf the size of the D-split axes (`d_split_axes`: fsdp by default), F' = F / tensor (F when tensor does not divide it) and
  L = E / P local experts:

    sharded  = (Pf - 1) * M * (7 F' + 2 D / Pf) * act_bytes
               held:  gate, up and silu(gate) * up for all Pf * M peer rows instead of M (3 F')
               moved: the all-reduce of the partial gate and up sums over fsdp (4 F': 2 arrays of
                      Pf * M x F', each device sending 2 (Pf - 1) / Pf of them), and the D-slice
                      all-to-alls in and out (2 D / Pf)
    gathered = 6 * L * D * F' * (Pf - 1) / Pf * weight_bytes
               gate, up and down's D gathered over fsdp (moved) and then held whole (held)

  The backward pass about doubles both (activation cotangents; the weight gradients'
  reduce-scatter). Break-even: M* = 6 L D F' weight_bytes / (Pf (7 F' + 2 D / Pf) act_bytes) rows;
  fewer rows (decode, small batches) favour sharded, more (training at length) gathered. Both are 0
  when the weights' D is not split (no D-split axis of size > 1, or they do not divide D).
  """
  split = d_split_axes(mesh, embed, d_axes)
  fsdp, tensor = math.prod(mesh.shape[a] for a in split), mesh.shape[TENSOR_AXIS]
  if not split:
    return {"sharded": 0, "gathered": 0}
  local_hidden = hidden // tensor if hidden % tensor == 0 else hidden
  _, cap, recv_rows = buffer_rows(mesh, num_tokens, k, capacity_factor)
  rows = recv_rows if exchange in ("ragged", "emulated") else mesh.shape[EXPERT_AXIS] * cap
  local_experts = num_experts // mesh.shape[EXPERT_AXIS]
  return {"sharded": (fsdp - 1) * rows * (7 * local_hidden + 2 * embed // fsdp) * act_bytes,
          "gathered": 6 * local_experts * embed * local_hidden * weight_bytes * (fsdp - 1) // fsdp}


def resolve_weights(weights: str, mesh: Mesh, **shapes) -> str:
  """The weight layout an expert-parallel call runs: `weights`, or for "auto" the cheaper of
  `ep_weight_bytes(mesh, **shapes)` (a tie, e.g. fsdp 1, is "sharded"; D-split axes that do not
  divide D leave the weights gathered, so "gathered")."""
  check_weights(weights)
  if weights != "auto":
    return weights
  d_axes = shapes.get("d_axes", (FSDP_AXIS,))
  if _d_candidates(mesh, d_axes) and not d_split_axes(mesh, shapes["embed"], d_axes):
    return "gathered"
  cost = ep_weight_bytes(mesh, **shapes)
  return "sharded" if cost["sharded"] <= cost["gathered"] else "gathered"


def expert_weight_specs(mesh: Mesh, embed: int, hidden: int, weights: str = "sharded",
                        d_axes: tuple[str, ...] = (FSDP_AXIS,)) -> ExpertWeights:
  """In-specs of gate, up [E, D, F] and down [E, F, D] inside the shard_map: E over 'expert', D over
  the D-split axes (`d_split_axes`: 'fsdp' in the training layout of TRAIN_RULES) and F over 'tensor',
  so no weight is gathered. An axis that does not divide its dimension is left out (the weights are
  then gathered over it), and so are the D axes for weights="gathered" (each layer gathers its
  experts' D, as FSDP does). "auto" is resolved per call first (`resolve_weights`)."""
  if weights not in ("sharded", "gathered"):
    raise ValueError(f"weights={weights!r}: expected a resolved layout, 'sharded' or 'gathered' "
                     f"(resolve moe.ep_weights='auto' per call with resolve_weights).")
  split = d_split_axes(mesh, embed, d_axes) if weights == "sharded" else ()
  fsdp = split or None
  tensor = TENSOR_AXIS if mesh.shape[TENSOR_AXIS] > 1 and hidden % mesh.shape[TENSOR_AXIS] == 0 else None
  inner = PartitionSpec(EXPERT_AXIS, fsdp, tensor)
  return ExpertWeights(inner, inner, PartitionSpec(EXPERT_AXIS, tensor, fsdp))


def _sharded_swiglu(x: jax.Array, local_ids: jax.Array, w: ExpertWeights, *,
                    fsdp: tuple[str, ...] | None, tensor: bool) -> jax.Array:
  """The L local experts on received rows, with D split over the axes `fsdp` (the D-split axes,
  `d_split_axes`; None: D whole) and F over 'tensor' (inside shard_map): x [M, D], local_ids [M]
  (L marks an empty row) -> [M, D] (0 on empty rows).

  Weights are [L, D/Pf, F/Pt] (down [L, F/Pt, D/Pf]) and never move; activations do: each device
  trades D-slices of its rows with its fsdp peers (all-to-all), the partial gate and up sums are
  reduced over fsdp, the partial down sums over tensor, and the D-slices go back (all-to-all).
  """
  num_local = w.gate.shape[0]
  if fsdp:
    x = jax.lax.all_to_all(x, fsdp, 1, 0, tiled=True)  # [Pf*M, D/Pf]: all peers' rows, my D
    local_ids = jax.lax.all_gather(local_ids, fsdp, tiled=True)  # [Pf*M]
  order = jnp.argsort(local_ids, stable=True)  # empty rows last
  group_sizes = jnp.bincount(local_ids, length=num_local + 1)[:-1].astype(jnp.int32)  # [L]
  sorted_x = x[order]
  gate = jax.lax.ragged_dot(sorted_x, w.gate, group_sizes)  # [M', F/Pt], partial over fsdp
  up = jax.lax.ragged_dot(sorted_x, w.up, group_sizes)
  if fsdp:
    gate, up = jax.lax.psum(gate, fsdp), jax.lax.psum(up, fsdp)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w.down, group_sizes)  # [M', D/Pf], partial over tensor
  if tensor:
    out = jax.lax.psum(out, TENSOR_AXIS)
  out = jnp.where((local_ids[order] < num_local)[:, None], out, 0)
  out = jnp.zeros_like(out).at[order].set(out)  # received order
  if fsdp:
    out = jax.lax.all_to_all(out, fsdp, 0, 1, tiled=True)  # [M, D]: my rows, every D-slice
  return out


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
  """`jax.lax.ragged_all_to_all`'s semantics from an all-gather and scatters (recv_sizes unused):
  the same offsets bookkeeping runs, and is tested, on CPU, where XLA lacks the collective."""
  del recv_sizes
  peers = jax.lax.all_gather(operand, axis_name)  # [P, S, ...]
  in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name)
                            for a in (input_offsets, send_sizes, output_offsets))  # [P src, P dst]
  me = jax.lax.axis_index(axis_name)
  rows = jnp.arange(operand.shape[0])
  for src in range(peers.shape[0]):
    take = rows < sizes[src, me]
    dest = jnp.where(take, out_off[src, me] + rows, output.shape[0])
    source = jnp.minimum(in_off[src, me] + rows, operand.shape[0] - 1)
    output = output.at[dest].set(peers[src, source], mode="drop")
  return output


def _ragged_send(dest: jax.Array, num_shards: int, recv_rows: int):
  """Bookkeeping of the ragged exchange (inside shard_map) for slots with destination devices
  `dest` [S] (num_shards marks padding).

  Returns order [S] (slots sorted by destination), kept_sorted [S] bool, and the offsets and sizes of
  the forward exchange, `there` (to the experts) and `back`. Receiver r takes senders in device
  order into a buffer of recv_rows rows; what overflows is dropped from the tail of each sender's
  chunk (its last choice-major slots).
  """
  order = jnp.argsort(dest, stable=True)  # [S]
  sorted_dest = dest[order]
  counts = jnp.bincount(dest, length=num_shards + 1)[:-1].astype(jnp.int32)  # [P] slots per receiver
  all_counts = jax.lax.all_gather(counts, EXPERT_AXIS)  # [P src, P dst]
  me = jax.lax.axis_index(EXPERT_AXIS)
  starts = jnp.cumsum(all_counts, axis=0) - all_counts  # [src, dst] offset in the receiver's buffer
  quota = jnp.clip(recv_rows - starts, 0, all_counts).astype(jnp.int32)  # [src, dst] rows kept
  send_offsets = jnp.cumsum(all_counts, axis=1) - all_counts  # [src, dst] offset in the send buffer
  dest_ = jnp.minimum(sorted_dest, num_shards - 1)
  rank = jnp.arange(dest.shape[0]) - send_offsets[me][dest_]
  kept_sorted = (sorted_dest < num_shards) & (rank < quota[me][dest_])
  landing = jnp.minimum(starts, recv_rows - 1).astype(jnp.int32)  # valid even where nothing is sent
  there = (send_offsets[me].astype(jnp.int32), quota[me], landing[me], quota[:, me])
  back = (landing[:, me], quota[:, me], send_offsets[:, me].astype(jnp.int32), quota[me])
  return order, kept_sorted, there, back


def expert_parallel(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
                    w: ExpertWeights, *, mesh: Mesh, capacity_factor: float | None = None,
                    exchange: str = "all_to_all", weights: str = "sharded",
                    d_axes: tuple[str, ...] = (FSDP_AXIS,)) -> tuple[jax.Array, jax.Array]:
  """Experts sharded over 'expert' (and over 'fsdp' on D, 'tensor' on F); tokens travel to them.

  Inside `jax.shard_map` each device holds n tokens (N padded to a multiple of the token shards,
  `token_axes`; padding slots go nowhere and count as neither kept nor dropped) and L = E / P experts'
  slices. Slots go to the device owning their expert, the local experts run on the received rows
  (`_sharded_swiglu`: activations move between fsdp and tensor peers, weights never do), and the
  results come back the same way. The exchange:

    all_to_all  fixed buffers of C rows per destination device, two `all_to_all`s (every backend).
    ragged      `jax.lax.ragged_all_to_all` of the exact slot counts into a receive buffer of R rows
                (TPU; Ragged all-to-all as in MaxText's sparse MoE path).
    emulated    the ragged bookkeeping over `emulated_ragged_all_to_all` (tests on CPU).

  Args:
    xs: [N, D] tokens, any sharding.
    expert_choices: [N, K] int32 global expert ids.
    combine_weights: [N, K].
    w: expert weights [E, ...] (resharded to `expert_weight_specs` when not already so).
    mesh: the mesh; mesh.shape['expert'] must divide E.
    capacity_factor: None: buffers for the worst case (C = n * K, R = P * n * K), nothing dropped,
      equal to `dropless`. Otherwise C = ceil(capacity_factor * n * K / P) rows per destination
      (overflow dropped choice-major, as in `capacity`) or R = ceil(capacity_factor * n * K) rows per
      receiver (overflow dropped from the last senders' tails).
    exchange: "all_to_all", "ragged" or "emulated".
    weights: "sharded" (never gathered; each device computes its fsdp peers' rows against its D-slice,
      so hidden activations are fsdp times larger), "gathered" (D gathered over fsdp per call: the
      better trade when fsdp x rows x F outgrows the local experts' L x D x F) or "auto" (the one
      that moves/holds fewer bytes for this call's static shapes: `ep_weight_bytes`).
    d_axes: the mesh axes the parameter rules split the experts' D over ('fsdp' by default; paper_3t
      adds 'sequence'): "fsdp" above means these axes (`d_split_axes`).

  Returns:
    ys [N, D] sharded like the tokens, and the dropped slot count over the whole mesh.
  """
  num_tokens, k = expert_choices.shape
  num_experts, embed, hidden = w.gate.shape
  num_shards = mesh.shape[EXPERT_AXIS]
  if num_experts % num_shards:
    raise ValueError(f"num_experts={num_experts} must be divisible by the mesh's expert axis "
                     f"({num_shards}).")
  if exchange not in ("all_to_all", "ragged", "emulated"):
    raise ValueError(f"exchange={exchange!r} is unknown; choose all_to_all, ragged or emulated.")
  axes = token_axes(mesh)
  padded = padded_tokens(mesh, num_tokens)
  if padded != num_tokens:  # padding tokens choose the sentinel expert E: they go nowhere
    pad = ((0, padded - num_tokens), (0, 0))
    xs = jnp.pad(xs, pad)
    expert_choices = jnp.pad(expert_choices, pad, constant_values=num_experts)
    combine_weights = jnp.pad(combine_weights, pad)
  _, cap, recv_rows = buffer_rows(mesh, num_tokens, k, capacity_factor)
  weights = resolve_weights(weights, mesh, num_tokens=num_tokens, k=k, num_experts=num_experts,
                            embed=embed, hidden=hidden, capacity_factor=capacity_factor,
                            exchange=exchange, act_bytes=xs.dtype.itemsize,
                            weight_bytes=w.gate.dtype.itemsize, d_axes=d_axes)
  specs = expert_weight_specs(mesh, embed, hidden, weights, d_axes)
  fsdp, tensor = specs.gate[1], specs.gate[2] is not None
  ragged = {"ragged": jax.lax.ragged_all_to_all, "emulated": emulated_ragged_all_to_all}.get(exchange)

  def local(xs_, choices_, weights_, gate_, up_, down_):
    n, d = xs_.shape
    local_experts = gate_.shape[0]
    local_w = ExpertWeights(gate_, up_, down_)
    with jax.named_scope("dispatch"):
      slot_experts_ = choices_.T.reshape(-1)  # [S] choice-major, like `capacity`
      valid_ = slot_experts_ < num_experts  # padding slots carry E
      dest_ = jnp.where(valid_, slot_experts_ // local_experts, num_shards)  # [S]
      local_ids_ = (slot_experts_ % local_experts).astype(jnp.int32)  # [S]
      slot_tokens_ = jnp.arange(k * n) % n  # [S]
    if ragged is None:
      with jax.named_scope("dispatch"):
        rank_ = _rank_in_group(dest_, num_shards)  # [S]
        kept_ = valid_ & (rank_ < cap)
        row_ = jnp.where(kept_, dest_ * cap + rank_, num_shards * cap)  # [S]; last row = not sent
        send_x_ = jnp.zeros((num_shards * cap + 1, d), xs_.dtype).at[row_].add(xs_[slot_tokens_])
        send_e_ = jnp.full((num_shards * cap + 1,), local_experts, jnp.int32).at[row_].set(local_ids_)
      with jax.named_scope("all_to_all_in"):
        recv_x_ = jax.lax.all_to_all(send_x_[:-1], EXPERT_AXIS, 0, 0, tiled=True)  # [P*C, D]
        recv_e_ = jax.lax.all_to_all(send_e_[:-1], EXPERT_AXIS, 0, 0, tiled=True)  # [P*C]
      with jax.named_scope("expert_compute"):
        out_ = _sharded_swiglu(recv_x_, recv_e_, local_w, fsdp=fsdp, tensor=tensor)  # [P*C, D]
      with jax.named_scope("all_to_all_out"):
        back_ = jax.lax.all_to_all(out_, EXPERT_AXIS, 0, 0, tiled=True)  # [P*C, D] by destination
      back_ = jnp.concatenate([back_, jnp.zeros((1, d), back_.dtype)])  # [P*C+1, D]
      slot_out_ = back_[row_]  # [S, D]
    else:
      with jax.named_scope("dispatch"):
        order_, kept_sorted_, there_, back_sizes_ = _ragged_send(dest_, num_shards, recv_rows)
        kept_ = jnp.zeros_like(valid_).at[order_].set(kept_sorted_)
        send_x_ = xs_[slot_tokens_[order_]]  # [S, D] sorted by destination
      with jax.named_scope("ragged_all_to_all_in"):
        recv_x_ = ragged(send_x_, jnp.zeros((recv_rows, d), xs_.dtype), *there_, axis_name=EXPERT_AXIS)
        recv_e_ = ragged(local_ids_[order_], jnp.full((recv_rows,), local_experts, jnp.int32), *there_,
                         axis_name=EXPERT_AXIS)  # [R]; L marks a row nobody filled
      with jax.named_scope("expert_compute"):
        out_ = _sharded_swiglu(recv_x_, recv_e_, local_w, fsdp=fsdp, tensor=tensor)  # [R, D]
      with jax.named_scope("ragged_all_to_all_out"):
        back_ = ragged(out_, jnp.zeros((k * n, d), out_.dtype), *back_sizes_,
                       axis_name=EXPERT_AXIS)  # [S, D] sorted by destination; 0 where not kept
      slot_out_ = jnp.zeros_like(back_).at[order_].set(back_)  # [S, D] choice-major
    with jax.named_scope("combine"):
      slot_out_ = slot_out_.reshape(k, n, d).transpose(1, 0, 2)  # [n, K, D]
      ys_ = _combine(slot_out_, weights_)
      dropped_ = jax.lax.psum(jnp.sum(valid_ & ~kept_).astype(jnp.int32), axes)
    return ys_, dropped_

  tokens = PartitionSpec(axes)
  run_ = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, *specs),
                       out_specs=(tokens, PartitionSpec()))
  ys, dropped = run_(xs, expert_choices, combine_weights, w.gate, w.up, w.down)
  return ys[:num_tokens], dropped
