"""Compressed gradient collectives: the weight gradients' reduce-scatter and all-reduce over the mesh's
batch axes in bfloat16 or in int8 with per-block scales, optionally with error feedback
(`optim.grad_collective_dtype`; off, "float32", by default).

With it off the partitioner reduces each weight's gradient where it sees fit, in the dtype the
backward pass computed it in. With it on, the reductions are explicit (`reduce_scatter`, `all_reduce`,
inside shard_map) at the point where a weight is gathered for use (model/layers.py `Dense`,
model/moe_local.py and model/expert_parallel.py for the experts: `gather_for_use`), so their wire
format is chosen here:

  bfloat16  the partial sums cast to bfloat16, reduced by XLA's own reduce-scatter / all-reduce.
  int8      each device's partial sums cut into blocks of BLOCK values, each block scaled by its
            largest magnitude to int8 (`quantize`); a reduce-scatter is one all-to-all of the int8
            chunks and their float32 scales, each device summing the P chunks it receives in float32;
            an all-reduce adds an all-gather of the summed chunk, quantized again (the two phases of
            ZeRO++'s quantized gradients, Wang et al. 2023, arXiv 2306.10209). On the wire: 1 + 4 / BLOCK
            bytes per value against 2 for bfloat16.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, arXiv 1901.09847): a device
adds the quantization error it made last time to what it sends now, so what is lost to rounding in one
step is sent in the next and the sum over steps stays within one step's error of the exact one
(`all_reduce(..., error=)` returns the new error; tests/sharding/test_compress.py).

Axis legend: P devices in a reduction group, C values of one device's chunk, N blocks of BLOCK values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

GRAD_DTYPES = ("float32", "bfloat16", "int8")
BLOCK = 256  # values per int8 scale
GRAD_SCOPE = "grad_reduce"  # the named scope sharding/traffic.py counts as gradient collectives


def check_grad_dtype(name: str, backend: str) -> None:
  """Raises ValueError naming optim.grad_collective_dtype, the value, the backend and the choices when
  the backend's collectives cannot reduce in it (float8 and other types: XLA's reduce-scatter and
  all-reduce take neither on cpu nor tpu, and an int8 sum would overflow, hence the scaled blocks)."""
  if name not in GRAD_DTYPES:
    raise ValueError(f"optim.grad_collective_dtype={name!r}: the {backend} backend cannot reduce gradients "
                     f"in it; choose one of {', '.join(GRAD_DTYPES)} (int8 with per-block scales).")


@dataclasses.dataclass(frozen=True)
class GradReduce:
  """How the explicit gradient reductions run: the wire dtype ("bfloat16" or "int8"), the values per
  int8 scale, and for weights used under the partitioner (`matmul`) the mesh and logical rules that
  lay them out. Built by `from_name`; "float32" (off) gives None, so code tests `if grad_reduce`."""
  dtype: str
  block: int = BLOCK
  mesh: Any = None
  rules: Any = None

  @classmethod
  def from_name(cls, name: str, backend: str) -> "GradReduce | None":
    check_grad_dtype(name, backend)
    return None if name == "float32" else cls(name)


# ---------------------------------------------------------------------------------------------
# Per-block int8 quantization.


def quantize(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
  """[..., C] float -> (q [..., N, block] int8, scale [..., N] float32) with C padded to N * block;
  each block's largest magnitude maps to 127."""
  size = x.shape[-1]
  blocks = -(-size // block)
  x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, blocks * block - size)])
  x = x.reshape(x.shape[:-1] + (blocks, block))
  scale = jnp.max(jnp.abs(x), axis=-1) / 127.0  # [..., N]
  q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
  return q.astype(jnp.int8), scale


def dequantize(q: jax.Array, scale: jax.Array, size: int) -> jax.Array:
  """The inverse of `quantize`: [..., N, block] int8 and [..., N] -> [..., size] float32."""
  x = q.astype(jnp.float32) * scale[..., None]
  return x.reshape(x.shape[:-2] + (-1,))[..., :size]


# ---------------------------------------------------------------------------------------------
# Collectives (inside shard_map; `axes` are manual mesh axes).


def _group(axes: Sequence[str]) -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes)


def _int8_reduce_scatter_flat(x: jax.Array, axes: tuple[str, ...], block: int) -> tuple[jax.Array, jax.Array]:
  """[P, C] float (chunk p for device p) -> (sum over the group of every device's chunk of mine [C]
  float32, this device's quantization error [P, C])."""
  size = x.shape[-1]
  q, scale = quantize(x, block)  # [P, N, block], [P, N]
  error = x.astype(jnp.float32) - dequantize(q, scale, size)
  q = jax.lax.all_to_all(q, axes, 0, 0, tiled=True)  # [P, N, block]: every device's chunk of mine
  scale = jax.lax.all_to_all(scale, axes, 0, 0, tiled=True)
  return jnp.sum(dequantize(q, scale, size), axis=0), error


def reduce_scatter(x: jax.Array, axes: Sequence[str], dim: int, grad: GradReduce) -> jax.Array:
  """psum_scatter(x, axes, scatter_dimension=dim, tiled=True) with `grad.dtype` on the wire; float32
  result. `x` is this device's partial sum; x.shape[dim] must divide by the group size."""
  axes = tuple(axes)
  if not axes:
    return x.astype(jnp.float32)
  with jax.named_scope(GRAD_SCOPE):
    if grad.dtype != "int8":
      return jax.lax.psum_scatter(x.astype(grad.dtype), axes, scatter_dimension=dim, tiled=True).astype(jnp.float32)
    group = _group(axes)
    moved = jnp.moveaxis(x, dim, 0)  # [P * c, ...]
    chunk_shape = (moved.shape[0] // group,) + moved.shape[1:]
    summed, _ = _int8_reduce_scatter_flat(moved.reshape(group, -1), axes, grad.block)
    return jnp.moveaxis(summed.reshape(chunk_shape), 0, dim)


def all_reduce(x: jax.Array, axes: Sequence[str], grad: GradReduce,
               error: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """psum(x, axes) with `grad.dtype` on the wire -> (float32 sum, the new error or None).

  int8: a reduce-scatter of x (+ error) in int8 blocks, then an all-gather of each summed chunk
  quantized again. With `error` (x's shape, float32; zeros at first), the returned error holds what
  this device's quantization lost: its own blocks' rounding, plus on the chunk it summed the rounding
  of the sum, which the next call adds back."""
  axes = tuple(axes)
  if not axes:
    return x.astype(jnp.float32), error
  with jax.named_scope(GRAD_SCOPE):
    if grad.dtype != "int8":
      return jax.lax.psum(x.astype(grad.dtype), axes).astype(jnp.float32), error
    group, shape = _group(axes), x.shape
    flat = x.astype(jnp.float32).reshape(-1)
    if error is not None:
      flat = flat + error.reshape(-1)
    chunk = -(-flat.shape[0] // group)
    flat = jnp.pad(flat, (0, chunk * group - flat.shape[0])).reshape(group, chunk)  # [P, C]
    summed, sent_error = _int8_reduce_scatter_flat(flat, axes, grad.block)  # [C], [P, C]
    q, scale = quantize(summed[None], grad.block)  # [1, N, block]
    sum_error = summed - dequantize(q, scale, chunk)[0]
    q = jax.lax.all_gather(q[0], axes, tiled=False, to="invarying")  # [P, N, block], the same everywhere
    scale = jax.lax.all_gather(scale[0], axes, tiled=False, to="invarying")  # [P, N]
    total = dequantize(q, scale, chunk).reshape(-1)[:math.prod(shape)].reshape(shape)
    if error is None:
      return total, None
    me = jax.lax.axis_index(axes)
    sent_error = jax.lax.dynamic_update_index_in_dim(
        sent_error, jax.lax.dynamic_index_in_dim(sent_error, me, keepdims=False) + sum_error, me, 0)
    return total, sent_error.reshape(-1)[:math.prod(shape)].reshape(shape)


# ---------------------------------------------------------------------------------------------
# A weight used under the partitioner (model/layers.py Dense): its gradient reduced explicitly.


def _axes_of(entry) -> tuple[str, ...]:
  return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def weight_grad(x: jax.Array, ct: jax.Array, kernel_shape: tuple[int, int], kernel_names: tuple, *,
                grad: GradReduce, mesh, rules) -> jax.Array:
  """d(x @ kernel) / d kernel for the output cotangent ct, laid out like the kernel, its sum over the
  devices' rows by `reduce_scatter` / `all_reduce` in `grad.dtype`.

  x [..., in] and ct [..., out] are split as the rules split their leading names (batch, length);
  each device forms its partial sum x_^T ct_ [in', out'] in float32, reduce-scatters it over the
  leading axes that also split a kernel dimension (fsdp: ZeRO-3) and all-reduces it over the other
  leading axes (data; expert for a weight the experts do not split)."""
  from meshrl.sharding.mesh import in_context  # pylint: disable=import-outside-toplevel
  from meshrl.sharding.rules import logical_to_spec  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel
  lead = x.ndim - 1
  lead_names = (("batch", "length") if lead == 2 else ("batch",) + (None,) * (lead - 1))[:lead]
  lead_spec = tuple(logical_to_spec(lead_names, rules, mesh, shape=x.shape[:lead]))
  lead_axes = tuple(a for entry in lead_spec for a in _axes_of(entry))
  k_spec = logical_to_spec(kernel_names, rules, mesh, shape=kernel_shape)
  own = [tuple(a for a in _axes_of(k_spec[d]) if a not in lead_axes) for d in (0, 1)]  # split x / ct too
  scatter = [tuple(a for a in _axes_of(k_spec[d]) if a in lead_axes) for d in (0, 1)]
  rest = tuple(a for a in lead_axes if a not in scatter[0] + scatter[1])
  entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
  x_spec = PartitionSpec(*lead_spec, entry(own[0]))
  ct_spec = PartitionSpec(*lead_spec, entry(own[1]))

  def local(x_, ct_):
    partial = jnp.einsum("...i,...o->io", x_, ct_, preferred_element_type=jnp.float32)  # [in', out']
    for dim in (0, 1):
      partial = reduce_scatter(partial, scatter[dim], dim, grad)
    return all_reduce(partial, rest, grad)[0]

  return jax.shard_map(local, mesh=in_context(mesh), in_specs=(x_spec, ct_spec), out_specs=k_spec)(x, ct)


def matmul(x: jax.Array, kernel: jax.Array, kernel_names: tuple, grad: GradReduce) -> jax.Array:
  """x [..., in] @ kernel [in, out], with the kernel's gradient reduced by `weight_grad` on grad.mesh
  (the input's gradient and the forward are the partitioner's, as without it)."""

  @jax.custom_vjp
  def product(x, kernel):
    return jnp.einsum("...i,io->...o", x, kernel)

  def forward(x, kernel):
    return product(x, kernel), (x, kernel)

  def backward(saved, ct):
    x, kernel = saved
    dx = jnp.einsum("...o,io->...i", ct, kernel).astype(x.dtype)
    dk = weight_grad(x, ct, kernel.shape, kernel_names, grad=grad, mesh=grad.mesh, rules=grad.rules)
    return dx, dk.astype(kernel.dtype)

  product.defvjp(forward, backward)
  return product(x, kernel)


# ---------------------------------------------------------------------------------------------
# A weight gathered inside shard_map (the experts: model/moe_local.py, model/expert_parallel.py).


def _vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def gather_for_use(w_: jax.Array, gather_axes: Sequence[str] | None, dim: int, vary_axes: Sequence[str],
                   grad: GradReduce) -> jax.Array:
  """Inside shard_map: w_ all-gathered over `gather_axes` along `dim` (FSDP's gather before use) and
  marked varying over `vary_axes` (the axes whose devices hold other rows). Its cotangent, each
  device's partial sum over the rows it saw, goes back by `reduce_scatter` over `gather_axes` and
  `all_reduce` over the other `vary_axes`, in grad.dtype: the reductions the transposes of the gather
  and of the varying cast would make in the gradient's own dtype."""
  gather_axes = tuple(gather_axes or ())
  vary_axes = tuple(vary_axes)
  rest = tuple(a for a in vary_axes if a not in gather_axes)

  @jax.custom_vjp
  def use(w_):
    full = jax.lax.all_gather(w_, gather_axes, axis=dim, tiled=True) if gather_axes else w_
    return _vary(full, vary_axes)

  def forward(w_):
    return use(w_), None

  def backward(_, ct):
    reduced = reduce_scatter(ct, gather_axes, dim, grad)
    return (all_reduce(reduced, rest, grad)[0].astype(ct.dtype),)

  use.defvjp(forward, backward)
  return use(w_)
