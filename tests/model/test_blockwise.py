"""The blockwise kernel's block classification and its one-stream-at-a-time path (model/blockwise.py).

tests/model/test_ring_attention.py checks small blocks (all streams of a block computed together);
here the blocks are big enough (rows x keys >= 128 x 128) for the per-stream path that training runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.model import blockwise as bw
from meshrl.model import ring_attention as ra
from meshrl.sharding import make_mesh

TOL = 1e-5
D, F, P = bw.DEAD, bw.FULL, bw.PARTIAL


def _kinds(q_pos, kv_pos, block, *, q_seg=None, kv_seg=None, per_stream=True):
  q_pos, kv_pos = np.atleast_2d(q_pos), np.atleast_2d(kv_pos)
  segments = q_seg is not None
  q_seg = np.zeros_like(q_pos) if q_seg is None else np.atleast_2d(q_seg)
  kv_seg = np.zeros_like(kv_pos) if kv_seg is None else np.atleast_2d(kv_seg)
  blocking = bw.Blocking(causal=True, segments=segments, scale=1.0, block_q=block,
                         block_kv=block, per_stream=per_stream)
  kinds = bw.block_kinds((jnp.asarray(q_pos), jnp.asarray(q_seg)),
                         (jnp.asarray(kv_pos), jnp.asarray(kv_seg)), blocking,
                         q_pos.shape[1] // block, kv_pos.shape[1] // block)
  return np.asarray(kinds)


def test_block_kinds_at_block_edges():
  """Equal positions attend: a key block ending at the query block's first position is FULL, one
  starting at the query block's last position is PARTIAL (not DEAD), one past it is DEAD."""
  q = np.arange(8, 12)  # one query block, positions 8..11
  assert _kinds(q, np.arange(5, 9), 4).tolist() == [[[F]]]  # max key 8 == min query 8
  assert _kinds(q, np.arange(6, 10), 4).tolist() == [[[P]]]  # key 9 > query 8
  assert _kinds(q, np.arange(11, 15), 4).tolist() == [[[P]]]  # key 11 == query 11
  assert _kinds(q, np.arange(12, 16), 4).tolist() == [[[D]]]
  contiguous = np.arange(12)
  assert _kinds(contiguous, contiguous, 4).tolist() == [[[P, D, D], [F, P, D], [F, F, P]]]


def test_block_kinds_segments_and_rows():
  """A pair is FULL only if both blocks hold one and the same segment; per stream, each batch row
  is classified on its own (row 1 packs two documents, row 0 one)."""
  pos = np.stack([np.arange(8), np.arange(8)])
  seg = np.array([[1] * 8, [1, 1, 1, 1, 2, 2, 2, 2]])
  kinds = _kinds(pos, pos, 4, q_seg=seg, kv_seg=seg)
  assert kinds.tolist() == [[[P, D], [F, P]], [[P, D], [D, P]]]
  # All rows together: DEAD or FULL only where every row agrees.
  assert _kinds(pos, pos, 4, q_seg=seg, kv_seg=seg, per_stream=False).tolist() == [
      [[P, D], [P, P]]]


def test_zigzag_off_diagonal_steps_need_no_mask():
  """On the zigzag layout every ring step but the home one is DEAD/FULL pairs only, half live:
  the masks are built on the home shard alone."""
  shards, length, block = 4, 256, 16
  pos = ra.zigzag(np.arange(length), shards, 0).reshape(shards, -1)
  for r in range(shards):
    for src in range(shards):
      kinds = _kinds(pos[r], pos[src], block)
      if src == r:
        assert (kinds == P).any()
      else:
        assert not (kinds == P).any(), (r, src)
        assert (kinds == F).sum() * 2 == kinds.size, (r, src)


def _inputs(b, t, n, kv_heads, h, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[1], (b, t, kv_heads, h)),
          jax.random.normal(keys[2], (b, t, kv_heads, h)), jax.random.normal(keys[3], (b, t, n, h)))


def _out_and_grads(impl, q, k, v, cot, **kwargs):
  def run(q, k, v, cot):
    out, vjp = jax.vjp(lambda q, k, v: ra.attend(q, k, v, impl=impl, **kwargs), q, k, v)
    return (out,) + vjp(cot)
  return jax.jit(run)(q, k, v, cot)


def _max_errors(got, want):
  return [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want)]


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_per_stream_blocks_match_reference_with_packed_rows(causal):
  """Per-stream 64 x 128 blocks (2 query heads per kv head: 128 rows), T=320 (padded to 384).
  Row 0: documents cut at a block edge (128) and one past another (257); row 1: one document.
  Forward and all gradients must match, so a wrongly skipped or wrongly unmasked block, a mask
  off by one at a block edge, or segment ids dropped from the backward all fail."""
  b, t = 2, 320
  q, k, v, cot = _inputs(b, t, n=4, kv_heads=2, h=16)
  cuts = np.array([128, 257])
  segments = np.stack([(np.arange(t)[:, None] >= cuts).sum(-1), np.zeros(t, int)])
  kwargs = dict(causal=causal, segment_ids=jnp.asarray(segments, jnp.int32))
  want = _out_and_grads("reference", q, k, v, cot, **kwargs)
  got = _out_and_grads("blockwise", q, k, v, cot, block_q=64, block_kv=128, **kwargs)
  errors = _max_errors(got, want)
  assert max(errors) <= TOL, f"out, dq, dk, dv max errors {errors}"


def test_per_stream_ring_on_zigzag_matches_reference():
  """The ring over 2 devices, zigzag layout, 128 x 128 per-stream blocks, grouped-query heads."""
  shards, t = 2, 512
  q, k, v, cot = _inputs(1, t, n=4, kv_heads=2, h=16, seed=1)
  mesh = make_mesh(dict(data=1, fsdp=1, expert=1, sequence=shards, tensor=1),
                   devices=jax.devices()[:shards])
  want = _out_and_grads("reference", q, k, v, cot)
  zz = lambda x: ra.zigzag(x, shards)
  positions = zz(jnp.arange(t)[None])
  got = _out_and_grads("ring", zz(q), zz(k), zz(v), zz(cot), mesh=mesh, q_positions=positions,
                       kv_positions=positions, block_q=64, block_kv=128)
  errors = _max_errors([ra.unzigzag(x, shards) for x in got], want)
  assert max(errors) <= TOL, f"out, dq, dk, dv max errors {errors}"


@pytest.mark.slow
def test_per_stream_decode_reads_token_major_cache():
  """A 64-token chunk against a [B, S, K, H] cache in per-stream blocks (token-major slicing)."""
  b, t, s = 2, 64, 256
  keys = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(keys[0], (b, t, 4, 16))
  k_cache, v_cache = (jax.random.normal(key, (b, s, 2, 16)) for key in keys[1:])
  lengths = np.array([200, 256])
  kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  q_pos = jnp.asarray(lengths[:, None] - t + np.arange(t)[None], jnp.int32)
  kv_valid = kv_pos < lengths[:, None]
  want = ra.reference_attention(q, k_cache, v_cache, causal=True, q_positions=q_pos,
                                kv_positions=kv_pos, q_segment_ids=jnp.ones((b, t), jnp.int32),
                                kv_segment_ids=kv_valid.astype(jnp.int32), scale=0.25)
  got = jax.jit(lambda q, k, v: ra.decode_attend(
      q, k, v, mesh=None, q_positions=q_pos, kv_positions=kv_pos, kv_valid=kv_valid,
      block_kv=128))(q, k_cache, v_cache)
  assert float(jnp.max(jnp.abs(got - want))) <= TOL
