"""The attention kernel: FlashAttention-2 in plain jnp, two levels of blocks, online softmax.

Every attention path of meshrl (blockwise on one device, the ring over `sequence`, sequence-sharded
decode) is built from the one primitive here, `block_update`: a block of queries against a block of
keys, updating a running max `m`, denominator `l` and accumulator `acc` (Dao 2023,
"FlashAttention-2", arXiv:2307.08691; Rabe & Staats 2021, arXiv:2112.05682). Around it:

  forward_sweep   all query blocks x the live key blocks of one key/value shard -> updated Stats.
  finalize        Stats -> (output, log-sum-exp).
  backward_sweep  the FlashAttention-2 backward for one key/value shard: recomputes each block's
                  probabilities from the saved log-sum-exp, returns dq (accumulated) and this
                  shard's dk, dv.

Masks come from explicit token positions (`q_pos >= kv_pos` when causal) and segment ids (equal ids
attend), so any token layout works (zigzag, packed documents, a KV cache). A block pair that the
block-level position and segment ranges prove fully masked is never computed: each query block loops
only over the span of live key blocks, and a `lax.cond` skips dead blocks inside that span.

Layout: the callers' own, so no O(T) copy is made: queries [B, T, N, H], keys [B, S, K, H],
values [B, S, K, J]; a query block is viewed as [B, bq, K, G, H] for grouped-query products.
Per-row softmax statistics are [B, K, G, T] and the output accumulator [B, T, K, G, J].

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per key/value head (N = K * G), H query/key head dim, J value head dim (H except MLA).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Initial running max: finite, so exp(m_old - m_new) is never exp(-inf + inf); masked scores are
# -inf, so exp(score - m) of a masked score is exactly 0 even while a row has seen nothing yet.
_M_INIT = -0.5 * float(np.finfo(np.float32).max)
# Padding sentinels (never equal to a real segment id; positions that mask under causal).
PAD_Q_SEGMENT = np.iinfo(np.int32).min
PAD_KV_SEGMENT = np.iinfo(np.int32).min + 1
PAD_Q_POSITION = np.iinfo(np.int32).min
PAD_KV_POSITION = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class Blocking:
  """Static kernel settings (hashable; a `nondiff_argnums` of the custom VJPs).

  Attributes:
    causal: mask out keys whose position is greater than the query's.
    segments: mask out keys whose segment id differs from the query's.
    scale: multiplies the scores q.k (folded into the softmax, so q is never rescaled in memory).
    block_q: query rows per block; divides the (local) query length.
    block_kv: key rows per block; divides the (local) key length.
  """
  causal: bool
  segments: bool
  scale: float
  block_q: int
  block_kv: int


class Queries(NamedTuple):
  q: jax.Array  # [B, T, N, H]
  positions: jax.Array  # [B, T] int32
  segments: jax.Array  # [B, T] int32


class Keys(NamedTuple):
  """One key/value shard: what travels around the ring."""
  k: jax.Array  # [B, S, K, H]
  v: jax.Array  # [B, S, K, J]
  positions: jax.Array  # [B, S] int32
  segments: jax.Array  # [B, S] int32


class Stats(NamedTuple):
  """Online-softmax state of every query row (float32)."""
  m: jax.Array  # [B, K, G, T] running max of the scores
  l: jax.Array  # [B, K, G, T] running sum of exp(score - m)
  acc: jax.Array  # [B, T, K, G, J] running sum of exp(score - m) * v


def match_vma(x, *likes):
  """Marks `x` as varying over every manual mesh axis one of `likes` varies over (inside
  shard_map, e.g. zero-initialised accumulators; a no-op outside)."""
  varying = frozenset().union(*(jax.typeof(like).mat.varying for like in likes))
  missing = tuple(sorted(varying - jax.typeof(x).mat.varying))
  return lax.pcast(x, missing, to="varying") if missing else x


def init_stats(queries: Queries, keys: Keys) -> Stats:
  """Stats of a query row that has seen no key yet (varying like queries and keys)."""
  b, t, n, _ = queries.q.shape
  k = keys.k.shape[2]
  g = n // k
  zeros = lambda *shape: match_vma(jnp.zeros(shape, jnp.float32), queries.q, keys.k)
  return Stats(zeros(b, k, g, t) + _M_INIT, zeros(b, k, g, t), zeros(b, t, k, g, keys.v.shape[-1]))


def _rows(x):
  """[B, K, G, T] row statistics -> [B, T, K, G, 1], to scale [B, T, K, G, J] rows."""
  return jnp.moveaxis(x, 3, 1)[..., None]


def finalize(stats: Stats) -> tuple[jax.Array, jax.Array]:
  """(out [B, T, K, G, J], lse [B, K, G, T]) in float32; rows that saw no key give 0 and -inf."""
  seen = stats.l > 0
  out = stats.acc / _rows(jnp.where(seen, stats.l, 1.0))
  lse = jnp.where(seen, stats.m + jnp.log(jnp.where(seen, stats.l, 1.0)), -jnp.inf)
  return out, lse


def _slice(x, start, size, axis):
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _q_block(x, t0, bq, kv_heads):
  """Rows [t0, t0 + bq) of a [B, T, N, X] array as [B, bq, K, G, X]."""
  b, _, n, d = x.shape
  return _slice(x, t0, bq, 1).reshape(b, bq, kv_heads, n // kv_heads, d)


def _block_mask(q_pos, q_seg, kv_pos, kv_seg, blocking: Blocking):
  """[B, bq, bk] bool (True = attend) from [B, bq] and [B, bk] ids, or None when nothing masks."""
  mask = None
  if blocking.causal:
    mask = q_pos[:, :, None] >= kv_pos[:, None, :]
  if blocking.segments:
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    mask = same if mask is None else mask & same
  return mask


def _scores(q_blk, k_blk, mask, scale):
  """[B, K, G, bq, bk] float32 scaled scores, -inf where masked."""
  s = jnp.einsum("BTKGH,BSKH->BKGTS", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
  if mask is not None:
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
  return s


def block_update(stats: Stats, q_blk, k_blk, v_blk, mask, scale: float) -> Stats:
  """The shared primitive: one query block against one key block, online softmax.

  Args:
    stats: Stats of the query block (m, l [B, K, G, bq]; acc [B, bq, K, G, J]).
    q_blk: [B, bq, K, G, H] queries.
    k_blk: [B, bk, K, H] keys.
    v_blk: [B, bk, K, J] values.
    mask: [B, bq, bk] bool (True = attend) or None.
    scale: the score scale.

  Returns:
    The updated Stats.
  """
  s = _scores(q_blk, k_blk, mask, scale)  # [B, K, G, bq, bk]
  m_new = jnp.maximum(stats.m, s.max(axis=-1))
  p = jnp.exp(s - m_new[..., None])  # masked scores give exactly 0
  alpha = jnp.exp(stats.m - m_new)
  l = alpha * stats.l + p.sum(axis=-1)
  pv = jnp.einsum("BKGTS,BSKJ->BTKGJ", p.astype(v_blk.dtype), v_blk,
                  preferred_element_type=jnp.float32)
  return Stats(m_new, l, _rows(alpha) * stats.acc + pv)


def _live_blocks(q_ids, kv_ids, blocking: Blocking, n_q: int, n_kv: int):
  """Which block pairs may hold an unmasked (query, key) pair, from block-level id ranges.

  Returns:
    live [n_q, n_kv] bool (False: every pair of the block is masked), and for each query block
    the span of live key blocks: first [n_q], stop [n_q] (first = stop = 0 when none is live).
  """
  (q_pos, q_seg), (kv_pos, kv_seg) = q_ids, kv_ids
  live = jnp.ones((n_q, n_kv), bool)

  def per_block(x, n, reduce):
    return reduce(x.reshape(x.shape[0], n, -1), axis=(0, 2))  # [n]

  if blocking.causal:
    live &= per_block(q_pos, n_q, jnp.max)[:, None] >= per_block(kv_pos, n_kv, jnp.min)[None, :]
  if blocking.segments:
    q_lo, q_hi = per_block(q_seg, n_q, jnp.min), per_block(q_seg, n_q, jnp.max)
    kv_lo, kv_hi = per_block(kv_seg, n_kv, jnp.min), per_block(kv_seg, n_kv, jnp.max)
    live &= (q_hi[:, None] >= kv_lo[None, :]) & (q_lo[:, None] <= kv_hi[None, :])
  return live, *_live_span(live)


def _live_span(live):
  """[rows, cols] bool -> first [rows], stop [rows]: the span of True columns of each row."""
  any_live = live.any(axis=1)
  first = jnp.where(any_live, jnp.argmax(live, axis=1), 0)
  stop = jnp.where(any_live, live.shape[1] - jnp.argmax(live[:, ::-1], axis=1), 0)
  return first, stop


def forward_sweep(queries: Queries, keys: Keys, stats: Stats, blocking: Blocking) -> Stats:
  """Updates every query row's Stats with one key/value shard, block by block.

  Args:
    queries: Queries, q [B, T, N, H].
    keys: Keys, k [B, S, K, H], v [B, S, K, J].
    stats: Stats of all T query rows.
    blocking: static settings; block_q divides T and block_kv divides S.

  Returns:
    The updated Stats.
  """
  bq, bk = blocking.block_q, blocking.block_kv
  n_q, n_kv = queries.q.shape[1] // bq, keys.k.shape[1] // bk
  live, first, stop = _live_blocks(queries[1:], keys[2:], blocking, n_q, n_kv)

  def q_step(i, stats):
    t0 = i * bq
    q_blk = _q_block(queries.q, t0, bq, keys.k.shape[2])
    q_pos, q_seg = _slice(queries.positions, t0, bq, 1), _slice(queries.segments, t0, bq, 1)
    blk_stats = Stats(_slice(stats.m, t0, bq, 3), _slice(stats.l, t0, bq, 3),
                      _slice(stats.acc, t0, bq, 1))

    def kv_step(j, blk_stats):
      s0 = j * bk

      def update(blk_stats):
        mask = _block_mask(q_pos, q_seg, _slice(keys.positions, s0, bk, 1),
                           _slice(keys.segments, s0, bk, 1), blocking)
        return block_update(blk_stats, q_blk, _slice(keys.k, s0, bk, 1),
                            _slice(keys.v, s0, bk, 1), mask, blocking.scale)

      return lax.cond(live[i, j], update, lambda blk_stats: blk_stats, blk_stats)

    blk_stats = lax.fori_loop(first[i], stop[i], kv_step, blk_stats)
    return Stats(*(lax.dynamic_update_slice_in_dim(x, x_blk, t0, axis)
                   for x, x_blk, axis in zip(stats, blk_stats, (3, 3, 1))))

  with jax.named_scope("attention_forward_sweep"):
    return lax.fori_loop(0, n_q, q_step, stats)


def backward_sweep(queries: Queries, keys: Keys, d_out, lse, delta, dq, blocking: Blocking):
  """FlashAttention-2 backward against one key/value shard.

  Args:
    queries: Queries, q [B, T, N, H].
    keys: Keys, k [B, S, K, H], v [B, S, K, J].
    d_out: [B, T, N, J] cotangent of the output.
    lse: [B, K, G, T] float32 log-sum-exp of the scores over all keys (forward residual).
    delta: [B, K, G, T] float32 rowsum(d_out * out).
    dq: [B, T, N, H] float32 accumulator of dq.
    blocking: static settings.

  Returns:
    (dq updated, dk [B, S, K, H] float32, dv [B, S, K, J] float32) where dk, dv hold only this
    sweep's contributions for this shard's keys.
  """
  bq, bk = blocking.block_q, blocking.block_kv
  n_q, n_kv = queries.q.shape[1] // bq, keys.k.shape[1] // bk
  kv_heads = keys.k.shape[2]
  live, _, _ = _live_blocks(queries[1:], keys[2:], blocking, n_q, n_kv)
  live_t = live.T  # [n_kv, n_q]
  first, stop = _live_span(live_t)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw nothing: every p is exp(-inf) = 0
  dk = match_vma(jnp.zeros(keys.k.shape, jnp.float32), queries.q, keys.k)
  dv = match_vma(jnp.zeros(keys.v.shape, jnp.float32), queries.q, keys.k)
  dq = match_vma(dq, keys.k)
  block_zeros = lambda x, rows: match_vma(jnp.zeros((x.shape[0], rows) + x.shape[2:], jnp.float32),
                                          dq)
  dq_zero, dk_zero, dv_zero = block_zeros(dq, bq), block_zeros(dk, bk), block_zeros(dv, bk)

  def kv_step(j, carry):
    dq, dk, dv = carry
    s0 = j * bk
    k_blk, v_blk = _slice(keys.k, s0, bk, 1), _slice(keys.v, s0, bk, 1)
    kv_pos, kv_seg = _slice(keys.positions, s0, bk, 1), _slice(keys.segments, s0, bk, 1)

    def q_step(i, dk_blk, dv_blk):
      """One live block pair: returns (dq of the query block, dk_blk, dv_blk updated)."""
      t0 = i * bq
      q_blk = _q_block(queries.q, t0, bq, kv_heads)
      do_blk = _q_block(d_out, t0, bq, kv_heads)
      mask = _block_mask(_slice(queries.positions, t0, bq, 1), _slice(queries.segments, t0, bq, 1),
                         kv_pos, kv_seg, blocking)
      s = _scores(q_blk, k_blk, mask, blocking.scale)  # [B, K, G, bq, bk]
      p = jnp.exp(s - _slice(lse, t0, bq, 3)[..., None])
      dv_blk += jnp.einsum("BKGTS,BTKGJ->BSKJ", p.astype(do_blk.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("BTKGJ,BSKJ->BKGTS", do_blk, v_blk, preferred_element_type=jnp.float32)
      ds = p * (dp - _slice(delta, t0, bq, 3)[..., None]) * blocking.scale  # d(q.k)
      dq_blk = jnp.einsum("BKGTS,BSKH->BTKGH", ds.astype(k_blk.dtype), k_blk,
                          preferred_element_type=jnp.float32)
      dk_blk += jnp.einsum("BKGTS,BTKGH->BSKH", ds.astype(q_blk.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      return dq_blk.reshape(dq_blk.shape[:2] + (-1, dq_blk.shape[-1])), dk_blk, dv_blk

    def guarded(i, carry):
      # Only block-sized values pass through the cond (a full-size dq would be copied).
      dq, dk_blk, dv_blk = carry
      dq_blk, dk_blk, dv_blk = lax.cond(live_t[j, i], functools.partial(q_step, i),
                                        lambda dk_blk, dv_blk: (dq_zero, dk_blk, dv_blk),
                                        dk_blk, dv_blk)
      t0 = i * bq
      dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, t0, bq, 1) + dq_blk, t0, 1)
      return dq, dk_blk, dv_blk

    dq, dk_blk, dv_blk = lax.fori_loop(first[j], stop[j], guarded, (dq, dk_zero, dv_zero))
    dk = lax.dynamic_update_slice_in_dim(dk, dk_blk, s0, 1)
    dv = lax.dynamic_update_slice_in_dim(dv, dv_blk, s0, 1)
    return dq, dk, dv

  with jax.named_scope("attention_backward_sweep"):
    return lax.fori_loop(0, n_kv, kv_step, (dq, dk, dv))
