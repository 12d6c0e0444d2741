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
attend), so any token layout works (zigzag, packed documents, a KV cache). Each block pair is
classified from its block-level position and segment ranges as dead (every pair masked: never
computed), full (no pair masked: no mask is built or applied) or partial (the mask is built from the
ids); each query block loops only over the span of live key blocks.

Layout (what makes a block cost no more than its matrix products on CPU): per-head-major arrays, so
every block product is a plain batched matmul with no per-block transpose.
  queries  q [B, K, R, H]: R = T * G rows, row t * G + g is query head k * G + g of token t; the
           score scale is already multiplied in (`to_rows(q * scale)`).
  keys     k [B, K, S, H], v [B, K, S, J] (`heads_major`).
  stats    m, l [B, K, R]; acc [B, K, R, J].
The forward computes scores as [rows, keys]; the backward as [keys, rows], so that dv = P^T dO,
dk = dS^T Q and dq^T = K^T dS all multiply untransposed operands (a product with a transposed
[rows, keys] operand costs 3x a plain one here) and dq accumulates transposed, [B, K, H, R].
Big blocks are computed one (batch row, kv head) stream at a time (`Blocking.per_stream`), so a
block's [bq, bk] scores stay in cache and each batch row's pairs are classified on their own. A
FULL pair then costs 2 matmuls and 3 passes over its scores forward, 5 matmuls backward.

Axis legend: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per key/value head (N = K * G), R = T * G query rows, H query/key head dim,
J value head dim (H except MLA).
"""

from __future__ import annotations

import dataclasses
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
# Block pair kinds (`block_kinds`).
DEAD, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Blocking:
  """Static kernel settings (hashable; a `nondiff_argnums` of the custom VJPs).

  Attributes:
    causal: mask out keys whose position is greater than the query's.
    segments: mask out keys whose segment id differs from the query's.
    scale: the score scale; the sweeps expect it already multiplied into the queries, the caller
      applies it to dq.
    block_q: query rows per block (tokens x G); divides R.
    block_kv: key rows per block; divides the (local) key length.
    kv_token_major: keys and values arrive token-major, [B, S, K, X] (a KV cache in decode: each
      block is transposed as it is sliced, so the cache itself is never copied). Forward only.
    per_stream: each block step computes one (batch row, key/value head) stream, so a block's
      [bq, bk] scores stay in cache (2x faster here at 512 x 512 blocks than all heads at once);
      False computes every stream of a block together (small blocks: decode, short prefill).
  """
  causal: bool
  segments: bool
  scale: float
  block_q: int
  block_kv: int
  kv_token_major: bool = False
  per_stream: bool = True


class Queries(NamedTuple):
  q: jax.Array  # [B, K, R, H] scaled queries
  positions: jax.Array  # [B, R] int32
  segments: jax.Array  # [B, R] int32


class Keys(NamedTuple):
  """One key/value shard: what travels around the ring."""
  k: jax.Array  # [B, K, S, H]
  v: jax.Array  # [B, K, S, J]
  positions: jax.Array  # [B, S] int32
  segments: jax.Array  # [B, S] int32


class Stats(NamedTuple):
  """Online-softmax state of every query row (float32)."""
  m: jax.Array  # [B, K, R] running max of the scores
  l: jax.Array  # [B, K, R] running sum of exp(score - m)
  acc: jax.Array  # [B, K, R, J] running sum of exp(score - m) * v


# ---------------------------------------------------------------------------------------------
# Layouts.


def to_rows(x, kv_heads: int):
  """[B, T, N, X] -> [B, K, T * G, X] (row t * G + g holds head k * G + g of token t)."""
  b, t, n, d = x.shape
  x = x.reshape(b, t, kv_heads, n // kv_heads, d)  # [B, T, K, G, X]
  return jnp.swapaxes(x, 1, 2).reshape(b, kv_heads, t * (n // kv_heads), d)


def from_rows(x, length: int):
  """[B, K, T * G, X] -> [B, T, N, X], the inverse of `to_rows`."""
  b, kv_heads, rows, d = x.shape
  x = x.reshape(b, kv_heads, length, rows // length, d)  # [B, K, T, G, X]
  return jnp.swapaxes(x, 1, 2).reshape(b, length, -1, d)


def row_ids(ids, groups: int):
  """[B, T] per-token ids -> [B, T * G] per-row ids."""
  return jnp.repeat(ids, groups, axis=1) if groups > 1 else ids


def heads_major(x):
  """[B, S, K, X] <-> [B, K, S, X]."""
  return jnp.swapaxes(x, 1, 2)


def match_vma(x, *likes):
  """Marks `x` as varying over every manual mesh axis one of `likes` varies over (inside
  shard_map, e.g. zero-initialised accumulators; a no-op outside)."""
  varying = frozenset().union(*(jax.typeof(like).mat.varying for like in likes))
  missing = tuple(sorted(varying - jax.typeof(x).mat.varying))
  return lax.pcast(x, missing, to="varying") if missing else x


def init_stats(queries: Queries, keys: Keys) -> Stats:
  """Stats of a query row that has seen no key yet (varying like queries and keys)."""
  b, k, r, _ = queries.q.shape
  zeros = lambda *shape: match_vma(jnp.zeros(shape, jnp.float32), queries.q, keys.k)
  return Stats(zeros(b, k, r) + _M_INIT, zeros(b, k, r), zeros(b, k, r, keys.v.shape[-1]))


def finalize(stats: Stats) -> tuple[jax.Array, jax.Array]:
  """(out [B, K, R, J], lse [B, K, R]) in float32; rows that saw no key give 0 and -inf."""
  seen = stats.l > 0
  l = jnp.where(seen, stats.l, 1.0)
  out = stats.acc / l[..., None]
  lse = jnp.where(seen, stats.m + jnp.log(l), -jnp.inf)
  return out, lse


# ---------------------------------------------------------------------------------------------
# Streams, masks and block classification.


class _Group(NamedTuple):
  """One group of (batch row, key/value head) streams that a block step computes together."""
  b0: jax.Array  # first batch row
  h0: jax.Array  # first key/value head
  gb: int  # batch rows in the group (1 or B)
  gk: int  # heads in the group (1 or K)


def _groups(blocking: Blocking, batch: int, kv_heads: int):
  """(number of groups, index -> _Group): one stream at a time, or all of them at once."""
  if not blocking.per_stream:
    return 1, lambda c: _Group(jnp.int32(0), jnp.int32(0), batch, kv_heads)
  return batch * kv_heads, lambda c: _Group(c // kv_heads, c % kv_heads, 1, 1)


def _rows_block(x, g: _Group, r0, size):
  """Rows [r0, r0 + size) of the group's streams of a [B, K, R, X] array: [gb, gk, size, X]."""
  return lax.dynamic_slice(x, (g.b0, g.h0, r0, 0), (g.gb, g.gk, size, x.shape[3]))


def _kv_block(x, g: _Group, s0, size, blocking: Blocking):
  """Keys [s0, s0 + size) of the group's streams of k or v as [gb, gk, size, X]."""
  if blocking.kv_token_major:
    return heads_major(lax.dynamic_slice(x, (g.b0, s0, g.h0, 0), (g.gb, size, g.gk, x.shape[3])))
  return _rows_block(x, g, s0, size)


def _ids_block(ids, g: _Group, start, size):
  """(positions, segments) [gb, size] of the group's batch rows."""
  return tuple(lax.dynamic_slice(x, (g.b0, start), (g.gb, size)) for x in ids)


def _pair_mask(rows_ids, cols_ids, blocking: Blocking, *, keys_first: bool):
  """[gb, 1, rows, cols] bool (True = attend) from ids [gb, rows] and [gb, cols]: query ids first,
  or key ids first when `keys_first` (the backward's [keys, rows] scores)."""
  (r_pos, r_seg), (c_pos, c_seg) = rows_ids, cols_ids
  mask = None
  if blocking.causal:
    if keys_first:
      mask = r_pos[:, :, None] <= c_pos[:, None, :]
    else:
      mask = r_pos[:, :, None] >= c_pos[:, None, :]
  if blocking.segments:
    same = r_seg[:, :, None] == c_seg[:, None, :]
    mask = same if mask is None else mask & same
  return mask[:, None]


def block_kinds(q_ids, kv_ids, blocking: Blocking, n_q: int, n_kv: int):
  """Classifies block pairs from block-level id ranges, per batch row.

  Args:
    q_ids: (positions, segments) [B, R] of the query rows.
    kv_ids: (positions, segments) [B, S] of the keys.
    blocking: static settings.
    n_q, n_kv: the numbers of query and key blocks.

  Returns:
    kinds [B', n_q, n_kv] int32, B' = B with per-stream groups, else 1 (a pair is then DEAD or
    FULL only if it is in every row): DEAD (every pair masked), FULL (none masked) or PARTIAL.
  """
  (q_pos, q_seg), (kv_pos, kv_seg) = q_ids, kv_ids
  axes = (2,) if blocking.per_stream else (0, 2)

  def ranges(x, n):
    x = x.reshape(x.shape[0], n, -1)
    lo, hi = x.min(axis=axes), x.max(axis=axes)
    return (lo, hi) if blocking.per_stream else (lo[None], hi[None])  # [B', n]

  dead = jnp.zeros((1, n_q, n_kv), bool)
  full = jnp.ones((1, n_q, n_kv), bool)
  if blocking.causal:
    (q_lo, q_hi), (kv_lo, kv_hi) = ranges(q_pos, n_q), ranges(kv_pos, n_kv)
    dead = dead | (q_hi[:, :, None] < kv_lo[:, None, :])
    full = full & (q_lo[:, :, None] >= kv_hi[:, None, :])
  if blocking.segments:
    (q_lo, q_hi), (kv_lo, kv_hi) = ranges(q_seg, n_q), ranges(kv_seg, n_kv)
    dead = dead | (q_hi[:, :, None] < kv_lo[:, None, :]) | (q_lo[:, :, None] > kv_hi[:, None, :])
    full = full & ((q_lo == q_hi)[:, :, None] & (kv_lo == kv_hi)[:, None, :]
                   & (q_lo[:, :, None] == kv_lo[:, None, :]))
  return jnp.where(dead, DEAD, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def live_span(kinds):
  """[..., cols] kinds -> first [...], stop [...]: the span of live (not DEAD) columns."""
  live = kinds != DEAD
  any_live = live.any(axis=-1)
  cols = live.shape[-1]
  first = jnp.where(any_live, jnp.argmax(live, axis=-1), 0)
  stop = jnp.where(any_live, cols - jnp.argmax(live[..., ::-1], axis=-1), 0)
  return first, stop


def _by_kind(blocking: Blocking, kind, dead, compute, *operands):
  """Runs `compute(masked: bool, *operands)` for FULL (unmasked) and PARTIAL (masked) pairs and
  `dead(*operands)` for DEAD ones; with neither causal nor segment masks every pair is FULL and no
  branch is built."""
  if not (blocking.causal or blocking.segments):
    return compute(False, *operands)
  return lax.switch(kind, (dead, lambda *a: compute(False, *a), lambda *a: compute(True, *a)),
                    *operands)


# ---------------------------------------------------------------------------------------------
# Forward.


def block_update(stats: Stats, q_blk, k_blk, v_blk, mask) -> Stats:
  """The shared primitive: one query block against one key block, online softmax.

  Args:
    stats: Stats of the query block (m, l [b, k, bq]; acc [b, k, bq, J]).
    q_blk: [b, k, bq, H] scaled queries (b, k: the streams of a group).
    k_blk: [b, k, bk, H] keys.
    v_blk: [b, k, bk, J] values.
    mask: [b, 1, bq, bk] bool (True = attend) or None (a FULL pair).

  Returns:
    The updated Stats.
  """
  s = jnp.einsum("bkrh,bksh->bkrs", q_blk, k_blk, preferred_element_type=jnp.float32)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(stats.m, s.max(axis=-1))
  p = jnp.exp(s - m_new[..., None])  # masked scores give exactly 0
  alpha = jnp.exp(stats.m - m_new)
  l = alpha * stats.l + p.sum(axis=-1)
  pv = jnp.einsum("bkrs,bksj->bkrj", p.astype(v_blk.dtype), v_blk,
                  preferred_element_type=jnp.float32)
  return Stats(m_new, l, alpha[..., None] * stats.acc + pv)


def forward_sweep(queries: Queries, keys: Keys, stats: Stats, blocking: Blocking) -> Stats:
  """Updates every query row's Stats with one key/value shard, block by block.

  Args:
    queries: Queries, q [B, K, R, H] (scaled).
    keys: Keys, k [B, K, S, H], v [B, K, S, J] (or [B, S, K, .] with blocking.kv_token_major).
    stats: Stats of all R query rows.
    blocking: static settings; block_q divides R and block_kv divides S.

  Returns:
    The updated Stats.
  """
  bq, bk = blocking.block_q, blocking.block_kv
  b, kv_heads, rows, _ = queries.q.shape
  n_q, n_kv = rows // bq, keys.positions.shape[1] // bk
  kinds = block_kinds(queries[1:], keys[2:], blocking, n_q, n_kv)  # [B', n_q, n_kv]
  first, stop = live_span(kinds)  # [B', n_q]
  n_groups, group = _groups(blocking, b, kv_heads)

  def q_step(c, stats):
    g, i = group(c // n_q), c % n_q
    r0 = i * bq
    q_blk = _rows_block(queries.q, g, r0, bq)
    q_ids = _ids_block(queries[1:], g, r0, bq)
    blk_stats = Stats(*(lax.dynamic_slice(x, (g.b0, g.h0, r0), (g.gb, g.gk, bq))
                        for x in stats[:2]), _rows_block(stats.acc, g, r0, bq))

    def compute(masked, blk_stats, s0):
      k_blk = _kv_block(keys.k, g, s0, bk, blocking)
      v_blk = _kv_block(keys.v, g, s0, bk, blocking)
      mask = None
      if masked:
        mask = _pair_mask(q_ids, _ids_block(keys[2:], g, s0, bk), blocking, keys_first=False)
      return block_update(blk_stats, q_blk, k_blk, v_blk, mask)

    def kv_step(j, blk_stats):
      return _by_kind(blocking, kinds[g.b0, i, j], lambda blk_stats, s0: blk_stats, compute,
                      blk_stats, j * bk)

    blk_stats = lax.fori_loop(first[g.b0, i], stop[g.b0, i], kv_step, blk_stats)
    return Stats(lax.dynamic_update_slice(stats.m, blk_stats.m, (g.b0, g.h0, r0)),
                 lax.dynamic_update_slice(stats.l, blk_stats.l, (g.b0, g.h0, r0)),
                 lax.dynamic_update_slice(stats.acc, blk_stats.acc, (g.b0, g.h0, r0, 0)))

  with jax.named_scope("attention_forward_sweep"):
    return lax.fori_loop(0, n_groups * n_q, q_step, stats)


# ---------------------------------------------------------------------------------------------
# Backward.


def backward_sweep(queries: Queries, keys: Keys, d_out, lse, delta, dq_t, blocking: Blocking):
  """FlashAttention-2 backward against one key/value shard, scores laid out [keys, rows].

  Args:
    queries: Queries, q [B, K, R, H] (scaled).
    keys: Keys, k [B, K, S, H], v [B, K, S, J].
    d_out: [B, K, R, J] cotangent of the output rows.
    lse: [B, K, R] float32 log-sum-exp of the scores over all keys (forward residual).
    delta: [B, K, R] float32 rowsum(d_out * out).
    dq_t: [B, K, H, R] float32 accumulator of the gradient of the scaled queries, transposed
      (the caller multiplies by the scale).
    blocking: static settings.

  Returns:
    (dq_t updated, dk [B, K, S, H] float32, dv [B, K, S, J] float32) where dk, dv hold only this
    sweep's contributions for this shard's keys.
  """
  if blocking.kv_token_major:
    raise ValueError("backward_sweep takes head-major keys (kv_token_major=False).")
  bq, bk = blocking.block_q, blocking.block_kv
  b, kv_heads, rows, h = queries.q.shape
  n_q, n_kv = rows // bq, keys.k.shape[2] // bk
  kinds_t = jnp.swapaxes(block_kinds(queries[1:], keys[2:], blocking, n_q, n_kv), 1, 2)
  first, stop = live_span(kinds_t)  # [B', n_kv]
  n_groups, group = _groups(blocking, b, kv_heads)
  gb, gk = group(0).gb, group(0).gk
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw nothing: every p is exp(-inf) = 0
  zeros = lambda *shape: match_vma(jnp.zeros(shape, jnp.float32), queries.q, keys.k)
  dk, dv = zeros(*keys.k.shape), zeros(*keys.v.shape)
  dq_t = match_vma(dq_t, keys.k)
  dq_zero, dk_zero, dv_zero = zeros(gb, gk, h, bq), zeros(gb, gk, bk, h), zeros(
      gb, gk, bk, keys.v.shape[-1])

  def kv_step(c, carry):
    dq_t, dk, dv = carry
    g, j = group(c // n_kv), c % n_kv
    s0 = j * bk
    k_blk, v_blk = _rows_block(keys.k, g, s0, bk), _rows_block(keys.v, g, s0, bk)
    kv_ids = _ids_block(keys[2:], g, s0, bk)

    def compute(masked, dk_blk, dv_blk, r0):
      """One live block pair: returns (dq_t of the query block, dk_blk, dv_blk updated)."""
      q_blk, do_blk = _rows_block(queries.q, g, r0, bq), _rows_block(d_out, g, r0, bq)
      s_t = jnp.einsum("bksh,bkrh->bksr", k_blk, q_blk, preferred_element_type=jnp.float32)
      if masked:
        mask_t = _pair_mask(kv_ids, _ids_block(queries[1:], g, r0, bq), blocking, keys_first=True)
        s_t = jnp.where(mask_t, s_t, -jnp.inf)
      row_stat = lambda x: lax.dynamic_slice(x, (g.b0, g.h0, r0), (gb, gk, bq))[:, :, None, :]
      p_t = jnp.exp(s_t - row_stat(lse))  # [gb, gk, bk, bq]
      dv_blk += jnp.einsum("bksr,bkrj->bksj", p_t.astype(do_blk.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      dp_t = jnp.einsum("bksj,bkrj->bksr", v_blk, do_blk, preferred_element_type=jnp.float32)
      ds_t = p_t * (dp_t - row_stat(delta))  # d(score)
      dk_blk += jnp.einsum("bksr,bkrh->bksh", ds_t.astype(q_blk.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bksh,bksr->bkhr", k_blk, ds_t.astype(k_blk.dtype),
                          preferred_element_type=jnp.float32)
      return dq_blk, dk_blk, dv_blk

    def q_step(i, carry):
      # Only block-sized values pass through the switch (a full-size dq would be copied).
      dq_t, dk_blk, dv_blk = carry
      r0 = i * bq
      dq_blk, dk_blk, dv_blk = _by_kind(
          blocking, kinds_t[g.b0, j, i], lambda dk_blk, dv_blk, r0: (dq_zero, dk_blk, dv_blk),
          compute, dk_blk, dv_blk, r0)
      start = (g.b0, g.h0, 0, r0)
      dq_t = lax.dynamic_update_slice(
          dq_t, lax.dynamic_slice(dq_t, start, dq_blk.shape) + dq_blk, start)
      return dq_t, dk_blk, dv_blk

    dq_t, dk_blk, dv_blk = lax.fori_loop(first[g.b0, j], stop[g.b0, j], q_step,
                                         (dq_t, dk_zero, dv_zero))
    dk = lax.dynamic_update_slice(dk, dk_blk, (g.b0, g.h0, s0, 0))
    dv = lax.dynamic_update_slice(dv, dv_blk, (g.b0, g.h0, s0, 0))
    return dq_t, dk, dv

  with jax.named_scope("attention_backward_sweep"):
    return lax.fori_loop(0, n_groups * n_kv, kv_step, (dq_t, dk, dv))
