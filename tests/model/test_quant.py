"""int8 generation (model/quant.py): the int8 KV cache against the float cache (values within half a
quantisation step, decode logits close, a planted wrong scale far off), its bytes, the engine on it;
int8 weights per output channel (experts included), generation on them, their argument bytes and
sharding; bad options."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from meshrl import configs
from meshrl.model import kv_cache as kvc
from meshrl.model import quant
from meshrl.model.params import state_shardings
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.generation.quality import int8_quality
from meshrl.rl.step.spec import make_generator, rollout_model_config
from meshrl.sharding import make_mesh
from meshrl.sharding.rules import logical_to_spec, rules_from_config

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "model.max_seq_len=24", "model.init_std=0.1",
         "rl.max_prompt_len=8", "rl.max_new_tokens=8"]
MLA = ["model.attention_type=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12"]
DENSE = ("moe.num_experts=0", "model.num_layers=1")  # the cache tests need no experts: cheaper to compile
PREFILL, DECODE = 8, 3


def _cfg(*extra):
  return configs.load("configs/tiny.py", SMALL + list(extra))


@functools.lru_cache(maxsize=None)
def _model(*extra):
  """(cfg, model, graphdef, params, rest) of a small model, built once per test session."""
  cfg = _cfg(*extra)
  make = lambda: Transformer(ModelConfig.from_config(cfg), rngs=nnx.Rngs(0))  # noqa: E731
  graphdef, _, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
  params, rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[1:])()  # one compiled init
  return cfg, nnx.merge(graphdef, params, rest), graphdef, params, rest


def _tokens(batch, length, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(3, 259, (batch, length)), jnp.int32)


def _step_fn(graphdef, params, rest):
  """Jitted forward(tokens [B, T], cache) -> (logits [B, T, V], cache): prefill (T > 1) or decode."""
  @jax.jit
  def forward(tokens, cache):
    out = nnx.merge(graphdef, params, rest)(tokens, cache=cache)
    return out.logits, out.cache
  return forward


def _decode(forward, tokens, cache):
  """Logits [B, T, V] of decoding tokens [B, T] one by one into cache."""
  steps = []
  for t in range(tokens.shape[1]):
    logits, cache = forward(tokens[:, t:t + 1], cache)
    steps.append(logits)
  return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize("variant", ["gqa", pytest.param("mla", marks=pytest.mark.slow)])
def test_int8_cache_is_within_half_a_step_and_decodes_close_to_the_float_cache(variant):
  """The first layer's int8 entries are within scale / 2 of the float cache's (same inputs there);
  decode logits over an int8 cache are close to the float cache's, and a cache whose scales are
  applied along the wrong axis (kv heads swapped; MLA: slots reversed) or dropped is far off."""
  _, model, graphdef, params, rest = _model(*DENSE, *(MLA if variant == "mla" else []))
  shapes, batch = model.config.cache_entry_shapes(), 2
  tokens = _tokens(batch, PREFILL + DECODE)
  forward = _step_fn(graphdef, params, rest)
  decode = lambda cache: _decode(forward, tokens[:, PREFILL:], cache)  # noqa: E731
  _, float_cache = forward(tokens[:, :PREFILL], kvc.init_cache(shapes, batch, 16))
  _, int8_cache = forward(tokens[:, :PREFILL], kvc.init_cache(shapes, batch, 16, "int8"))

  names = ("latent", "k_rope") if variant == "mla" else ("k", "v")
  for name in names:
    layer8 = jax.tree.map(lambda a: a[0], int8_cache.layers["dense"])  # layer 0: identical inputs
    assert layer8[name].dtype == jnp.int8 and layer8[name + "_scale"].dtype == jnp.bfloat16
    got = np.asarray(kvc.read_entry(layer8, name, jnp.float32))[:, :PREFILL]
    want = np.asarray(float_cache.layers["dense"][name][0])[:, :PREFILL]
    half_step = np.asarray(layer8[name + "_scale"], np.float32)[:, :PREFILL, ..., None] / 2
    assert np.all(np.abs(got - want) <= half_step * (1 + 1e-6) + 1e-9), name
    assert np.abs(got - want).max() > 0  # really quantised

  reference = decode(float_cache)
  error = float(jnp.max(jnp.abs(decode(int8_cache) - reference)))
  spread = float(jnp.max(reference) - jnp.min(reference))
  assert 0 < error < 0.03 * spread, (error, spread)

  scale = names[0] + "_scale"
  wrong_axis = 3 if variant == "gqa" else 2  # [L, B, S, K]: swap kv heads; [L, B, S]: reverse slots
  planted = {s: dict(entries, **{scale: jnp.flip(entries[scale], axis=wrong_axis)})
             for s, entries in int8_cache.layers.items()}
  dropped = {s: dict(entries, **{scale: jnp.ones_like(entries[scale])})
             for s, entries in int8_cache.layers.items()}
  for layers in (planted, dropped):
    bad = float(jnp.max(jnp.abs(decode(int8_cache.replace(layers=layers)) - reference)))
    assert bad > 5 * error, (bad, error)


def test_int8_cache_bytes_are_about_half_of_bfloat16():
  """From the arrays: (H + 2) / (2 H) for GQA (int8 values + a bfloat16 scale per token and head),
  (R + Hr + 4) / (2 (R + Hr)) for MLA; 0.508 at H = 128."""
  def ratio(entries):
    shapes = {"dense": entries}
    int8 = jax.eval_shape(lambda: kvc.init_cache(shapes, 4, 64, "int8"))
    bf16 = jax.eval_shape(lambda: kvc.init_cache(shapes, 4, 64, jnp.bfloat16))
    assert {a.dtype for a in jax.tree.leaves(int8.layers)} == {jnp.dtype(jnp.int8), jnp.dtype(jnp.bfloat16)}
    return quant.kv_cache_bytes(int8) / quant.kv_cache_bytes(bf16)
  for head_dim in (32, 128):
    assert ratio({"k": (3, 2, head_dim), "v": (3, 2, head_dim)}) == pytest.approx((head_dim + 2) / (2 * head_dim))
  assert ratio({"latent": (3, 512), "k_rope": (3, 64)}) == pytest.approx((576 + 4) / (2 * 576))
  assert ratio({"k": (3, 8, 128), "v": (3, 8, 128)}) < 0.51


def _greedy(cfg, params, rest):
  tokens, mask = TOK.encode_batch(["1+2=", "rev abcd=", "x", "sort 9 1 5="], length=8, padding="left")
  return make_generator(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, temperature=0.0)(
      params, rest, tokens, mask, jax.random.key(3))


ENGINE = ("rl.engine=continuous", "rl.decode_slots=3")


def test_engine_on_an_int8_cache_agrees_greedily_with_the_float_engine():
  """Greedy, 4 prompts x G=2 on 3 slots (refills copy int8 rows with their scales): the int8 engine's
  tokens are the float engine's (but where a near-tie flips), log-probs close."""
  _, _, _, params, rest = _model(*DENSE)
  float_engine = _greedy(_cfg(*DENSE, *ENGINE, "rl.group_size=2"), params, rest)
  int8_engine = _greedy(_cfg(*DENSE, *ENGINE, "rl.group_size=2", "rl.kv_cache_dtype=int8"), params, rest)
  response = np.asarray(float_engine.response_mask)
  same = np.asarray(int8_engine.tokens)[response] == np.asarray(float_engine.tokens)[response]
  assert same.mean() >= 0.9, same.mean()
  first_rows = np.cumprod(np.asarray(int8_engine.tokens) == np.asarray(float_engine.tokens), axis=1).astype(bool)
  logprob_error = np.abs(np.asarray(int8_engine.logprobs) - np.asarray(float_engine.logprobs))[first_rows]
  assert logprob_error.max() < 0.02, logprob_error.max()  # where the two still agree token for token


@pytest.mark.slow
def test_static_rollout_on_an_int8_cache_equals_the_int8_engine():
  """The static rollout (a prompt's int8 cache repeated over its group) and the engine (int8 rows
  copied into slots) give exactly the same greedy samples."""
  _, _, _, params, rest = _model(*DENSE)
  static = _greedy(_cfg(*DENSE, "rl.group_size=2", "rl.kv_cache_dtype=int8"), params, rest)
  engine = _greedy(_cfg(*DENSE, *ENGINE, "rl.group_size=2", "rl.kv_cache_dtype=int8"), params, rest)
  np.testing.assert_array_equal(np.asarray(static.tokens), np.asarray(engine.tokens))
  np.testing.assert_allclose(np.asarray(static.logprobs), np.asarray(engine.logprobs), atol=1e-5)


def _expected_quantized(params) -> set:
  paths = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = tuple(str(getattr(k, "key", k)) for k in path)
    if names[0] in ("dense_stack", "moe_stack") and leaf.get_value().ndim >= 3 and names[-1] != "router":
      paths.add(names)
  return paths


def test_int8_weights_are_per_output_channel_experts_included():
  """Every matmul weight of the blocks (experts' gate/up/down per expert included) is int8 with one
  scale per output channel: each element within max|w[..., :, out]| / 254 of the original, every
  channel reaching 127. Router, embedding and norms stay full precision. A quantisation along the
  wrong axis breaks the bound."""
  _, _, _, params, _ = _model()
  qparams = jax.jit(quant.quantize_params)(params)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  flat = {tuple(str(getattr(k, "key", k)) for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(qparams, is_leaf=is_var)[0]}
  originals = {tuple(str(getattr(k, "key", k)) for k in path): v.get_value()
               for path, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]}
  quantized = {p for p, v in flat.items() if isinstance(v.get_value(), quant.QuantizedArray)}
  assert quantized == _expected_quantized(params)
  assert {("moe_stack", "mlp", name) for name in ("gate", "up", "down")} <= quantized
  assert not isinstance(flat[("moe_stack", "mlp", "router")].get_value(), quant.QuantizedArray)
  assert not isinstance(flat[("embed", "embedding")].get_value(), quant.QuantizedArray)

  def within_bound(w, q):
    w = np.asarray(w, np.float32)
    bound = np.abs(w).max(axis=-2, keepdims=True) / 254 * (1 + 1e-6) + 1e-12  # per output channel
    return bool(np.all(np.abs(np.asarray(quant.dequantize(q)) - w) <= bound))

  for path in quantized:
    q, w = flat[path].get_value(), originals[path]
    assert q.values.dtype == jnp.int8 and q.scale.shape == w.shape[:-2] + (1, w.shape[-1]), path
    assert within_bound(w, q), path
    np.testing.assert_array_equal(np.abs(np.asarray(q.values)).max(axis=-2), 127, err_msg=str(path))
  experts = originals[("moe_stack", "mlp", "down")]  # [L, E, F, D]
  assert not within_bound(experts, quant.absmax_quantize(experts, axis=-1))
  per_tensor = quant.absmax_quantize(experts.reshape(-1, 1), axis=0)
  assert not within_bound(experts, quant.QuantizedArray(per_tensor.values.reshape(experts.shape),
                                                         per_tensor.scale.reshape(1, 1, 1, 1)))


def test_generation_with_int8_weights_is_close_and_takes_int8_arguments():
  """Greedy rollouts on int8 weights match full precision's tokens and log-probs closely; the
  generation program's arguments are the int8 weights (+ scales): the weight bytes shrink to about a
  quarter of float32's, and the compiled program's arguments by that difference."""
  opts = ("rl.tis_level=token", "rl.group_size=2", "rl.max_new_tokens=6")
  _, _, _, params, rest = _model()
  tokens, mask = TOK.encode_batch(["1+2=", "rev abcd="], length=8, padding="left")
  key = jax.random.key(0)
  make = lambda *o: make_generator(_cfg(*opts, *o), None, stop_ids=(), pad_id=TOK.pad_id,  # noqa: E731
                                   temperature=0.0)
  full_rollout, int8_rollout = make(), make("rl.generation_weights=int8")
  qparams = int8_rollout.prepare(params)
  full_program = full_rollout.lower(params, rest, tokens, mask, key).compile()
  int8_program = int8_rollout.lower(params, rest, tokens, mask, key).compile()  # takes the int8 weights
  full, _ = full_program(params, rest, None, tokens, mask, key, None, 0)
  int8, _ = int8_program(qparams, rest, None, tokens, mask, key, None, 0)
  assert np.mean(np.asarray(full.tokens) == np.asarray(int8.tokens)) >= 0.9
  logprob_error = np.abs(np.asarray(int8.logprobs) - np.asarray(full.logprobs))
  assert 0 < logprob_error.max() < 0.3 and logprob_error.mean() < 0.05, logprob_error.max()

  quantized = _expected_quantized(params)
  stack_bytes = {"dense_stack": 0, "moe_stack": 0}  # one layer per stack here
  for path, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = tuple(str(getattr(k, "key", k)) for k in path)
    if names in quantized:
      stack_bytes[names[0]] += np.asarray(v.get_value()).nbytes
  weight_bytes = sum(stack_bytes.values())
  saved = quant.params_bytes(params) - quant.params_bytes(qparams)
  assert 0.70 * weight_bytes < saved < 0.75 * weight_bytes  # int8 values + one float32 scale per column
  full_memory, int8_memory = full_program.memory_analysis(), int8_program.memory_analysis()
  assert full_memory.argument_size_in_bytes - int8_memory.argument_size_in_bytes == saved
  # Dequantised per layer inside the loops: the int8 program's extra temporaries stay below the
  # quantised weights' full-precision bytes. Hoisted out of the decode loop (dequantize_layer without
  # its optimization barrier) they are all of them: 245,888 bytes extra against 245,760 of weights,
  # and 198,128 with the barrier. (Each MoE layer's dispatch, `ladder` or `blocks`, materialises the
  # layer's dequantised experts, so the margin is small in this one-layer-per-stack model; with more
  # layers XLA did not hoist even without the barrier.)
  assert int8_memory.temp_size_in_bytes - full_memory.temp_size_in_bytes < weight_bytes


def test_int8_weights_keep_the_parameter_sharding(devices):
  """On an 8-device mesh (fsdp=2 x expert=2 x tensor=2) the quantiser's int8 values lie as the weight
  they replace, and each scale as its output channels (input axis whole). Read from the jitted
  quantiser's output shardings (abstract: nothing is compiled)."""
  del devices
  cfg = _cfg("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
  mesh, rules = make_mesh(cfg.mesh), rules_from_config(cfg.mesh)
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(ModelConfig.from_config(cfg, mesh), rngs=nnx.Rngs(0))),
                       nnx.Param)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  abstract = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
                          abstract, state_shardings(abstract, mesh, rules), is_leaf=is_var)
  qparams = jax.eval_shape(quant.make_weight_quantizer(abstract, mesh, rules), abstract)
  originals = dict(jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_var)[0])
  checked = set()
  for path, variable in jax.tree_util.tree_flatten_with_path(qparams, is_leaf=is_var)[0]:
    q = variable.get_value()
    if not isinstance(q, quant.QuantizedArray):
      continue
    weight = originals[path].get_value()
    assert q.values.sharding.is_equivalent_to(weight.sharding, weight.ndim), path
    axes = tuple(variable.get_metadata()["axes"])
    spec = logical_to_spec(axes[:-2] + (None,) + axes[-1:], rules, mesh, shape=q.scale.shape)
    assert q.scale.sharding.is_equivalent_to(NamedSharding(mesh, spec), q.scale.ndim), path
    checked |= {axis for axis in jax.tree.leaves(tuple(q.scale.sharding.spec)) if axis}
  assert checked == {"expert", "tensor", "fsdp"}  # experts, mlp/heads and embed output channels


def test_bad_generation_options_are_rejected():
  with pytest.raises(ValueError, match="rl.tis_level"):
    rollout_model_config(_cfg("rl.generation_weights=int8"), None)
  with pytest.raises(ValueError, match="rl.kv_cache_dtype='fp8'"):
    rollout_model_config(_cfg("rl.kv_cache_dtype=fp8"), None)
  with pytest.raises(ValueError, match="rl.generation_weights='int4'"):
    rollout_model_config(_cfg("rl.generation_weights=int4", "rl.tis_level=token"), None)
  with pytest.raises(ValueError, match="rl.kv_cache_dtype"):
    dataclasses.replace(ModelConfig.from_config(_cfg()), kv_cache_dtype="int4")
  mc = rollout_model_config(_cfg("rl.kv_cache_dtype=int8", "rl.generation_weights=int8", "rl.tis_level=token"),
                            None)
  assert mc.kv_cache_dtype == "int8"


@pytest.mark.slow
def test_quality_report_measures_every_variant():
  """int8_quality's keys (scripts/quant_report.py writes them): agreements are fractions, errors are
  positive and below the logits' spread, the cache ratio is the bfloat16 one from the arrays."""
  cfg, _, _, params, rest = _model()
  report = int8_quality(ModelConfig.from_config(cfg), params, rest, _tokens(2, 6), new_tokens=24)
  assert set(report) == {"int8_kv_greedy_agreement", "int8_kv_max_logit_err", "int8_kv_cache_bytes_ratio",
                         "int8_weights_greedy_agreement", "int8_weights_max_logit_err",
                         "int8_all_greedy_agreement"}
  for name in ("int8_kv_greedy_agreement", "int8_weights_greedy_agreement", "int8_all_greedy_agreement"):
    assert 0.5 <= report[name] <= 1.0, (name, report[name])
  assert 0 < report["int8_kv_max_logit_err"] < 1 and 0 < report["int8_weights_max_logit_err"] < 1
  assert report["int8_kv_cache_bytes_ratio"] == pytest.approx((16 + 2) / 32)  # head_dim 16
