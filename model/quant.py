"""int8 quantisation for generation: the KV cache and the layers' matmul weights.

Both are symmetric absmax quantisation, int8 values in [-127, 127] times a scale:
  KV cache  per token and kv head: scale = max|x| / 127 over head_dim, for each (layer, row, slot,
            kv head); MLA's "latent" and "k_rope" entries get one scale per token. Scales are bfloat16
            rounded up (so no value exceeds 127 steps), stored beside the values (model/kv_cache.py):
            (H + 2) / (2 H) of a bfloat16 cache's bytes, 0.516 for H = 128, 0.531 for H = 32.
            Per-token scales as in ZeroQuant (Yao et al. 2022, arXiv:2206.01861).
  weights   per output channel: every matmul weight of the scanned blocks, [..., in, out] (attention
            projections, dense SwiGLU, the MoE experts' gate/up/down per expert, shared experts) gets
            scale = max|w| / 127 over its input axis, float32 (LLM.int8's vector-wise absmax, Dettmers
            et al. 2022, arXiv:2208.07339, without the outlier decomposition). Full precision stays
            for the embedding (and the LM head tied to it, or untied), the value head, the MoE router
            (tiny, and its top-k is discrete: a flipped expert changes a whole token's path) and the
            norms. The scanned layer body dequantises its own layer's weights (model/transformer.py
            `_run_stack`), so no more than one layer's full-precision weights exist at once.

Training never sees any of this: the train state keeps full-precision parameters, and
`make_weight_quantizer` derives the int8 copy from them for each rollout (rl/generation/core.py). Behaviour
and training numerics then differ, so rl.generation_weights = "int8" requires rl.tis_level != "none"
(the update's truncated importance correction, rl/algo/losses.py, covers the mismatch).

rl/generation/quality.py measures what the int8 paths cost against full precision (scripts/quant_report.py).

Axis legend: L layers, E experts, B batch, S cache length, K kv heads, H head dim, P prompts,
N new tokens, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from meshrl.sharding.rules import TRAIN_RULES, Rules, logical_to_spec

KV_CACHE_DTYPES = ("model", "int8")
GENERATION_WEIGHTS = ("full", "int8")
_QUANTIZED_STACKS = ("dense_stack", "moe_stack")
_FULL_PRECISION = ("router",)  # matmul weights in the stacks that stay full precision (see above)


@struct.dataclass
class QuantizedArray:
  """An int8 array and its scale: value ~= values * scale (scale broadcasts against values)."""
  values: jax.Array  # int8, the original shape
  scale: jax.Array  # float, the original shape with the reduced axis of size 1

  @property
  def shape(self):
    return self.values.shape

  @property
  def ndim(self):
    return self.values.ndim


def absmax_quantize(x: jax.Array, axis: int = -1, scale_dtype=jnp.float32) -> QuantizedArray:
  """Symmetric int8 quantisation of x with one scale per slice along `axis` (kept, size 1).

  A scale stored in a narrower dtype than float32 is rounded up first (x 1 + 2^-7 covers bfloat16's
  rounding), so |x| / scale <= 127 and the error of every element is at most scale / 2.
  """
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=axis, keepdims=True) / 127.0
  if jnp.dtype(scale_dtype) != jnp.float32:
    scale = scale * (1.0 + 2.0 ** -7)
  scale = scale.astype(scale_dtype)
  scale32 = scale.astype(jnp.float32)
  steps = jnp.where(scale32 > 0, x32 / jnp.where(scale32 > 0, scale32, 1.0), 0.0)
  values = jnp.clip(jnp.round(steps), -127, 127).astype(jnp.int8)
  return QuantizedArray(values=values, scale=scale)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """values * scale in float32, cast to dtype."""
  return (q.values.astype(jnp.float32) * q.scale.astype(jnp.float32)).astype(dtype)


def check_generation_options(*, kv_cache_dtype: str, generation_weights: str, tis_level: str) -> None:
  """Raises ValueError naming the field for an unknown rl.kv_cache_dtype / rl.generation_weights, or
  int8 generation weights without an importance correction (rl.tis_level = "none")."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"rl.kv_cache_dtype={kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}.")
  if generation_weights not in GENERATION_WEIGHTS:
    raise ValueError(f"rl.generation_weights={generation_weights!r}; choose one of "
                     f"{', '.join(GENERATION_WEIGHTS)}.")
  if generation_weights == "int8" and tis_level == "none":
    raise ValueError("rl.generation_weights='int8' makes the behaviour policy differ from the trained one: "
                     "set rl.tis_level to 'token' or 'sequence' (now 'none') so the update corrects it.")


# ---------------------------------------------------------------------------------------------
# Weights.


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _path_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _quantizable(path, variable: nnx.Variable) -> bool:
  """A matmul weight [L, ..., in, out] of a scanned stack (norm scales are [L, D]; router excluded)."""
  names = _path_names(path)
  return (isinstance(variable, nnx.Param) and bool(names) and names[0] in _QUANTIZED_STACKS
          and names[-1] not in _FULL_PRECISION and len(jnp.shape(variable.get_value())) >= 3)


def quantize_params(params: Any) -> Any:
  """The params State with every generation matmul weight [L, ..., in, out] replaced by a
  QuantizedArray (int8 values [L, ..., in, out], float32 scale [L, ..., 1, out]: per output channel,
  per expert for [L, E, in, out] expert weights). Other leaves are returned as they are."""
  def one(path, variable):
    if not _is_variable(variable) or not _quantizable(path, variable):
      return variable
    return variable.replace(absmax_quantize(variable.get_value(), axis=-2))
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)


def is_quantized(state: Any) -> bool:
  """Whether any Variable of `state` holds a QuantizedArray (a static fact of the pytree)."""
  return any(isinstance(v.get_value(), QuantizedArray)
             for v in jax.tree.leaves(state, is_leaf=_is_variable) if _is_variable(v))


def dequantize_params(state: Any, dtype=jnp.float32) -> Any:
  """`state` with every QuantizedArray value turned back into an array of `dtype` (a no-op for a
  state without any)."""
  def one(variable):
    if _is_variable(variable) and isinstance(variable.get_value(), QuantizedArray):
      return variable.replace(dequantize(variable.get_value(), dtype))
    return variable
  return jax.tree.map(one, state, is_leaf=_is_variable)


def dequantize_layer(layer_state: Any, x: jax.Array, dtype=jnp.float32) -> tuple[Any, jax.Array]:
  """(layer_state dequantised, x) for the scanned layer body; x is the layer's input activation.

  The layer's int8 weights pass an optimization barrier together with x, so their dequantisation
  depends on the loop iteration: otherwise XLA hoists it (loop-invariant) out of the decode loop and
  keeps every layer's full-precision weights alive at once (measured: the decode program's temp
  bytes grew by exactly the full-precision weight bytes). A state without QuantizedArrays passes
  untouched, so the full-precision program is unchanged.
  """
  if not is_quantized(layer_state):
    return layer_state, x
  layer_state, x = jax.lax.optimization_barrier((layer_state, x))
  return dequantize_params(layer_state, dtype), x


def quantized_shardings(abstract_qparams: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
  """Shardings for `quantize_params`' output: int8 values lie exactly as the full-precision weight
  (its logical axes), and each scale as the output channels it scales (the input axis, size 1, whole)."""
  def sharding(variable):
    axes = tuple(variable.get_metadata()["axes"])
    value = variable.get_value()
    if not isinstance(value, QuantizedArray):
      return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape=value.shape))
    scale_axes = axes[:-2] + (None,) + axes[-1:]
    return variable.replace(QuantizedArray(
        values=NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape=value.values.shape)),
        scale=NamedSharding(mesh, logical_to_spec(scale_axes, rules, mesh, shape=value.scale.shape))))
  return jax.tree.map(sharding, abstract_qparams, is_leaf=_is_variable)


def make_weight_quantizer(abstract_params: Any, mesh: Mesh | None,
                          rules: Rules = TRAIN_RULES) -> Callable[[Any], Any]:
  """A jitted `params -> quantize_params(params)` whose outputs land in `quantized_shardings` (on a
  mesh): the rollout's int8 weights are made from the train state's parameters on the devices."""
  if mesh is None:
    return jax.jit(quantize_params)
  abstract_q = jax.eval_shape(quantize_params, abstract_params)
  return jax.jit(quantize_params, out_shardings=quantized_shardings(abstract_q, mesh, rules))


def params_bytes(params: Any) -> int:
  """Bytes of every array in a params tree (int8 values and scales of quantised weights included)."""
  return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params)))


def kv_cache_bytes(cache) -> int:
  """Bytes of a KVCache's per-token entries (values and, for int8, their scales); arrays or shapes."""
  return params_bytes(cache.layers)
