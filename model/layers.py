"""Building blocks: RMSNorm, rotary position embeddings with long-context scaling, embeddings, SwiGLU.

Axis legend: B batch, T length, N heads, H head dim, D embed, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.model.params import param
from meshrl.sharding import compress


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32 (as Qwen3 and DeepSeek-V3 do)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, axes=("embed",), param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    del rngs
    self.eps = eps
    self.scale = param(None, (dim,), axes, std=None, dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# Rotary position embeddings.


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """How positions rotate queries and keys.

  scaling: "none", "linear" (positions divided by `factor`) or "yarn" (Peng et al. 2023, "YaRN:
  Efficient Context Window Extension of Large Language Models": interpolate low frequencies, keep
  high ones, ramp between `beta_slow` and `beta_fast` rotations over `original_max_len`).
  interleave: rotate pairs (x0, x1), (x2, x3), ... (DeepSeek's layout) instead of halves.
  """
  head_dim: int
  theta: float = 10000.0
  scaling: str = "none"
  factor: float = 1.0
  original_max_len: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  interleave: bool = False

  def __post_init__(self):
    if self.scaling not in ("none", "linear", "yarn"):
      raise ValueError(f"rope scaling={self.scaling!r}; choose one of none, linear, yarn.")
    if self.head_dim % 2:
      raise ValueError(f"rope head_dim={self.head_dim} must be even.")
    if self.scaling != "none" and self.factor < 1.0:
      raise ValueError(f"rope factor={self.factor} must be at least 1 for {self.scaling} scaling.")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inverse_frequencies(rope: RopeConfig) -> tuple[jax.Array, float]:
  """Returns (inverse frequencies [H/2], cos/sin magnitude) for the scaling method."""
  dim = rope.head_dim
  exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  inv_freq = 1.0 / (rope.theta ** exponents)
  if rope.scaling == "none":
    return inv_freq, 1.0
  if rope.scaling == "linear":
    return inv_freq / rope.factor, 1.0
  # YaRN: a ramp over the dimension index between the dims that make beta_fast and beta_slow
  # full rotations within the original context.
  def dim_for_rotations(rotations):
    return dim * math.log(rope.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
  low = max(math.floor(dim_for_rotations(rope.beta_fast)), 0)
  high = min(math.ceil(dim_for_rotations(rope.beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp  # 1 where the frequency is high enough to keep (extrapolate)
  inv_freq = (inv_freq / rope.factor) * (1.0 - keep) + inv_freq * keep
  if rope.mscale_all_dim:
    magnitude = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
  else:
    magnitude = _yarn_mscale(rope.factor)
  return inv_freq, magnitude


def yarn_softmax_scale_multiplier(rope: RopeConfig) -> float:
  """DeepSeek's extra softmax-scale factor mscale(factor, mscale_all_dim)^2 (1 when unused)."""
  if rope.scaling != "yarn" or not rope.mscale_all_dim:
    return 1.0
  return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
  """Rotates x [B, T, N, H] by positions [B, T]; the output keeps halves layout (x1 | x2 rotated)."""
  inv_freq, magnitude = rope_inverse_frequencies(rope)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = (jnp.cos(angles) * magnitude)[:, :, None, :]  # [B, T, 1, H/2]
  sin = (jnp.sin(angles) * magnitude)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  if rope.interleave:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
  else:
    x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# Embedding and MLP.


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` projects hidden states back to vocabulary logits."""

  def __init__(self, vocab_size: int, embed_dim: int, *, std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = param(rngs.params(), (vocab_size, embed_dim), ("vocab", "embed"), std=std,
                           dtype=param_dtype)

  def __call__(self, tokens: jax.Array, constrain=None) -> jax.Array:
    """tokens [B, T] int -> [B, T, D].

    constrain: `KernelConfig.constrain` (or None: no mesh). The table [V, D] is stored (`vocab`,
    `embed`), D split over `fsdp`; a gather straight from it would have to turn embed-split rows into
    batch-split ones, which XLA's partitioner does by an involuntary full rematerialisation. So the
    table is first gathered over `embed` (the all-gather FSDP does for every weight before use) and
    stays split over `vocab` only: a vocab-parallel lookup, masked locally and summed.
    """
    table = self.embedding[...]
    if constrain is not None:
      table = constrain(table, ("vocab", None))  # [V, D], vocab split only
    return jnp.take(table, tokens, axis=0).astype(self.dtype)

  def attend(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V] with the embedding as the output projection."""
    return jnp.einsum("btd,vd->btv", hidden, self.embedding[...].astype(self.dtype))


class Dense(nnx.Module):
  """y = x @ W with named axes; W is [in, out].

  merge_leading: merge x's leading axes into one for the matmul (ModelConfig.merge_dense_axes: on
  CPU when the mesh does not split the sequence). The weight gradient is then a plain
  [N, in]^T [N, out] product, which XLA:CPU computes from the arrays as they lie; as one contraction
  over several leading axes ("...i,io->...o") its backward first copied x and the output gradient
  into transposed layouts (scripts/bench_model.py's training step: 1.05-1.10x faster merged, in
  alternating runs in one process). A TPU compile of a sequence-split batch gathered more with the
  axes merged, so elsewhere the contraction stays.
  """

  def __init__(self, in_dim: int, out_dim: int, axes, *, std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, merge_leading: bool = False,
               grad_reduce: compress.GradReduce | None = None, rngs: nnx.Rngs):
    self.dtype, self.merge_leading = dtype, merge_leading
    self.kernel_axes, self.grad_reduce = tuple(axes), grad_reduce
    self.kernel = param(rngs.params(), (in_dim, out_dim), axes, std=std, dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., in] -> [..., out], split as x is (the leading axes) and as W's `out` axis is. With
    `grad_reduce` (optim.grad_collective_dtype) the kernel's gradient is reduced over the devices' rows
    explicitly, in its wire dtype (sharding/compress.py `matmul`)."""
    kernel = self.kernel[...].astype(self.dtype)
    if self.grad_reduce is not None and self.grad_reduce.mesh is not None:
      return compress.matmul(x.astype(self.dtype), kernel, self.kernel_axes, self.grad_reduce)
    if not self.merge_leading:
      return jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel)
    y = jnp.dot(x.reshape(-1, x.shape[-1]).astype(self.dtype), kernel)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class SwiGLU(nnx.Module):
  """Dense gated MLP: down(silu(gate(x)) * up(x)); x [B, T, D] -> [B, T, D], hidden F on `mlp`."""

  def __init__(self, embed_dim: int, mlp_dim: int, *, std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, merge_leading: bool = False,
               grad_reduce: compress.GradReduce | None = None, rngs: nnx.Rngs):
    kw = dict(std=std, dtype=dtype, param_dtype=param_dtype, merge_leading=merge_leading,
              grad_reduce=grad_reduce, rngs=rngs)
    self.gate = Dense(embed_dim, mlp_dim, ("embed", "mlp"), **kw)
    self.up = Dense(embed_dim, mlp_dim, ("embed", "mlp"), **kw)
    self.down = Dense(mlp_dim, embed_dim, ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
