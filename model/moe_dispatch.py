"""Expert computation for routed tokens, all experts in one program: dropless, capacity and the rest.

Each dispatcher takes routed tokens and returns their combined expert output:

  (xs [N, D], expert_choices [N, K], combine_weights [N, K], ExpertWeights) -> (ys [N, D], dropped)

where `dropped` is the number of token-slots (out of N * K) that got no expert output. Routing itself
(router, top-k, balancing) lives in moe.py; everything here is gather, scatter and grouped matmul.

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
  blocks    sort slots by expert, pad each expert's group to a multiple of b rows, and run each block
            of b rows through its expert's weights (MegaBlocks' block-sparse layout, Gale et al. 2022,
            "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", written in jnp; the loop
            over blocks and its backward pass are model/block_swiglu.py).
  buffered  the capacity buffer of C = ceil(capacity_factor * N * K / E) rows per expert when every
            expert fits, else `blocks`, chosen at run time by `lax.cond`: pays only when routing is
            balanced within capacity_factor (at init it is not: the busiest expert gets 1.7-2.8x the
            mean, and the cond then costs more than it saves).
  ladder    `capacity`'s buffers at the smallest of a few static sizes that holds every expert but
            the busiest, whose other rows go to a spill buffer of their own, each size picked at run
            time by `lax.switch` (`blocks` past the last size): no weight gather, one busy expert
            does not size every expert's buffer; for generation (a switch's backward would keep
            every branch's residuals).
  dense     every expert on every token, weighted by a [N, E] combine matrix (E / K times the FLOPs).
  gather    each slot multiplies its own expert's weights, gathered [N, K, D, F]: a decode step of a
            few tokens touches only the experts they chose.
  capacity  the fixed buffer alone; overflow slots are dropped (only when asked for).

`choose` is the `auto` policy: per backend and per phase (train, prefill, decode), from static shapes.

Expert parallelism (experts sharded over the mesh's 'expert' axis, tokens moved to them) lives in
model/expert_parallel.py and runs these experts' math on each device's share.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshrl.model.block_swiglu import block_swiglu
from meshrl.sharding.mesh import EXPERT_AXIS


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


def rank_in_group(group_ids: jax.Array, num_groups: int) -> jax.Array:
  """For each element, how many earlier elements share its group: [S] int -> [S] int32.

  Ids equal to `num_groups` (a sentinel) are allowed and ranked among themselves.
  """
  order = jnp.argsort(group_ids, stable=True)  # [S]
  sorted_ids = group_ids[order]  # [S]
  counts = jnp.bincount(group_ids, length=num_groups + 1)  # [G+1]
  starts = jnp.cumsum(counts) - counts  # [G+1]
  sorted_rank = jnp.arange(group_ids.shape[0]) - starts[sorted_ids]  # [S]
  return jnp.zeros_like(group_ids).at[order].set(sorted_rank.astype(group_ids.dtype))


def combine_slots(slot_outputs: jax.Array, combine_weights: jax.Array) -> jax.Array:
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
    ys = combine_slots(slot_out, combine_weights)
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
    rank = rank_in_group(slot_experts, num_experts)  # [S]
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
    ys = combine_slots(slot_out, combine_weights)
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
    ys = combine_slots(slot_out, combine_weights)
  return ys, jnp.zeros((), jnp.int32)


def block_size(num_slots: int, num_experts: int) -> int:
  """Rows per block b: the power of two at or below S / (2E), kept within [8, 128].

  Bigger blocks make bigger matmuls but pad each expert by up to b - 1 rows; 128 measured best for
  S / E of 256 to 640 on CPU (fp32, D 256-512, F 512).
  """
  target = max(1, num_slots // (2 * num_experts))
  return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def _block_layout(slot_experts: jax.Array, num_experts: int, block: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, int]:
  """Rows of the expert-sorted layout in which each expert's group is padded to a multiple of b.

  Args:
    slot_experts: [S] int expert of each slot.

  Returns:
    row [S] int32 (each slot's row in [0, G * b)), block_experts [G] int32 (the expert of each block;
    blocks past the last group hold only padding), used_blocks (int32 scalar: the blocks that hold a
    slot are [0, used_blocks)), and the static block count G, the most any routing can need:
    sum_e ceil(count_e / b) <= (S + E * (b - 1)) / b.
  """
  num_blocks = (slot_experts.shape[0] + num_experts * (block - 1)) // block
  counts = jnp.bincount(slot_experts, length=num_experts)  # [E]
  padded = (counts + block - 1) // block * block  # [E]
  ends = jnp.cumsum(padded)  # [E]
  row = ends[slot_experts] - padded[slot_experts] + rank_in_group(slot_experts, num_experts)  # [S]
  block_starts = jnp.arange(num_blocks) * block  # [G]
  block_experts = jnp.minimum(jnp.searchsorted(ends, block_starts, side="right"), num_experts - 1)
  used_blocks = (ends[-1] // block).astype(jnp.int32)
  return row.astype(jnp.int32), block_experts.astype(jnp.int32), used_blocks, num_blocks


def blocks(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
           w: ExpertWeights, *, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Grouped matmul over blocks of b rows, each block owned by one expert.

  Slots are laid out sorted by expert with each expert's group padded to a multiple of b (padding
  rows read a zero token and are never read back), so the blocks' SwiGLU (`block_swiglu`: a loop over
  the blocks that hold slots, each reading its expert's weights in place) computes every routed slot
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
    row, block_experts, used_blocks, num_blocks = _block_layout(expert_choices.reshape(-1), num_experts, block)
    slot_tokens = jnp.arange(num_tokens * k, dtype=jnp.int32) // k  # [S] token-major
    row_tokens = jnp.full((num_blocks * block,), num_tokens, jnp.int32).at[row].set(slot_tokens)  # [R]
    padded_xs = jnp.concatenate([xs, jnp.zeros((1, embed), xs.dtype)])  # [N + 1, D]; row N is zero
    block_xs = padded_xs[row_tokens].reshape(num_blocks, block, embed)  # [G, b, D]
  with jax.named_scope("expert_compute"):
    block_out = block_swiglu(block_xs, block_experts, used_blocks, *w)  # [G, b, D]
  with jax.named_scope("combine"):
    slot_out = block_out.reshape(num_blocks * block, embed)[row].reshape(num_tokens, k, embed)
    ys = combine_slots(slot_out, combine_weights)
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


def ladder_rungs(num_tokens: int, k: int, num_experts: int, first: float = 1.25, step: float = 1.3,
                 most: float = 4.0, small_rows: int = 4096) -> tuple[int, ...]:
  """The static capacities `ladder` chooses from: C_0 = ceil(first * N * K / E) rows per expert, then
  x `step` per rung up to the top, the largest capacity whose buffers' E x C rows stay within
  max(`most` x the N * K slots, `small_rows`) (every branch's buffers are allocated) and at most
  N * K. The top is N * K (every slot on one expert) when that is within the bound, as it is for a
  decode step or a short prefill; otherwise a busier expert sends the call to `blocks`.

  Why 1.3: the buffers cost E x C rows whatever the other experts hold, so a rung C wastes
  (C - busiest) x E rows; rungs 1.3x apart waste under a third of what doubling did (8 rungs from
  10 to 64 for the peer shape's 32-token decode step; at most log(E / 1.25) / log(1.3) + 1 in
  all), each one more small branch to compile. What it buys depends on how skewed the routing is:
  `scripts/bench_rollout.py --sections ladder` at the peer shape (random-initialised router, 2
  simulated devices) measured 0.97-1.07x of doubling's speed in three runs, and a rollout of random
  prompts 1.05-1.26x (best of 9 calls, two alternating runs)."""
  slots = num_tokens * k
  bound = int(max(most * slots, small_rows) // num_experts)
  top = min(slots, bound)
  rung = expert_capacity(num_tokens, k, num_experts, first)
  rungs = []
  while rung < top:
    rungs.append(rung)
    rung = max(rung + 1, math.ceil(rung * step - 1e-9))
  return tuple(rungs) + (top,)


def ladder(xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
           w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
  """`capacity`'s per-expert buffers [E, C, D] at the smallest rung C of `ladder_rungs` that holds every
  expert but the busiest, and the busiest expert's rows past C in a spill buffer [C', D] of its own at
  the smallest rung C' that holds them; both picked at run time by `lax.switch` (one branch each
  runs). `blocks` when either outgrows the last rung. Exact: no slot is ever dropped.

  The spill keeps one busy expert from sizing every expert's buffer: in the peer shape's decode a
  random-initialised router sends over 30 of a step's 64 slots to one expert, and E x C rows at its
  rung were 3-5x the slots. In three alternating runs of that rollout (10-16 calls a side, one process)
  the spill's best call was 1-3% faster and its median call 5% faster in two runs, 3% slower in one:
  within this 2-core machine's noise where the experts' weights, not their rows, bound a step.

  The buffers multiply the weights as they lie ([C, D] x [D, F] per expert, each expert's weights read
  once), where `blocks` re-reads an expert's weights for each of its blocks and `dense` computes every
  expert on every token: on CPU the fastest exact path for generation (a decode step of a batch, a
  prompt prefill). Meant for calls without gradients: a switch's backward keeps every branch's
  residuals.

  Returns:
    ys [N, D] and the dropped slot count (always 0).
  """
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  rungs = ladder_rungs(num_tokens, k, num_experts)
  top = jnp.int32(rungs[-1])
  slot_experts = expert_choices.T.reshape(-1)  # [S] slot j = choice j // N of token j % N
  counts = jnp.bincount(slot_experts, length=num_experts).astype(jnp.int32)  # [E]
  busiest = jnp.argmax(counts).astype(jnp.int32)
  second = jnp.max(jnp.where(jnp.arange(num_experts) == busiest, 0, counts))
  sizes = jnp.asarray(rungs, jnp.int32)
  cap = sizes[jnp.minimum(jnp.searchsorted(sizes, second), len(rungs) - 1)]
  spill = jnp.maximum(counts[busiest] - cap, 0)
  args = (xs, expert_choices, combine_weights, w)
  buffered = lambda a: _spilled_rows(*a, rungs, busiest, cap, spill)  # noqa: E731
  if rungs[-1] < num_tokens * k:
    ys = jax.lax.cond((second <= top) & (spill <= top), buffered, lambda a: blocks(*a)[0], args)
  else:
    ys = buffered(args)
  return ys, jnp.zeros((), jnp.int32)


def _spilled_rows(xs, expert_choices, combine_weights, w: ExpertWeights, rungs: tuple[int, ...], busiest,
                  cap, spill) -> jax.Array:
  """`ladder`'s buffers: every expert's first `cap` rows in [E, cap, D] (cap one of `rungs`), the
  `busiest` expert's next `spill` rows in [C', D] (C' the rung that holds them) -> ys [N, D]."""
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  with jax.named_scope("dispatch"):
    slot_experts = expert_choices.T.reshape(-1)  # [S]
    rank = rank_in_group(slot_experts, num_experts)  # [S]
    slot_xs = xs[jnp.arange(k * num_tokens) % num_tokens]  # [S, D]
    sizes = jnp.asarray(rungs, jnp.int32)

  def buffers(c):
    """[S, D]: each slot of rank < c through its expert's buffer row (others 0)."""
    row = jnp.where(rank < c, slot_experts * c + rank, num_experts * c)  # last row: not here
    expert_in = jnp.zeros((num_experts * c + 1, xs.shape[1]), xs.dtype).at[row].add(slot_xs)
    with jax.named_scope("expert_compute"):
      gate = jnp.einsum("ecd,edf->ecf", expert_in[:-1].reshape(num_experts, c, -1), w.gate)
      up = jnp.einsum("ecd,edf->ecf", expert_in[:-1].reshape(num_experts, c, -1), w.up)
      out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w.down).reshape(num_experts * c, -1)
    return jnp.concatenate([out, jnp.zeros((1, out.shape[-1]), out.dtype)])[row]

  def spilled(c):
    """[S, D]: the busiest expert's slots of rank cap .. cap + c - 1 through its spill row (others 0)."""
    row = jnp.where((slot_experts == busiest) & (rank >= cap), rank - cap, c)
    expert_in = jnp.zeros((c + 1, xs.shape[1]), xs.dtype).at[row].add(slot_xs)[:-1]
    take = lambda a: jax.lax.dynamic_index_in_dim(a, busiest, 0, keepdims=False)  # noqa: E731
    with jax.named_scope("expert_compute"):
      hidden = jax.nn.silu(expert_in @ take(w.gate)) * (expert_in @ take(w.up))
      out = hidden @ take(w.down)
    return jnp.concatenate([out, jnp.zeros((1, out.shape[-1]), out.dtype)])[row]

  slot_out = jax.lax.switch(jnp.minimum(jnp.searchsorted(sizes, cap), len(rungs) - 1),
                            [functools.partial(buffers, c) for c in rungs])
  spill_index = jnp.where(spill == 0, 0, 1 + jnp.minimum(jnp.searchsorted(sizes, spill), len(rungs) - 1))
  slot_out = slot_out + jax.lax.switch(spill_index, [lambda: jnp.zeros_like(slot_xs)]
                                       + [functools.partial(spilled, c) for c in rungs])
  with jax.named_scope("combine"):
    return combine_slots(slot_out.reshape(k, num_tokens, -1).transpose(1, 0, 2), combine_weights)


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
  and decode (no gradients; a decode step's blocks of a few rows each re-read their expert's weights:
  at the issue-9 peer shape the rollout took 0.67-0.87 s with "ladder" and 1.16-1.25 s with "blocks",
  two alternating pairs of scripts/bench_rl.py --config=configs/tiny.py:peer); a decode step with
  fewer slots than experts runs "gather" and so touches only the experts its tokens chose. Never
  "capacity": only an explicit `capacity` drops tokens.

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
