"""Softmax attention for 1M-token sequences: one entry point, `attend`, over three kernels.

  reference  plain softmax over the whole [T, S] score matrix (tests, tiny shapes).
  blockwise  one device, FlashAttention-2 in jnp (model/blockwise.py), O(T) memory, custom VJP.
  ring       `jax.shard_map` over the mesh axis `sequence` (Liu et al. 2023, "Ring Attention",
             arXiv:2310.01889): each device keeps its query shard and passes its key/value shard
             round the ring with `ppermute`, the next transfer issued before the current block is
             computed; the custom VJP rings keys, values and their gradients back home, so memory per
             device does not grow with the number of devices.

Masks come from explicit positions (`q_pos >= kv_pos` when causal) and segment ids (equal ids
attend), so any layout of the tokens works. For causal load balance lay the batch out once with
`zigzag` (device r holds chunks r and 2n-1-r of 2n, the context-parallel layout of the Llama 3
report, arXiv:2407.21783; Brandon et al. 2023, arXiv:2311.09431, analyse the imbalance) and pass
the zigzagged positions.
`decode_attend` serves generation against a KV cache sharded on `sequence`: each shard attends
locally and the partial outputs are merged by their log-sum-exp with one tiny all-reduce (Shyam et
al. 2024, "Tree Attention", arXiv:2408.04093); the cache never moves.

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per key/value head (N = K * G), H query/key head dim, J value head dim (H except MLA).
Inside shard_map, per-device arrays end in `_`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from meshrl.model import blockwise as bw
from meshrl.sharding.mesh import in_context
from meshrl.sharding.rules import batch_axes
from meshrl.sharding.mesh import SEQUENCE_AXIS, TENSOR_AXIS

IMPLS = ("reference", "blockwise", "ring")
BATCH_AXES = batch_axes()  # the mesh axes of the logical `batch` axis (sharding/rules.py)
HEADS_AXIS = TENSOR_AXIS


@dataclasses.dataclass(frozen=True)
class _Ring:
  axis: str
  size: int


# ---------------------------------------------------------------------------------------------
# The custom VJP shared by blockwise (no ring) and ring attention.


def _shift(tree, ring: _Ring):
  """Sends every leaf to the next device of the ring (device i -> i + 1)."""
  perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis, perm), tree)


def _prepare(q, k, v, q_ids, kv_ids, blocking: bw.Blocking):
  """The kernel's layouts (model/blockwise.py): scaled query rows, head-major keys and values."""
  kv_heads = k.shape[2]
  groups = q.shape[2] // kv_heads
  queries = bw.Queries(bw.to_rows(q * jnp.asarray(blocking.scale, q.dtype), kv_heads),
                       *(bw.row_ids(ids, groups) for ids in q_ids))
  return queries, bw.Keys(bw.heads_major(k), bw.heads_major(v), *kv_ids)


def _attention_fwd(queries: bw.Queries, keys: bw.Keys, blocking: bw.Blocking, ring: _Ring | None):
  """Forward pass; returns (out [B, K, R, J] float32, lse [B, K, R] float32)."""
  stats = bw.init_stats(queries, keys)
  if ring is not None and ring.size > 1:
    def step(carry, _):
      stats, keys = carry
      with jax.named_scope("ring_send_kv"):
        next_keys = _shift(keys, ring)  # independent of this step's compute: overlaps it
      return (bw.forward_sweep(queries, keys, stats, blocking), next_keys), None

    (stats, keys), _ = lax.scan(step, (stats, keys), length=ring.size - 1)
  stats = bw.forward_sweep(queries, keys, stats, blocking)  # the last shard: nothing left to send
  return bw.finalize(stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, q_ids, kv_ids, blocking, ring):
  """Attention of whole blocks: q [B, T, N, H], k [B, S, K, H], v [B, S, K, J] (T, S multiples of
  the block sizes); q_ids, kv_ids: (positions, segments) int32 [B, T], [B, S]. Returns [B, T, N, J].

  With `ring`, runs inside shard_map on per-device shards and rings the keys over `ring.axis`.
  """
  return _attention_vjp_fwd(q, k, v, q_ids, kv_ids, blocking, ring)[0]


def _attention_vjp_fwd(q, k, v, q_ids, kv_ids, blocking, ring):
  queries, keys = _prepare(q, k, v, q_ids, kv_ids, blocking)
  out, lse = _attention_fwd(queries, keys, blocking, ring)
  out = bw.from_rows(out, q.shape[1]).astype(q.dtype)  # [B, T, N, J]
  return out, (queries, keys, out, lse)


def _attention_vjp_bwd(blocking, ring, residuals, d_out):
  queries, keys, out, lse = residuals
  b, t, n, _ = out.shape
  kv_heads = keys.k.shape[1]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.swapaxes(delta.reshape(b, t, kv_heads, n // kv_heads), 1, 2).reshape(lse.shape)
  dq_t = bw.match_vma(jnp.zeros(queries.q.shape[:2] + queries.q.shape[3:] + queries.q.shape[2:3],
                                jnp.float32), queries.q)  # [B, K, H, R]
  sweep = functools.partial(bw.backward_sweep, queries, d_out=bw.to_rows(d_out, kv_heads),
                            lse=lse, delta=delta, blocking=blocking)
  if ring is None or ring.size == 1:
    dq_t, dk, dv = sweep(keys, dq_t=dq_t)
  else:
    # Step 0 on the home shard; then each step sends the keys on and the gradients of the shard
    # seen last step ("pending") to the device that now holds that shard, both before computing.
    with jax.named_scope("ring_send_kv"):
      next_keys = _shift(keys, ring)
    dq_t, dk, dv = sweep(keys, dq_t=dq_t)

    def step(carry, _):
      keys, dq_t, pending = carry
      with jax.named_scope("ring_send_kv_grads"):
        next_keys, arrived = _shift(keys, ring), _shift(pending, ring)
      dq_t, dk, dv = sweep(keys, dq_t=dq_t)
      return (next_keys, dq_t, (arrived[0] + dk, arrived[1] + dv)), None

    (_, dq_t, pending), _ = lax.scan(step, (next_keys, dq_t, (dk, dv)), length=ring.size - 1)
    with jax.named_scope("ring_send_kv_grads"):
      dk, dv = _shift(pending, ring)  # the last shard's gradients go home
  dq = bw.from_rows(jnp.swapaxes(dq_t, 2, 3) * blocking.scale, t)  # [B, T, N, H]
  dtype = queries.q.dtype
  return (dq.astype(dtype), bw.heads_major(dk).astype(keys.k.dtype),
          bw.heads_major(dv).astype(keys.v.dtype), None, None)


_attention.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


# ---------------------------------------------------------------------------------------------
# Block sizes and padding.


def _pad(x, length, axis, value):
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


# Blocks of at least this many (query row, key) pairs are computed one (batch row, kv head) stream
# at a time (model/blockwise.py `Blocking.per_stream`); smaller ones (decode) all streams at once.
_PER_STREAM_MIN_BLOCK = 128 * 128


def _padded_inputs(q, k, v, ids, *, causal, segments, scale, block_q, block_kv):
  """Pads T and S up to whole blocks; returns (q, k, v, q_ids, kv_ids, Blocking).

  Padded query rows get positions/segments that match no key; padded keys match no query.
  """
  (q_pos, q_seg, kv_pos, kv_seg) = ids
  t, s = q.shape[1], k.shape[1]
  bq, bk = min(block_q, t), min(block_kv, s)
  t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
  segments = segments or (not causal and (t_pad > t or s_pad > s))
  q = _pad(q, t_pad, 1, 0)
  k, v = _pad(k, s_pad, 1, 0), _pad(v, s_pad, 1, 0)
  q_ids = (_pad(q_pos, t_pad, 1, bw.PAD_Q_POSITION), _pad(q_seg, t_pad, 1, bw.PAD_Q_SEGMENT))
  kv_ids = (_pad(kv_pos, s_pad, 1, bw.PAD_KV_POSITION), _pad(kv_seg, s_pad, 1, bw.PAD_KV_SEGMENT))
  rows = bq * (q.shape[2] // k.shape[2])  # query rows per block: tokens x heads per kv head
  per_stream = rows * bk >= _PER_STREAM_MIN_BLOCK
  return q, k, v, q_ids, kv_ids, bw.Blocking(causal, segments, scale, rows, bk,
                                             per_stream=per_stream)


def _local_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, causal, segments, scale,
                     block_q, block_kv, ring):
  """Blockwise attention of local arrays ([B, T, N, H] etc.), ringing keys if `ring` is set."""
  *args, blocking = _padded_inputs(
      q, k, v, (q_pos, q_seg, kv_pos, kv_seg), causal=causal, segments=segments, scale=scale,
      block_q=block_q, block_kv=block_kv)
  return _attention(*args, blocking, ring)[:, :q.shape[1]]


# ---------------------------------------------------------------------------------------------
# Reference.


def reference_attention(q, k, v, *, causal, q_positions, kv_positions, q_segment_ids=None,
                        kv_segment_ids=None, scale, causal_blocks: int = 1):
  """Plain softmax attention in float32 (the whole [T, S] score matrix); rows with no key give 0.

  Shapes as `attend`; segment ids are [B, T] and [B, S] or None. Decode (T = 1 against a KV cache)
  takes this path too, without the unit query axis: on XLA:CPU its batched dots, transposed cache
  copies included, measured 2-20x faster than a broadcast-multiply over the cache as laid out (an
  earlier kernel), and dropping the axis 1.3-1.5x faster than keeping it. More queries are laid out
  [B, K, T * G, H] (batch axes first), so neither product nor its gradients transpose the scores: the
  agent preset's update took 0.94x, an observation fed into its cache 0.66x the time of [B, T, K, G, H].

  causal_blocks: n > 1 splits the queries into n blocks, each scored against the keys up to its own
  last column only: (n + 1) / 2n of the score matrix. Exact when no query attends a later column:
  causal self-attention (T == S) in token order, whatever segments and positions restart inside a
  row (packed rows). Not for the zigzag layout, whose columns are out of token order.
  """
  t = q.shape[1]
  if causal_blocks > 1:
    if not causal or t != k.shape[1]:
      raise ValueError(f"causal_blocks={causal_blocks} needs causal self-attention (T == S); got causal="
                       f"{causal}, T={t}, S={k.shape[1]}.")
    ends = [round(t * (i + 1) / causal_blocks) for i in range(causal_blocks)]
    cut = lambda x, a, z: None if x is None else x[:, a:z]  # noqa: E731  (segment ids may be None)
    return jnp.concatenate([
        reference_attention(q[:, a:z], k[:, :z], v[:, :z], causal=True, q_positions=q_positions[:, a:z],
                            kv_positions=kv_positions[:, :z], q_segment_ids=cut(q_segment_ids, a, z),
                            kv_segment_ids=cut(kv_segment_ids, 0, z), scale=scale)
        for a, z in zip([0] + ends[:-1], ends) if z > a], axis=1)
  b, _, n, h = q.shape
  kv_heads, s_len = k.shape[2], k.shape[1]
  groups = n // kv_heads
  mask = jnp.ones((b, t, s_len), bool)
  if causal:
    mask &= q_positions[:, :, None] >= kv_positions[:, None, :]
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  hi = lax.Precision.HIGHEST
  if t > 1:  # queries [B, K, T * G, H], keys and values [B, K, S, .]
    queries = q.astype(jnp.float32).reshape(b, t, kv_heads, groups, h).transpose(0, 2, 1, 3, 4)
    keys, values = (x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (k, v))
    rows = jnp.broadcast_to(mask[:, None, :, None], (b, 1, t, groups, s_len))
    s = jnp.einsum("BKMH,BKSH->BKMS", queries.reshape(b, kv_heads, t * groups, h), keys, precision=hi) * scale
    p = _softmax(jnp.where(rows.reshape(b, 1, t * groups, s_len), s, -jnp.inf))
    out = jnp.einsum("BKMS,BKSJ->BKMJ", p, values, precision=hi).reshape(b, kv_heads, t, groups, -1)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, v.shape[-1]).astype(q.dtype)
  # One query (decode): its axis dropped, the cache read in its own layout
  s = jnp.einsum("BKGH,BSKH->BKGS", q.astype(jnp.float32).reshape(b, kv_heads, groups, h),
                 k.astype(jnp.float32), precision=hi) * scale
  p = _softmax(jnp.where(mask[:, :, None], s, -jnp.inf))  # mask [B, 1, 1, S]
  out = jnp.einsum("BKGS,BSKJ->BKGJ", p, v.astype(jnp.float32), precision=hi)
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)


def _softmax(s):
  """Softmax over the last axis of scores whose masked entries are -inf; a row with none left gives 0."""
  m = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = p.sum(axis=-1, keepdims=True)
  return p / jnp.where(l > 0, l, 1.0)


# ---------------------------------------------------------------------------------------------
# Checks and defaults.


def _check_qkv(q, k, v):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, length, heads, head_dim]; got shapes {q.shape}, "
                     f"{k.shape}, {v.shape}.")
  (b, _, n, h), (kb, s, kv_heads, kh) = q.shape, k.shape
  if kb != b or v.shape[0] != b:
    raise ValueError(f"batch sizes differ: q {b}, k {kb}, v {v.shape[0]}.")
  if v.shape[1] != s or v.shape[2] != kv_heads:
    raise ValueError(f"k {k.shape} and v {v.shape} must agree on length and heads.")
  if kh != h:
    raise ValueError(f"q head_dim={h} and k head_dim={kh} must be equal.")
  if kv_heads == 0 or n % kv_heads:
    raise ValueError(f"kv_heads={kv_heads} must divide heads={n} (grouped-query attention).")


def _ids(q, k, q_positions, kv_positions, segment_ids):
  """Returns (q_pos, kv_pos, q_seg, kv_seg, use_segments), all int32 [B, T] / [B, S].

  Default positions put the queries at the end of the keys (decode, chunked prefill).
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  if kv_positions is None:
    kv_positions = jnp.arange(s, dtype=jnp.int32)
  if q_positions is None:
    q_positions = jnp.arange(t, dtype=jnp.int32) + (s - t)
  q_pos = jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32), (b, t))
  kv_pos = jnp.broadcast_to(jnp.asarray(kv_positions, jnp.int32), (b, s))
  if segment_ids is None:
    return q_pos, kv_pos, jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32), False
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  elif t != s:
    raise ValueError(f"one segment_ids array needs q_len == kv_len, got {t} and {s}; pass a pair "
                     "(q_segment_ids, kv_segment_ids).")
  else:
    q_seg = kv_seg = segment_ids
  q_seg = jnp.broadcast_to(jnp.asarray(q_seg, jnp.int32), (b, t))
  kv_seg = jnp.broadcast_to(jnp.asarray(kv_seg, jnp.int32), (b, s))
  return q_pos, kv_pos, q_seg, kv_seg, True


def _sequence_size(mesh, what):
  if mesh is None:
    raise ValueError(f"{what} needs a mesh with a {SEQUENCE_AXIS!r} axis, got mesh=None.")
  if SEQUENCE_AXIS not in mesh.shape:
    raise ValueError(f"{what} needs a mesh with a {SEQUENCE_AXIS!r} axis; this mesh has axes "
                     f"{dict(mesh.shape)}.")
  return mesh.shape[SEQUENCE_AXIS]


def _outer_specs(mesh: Mesh, batch: int, kv_heads: int):
  """(batch axes, heads axis) for shard_map specs: the batch over those of data/fsdp/expert that
  divide it, the heads over `tensor` when it divides the key/value heads."""
  batch_axes, size = [], 1
  for axis in BATCH_AXES:
    if axis in mesh.shape and mesh.shape[axis] > 1 and batch % (size * mesh.shape[axis]) == 0:
      batch_axes.append(axis)
      size *= mesh.shape[axis]
  heads = mesh.shape.get(HEADS_AXIS, 1)
  heads_axis = HEADS_AXIS if heads > 1 and kv_heads % heads == 0 else None
  return (tuple(batch_axes) or None), heads_axis


# ---------------------------------------------------------------------------------------------
# Public API.


def attend(q, k, v, *, impl: str, mesh: Mesh | None = None, causal: bool = True,
           q_positions=None, kv_positions=None, segment_ids: Any = None,
           scale: float | None = None, block_q: int = 512, block_kv: int = 256, causal_blocks: int = 1):
  """Softmax attention with grouped-query heads, position-based causal masks and packed segments.

  Args:
    q: [B, T, N, H] queries.
    k: [B, S, K, H] keys; K divides N (query head n reads key/value head n // (N / K)).
    v: [B, S, K, J] values (J may differ from H, as in MLA).
    impl: "reference", "blockwise" or "ring".
    mesh: the run's mesh (sharding.make_mesh); required for "ring", which splits T and S over its
      `sequence` axis (both divisible by its size), the batch over those of data/fsdp/expert that
      divide B, and heads over `tensor` when it divides K. Inputs may arrive with any sharding.
    causal: mask keys whose position exceeds the query's.
    q_positions: [B, T] or [T] int token positions; default S - T + arange(T).
    kv_positions: [B, S] or [S] int positions; default arange(S). With the zigzag layout pass the
      zigzagged positions.
    segment_ids: None, [B, T] ids (needs T == S) or a pair ([B, T], [B, S]); only equal ids attend.
    scale: score scale, default 1 / sqrt(H).
    block_q: query rows per block (blockwise and ring; capped at the local length).
    block_kv: key rows per block.
    causal_blocks: "reference" only: n > 1 scores each of n query blocks against the keys up to its
      own last column (`reference_attention`); for causal self-attention in token order.

  Returns:
    [B, T, N, J] in q's dtype, sharded like q under "ring". Query rows that can see no key give 0.
  """
  _check_qkv(q, k, v)
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; choose one of {IMPLS}.")
  if block_q < 1 or block_kv < 1:
    raise ValueError(f"block_q={block_q} and block_kv={block_kv} must be at least 1.")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  q_pos, kv_pos, q_seg, kv_seg, use_segments = _ids(q, k, q_positions, kv_positions, segment_ids)
  if impl == "reference":
    return reference_attention(q, k, v, causal=causal, q_positions=q_pos, kv_positions=kv_pos,
                               q_segment_ids=q_seg if use_segments else None,
                               kv_segment_ids=kv_seg, scale=scale, causal_blocks=causal_blocks)
  local = functools.partial(_local_attention, causal=causal, segments=use_segments, scale=scale,
                            block_q=block_q, block_kv=block_kv)
  if impl == "blockwise":
    return local(q, k, v, q_pos, kv_pos, q_seg, kv_seg, ring=None)

  ring_size = _sequence_size(mesh, 'impl="ring"')
  t, s = q.shape[1], k.shape[1]
  if t % ring_size or s % ring_size:
    raise ValueError(f"q_len={t} and kv_len={s} must both be divisible by the {SEQUENCE_AXIS!r} "
                     f"axis size {ring_size}.")
  batch_axes, heads_axis = _outer_specs(mesh, q.shape[0], k.shape[2])
  x_spec = P(batch_axes, SEQUENCE_AXIS, heads_axis, None)
  ids_spec = P(batch_axes, SEQUENCE_AXIS)
  ring_fn = jax.shard_map(
      functools.partial(local, ring=_Ring(SEQUENCE_AXIS, ring_size)), mesh=in_context(mesh),
      in_specs=(x_spec,) * 3 + (ids_spec,) * 4, out_specs=x_spec)
  with jax.named_scope("ring_attention"):
    return ring_fn(q, k, v, q_pos, kv_pos, q_seg, kv_seg)


def decode_attend(q, k_cache, v_cache, *, mesh: Mesh | None, q_positions, kv_positions,
                  segment_ids: Any = None, kv_valid=None, causal: bool = True,
                  scale: float | None = None, block_kv: int = 512):
  """A few new queries against a KV cache sharded on `sequence` (no KV moves between devices).

  Each shard attends to its slice of the cache with the blockwise kernel, then the partial outputs
  are merged by log-sum-exp: one all-reduce of the max and one of the weighted sums, both
  O(B * N * T * J). Forward only (generation is not differentiated).

  Args:
    q: [B, T, N, H] the new tokens' queries (T small, e.g. 1), replicated over `sequence`.
    k_cache: [B, S, K, H] keys, S split over `sequence` (divisible by its size).
    v_cache: [B, S, K, J] values, split like k_cache.
    mesh: the run's mesh, or None to attend on one device.
    q_positions: [B, T] or [T] int positions of the new tokens.
    kv_positions: [B, S] or [S] int positions of the cache slots.
    segment_ids: None or a pair ([B, T], [B, S]) of ids; only equal ids attend.
    kv_valid: None or [B, S] bool, False for empty cache slots.
    causal: mask cache slots whose position exceeds the query's.
    scale: score scale, default 1 / sqrt(H).
    block_kv: cache rows per block.

  Returns:
    [B, T, N, J] in q's dtype, replicated over `sequence`.
  """
  _check_qkv(q, k_cache, v_cache)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  if segment_ids is not None and not isinstance(segment_ids, (tuple, list)):
    raise ValueError("decode_attend takes segment_ids as a pair (q_segment_ids [B, T], "
                     "kv_segment_ids [B, S]).")
  q_pos, kv_pos, q_seg, kv_seg, use_segments = _ids(q, k_cache, q_positions, kv_positions,
                                                    segment_ids)
  if kv_valid is not None:
    kv_valid = jnp.broadcast_to(kv_valid, kv_seg.shape)
    kv_seg = jnp.where(kv_valid, kv_seg, bw.PAD_KV_SEGMENT)
    use_segments = True
  local = functools.partial(_decode_local, causal=causal, segments=use_segments, scale=scale,
                            block_kv=block_kv)
  if mesh is None:
    return local(q, k_cache, v_cache, q_pos, kv_pos, q_seg, kv_seg, axis=None)
  shards = _sequence_size(mesh, "decode_attend")
  if k_cache.shape[1] % shards:
    raise ValueError(f"cache length {k_cache.shape[1]} must be divisible by the "
                     f"{SEQUENCE_AXIS!r} axis size {shards}.")
  batch_axes, heads_axis = _outer_specs(mesh, q.shape[0], k_cache.shape[2])
  q_spec = P(batch_axes, None, heads_axis, None)
  cache_spec = P(batch_axes, SEQUENCE_AXIS, heads_axis, None)
  decode_fn = jax.shard_map(
      functools.partial(local, axis=SEQUENCE_AXIS), mesh=in_context(mesh),
      in_specs=(q_spec, cache_spec, cache_spec, P(batch_axes, None), P(batch_axes, SEQUENCE_AXIS),
                P(batch_axes, None), P(batch_axes, SEQUENCE_AXIS)),
      out_specs=q_spec)
  with jax.named_scope("sharded_decode"):
    return decode_fn(q, k_cache, v_cache, q_pos, kv_pos, q_seg, kv_seg)


def _decode_local(q_, k_, v_, q_pos_, kv_pos_, q_seg_, kv_seg_, *, causal, segments, scale,
                  block_kv, axis):
  """One shard's partial attention, merged over `axis` by log-sum-exp (no merge when axis=None)."""
  q_, k_, v_, q_ids_, kv_ids_, blocking = _padded_inputs(
      q_, k_, v_, (q_pos_, q_seg_, kv_pos_, kv_seg_), causal=causal, segments=segments,
      scale=scale, block_q=q_.shape[1], block_kv=block_kv)
  kv_heads = k_.shape[2]
  groups = q_.shape[2] // kv_heads
  blocking = dataclasses.replace(blocking, kv_token_major=True)  # the cache is never transposed
  queries_ = bw.Queries(bw.to_rows(q_ * jnp.asarray(scale, q_.dtype), kv_heads),
                        *(bw.row_ids(ids, groups) for ids in q_ids_))
  keys_ = bw.Keys(k_, v_, *kv_ids_)
  stats_ = bw.forward_sweep(queries_, keys_, bw.init_stats(queries_, keys_), blocking)
  out_, lse_ = bw.finalize(stats_)  # [B, K, R, J], [B, K, R]
  out_ = bw.from_rows(out_, q_.shape[1])  # [B, T, N, J]
  lse_ = bw.from_rows(lse_[..., None], q_.shape[1])[..., 0]  # [B, T, N]
  if axis is not None:
    with jax.named_scope("merge_partials"):
      top = lax.pmax(lse_, axis)
      weight_ = jnp.exp(lse_ - jnp.where(jnp.isfinite(top), top, 0.0))  # 0 for empty shards
      summed = lax.psum(jnp.concatenate([out_ * weight_[..., None], weight_[..., None]], -1), axis)
      total = summed[..., -1:]
      out_ = summed[..., :-1] / jnp.where(total > 0, total, 1.0)
  return out_.astype(q_.dtype)


# ---------------------------------------------------------------------------------------------
# Causal load balance.


def _zigzag_order(num_shards: int) -> np.ndarray:
  """Chunk order [0, 2n-1, 1, 2n-2, ...]: device r gets chunks r and 2n-1-r."""
  return np.stack([np.arange(num_shards), 2 * num_shards - 1 - np.arange(num_shards)], 1).ravel()


def _permute_chunks(x, num_shards, axis, order, name):
  length = x.shape[axis]
  if num_shards < 1 or length % (2 * num_shards):
    raise ValueError(f"{name}: length {length} (axis {axis}) must be divisible by "
                     f"2 * num_shards = {2 * num_shards}.")
  xp = np if isinstance(x, np.ndarray) else jnp
  axis = axis % x.ndim
  chunks = x.reshape(x.shape[:axis] + (2 * num_shards, length // (2 * num_shards))
                     + x.shape[axis + 1:])
  return xp.take(chunks, order, axis=axis).reshape(x.shape)


def zigzag(x, num_shards: int, axis: int = 1):
  """Lays a sequence out for causal balance over `num_shards` devices.

  Splits `axis` into 2 * num_shards chunks and orders them so that contiguous sharding over the
  `sequence` axis gives device r chunks r and 2 * num_shards - 1 - r: every device then has exactly
  the same number of unmasked (query, key) pairs. Apply it once to the batch (tokens, positions,
  segment ids, loss masks), before the model. Works on numpy (host) and jax arrays.
  """
  return _permute_chunks(x, num_shards, axis, _zigzag_order(num_shards), "zigzag")


def unzigzag(x, num_shards: int, axis: int = 1):
  """The exact inverse of `zigzag`."""
  return _permute_chunks(x, num_shards, axis, np.argsort(_zigzag_order(num_shards)), "unzigzag")


def unzigzag_on_mesh(x, mesh: Mesh, axis: int = 1):
  """`unzigzag` of an array split over the mesh's `sequence` axis on `axis`, with no gather.

  Device r holds chunks r and 2n-1-r of the zigzag layout and must end with chunks 2r and 2r+1 of
  token order. Of its two chunks one has even index and one odd (r + 2n-1-r is odd), and the even
  chunks 2d go to devices d as their first half, the odd ones as their second: so two collective
  permutes of one chunk each (every device sends one chunk and receives one in each) move it all,
  and no device ever holds more than its own slice (the ring prefill writes each layer's keys and
  values into the cache this way). Other mesh axes stay as they are (partial manual shard_map).

  Args:
    x: [..., S, ...] with S on `axis` split over `sequence`, in the zigzag layout of n = the axis
      size; S divisible by 2n.
    mesh: the run's mesh.
    axis: the sequence axis of x.

  Returns:
    x in token order, split over `sequence` on `axis` like the input.
  """
  return _permute_on_mesh(x, mesh, axis, to_zigzag=False)


def zigzag_on_mesh(x, mesh: Mesh, axis: int = 1):
  """`zigzag` of an array in token order split over the mesh's `sequence` axis on `axis`, with no
  gather: `unzigzag_on_mesh`'s two collective permutes run backwards (device d sends its chunk 2d to
  the device whose zigzag slice holds it, and its chunk 2d+1 likewise). Same arguments; returns x in
  the zigzag layout, split like the input."""
  return _permute_on_mesh(x, mesh, axis, to_zigzag=True)


def _permute_on_mesh(x, mesh: Mesh, axis: int, *, to_zigzag: bool):
  """zigzag (to_zigzag) or unzigzag of x split over `sequence` on `axis`, by two collective permutes."""
  name = "zigzag_on_mesh" if to_zigzag else "unzigzag_on_mesh"
  shards = _sequence_size(mesh, name)
  axis = axis % x.ndim
  if shards == 1:
    return x
  if x.shape[axis] % (2 * shards):
    raise ValueError(f"{name}: length {x.shape[axis]} (axis {axis}) must be divisible by "
                     f"2 * mesh.sequence = {2 * shards}.")
  order = _zigzag_order(shards)  # device slot // 2 holds chunk order[slot] as its half slot % 2
  moves = {0: [], 1: []}  # parity of the chunk -> [(zigzag holder, token-order holder)]
  for slot, chunk in enumerate(order):
    moves[chunk % 2].append((slot // 2, chunk // 2))

  def local(x_):
    chunk = x_.shape[axis] // 2
    me = lax.axis_index(SEQUENCE_AXIS)
    out = []
    for parity in (0, 1):
      if to_zigzag:  # chunk 2d + parity is this device's half `parity`; it goes to its zigzag holder
        send = lax.slice_in_dim(x_, parity * chunk, (parity + 1) * chunk, axis=axis)
        out.append(lax.ppermute(send, SEQUENCE_AXIS, [(dst, src) for src, dst in moves[parity]]))
      else:  # device r's chunk of this parity is its first half (chunk r) when r has this parity
        start = jnp.where(me % 2 == parity, 0, chunk)
        send = lax.dynamic_slice_in_dim(x_, start, chunk, axis=axis)
        out.append(lax.ppermute(send, SEQUENCE_AXIS, moves[parity]))
    if to_zigzag:  # device r's first half is chunk r, of r's parity
      return jnp.where(me % 2 == 0, jnp.concatenate(out, axis=axis),
                       jnp.concatenate(out[::-1], axis=axis))
    return jnp.concatenate(out, axis=axis)

  spec = P(*([None] * axis + [SEQUENCE_AXIS]))
  return jax.shard_map(local, mesh=in_context(mesh), in_specs=(spec,), out_specs=spec,
                       axis_names=frozenset({SEQUENCE_AXIS}))(x)
