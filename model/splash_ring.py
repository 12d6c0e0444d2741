"""Ring attention whose block pairs are computed by splash (the Pallas TPU kernel), forward and backward.

The ring is the one of model/ring_attention.py (Liu et al. 2023, arXiv:2310.01889): each device keeps
its query shard, the key/value shards travel round the `sequence` axis with `ppermute`, and a custom
VJP rings them round again in the backward with their gradients, so no device ever holds more than
two shards. What changes is the compute of one (query shard, key shard) pair: splash's
FlashAttention-2 kernels instead of the jnp blockwise kernel.

Splash's masks are fixed at trace time and by index, so the pairs must be ones whose mask is known
before the run. With causal masks they are, for both layouts a run uses, which the caller declares
(KernelConfig.inputs_zigzag, model/attention.py; token order unless declared):

  zigzag      device r holds chunks r and 2n-1-r of 2n (ring_attention.zigzag). Step 0 (its own keys)
              is causal over the 2 local chunks in index order. At step j > 0 the keys come from
              device s = r - j (mod n): when s < r every query sees the first key chunk (s) whole and
              none of the second (chunk 2n-1-s comes after both query chunks); when s > r only the
              second query chunk (2n-1-r) sees keys, and it sees both key chunks whole. So each step
              is one unmasked rectangle of half the pairs: [2C queries x C keys] or [C queries x 2C
              keys], picked at run time by `lax.cond` (the load balance of zigzag: the same work on
              every device).
  contiguous  device r holds chunk r of n: step 0 causal, then whole (s < r) or nothing (s > r).

Segment ids (packed documents, padding) are splash's dynamic `SegmentIds`, applied in the kernel.
The causal mask by index agrees with meshrl's mask by position on the layouts the model feeds it
(positions increase along each segment in token order): the assumption of model/splash.py.

The pairs are merged by their log-sum-exp in float32 (each pair's output, and in the backward its
dq/dk/dv, come out of the kernel in the inputs' dtype: with bf16 inputs the gradients' error against
a float32 reference measured about 20% above the jnp ring's, 0.024-0.033 against 0.020-0.027 at 4
shards), in place: a step rewrites only the query rows
(forward) or the key rows and query rows (backward) its rectangle touches, so the ring holds about
the temporaries of the jnp ring (attention alone, one chip of paper_3t's shape compiled for v5p: 2.09
GiB against 1.94; 3.78 when each step built whole zero-padded arrays). The backward of a pair needs the *global*
log-sum-exp and delta = rowsum(out * d_out) of the merged output, not the pair's own: the packaged
kernel's VJP computes them from its own residuals, so the backward calls its dq/dkv kernels through
`splash_attention_kernel._splash_attention_bwd` with the global ones as the residuals (a private
function of jax.experimental.pallas, checked against jax 0.10.2: `private_api_problem` names a jax
whose function differs, and such a call falls back to the jnp ring; tests/model/test_splash_ring.py
runs it in interpret mode against the jnp ring).

Shapes per device (inside shard_map): q_ [B, T, N, H], k_ [B, T, K, H], v_ [B, T, K, J],
seg_ [B, T] int32 (or None); T the local length (2C in the zigzag layout), a multiple of 128 per
chunk (TPU lanes). Splash computes one batch row, so every kernel call is vmapped over B.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from meshrl.model import ring_attention as ra
from meshrl.model import splash

LANES = splash.LANES
# The parameters of splash_attention_kernel._splash_attention_bwd this module calls (jax 0.10.2).
_BWD_PARAMETERS = ("save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
                   "mask_function", "attn_logits_soft_cap", "interpret", "res", "do")


@dataclasses.dataclass(frozen=True)
class RingSplash:
  """The static shape of a splash ring: ring size, layout, blocks, and how the kernels run."""
  axis: str
  size: int
  zigzag: bool
  block_q: int
  block_kv: int
  interpret: bool


def _kernel_for(kind, q, k, cfg: RingSplash):
  """The kernel of a pair of heads-major blocks q [B, N, Tq, H], k [B, K, Tk, H]: kind "causal" or
  "full", with the rows' log-sum-exp."""
  return splash.kernel(kind, q.shape[1], q.shape[2], k.shape[2], block_q=cfg.block_q, block_kv=cfg.block_kv,
                       interpret=cfg.interpret, save_residuals=True)


def _segments(q_seg, kv_seg):
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds  # pylint: disable=import-outside-toplevel
  return None if q_seg is None else SegmentIds(q_seg, kv_seg)


def _pair_forward(kind, q, k, v, q_seg, kv_seg, cfg):
  """One pair: q [B, N, Tq, H] (scaled) against k [B, K, Tk, H], v [B, K, Tk, J] ->
  (out [B, N, Tq, J] float32, lse [B, N, Tq] float32)."""
  kernel = _kernel_for(kind, q, k, cfg)
  if q_seg is None:
    out, (lse,) = jax.vmap(kernel)(q, k, v)
  else:
    out, (lse,) = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=_segments(qs, ks)))(
        q, k, v, q_seg, kv_seg)
  return out.astype(jnp.float32), lse


def _pair_backward(kind, q, k, v, q_seg, kv_seg, out, lse, d_out, cfg):
  """Gradients of one pair given the merged output `out` [B, N, Tq, J] and its log-sum-exp `lse`
  [B, N, Tq] (the global softmax): -> dq [B, N, Tq, H], dk [B, K, Tk, H], dv [B, K, Tk, J], float32."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak  # pylint: disable=import-outside-toplevel
  kernel = _kernel_for(kind, q, k, cfg)
  kw = kernel.kwargs

  def one_row(q, k, v, qs, ks, out, lse, d_out):
    res = (q, k, v, _segments(qs, ks), None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
    grads = sak._splash_attention_bwd(  # pylint: disable=protected-access
        False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
        kw["attn_logits_soft_cap"], kw["interpret"], res, d_out)
    return grads[3:6]

  if q_seg is None:
    dq, dk, dv = jax.vmap(lambda q, k, v, o, l, d: one_row(q, k, v, None, None, o, l, d))(
        q, k, v, out, lse, d_out)
  else:
    dq, dk, dv = jax.vmap(one_row)(q, k, v, q_seg, kv_seg, out, lse, d_out)
  return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _merge(acc, part):
  """Two partial softmaxes (out [B, N, T, J], lse [B, N, T]) of disjoint keys -> their union's."""
  (out_a, lse_a), (out_b, lse_b) = acc, part
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  weight_a, weight_b = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
  return out_a * weight_a + out_b * weight_b, lse


def _halves(x, axis=2):
  half = x.shape[axis] // 2
  return lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, 2 * half, axis=axis)


def _seg_halves(seg):
  return (None, None) if seg is None else _halves(seg, axis=1)


def _source(cfg: RingSplash, step):
  """The device whose key shard this device holds at ring step `step` (> 0)."""
  return (lax.axis_index(cfg.axis) - step) % cfg.size


def _add_at(total, part, start: int):
  """total with `part` added to its slice from `start` on axis 2 (in place in the compiled program)."""
  current = lax.dynamic_slice_in_dim(total, start, part.shape[2], axis=2)
  return lax.dynamic_update_slice_in_dim(total, current + part, start, axis=2)


def _step_forward(stats, q, k, v, q_seg, kv_seg, step, cfg: RingSplash):
  """stats (out [B, N, T, J] float32, lse [B, N, T]) merged with this device's queries' partial
  softmax against the key shard of ring step `step` > 0. Only the rows a pair touches are rewritten."""
  me, source = lax.axis_index(cfg.axis), _source(cfg, step)
  if not cfg.zigzag:
    return lax.cond(source < me, lambda: _merge(stats, _pair_forward("full", q, k, v, q_seg, kv_seg, cfg)),
                    lambda: stats)

  def low_keys():  # all queries against key chunk s
    (k_low, _), (v_low, _), (kv_seg_low, _) = _halves(k), _halves(v), _seg_halves(kv_seg)
    return _merge(stats, _pair_forward("full", q, k_low, v_low, q_seg, kv_seg_low, cfg))

  def high_queries():  # query chunk 2n-1-r against both key chunks
    (_, q_high), (_, q_seg_high) = _halves(q), _seg_halves(q_seg)
    half = q_high.shape[2]
    high = tuple(lax.slice_in_dim(x, half, 2 * half, axis=2) for x in stats)
    high = _merge(high, _pair_forward("full", q_high, k, v, q_seg_high, kv_seg, cfg))
    return tuple(lax.dynamic_update_slice_in_dim(x, h, half, axis=2) for x, h in zip(stats, high))

  return lax.cond(source < me, low_keys, high_queries)


def _step_backward(grads, q, k, v, q_seg, kv_seg, out, lse, d_out, step, cfg: RingSplash):
  """grads (dq [B, N, T, H], dk [B, K, T, H], dv [B, K, T, J], float32) plus those of ring step
  `step` > 0's pair (as `_step_forward`), added in place to the rows it touches."""
  me, source = lax.axis_index(cfg.axis), _source(cfg, step)
  dq, dk, dv = grads
  if not cfg.zigzag:
    return lax.cond(source < me,
                    lambda: tuple(a + b for a, b in zip(grads, _pair_backward(
                        "full", q, k, v, q_seg, kv_seg, out, lse, d_out, cfg))),
                    lambda: grads)

  def low_keys():
    (k_low, _), (v_low, _), (kv_seg_low, _) = _halves(k), _halves(v), _seg_halves(kv_seg)
    dq_, dk_, dv_ = _pair_backward("full", q, k_low, v_low, q_seg, kv_seg_low, out, lse, d_out, cfg)
    return dq + dq_, _add_at(dk, dk_, 0), _add_at(dv, dv_, 0)

  def high_queries():
    (_, q_high), (_, q_seg_high) = _halves(q), _seg_halves(q_seg)
    (_, out_high), (_, lse_high), (_, d_out_high) = _halves(out), _halves(lse), _halves(d_out)
    dq_, dk_, dv_ = _pair_backward("full", q_high, k, v, q_seg_high, kv_seg, out_high, lse_high,
                                   d_out_high, cfg)
    return _add_at(dq, dq_, q_high.shape[2]), dk + dk_, dv + dv_

  return lax.cond(source < me, low_keys, high_queries)


def _shift(tree, cfg: RingSplash):
  return ra._shift(tree, ra._Ring(cfg.axis, cfg.size))  # pylint: disable=protected-access


def _ring_forward(q, k, v, q_seg, kv_seg, cfg: RingSplash):
  """-> (out [B, N, T, J] float32, lse [B, N, T]) of heads-major local blocks over the whole ring."""
  stats = _pair_forward("causal", q, k, v, q_seg, kv_seg, cfg)  # step 0: this device's own keys
  if cfg.size == 1:
    return stats

  def step(carry, index):
    stats, keys = carry
    with jax.named_scope("ring_send_kv"):
      keys = _shift(keys, cfg)
    k_, v_, kv_seg_ = keys
    return (_step_forward(stats, q, k_, v_, q_seg, kv_seg_, index, cfg), keys), None

  (stats, _), _ = lax.scan(step, (stats, (k, v, kv_seg)), jnp.arange(1, cfg.size))
  return stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, seg, cfg: RingSplash):
  """q [B, N, T, H] (scaled), k [B, K, T, H], v [B, K, T, J], seg [B, T] or None -> [B, N, T, J]."""
  return _ring_fwd(q, k, v, seg, cfg)[0]


def _ring_fwd(q, k, v, seg, cfg):
  out, lse = _ring_forward(q, k, v, seg, seg, cfg)
  out = out.astype(q.dtype)
  return out, (q, k, v, seg, out, lse)


def _ring_bwd(cfg, residuals, d_out):
  q, k, v, seg, out, lse = residuals
  dq, dk, dv = _pair_backward("causal", q, k, v, seg, seg, out, lse, d_out, cfg)
  if cfg.size > 1:
    # As ring_attention's backward: the keys travel on, and the gradients of the shard seen last
    # step ("pending") go to the device that now holds that shard, both sent before computing.
    def step(carry, index):
      keys, dq, pending = carry
      with jax.named_scope("ring_send_kv_grads"):
        keys, arrived = _shift(keys, cfg), _shift(pending, cfg)
      k_, v_, kv_seg_ = keys
      dq, dk, dv = _step_backward((dq, *arrived), q, k_, v_, seg, kv_seg_, out, lse, d_out, index, cfg)
      return (keys, dq, (dk, dv)), None

    (_, dq, pending), _ = lax.scan(step, ((k, v, seg), dq, (dk, dv)), jnp.arange(1, cfg.size))
    with jax.named_scope("ring_send_kv_grads"):
      dk, dv = _shift(pending, cfg)  # the last shard's gradients go home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


@functools.lru_cache(maxsize=1)
def private_api_problem() -> str | None:
  """Why this jax's splash backward cannot be called as `_pair_backward` does (None: it can)."""
  import inspect  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak  # pylint: disable=import-outside-toplevel
  bwd = getattr(sak, "_splash_attention_bwd", None)
  if bwd is None:
    return f"jax {jax.__version__} has no splash_attention_kernel._splash_attention_bwd"
  found = tuple(inspect.signature(bwd).parameters)
  if found != _BWD_PARAMETERS:
    return f"jax {jax.__version__}'s splash _splash_attention_bwd takes {found}, not {_BWD_PARAMETERS}"
  return None


def unsupported_reason(q, k, *, mesh, q_positions, kv_positions, segment_ids, zigzag: bool) -> str | None:
  """Why the splash ring cannot compute this ring self-attention call (None: it can)."""
  reason = private_api_problem() or splash.unsupported_reason(
      q, k, q_positions=q_positions, kv_positions=kv_positions, segment_ids=segment_ids, cached=False)
  if reason is not None:
    return reason
  shards = ra._sequence_size(mesh, "splash ring")  # pylint: disable=protected-access
  chunks = shards * (2 if zigzag else 1)
  if q.shape[1] % (chunks * LANES):
    return (f"length {q.shape[1]} is not a multiple of {chunks} chunks x {LANES} lanes "
            f"(mesh.sequence={shards}{', zigzag' if zigzag else ''})")
  return None


def ring_splash_attend(q, k, v, segment_ids=None, *, mesh: Mesh, zigzag: bool, scale: float,
                       block_q: int, block_kv: int, interpret: bool = False):
  """Causal ring self-attention over the mesh's `sequence` axis, splash computing every block pair.

  Args:
    q: [B, T, N, H] queries (unscaled), T split over `sequence`; in the zigzag layout when `zigzag`.
    k: [B, T, K, H] keys, K divides N; v: [B, T, K, J] values; laid out like q.
    segment_ids: None or [B, T] int ids in q's layout; only equal ids attend.
    mesh: the run's mesh; batch over data/fsdp/expert where they divide B, heads over `tensor`
      where it divides K (ring_attention's split).
    zigzag: the layout of T (ring_attention.zigzag over mesh.sequence devices) or token order.
    scale: score scale.
    block_q, block_kv: splash's blocks (splash.block_size: at most splash.MAX_BLOCK, multiples of 128
      dividing each chunk).
    interpret: run the Pallas kernels in interpret mode (any backend; slow: tests).

  Returns:
    [B, T, N, J] in q's dtype, split like q. `unsupported_reason` lists what it needs.
  """
  shards = ra._sequence_size(mesh, "splash ring")  # pylint: disable=protected-access
  cfg = RingSplash(ra.SEQUENCE_AXIS, shards, zigzag, block_q, block_kv, interpret)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, X, D] <-> [B, X, T, D]

  def local(q_, k_, v_, seg_):
    out_ = _ring(heads_major(q_ * jnp.asarray(scale, q_.dtype)), heads_major(k_), heads_major(v_),
                 None if seg_ is None else seg_.astype(jnp.int32), cfg)
    return heads_major(out_)

  return splash.per_device(local, q, k, v, segment_ids, mesh=mesh, length_axis=ra.SEQUENCE_AXIS,
                           scope="ring_splash_attention")
