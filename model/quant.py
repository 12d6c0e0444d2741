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
`make_weight_quantizer` derives the int8 copy from them for each rollout (rl/rollout.py). Behaviour
and training numerics then differ, so rl.generation_weights = "int8" requires rl.tis_level != "none"
(the update's truncated importance correction, rl/losses.py, covers the mismatch).

`quality_report` measures what the int8 paths cost against full precision (scripts/bench_speed.py).

Axis legend: L layers, E experts, B batch, S cache length, K kv heads, H head dim, P prompts,
N new tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
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


# ---------------------------------------------------------------------------------------------
# Quality against full precision.


def kv_cache_bytes(cache) -> int:
  """Bytes of a KVCache's per-token entries (values and, for int8, their scales); arrays or shapes."""
  return params_bytes(cache.layers)


def _model_for(cfg, max_len: int, kv_cache_dtype: str):
  """(graphdef, abstract params, abstract extra, ModelConfig) of cfg's model on one device, its
  max_seq_len raised to max_len (positions are rotary: no parameter depends on the length)."""
  from meshrl.model.transformer import ModelConfig, Transformer  # pylint: disable=import-outside-toplevel
  mc = ModelConfig.from_config(cfg)
  mc = dataclasses.replace(mc, max_seq_len=max(mc.max_seq_len, max_len), kv_cache_dtype=kv_cache_dtype)
  graphdef, params, extra = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))),
                                      nnx.Param, ...)
  return graphdef, params, extra, mc


def greedy_generate(model, prompts: jax.Array, new_tokens: int) -> tuple[jax.Array, Any]:
  """Greedy continuation of unpadded prompts [P, Lp] by `new_tokens` tokens (pure; jit it).

  Returns (tokens [P, N] int32, the final cache). No stop tokens: every row runs N tokens."""
  num, prompt_len = prompts.shape
  prefill = model(prompts, cache=model.init_cache(num, prompt_len + new_tokens))

  def step(carry, _):
    cache, logits = carry
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [P]
    out = model(token[:, None], cache=cache)
    return (out.cache, out.logits[:, 0]), token

  (cache, _), tokens = jax.lax.scan(step, (prefill.cache, prefill.logits[:, -1]), None, length=new_tokens)
  return tokens.T, cache


def quality_report(cfg, params, prompts, *, new_tokens: int = 256, extra=None) -> dict:
  """What int8 generation costs against full precision, on one device.

  Args:
    cfg: the run config (its model section; rl.* quantisation options are not read: every variant
      is measured).
    params: the model's nnx.Param State (full precision, e.g. the train state's `params`).
    prompts: [P, Lp] int token ids, no padding (every row a real prompt of Lp tokens).
    new_tokens: N, greedy tokens generated per prompt.
    extra: the non-Param state (MoE RouterBias); None: zeros.

  Returns a dict of floats:
    int8_kv_greedy_agreement       fraction of the P x N greedy tokens equal to full precision's,
                                   position by position (a divergence counts every token after it)
    int8_kv_max_logit_err          max |logit - full-precision logit| teacher-forced over prompt +
                                   the full-precision greedy continuation (the int8 cache is
                                   read by every position's attention)
    int8_kv_cache_bytes_ratio      bytes of the int8 cache (values + scales) / a bfloat16 cache's
    int8_weights_greedy_agreement, int8_weights_max_logit_err   the same for int8 weights
    int8_all_greedy_agreement      int8 weights and int8 cache together
  """
  prompts = jnp.asarray(prompts, jnp.int32)
  total = prompts.shape[1] + new_tokens
  graphdef, abstract_params, abstract_extra, mc = _model_for(cfg, total, "model")
  graphdef_q8, _, _, _ = _model_for(cfg, total, "int8")
  if extra is None:
    extra = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_extra)
  qparams = jax.jit(quantize_params)(params)

  def generate(p, int8_cache: bool):
    return greedy_generate(nnx.merge(graphdef_q8 if int8_cache else graphdef, p, extra), prompts,
                           new_tokens)

  def teacher_forced(p, sequence, int8_cache: bool):
    model = nnx.merge(graphdef_q8 if int8_cache else graphdef, p, extra)
    return model(sequence, cache=model.init_cache(sequence.shape[0], sequence.shape[1])).logits

  generate = jax.jit(generate, static_argnums=1)
  teacher_forced = jax.jit(teacher_forced, static_argnums=2)

  reference, _ = generate(params, False)
  sequence = jnp.concatenate([prompts, reference], axis=1)
  reference_logits = teacher_forced(params, sequence, False)
  agreement = lambda tokens: float(jnp.mean(tokens == reference))  # noqa: E731
  max_err = lambda logits: float(jnp.max(jnp.abs(logits - reference_logits)))  # noqa: E731

  kv_tokens, kv_cache = generate(params, True)
  w_tokens, _ = generate(qparams, False)
  all_tokens, _ = generate(qparams, True)
  from meshrl.model import kv_cache as kvc  # pylint: disable=import-outside-toplevel
  bf16_cache = jax.eval_shape(lambda: kvc.init_cache(mc.cache_entry_shapes(), prompts.shape[0], total,
                                                     jnp.bfloat16))
  return {
      "int8_kv_greedy_agreement": agreement(kv_tokens),
      "int8_kv_max_logit_err": max_err(teacher_forced(params, sequence, True)),
      "int8_kv_cache_bytes_ratio": kv_cache_bytes(kv_cache) / kv_cache_bytes(bf16_cache),
      "int8_weights_greedy_agreement": agreement(w_tokens),
      "int8_weights_max_logit_err": max_err(teacher_forced(qparams, sequence, False)),
      "int8_all_greedy_agreement": agreement(all_tokens),
  }
