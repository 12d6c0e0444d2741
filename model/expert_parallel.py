"""Expert parallelism: the experts sharded over the mesh's 'expert' axis, tokens moved to them.

`expert_parallel` runs the experts sharded over 'expert' (weights also split over the D-split axes,
'fsdp' by default, on D and 'tensor' on F; never gathered unless the weight layout says so), moving
tokens by all-to-all with fixed buffers or by `ragged_all_to_all` (TPU), for any token count (padded
to the token shards). `ep_weight_bytes` / `resolve_weights` pick the weight layout per call (the
`moe.ep_weights=auto` rule), `resolve_exchange` the token exchange (`moe.ep_exchange`).

Axes as in model/moe_dispatch.py, plus: n tokens on one device (inside shard_map), L = E / P local
experts, P devices on 'expert', Pf the size of the D-split axes, C rows per destination device,
R receive rows of the ragged exchange, M rows a device's experts receive.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshrl.model.blockwise import match_vma
from meshrl.model.moe_dispatch import ExpertWeights, combine_slots, rank_in_group
from meshrl.sharding import compress
from meshrl.sharding.mesh import EXPERT_AXIS, FSDP_AXIS, MESH_AXES, STAGE_AXIS, TENSOR_AXIS, in_context

EXCHANGES = ("auto", "all_to_all", "ragged")
WEIGHT_LAYOUTS = ("auto", "sharded", "gathered")


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axes."""
  return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


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


def resolve_exchange(exchange: str, backend: str, phase: str = "train") -> str:
  """The exchange an expert-parallel call runs: `auto` is `ragged` on TPU for training and prefill
  and `all_to_all` elsewhere and for decode steps. A decode step moves a few rows per device (fixed
  buffers of them cost little), and libtpu refuses ragged-all-to-all in paper_3t's compiled decode
  step ("INTERNAL: Assigned barrier is not acceptable for opcode: ragged-all-to-all", one slice and
  two; docs/pods-and-aot.md), so `auto` never gives a decode step the ragged exchange."""
  check_exchange(exchange, backend)
  if exchange != "auto":
    return exchange
  return "ragged" if backend == "tpu" and phase != "decode" else "all_to_all"


def token_axes(mesh: Mesh) -> tuple[str, ...]:
  """Mesh axes that split the tokens inside the expert-parallel shard_map: every axis of size > 1
  but 'tensor' (whose devices share their tokens and split each expert's hidden F) and 'stage' (which
  splits the layers: a pipelined call runs vmapped over it, model/pipeline.py, which adds it to the
  shard_map's specs), in mesh order."""
  return tuple(a for a in MESH_AXES if a not in (TENSOR_AXIS, STAGE_AXIS) and mesh.shape[a] > 1)


def token_shards(mesh: Mesh) -> int:
  """How many ways a call's tokens are split: the product of `token_axes`' sizes."""
  return math.prod(mesh.shape[a] for a in token_axes(mesh))


def tensor_split_axis(mesh: Mesh, hidden: int) -> str | None:
  """'tensor' when it has more than one device and divides the experts' hidden F, else None (F
  whole on every device)."""
  size = mesh.shape[TENSOR_AXIS]
  return TENSOR_AXIS if size > 1 and hidden % size == 0 else None


def padded_tokens(mesh: Mesh, num_tokens: int) -> int:
  """N rounded up to a multiple of the token shards (`token_shards`)."""
  shards = token_shards(mesh)
  return -(-num_tokens // shards) * shards


def buffer_rows(mesh: Mesh, num_tokens: int, k: int, capacity_factor: float | None = None
                ) -> tuple[int, int, int]:
  """(S, C, R) of one device, from static shapes: S = n * K slots of its n tokens (N padded to the
  token shards), C rows per destination device of the all_to_all exchange and R receive rows of the
  ragged one. capacity_factor None: the worst case, C = S and R = P * S (nothing dropped)."""
  slots = padded_tokens(mesh, num_tokens) // token_shards(mesh) * k
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
  return tuple(a for a in MESH_AXES if a in d_axes and a not in (EXPERT_AXIS, TENSOR_AXIS, STAGE_AXIS)
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
  tensor = tensor_split_axis(mesh, hidden)
  inner = PartitionSpec(EXPERT_AXIS, fsdp, tensor)
  return ExpertWeights(inner, inner, PartitionSpec(EXPERT_AXIS, tensor, fsdp))


def inverse_permutation(order: jax.Array) -> jax.Array:
  """[M] int permutation -> its inverse, so `x[order][inverse_permutation(order)] == x`.

  Rows go back to their order by this gather, never by `zeros.at[order].set(x)`: JAX cannot know a
  scatter's indices are unique, and its JVP of one tags every element of x with an id in an array
  of x's shape and masks value and tangent through it. In the paper_3t update (163,840 received rows
  of 8,192 per MoE layer) that cost 4.1 GiB per chip of temporaries (84.5 against 80.45 GiB). The
  scatter here is of integers, outside any gradient."""
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


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
  out = out[inverse_permutation(order)]  # received order
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
                    d_axes: tuple[str, ...] = (FSDP_AXIS,), grad_reduce=None) -> tuple[jax.Array, jax.Array]:
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
    grad_reduce: sharding/compress.GradReduce or None. With it, "gathered" weights enter split as
      stored and are gathered inside (compress.gather_for_use), so their gradients are reduced in its
      wire dtype; "sharded" weights move no gradient (each device's D-slice sees every row).

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
  gather = ()  # D-split axes the weights are gathered over inside (explicit gradient reductions)
  if grad_reduce is not None and weights == "gathered":
    specs = expert_weight_specs(mesh, embed, hidden, "sharded", d_axes)
    gather = _axes(specs.gate[1])
  reduce_over = tuple(a for a in axes if a != EXPERT_AXIS)  # devices of one expert shard, other rows
  ragged = {"ragged": jax.lax.ragged_all_to_all, "emulated": emulated_ragged_all_to_all}.get(exchange)

  def local(xs_, choices_, weights_, gate_, up_, down_):
    if grad_reduce is not None and weights == "gathered":
      gate_, up_ = (compress.gather_for_use(w_, gather, 1, reduce_over, grad_reduce) for w_ in (gate_, up_))
      down_ = compress.gather_for_use(down_, gather, 2, reduce_over, grad_reduce)
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
        rank_ = rank_in_group(dest_, num_shards)  # [S]
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
        # The output buffers vary over the token axes like the rows sent into them: the result takes
        # its buffer's varying axes, and an invariant one made the backward psum the rows' cotangents
        # over those axes (other devices' rows added into each device's: wrong gradients, and two
        # activation-sized all-reduces, 5.5 GiB of temporaries in paper_3t's SFT step).
        recv_x_ = ragged(send_x_, match_vma(jnp.zeros((recv_rows, d), xs_.dtype), send_x_), *there_,
                         axis_name=EXPERT_AXIS)
        recv_e_ = ragged(local_ids_[order_],
                         match_vma(jnp.full((recv_rows,), local_experts, jnp.int32), local_ids_), *there_,
                         axis_name=EXPERT_AXIS)  # [R]; L marks a row nobody filled
      with jax.named_scope("expert_compute"):
        out_ = _sharded_swiglu(recv_x_, recv_e_, local_w, fsdp=fsdp, tensor=tensor)  # [R, D]
      with jax.named_scope("ragged_all_to_all_out"):
        back_ = ragged(out_, match_vma(jnp.zeros((k * n, d), out_.dtype), out_, xs_), *back_sizes_,
                       axis_name=EXPERT_AXIS)  # [S, D] sorted by destination; 0 where not kept
      slot_out_ = back_[inverse_permutation(order_)]  # [S, D] choice-major
    with jax.named_scope("combine"):
      slot_out_ = slot_out_.reshape(k, n, d).transpose(1, 0, 2)  # [n, K, D]
      ys_ = combine_slots(slot_out_, weights_)
      dropped_ = jax.lax.psum(jnp.sum(valid_ & ~kept_).astype(jnp.int32), axes)
    return ys_, dropped_

  tokens = PartitionSpec(axes)
  run_ = jax.shard_map(local, mesh=in_context(mesh), in_specs=(tokens, tokens, tokens, *specs),
                       out_specs=(tokens, PartitionSpec()))
  ys, dropped = run_(xs, expert_choices, combine_weights, w.gate, w.up, w.down)
  return ys[:num_tokens], dropped
