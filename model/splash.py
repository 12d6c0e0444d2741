"""Splash attention (the Pallas TPU "sparse flash" kernel) as the local compute of impl="blockwise"
(and, through model/splash_ring.py, of impl="ring").

`jax.experimental.pallas.ops.tpu.splash_attention` runs FlashAttention-2 (Dao 2023,
arXiv:2307.08691) as a Pallas kernel: per (head, query block) it visits only the key blocks its
mask leaves live, with a precomputed block map, and differentiates through its own dq / dkv
kernels. meshrl uses it for the blockwise kernel's compute on TPU; the jnp kernel
(model/blockwise.py) stays the path everywhere else.

Which kernel runs (`attention.local_kernel`, checked by `check_local_kernel`):
  jnp     always model/blockwise.py.
  splash  splash wherever the call is supported (`unsupported_reason`); on a non-TPU backend it runs
          in Pallas interpret mode (exact, very slow: for tests).
  auto    splash on TPU where supported, jnp elsewhere.
A call splash cannot serve falls back to the jnp kernel, never errors (a model's decode steps
attend to a KV cache and must keep working under local_kernel="splash").

The mask. Splash's causal mask is by index (`CausalMask`: key index <= query index) and fixed at
trace time, and its segment ids are compared for equality; meshrl's masks are by position
(`q_pos >= kv_pos`) and segment. The two agree on every query row whose segment's positions
increase strictly with the index, which is what the training and prefill layouts give (a row
0..T-1; packed documents restarting at 0 with their own segment id; left-padded prompts continued
by their response). So splash serves only self-attention calls (`unsupported_reason`): no KV cache,
T == S, the one position array for queries and keys, one segment array; a decode step, a cached
prefill, separate q/kv ids or the zigzag ring shards go to the jnp kernel. Not checked at run time
(the positions are traced): rows of a segment whose positions repeat, e.g. the padding segment of
rl/generation whose tokens all sit at position 0, attend to a causal prefix of their segment instead
of the whole of it. No real token sees such a row (segments differ), so real tokens' outputs and
every gradient that reaches the loss through them are the same as the jnp kernel's.
A mask built from the positions (splash's dynamic `jax.Array` masks) would be O(T * S) bool per
head: not used.

Shapes. Splash computes one batch row: q [N, T, H], k [K, S, H], v [K, S, J], GQA native (query
head n reads key head n // (N / K), as `attend`), so it is vmapped over the batch; with a mesh it
runs inside `jax.shard_map`, the batch split over data/fsdp/expert and the heads over `tensor` as
ring attention splits them (a Pallas call has no sharding rule: left to the partitioner it would be
replicated). Key blocks must be multiples of 128 (TPU lanes): T is padded at the end up to a multiple
of 128, the padded keys masked for every real query by the causal mask itself.

Ring attention (impl="ring") computes its block pairs with splash too: model/splash_ring.py, which
needs the layout of the sequence (attention.zigzag) known when the program is traced.

Axis legend: B batch, T length (queries and keys), N query heads, K key/value heads, H query/key head
dim, J value head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from meshrl.model.ring_attention import _outer_specs
from meshrl.sharding.mesh import in_context

LOCAL_KERNELS = ("auto", "jnp", "splash")
SPLASH_IMPLS = ("blockwise", "ring")  # the attention.impl values splash can compute (ring: model/splash_ring.py)
LANES = 128  # splash's key blocks are multiples of the TPU lane width
# Splash's largest block: its kernels hold [block_q, block_kv] float32 scores and the blocks of q, k, v
# and the output in the TPU core's scoped VMEM. attention.block_q / block_kv size the jnp kernel's
# blocks (paper_3t: 2,048 x 1,024); handed to splash unchanged they fail to compile
# (CompileTimeScopedVmemOom on v5p). 512 is MaxText's default for its splash blocks.
MAX_BLOCK = 512
# Segment id of the padding added up to a multiple of LANES (never a real id; pads see themselves).
PAD_SEGMENT = -(2 ** 31)


def check_local_kernel(local_kernel: str, impl: str) -> None:
  """Raises ValueError unless `local_kernel` is known and composes with `impl`."""
  if local_kernel not in LOCAL_KERNELS:
    raise ValueError(f"attention.local_kernel={local_kernel!r}; choose one of "
                     f"{', '.join(LOCAL_KERNELS)}.")
  if local_kernel == "splash" and impl not in SPLASH_IMPLS:
    raise ValueError(f"attention.local_kernel='splash' needs attention.impl='blockwise' or 'ring', got "
                     f"{impl!r}: 'reference' has no kernel (use local_kernel='auto' or 'jnp').")


def resolve(local_kernel: str, impl: str, backend: str) -> str:
  """The kernel blockwise and ring calls run where they are supported: "splash" or "jnp"."""
  if impl not in SPLASH_IMPLS or local_kernel == "jnp":
    return "jnp"
  return "splash" if local_kernel == "splash" or backend == "tpu" else "jnp"


def summary(impl: str, local_kernel: str, backend: str) -> str:
  """One line for a run's console summary: which kernel computes attention."""
  if impl not in SPLASH_IMPLS:
    what = {"reference": "whole score matrix"}.get(impl, impl)
    return f"attention: {impl} ({what})"
  kernel = resolve(local_kernel, impl, backend)
  where = "blockwise" if impl == "blockwise" else "ring over `sequence`"
  if kernel == "jnp":
    return f"attention: {where}, jnp kernel (local_kernel={local_kernel} on {backend})"
  mode = "" if backend == "tpu" else ", Pallas interpret mode"
  calls = ("self-attention calls" if impl == "blockwise"
           else "self-attention calls and the ring prefill, block pairs")
  return (f"attention: {where}, splash kernel for {calls}{mode}; other KV-cache calls "
          f"(decode, cached prefill) on the jnp kernel (local_kernel={local_kernel} on {backend})")


def unsupported_reason(q, k, *, q_positions, kv_positions, segment_ids, cached: bool) -> str | None:
  """Why splash cannot compute this call (None: it can). See the module docstring for the layout
  it assumes (positions increasing along each segment)."""
  if cached:
    return "a KV-cache call: cache slots are not the queries' own 0..T-1 layout"
  if q.shape[1] != k.shape[1]:
    return f"q_len={q.shape[1]} differs from kv_len={k.shape[1]}"
  if q_positions is not kv_positions:
    return "queries and keys carry different position arrays"
  if isinstance(segment_ids, (tuple, list)):
    return "separate query and key segment ids"
  return None


def block_size(size: int, length: int) -> int:
  """Splash's block for `length` tokens: the largest multiple of LANES, at most
  max(min(size, MAX_BLOCK), LANES), that divides `length`."""
  block = max(min(size, MAX_BLOCK) // LANES, 1) * LANES
  while length % block:
    block -= LANES
  return block


def kernel(mask: str, heads: int, q_len: int, kv_len: int, *, block_q: int, block_kv: int,
           interpret: bool, save_residuals: bool = False):
  """Splash for one batch row of `heads` query heads, q_len queries against kv_len keys: `mask`
  "causal" (by index) or "full"; blocks by `block_size`, the backward's the same; with
  save_residuals it also returns the rows' log-sum-exp. A Pallas kernel object holding its block
  maps, cached (building the maps is host work) and built outside the current trace (they are
  constants, not values of it)."""
  with jax.ensure_compile_time_eval():
    return _kernel(mask, heads, q_len, kv_len, block_size(block_q, q_len), block_size(block_kv, kv_len),
                   interpret, save_residuals)


@functools.lru_cache(maxsize=64)
def _kernel(mask: str, heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int, interpret: bool,
            save_residuals: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=import-outside-toplevel
  one = sa.CausalMask((q_len, kv_len)) if mask == "causal" else sa.FullMask((q_len, kv_len))
  sizes = sa.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                        block_q_dq=block_q, block_kv_dq=block_kv)
  return sa.make_splash_mha(sa.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                            q_seq_shards=1, save_residuals=save_residuals, interpret=interpret)


def _local(q_, k_, v_, seg_, *, scale, block_q, block_kv, interpret):
  """Causal splash attention of local arrays: q_ [B, T, N, H], k_ [B, T, K, H], v_ [B, T, K, J],
  seg_ [B, T] int32 or None -> [B, T, N, J]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds  # pylint: disable=import-outside-toplevel
  t = q_.shape[1]
  length = -(-t // LANES) * LANES
  pad = lambda x, value: jnp.pad(x, [(0, 0), (0, length - t)] + [(0, 0)] * (x.ndim - 2),
                                 constant_values=value)
  heads_major = lambda x: jnp.swapaxes(pad(x, 0), 1, 2)  # [B, T, X, D] -> [B, X, T', D]
  q_ = heads_major(q_ * jnp.asarray(scale, q_.dtype))
  k_, v_ = heads_major(k_), heads_major(v_)
  causal = kernel("causal", q_.shape[1], length, length, block_q=block_q, block_kv=block_kv,
                  interpret=interpret)
  if seg_ is None:
    out_ = jax.vmap(causal)(q_, k_, v_)
  else:
    seg_ = pad(seg_.astype(jnp.int32), PAD_SEGMENT)
    out_ = jax.vmap(lambda q, k, v, s: causal(q, k, v, segment_ids=SegmentIds(s, s)))(
        q_, k_, v_, seg_)
  return jnp.swapaxes(out_, 1, 2)[:, :t]  # [B, T, N, J]


def splash_attend(q, k, v, segment_ids=None, *, scale: float, block_q: int, block_kv: int,
                  mesh: Mesh | None = None, interpret: bool = False):
  """Causal self-attention of a whole sequence by splash.

  Args:
    q: [B, T, N, H] queries (unscaled).
    k: [B, T, K, H] keys; K divides N.
    v: [B, T, K, J] values.
    segment_ids: None or [B, T] int ids; only equal ids attend.
    scale: score scale.
    block_q, block_kv: splash's query and key blocks (`block_size`: at most MAX_BLOCK, rounded down
      to multiples of 128, at least 128, dividing T rounded up to a multiple of 128); the backward
      uses the same blocks.
    mesh: with a mesh, one kernel per device under shard_map (batch over data/fsdp/expert axes that
      divide B, heads over `tensor` when it divides K); None: one call over the whole arrays.
    interpret: run the Pallas kernel in interpret mode (any backend; slow).

  Returns:
    [B, T, N, J] in q's dtype. The position layout it assumes: the module docstring.
  """
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"kv_heads={k.shape[2]} must divide heads={q.shape[2]} (grouped-query attention).")
  local = functools.partial(_local, scale=scale, block_q=block_q, block_kv=block_kv,
                            interpret=interpret)
  if mesh is None:
    return local(q, k, v, segment_ids)
  return per_device(local, q, k, v, segment_ids, mesh=mesh, length_axis=None, scope="splash_attention")


def per_device(local, q, k, v, segment_ids, *, mesh: Mesh, length_axis: str | None, scope: str):
  """local(q_, k_, v_, seg_ or None) -> out_ run on every device's shards under shard_map: the batch
  over data/fsdp/expert where they divide B, the heads over `tensor` where it divides K (ring
  attention's split, ring_attention._outer_specs), the length over `length_axis` (None: whole)."""
  batch_axes, heads_axis = _outer_specs(mesh, q.shape[0], k.shape[2])
  x_spec, ids_spec = P(batch_axes, length_axis, heads_axis, None), P(batch_axes, length_axis)
  # check_vma=False: the packaged kernel's pallas_call declares outputs without varying axes.
  if segment_ids is None:
    fn = jax.shard_map(lambda q_, k_, v_: local(q_, k_, v_, None), mesh=in_context(mesh),
                       in_specs=(x_spec,) * 3, out_specs=x_spec, check_vma=False)
    args = (q, k, v)
  else:
    fn = jax.shard_map(local, mesh=in_context(mesh), in_specs=(x_spec,) * 3 + (ids_spec,), out_specs=x_spec,
                       check_vma=False)
    args = (q, k, v, segment_ids)
  with jax.named_scope(scope):
    return fn(*args)
