"""Blockwise, ring and decode attention against the plain-softmax reference (8 simulated devices)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from meshrl.model import ring_attention as ra
from meshrl.sharding import make_mesh

TOL = 1e-5  # fp32, forward and gradients


def _mesh(sequence, data=1, tensor=1):
  return make_mesh(dict(data=data, fsdp=1, expert=1, sequence=sequence, tensor=tensor),
                   devices=jax.devices()[:sequence * data * tensor])


def _inputs(b=2, t=64, s=None, n=4, kv_heads=2, h=16, j=None, seed=0):
  """q [B, T, N, H], k [B, S, K, H], v [B, S, K, J] and an output cotangent [B, T, N, J]."""
  s, j = s or t, j or h
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[1], (b, s, kv_heads, h)),
          jax.random.normal(keys[2], (b, s, kv_heads, j)),
          jax.random.normal(keys[3], (b, t, n, j)))


def _packed_segments(b, t):
  """Three documents per row, different cut points per row: [B, T] int32."""
  cuts = np.array([[t // 3, t // 2], [t // 5, 3 * t // 4]])[:b]
  return jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def _out_and_grads(impl, q, k, v, cot, **kwargs):
  """(out, dq, dk, dv) of attend under jit."""
  def run(q, k, v, cot):
    out, vjp = jax.vjp(lambda q, k, v: ra.attend(q, k, v, impl=impl, **kwargs), q, k, v)
    return (out,) + vjp(cot)
  return jax.jit(run)(q, k, v, cot)


def _max_errors(got, want):
  return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
          for a, b in zip(got, want)]


def test_reference_matches_jax_dot_product_attention():
  q, k, v, _ = _inputs(t=48, n=4, kv_heads=2)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  got = ra.attend(q, k, v, impl="reference")
  assert float(jnp.max(jnp.abs(got - want))) <= TOL


def test_one_query_form_equals_the_many_query_form():
  """Decode's form (the unit query axis dropped) against the same query computed beside a second
  one, for GQA with J != H, segment pairs, causal masks, and a row that sees no key (gives 0)."""
  q, k, v, _ = _inputs(b=3, t=1, s=40, n=6, kv_heads=2, h=16, j=8, seed=3)
  q_pos = jnp.asarray([[25], [39], [0]], jnp.int32)
  kv_pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (3, 40))
  q_seg = jnp.asarray([[1], [2], [5]], jnp.int32)
  kv_seg = jnp.asarray((np.arange(40)[None] >= np.array([[10], [30], [40]])) + np.array([[0], [1], [1]]),
                       jnp.int32)  # row 2: no key of segment 5 at all
  run = lambda q, q_pos, q_seg: ra.reference_attention(  # noqa: E731
      q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
      kv_segment_ids=kv_seg, scale=0.3)
  got = run(q, q_pos, q_seg)
  twice = lambda x: jnp.concatenate([x, x], axis=1)  # noqa: E731
  want = run(twice(q), twice(q_pos), twice(q_seg))[:, :1]
  assert got.shape == (3, 1, 6, 8)
  assert float(jnp.max(jnp.abs(got - want))) <= TOL
  assert float(jnp.max(jnp.abs(got[2]))) == 0.0 and float(jnp.max(jnp.abs(got[:2]))) > 0.1


@pytest.mark.parametrize("t,blocks", [(96, 2), (97, 3)])
def test_causal_blocks_equal_one_block_and_score_less(t, blocks):
  """Causal self-attention split into query blocks, each scored against the keys up to its own last
  column (attend's causal_blocks, the reference kernel's training path), gives the one-block result
  and gradients on packed rows whose positions restart in every document, with trailing padding;
  and it compiles to fewer FLOPs (the skipped keys are really not scored)."""
  q, k, v, cot = _inputs(b=2, t=t, n=4, kv_heads=2)
  segments = _packed_segments(2, t) + 1
  segments = jnp.where(jnp.arange(t)[None] >= t - 5, 0, segments)  # five padding columns
  starts = jax.vmap(lambda row: jnp.searchsorted(row, row, side="left"))(segments)
  positions = jnp.arange(t)[None] - starts  # 0.. in each document
  kwargs = dict(q_positions=positions, kv_positions=positions, segment_ids=segments)
  run = {n: jax.jit(lambda q, k, v, cot, n=n: _out_and_grads("reference", q, k, v, cot, causal_blocks=n, **kwargs))
         for n in (1, blocks)}
  whole, split = run[1](q, k, v, cot), run[blocks](q, k, v, cot)
  assert max(_max_errors(split, whole)) <= TOL, _max_errors(split, whole)
  flops = {n: fn.lower(q, k, v, cot).compile().cost_analysis()["flops"] for n, fn in run.items()}
  assert flops[blocks] < 0.9 * flops[1], flops
  with pytest.raises(ValueError, match="causal_blocks=2 needs causal self-attention"):
    ra.attend(q, k, v, impl="reference", causal=False, causal_blocks=2)
  with pytest.raises(ValueError, match="T=8, S=96"):
    ra.attend(q[:, :8], k[:, :96], v[:, :96], impl="reference", causal_blocks=2)


BLOCKWISE_CASES = {
    # name: (input shapes, attend kwargs)
    "causal_gqa_padded_len200": (dict(t=200, n=4, kv_heads=2), dict(block_q=64, block_kv=32)),
    "noncausal_padded_len200": (dict(t=200, n=4, kv_heads=4),
                                dict(causal=False, block_q=64, block_kv=48)),
    "causal_packed_5heads_mqa": (dict(t=96, n=5, kv_heads=1), dict(segments=True, block_q=16,
                                                                   block_kv=32)),
    "noncausal_packed_5heads": (dict(t=96, n=5, kv_heads=5), dict(causal=False, segments=True,
                                                                  block_q=32, block_kv=16)),
    "value_dim_differs": (dict(t=64, h=24, j=8), dict(block_q=16, block_kv=16)),
    "cross_len_default_positions": (dict(t=24, s=72), dict(block_q=8, block_kv=16)),
}


@pytest.mark.parametrize("case", list(BLOCKWISE_CASES))
def test_blockwise_matches_reference(case):
  shapes, kwargs = BLOCKWISE_CASES[case]
  kwargs = dict(kwargs)
  q, k, v, cot = _inputs(**shapes)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = _packed_segments(q.shape[0], q.shape[1])
  want = _out_and_grads("reference", q, k, v, cot, **kwargs)
  got = _out_and_grads("blockwise", q, k, v, cot, **kwargs)
  errors = _max_errors(got, want)
  assert max(errors) <= TOL, f"{case}: out, dq, dk, dv max errors {errors}"


RING_CASES = {
    # name: (mesh sizes, attend kwargs)
    "1dev_causal_packed": (dict(sequence=1), dict(segments=True)),
    "2dev_noncausal_tensor2_data2": (dict(sequence=2, data=2, tensor=2), dict(causal=False)),
    "4dev_causal_data2": (dict(sequence=4, data=2), dict()),
    "8dev_causal_packed": (dict(sequence=8), dict(segments=True)),
    "8dev_noncausal_packed": (dict(sequence=8), dict(causal=False, segments=True)),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_matches_reference(case):
  mesh_sizes, kwargs = RING_CASES[case]
  kwargs = dict(kwargs)
  q, k, v, cot = _inputs(t=96, n=4, kv_heads=2)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = _packed_segments(q.shape[0], q.shape[1])
  want = _out_and_grads("reference", q, k, v, cot, **kwargs)
  got = _out_and_grads("ring", q, k, v, cot, mesh=_mesh(**mesh_sizes), block_q=8, block_kv=4,
                       **kwargs)
  errors = _max_errors(got, want)
  assert max(errors) <= TOL, f"{case}: out, dq, dk, dv max errors {errors}"


def test_ring_odd_heads_on_zigzag_layout_matches_reference():
  """5 query heads over 1 kv head, 4 devices, the batch laid out zigzag with its positions."""
  shards = 4
  q, k, v, cot = _inputs(t=120, n=5, kv_heads=1)
  positions = jnp.broadcast_to(jnp.arange(120), (2, 120))
  want = _out_and_grads("reference", q, k, v, cot)
  zz = lambda x: ra.zigzag(x, shards)
  got = _out_and_grads("ring", zz(q), zz(k), zz(v), zz(cot), mesh=_mesh(sequence=shards),
                       q_positions=zz(positions), kv_positions=zz(positions), block_q=8,
                       block_kv=8)
  got = [ra.unzigzag(x, shards) for x in got]
  errors = _max_errors(got, want)
  assert max(errors) <= TOL, f"out, dq, dk, dv max errors {errors}"


def test_bf16_within_2e2_of_fp32_reference():
  q, k, v, cot = _inputs(t=64, n=4, kv_heads=2)
  want = _out_and_grads("reference", q, k, v, cot)
  as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, cot)]
  for impl, kwargs in (("blockwise", dict(block_q=16, block_kv=16)),
                       ("ring", dict(mesh=_mesh(sequence=4), block_q=8, block_kv=8))):
    got = _out_and_grads(impl, *as_bf16, **kwargs)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    errors = _max_errors(got, want)
    assert max(errors) <= 2e-2, f"{impl}: out, dq, dk, dv max errors {errors}"


def _op_count(hlo_text, op):
  return len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text))  # async ops count once (start)


@functools.lru_cache(maxsize=None)
def _compiled_ring_fwd_bwd(shards, tokens_per_device=256):
  """Ring attention forward+backward compiled for `shards` devices (cached: two tests use it)."""
  q, k, v, cot = _inputs(b=1, t=shards * tokens_per_device, n=4, kv_heads=2, h=32)
  mesh = _mesh(sequence=shards)

  def fwd_bwd(q, k, v, cot):
    out, vjp = jax.vjp(lambda q, k, v: ra.attend(q, k, v, impl="ring", mesh=mesh, block_q=64,
                                                 block_kv=64), q, k, v)
    return out, vjp(cot)

  return jax.jit(fwd_bwd).lower(q, k, v, cot).compile()


def test_compiled_ring_permutes_and_never_gathers_kv():
  hlo = _compiled_ring_fwd_bwd(4).as_text()
  assert _op_count(hlo, "collective-permute") >= 2, "expected ppermutes in forward and backward"
  for op in ("all-gather", "all-to-all", "all-reduce"):
    assert _op_count(hlo, op) == 0, op


def test_ring_temp_memory_flat_in_device_count():
  """Per-device temp bytes do not grow with the ring size at fixed tokens per device.

  With 2 devices the ring loops run a single step, which XLA inlines, so that program needs a
  little less memory (no double-buffered loop carries); from 4 devices on the loop is real and
  the footprint must stay put.
  """
  temps = {shards: _compiled_ring_fwd_bwd(shards).memory_analysis().temp_size_in_bytes
           for shards in (2, 4, 8)}
  assert temps[8] <= 1.05 * temps[4] and temps[4] <= 1.05 * temps[8], temps
  assert temps[2] <= 1.05 * temps[4], temps


def test_zigzag_roundtrip_and_layout():
  x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
  zz = ra.zigzag(x, 3)
  np.testing.assert_array_equal(ra.unzigzag(zz, 3), x)
  np.testing.assert_array_equal(zz[0, :, 0] // 3, [0, 1, 2, 3, 20, 21, 22, 23, 4, 5, 6, 7,
                                                   16, 17, 18, 19, 8, 9, 10, 11, 12, 13, 14, 15])
  jx = jnp.asarray(x, jnp.float32)
  assert bool(jnp.all(ra.unzigzag(ra.zigzag(jx, 4, axis=-2), 4, axis=-2) == jx))


@pytest.mark.parametrize("sequence,data,axis", [(4, 2, 1), (8, 1, 2), (2, 2, 1)])
def test_unzigzag_on_mesh_is_unzigzag_without_a_gather(sequence, data, axis):
  """The ring prefill's cache write-back (and the RL step's advantages, rl/batches/layouts.py): equal to
  `unzigzag`, sharded like its input, and moved by collective permutes only (no all-gather: no device
  holds more than its slice); `zigzag_on_mesh` likewise equals `zigzag`."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = _mesh(sequence, data=data)
  shape = (data * 2, 4 * sequence, 3) if axis == 1 else (2, data, 4 * sequence, 5)
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  spec = P("data", "sequence") if axis == 1 else P(None, "data", "sequence")
  zz = jax.device_put(ra.zigzag(x, sequence, axis=axis), NamedSharding(mesh, spec))
  fn = jax.jit(lambda a: ra.unzigzag_on_mesh(a, mesh, axis=axis))
  out = fn(zz)
  np.testing.assert_array_equal(np.asarray(out), x)
  assert out.sharding.is_equivalent_to(zz.sharding, x.ndim)
  collectives = set(re.findall(r"(all-gather|all-to-all|all-reduce|collective-permute)\(",
                               fn.lower(zz).compile().as_text()))
  assert collectives == {"collective-permute"}
  back = jax.jit(lambda a: ra.zigzag_on_mesh(a, mesh, axis=axis))
  again = back(out)
  np.testing.assert_array_equal(np.asarray(again), ra.zigzag(x, sequence, axis=axis))
  assert again.sharding.is_equivalent_to(zz.sharding, x.ndim)
  collectives = set(re.findall(r"(all-gather|all-to-all|all-reduce|collective-permute)\(",
                               back.lower(out).compile().as_text()))
  assert collectives == {"collective-permute"}
  with pytest.raises(ValueError, match=r"length 12 \(axis 1\) must be divisible by 2 \* mesh.sequence"):
    ra.unzigzag_on_mesh(jnp.zeros((2, 12)), _mesh(4))
  with pytest.raises(ValueError, match=r"zigzag_on_mesh: length 12"):
    ra.zigzag_on_mesh(jnp.zeros((2, 12)), _mesh(4))


def test_zigzag_balances_causal_work():
  shards, length = 8, 8 * 2 * 16
  for layout, want_balanced in ((lambda p: p, False), (lambda p: ra.zigzag(p, shards, 0), True)):
    pos = layout(np.arange(length)).reshape(shards, -1)  # [device, local tokens]
    work = [(pos[d][:, None] >= np.arange(length)[None, :]).sum() for d in range(shards)]
    assert (max(work) == min(work)) == want_balanced, work


@pytest.mark.parametrize("q_len,shards", [(1, 4), (3, 8), (3, None)])
def test_sharded_decode_matches_reference(q_len, shards):
  b, s = 2, 64
  q, k, v, _ = _inputs(b=b, t=q_len, s=s, n=4, kv_heads=2)
  lengths = np.array([40, 64])  # row 0 has 24 empty cache slots
  kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  q_pos = jnp.asarray(lengths[:, None] - q_len + np.arange(q_len)[None], jnp.int32)
  kv_valid = kv_pos < lengths[:, None]
  want = ra.reference_attention(q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos,
                                q_segment_ids=jnp.ones((b, q_len), jnp.int32),
                                kv_segment_ids=kv_valid.astype(jnp.int32), scale=0.25)
  mesh = None if shards is None else _mesh(sequence=shards, data=8 // shards)
  got = jax.jit(lambda q, k, v: ra.decode_attend(q, k, v, mesh=mesh, q_positions=q_pos,
                                                 kv_positions=kv_pos, kv_valid=kv_valid,
                                                 block_kv=8))(q, k, v)
  assert float(jnp.max(jnp.abs(got - want))) <= TOL


def test_sharded_decode_all_reduces_partials_and_moves_no_cache():
  q, k, v, _ = _inputs(b=1, t=1, s=64, n=4, kv_heads=2)
  mesh = _mesh(sequence=8)
  hlo = jax.jit(lambda q, k, v: ra.decode_attend(q, k, v, mesh=mesh, q_positions=[63],
                                                 kv_positions=jnp.arange(64))
                ).lower(q, k, v).compile().as_text()
  assert _op_count(hlo, "all-reduce") >= 1
  for op in ("collective-permute", "all-gather", "all-to-all"):
    assert _op_count(hlo, op) == 0, op


def test_bad_inputs_raise_naming_sizes():
  q, k, v, _ = _inputs(t=48, n=4, kv_heads=3, h=8)
  with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
    ra.attend(q, k, v, impl="blockwise")
  q, k, v, _ = _inputs(t=48, n=4, kv_heads=2, h=8)
  with pytest.raises(ValueError, match="impl="):
    ra.attend(q, k, v, impl="flash")
  with pytest.raises(ValueError, match="mesh=None"):
    ra.attend(q, k, v, impl="ring")
  no_sequence = Mesh(np.array(jax.devices()[:2]), ("data",))
  with pytest.raises(ValueError, match="'sequence' axis"):
    ra.attend(q, k, v, impl="ring", mesh=no_sequence)
  q, k, v, _ = _inputs(t=44, n=4, kv_heads=2, h=8)
  with pytest.raises(ValueError, match="q_len=44 and kv_len=44 .* axis size 8"):
    ra.attend(q, k, v, impl="ring", mesh=_mesh(sequence=8))
  with pytest.raises(ValueError, match="length 20 .* 2 \\* num_shards = 8"):
    ra.zigzag(np.zeros((1, 20)), 4)
