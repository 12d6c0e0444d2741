"""The decoder: sharded equals unsharded, KV-cache decode equals the full forward, bad input."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model, parameter_counts
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import make_mesh, traffic

TINY = ["model.num_layers=3", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=128",
        "moe.expert_mlp_dim=32", "moe.num_experts=4", "moe.first_k_dense=1", "model.max_seq_len=32"]
MLA = ["model.attention_type=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12",
       "moe.num_shared_experts=1", "moe.score_func=sigmoid", "model.rope_interleave=true"]


def _cfg(*extra):
  return configs.load("configs/tiny.py", TINY + list(extra))


def _tokens(batch=8, length=12, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, 259, (batch, length)), jnp.int32)


def _forward(model, tokens, **kw):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, **kw).logits)(state, tokens)


@pytest.mark.parametrize("variant,mesh_sizes", [
    pytest.param("gqa", dict(fsdp=8), marks=pytest.mark.slow),  # fsdp alone: within the next one
    ("gqa", dict(fsdp=2, tensor=2, expert=2)),
    ("mla", dict(fsdp=1, expert=4, tensor=2))])
def test_sharded_forward_equals_unsharded(devices, variant, mesh_sizes):
  extra = MLA if variant == "mla" else ["model.qk_norm=true"]
  overrides = [f"mesh.{axis}={size}" for axis, size in mesh_sizes.items()]
  cfg = _cfg(*extra, *overrides)
  tokens = _tokens()
  reference = _forward(build_model(ModelConfig.from_config(cfg)), tokens)
  mesh = make_mesh(cfg.mesh)
  sharded_model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  kernel = sharded_model.embed.embedding[...]
  assert len({s.device for s in kernel.addressable_shards}) == 8
  sharded = _forward(sharded_model, tokens)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), atol=1e-5, rtol=0)


# GQA's cache decode runs in every generation test; the slow run checks it here too (suite budget).
@pytest.mark.parametrize("variant", [pytest.param("gqa", marks=pytest.mark.slow), "mla"])
def test_cache_decode_equals_full_forward(variant):
  cfg = _cfg(*(MLA if variant == "mla" else []))
  model = build_model(ModelConfig.from_config(cfg))
  tokens = _tokens(batch=2, length=10)
  full = model(tokens).logits
  out = model(tokens[:, :4], cache=model.init_cache(2, 16))
  steps, cache = [out.logits], out.cache
  for t in range(4, 10):
    out = model(tokens[:, t:t + 1], cache=cache)
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=1e-5)
  assert int(cache.index) == 10


@pytest.mark.parametrize("row_index,layers", [
    (True, "scan"), pytest.param(True, "unrolled", marks=pytest.mark.slow),
    pytest.param(False, "loop", marks=pytest.mark.slow)])  # the last: ~10 s more
def test_decode_writes_each_layer_slot_like_a_prefill(row_index, layers):
  """Token by token, each layer's cache ends equal to one prefill of the whole sequence (a write at
  the wrong slot or layer, or a step that attends over a stale layer, breaks it), and each step's
  logits equal the full forward; row_index: the continuous engine's per-row write index [B], the
  decode steps' positions left to the model (from each row's index); layers: scanned, unrolled on
  per-layer weights and caches (`layer_weights`, kv_cache.unstack: the decode loops' CPU path), or
  model.scan_layers=false."""
  scan = layers != "loop"
  model = build_model(ModelConfig.from_config(_cfg("moe.first_k_dense=0",  # one stack of 3 layers
                                                   f"model.scan_layers={str(scan).lower()}")))
  tokens = _tokens(batch=2, length=9, seed=1)
  graphdef, state = nnx.split(model)
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  step = jax.jit(lambda s, t, p, c: (lambda o: (o.logits, o.cache))(nnx.merge(graphdef, s)(
      t, positions=p, cache=c)))
  whole_logits, whole = step(state, tokens, positions, model.init_cache(2, 12))
  logits, cache = step(state, tokens[:, :3], positions[:, :3], model.init_cache(2, 12))
  if row_index:
    cache = kvc.with_row_index(cache)
  if layers == "unrolled":
    weights = jax.jit(lambda s: nnx.merge(graphdef, s).layer_weights())(state)
    step = jax.jit(lambda s, t, p, c: (lambda o: (o.logits, o.cache))(nnx.merge(graphdef, s)(
        t, positions=p, cache=c, layer_weights=weights)))
    with pytest.raises(ValueError, match="kv_cache.unstack"):
      step(state, tokens[:, 3:4], positions[:, 3:4], cache)  # weights per layer, cache stacked
    cache = kvc.unstack(cache)
  steps = [logits]
  for t in range(3, 9):
    logits, cache = step(state, tokens[:, t:t + 1], None if row_index else positions[:, t:t + 1], cache)
    steps.append(logits)
  if layers == "unrolled":
    cache = kvc.stack(cache)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(whole_logits), atol=1e-5)
  for name, entry in cache.layers["moe"].items():
    assert entry.shape[0] == 3
    np.testing.assert_allclose(np.asarray(entry), np.asarray(whole.layers["moe"][name]), atol=1e-5,
                               err_msg=name)
  np.testing.assert_array_equal(np.asarray(cache.positions), np.asarray(whole.positions))
  np.testing.assert_array_equal(np.asarray(cache.index), np.full(cache.index.shape, 9))


def _ops_of_size(hlo: str, size: int) -> list[str]:
  """The optimised program's instructions ('name opcode') whose result has `size` elements."""
  found = []
  for line in hlo.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\{[\d,]*\} ([\w\-]+)\(", line)
    if match and math.prod(int(n) for n in match.group(2).split(",") if n) == size:
      found.append(f"{match.group(1)} {match.group(3)}")
  return found


def _transposes(hlo: str, size: int) -> list[str]:
  """The optimised program's transposes (plain, or fusions named after them) of arrays with `size`
  elements. (Plain copies are left out: a step that writes a cache it was not donated copies it.)"""
  return [op for op in _ops_of_size(hlo, size)
          if op.endswith(" transpose") or (op.startswith("transpose") and op.endswith(" fusion"))]


@pytest.mark.parametrize("cache_dtype", ["model", "int8"])
def test_decode_step_reads_the_per_layer_cache_without_copying_it(cache_dtype):
  """A decode step on the per-layer form (kv_cache.unstack: keys [B, K, H, S], values [B, K, S, H])
  holds no transposed copy of a layer's keys or values; the same step on the token-major form does
  (the dots read the cache in the per-layer form's layouts). The step's logits agree."""
  model = build_model(ModelConfig.from_config(_cfg("moe.first_k_dense=0", "model.num_kv_heads=2",
                                                   f"rl.kv_cache_dtype={cache_dtype}")))
  graphdef, state = nnx.split(model)
  tokens = _tokens(batch=4, length=6, seed=3)
  cache = model(tokens[:, :5], cache=model.init_cache(4, 24)).cache
  weights = jax.jit(lambda s: nnx.merge(graphdef, s).layer_weights())(state)
  per_layer = jax.jit(lambda s, c: nnx.merge(graphdef, s)(tokens[:, 5:], cache=c, layer_weights=weights).logits)
  stacked = jax.jit(lambda s, c: nnx.merge(graphdef, s)(tokens[:, 5:], cache=c).logits)
  entry = cache.layers["moe"]["k"]  # [L, B, S, K, H]
  size = math.prod(entry.shape[1:])
  hlo = {name: fn.lower(state, c).compile().as_text() for name, fn, c in (
      ("per_layer", per_layer, kvc.unstack(cache)), ("stacked", stacked, cache))}
  assert _transposes(hlo["stacked"], size), "no transpose found in the token-major decode step"
  assert not _transposes(hlo["per_layer"], size), _transposes(hlo["per_layer"], size)
  assert kvc.unstack(cache).layers["moe"][0]["k"].shape == (4, 2, 16, 24)  # [B, K, H, S]
  np.testing.assert_allclose(np.asarray(per_layer(state, kvc.unstack(cache))),
                             np.asarray(stacked(state, cache)), atol=1e-5)


def test_per_row_decode_writes_the_cache_in_place():
  """A decode step with per-row write indices (the engine's slots) writes each row's new column
  into the cache in place (a scatter, or the dynamic-update-slices XLA makes of one): the program
  holds no select (or fusion of one) over a whole layer's entry, which would read and write all S
  columns to change one; the cache comes back as a prefill of the same tokens leaves it."""
  model = build_model(ModelConfig.from_config(_cfg("moe.first_k_dense=0", "model.num_kv_heads=2")))
  graphdef, state = nnx.split(model)
  tokens = _tokens(batch=4, length=6, seed=3)
  weights = jax.jit(lambda s: nnx.merge(graphdef, s).layer_weights())(state)
  prefix = kvc.unstack(kvc.with_row_index(model(tokens[:, :5], cache=model.init_cache(4, 24)).cache))
  step = jax.jit(lambda s, c: nnx.merge(graphdef, s)(tokens[:, 5:], cache=c, layer_weights=weights).cache,
                 donate_argnums=(1,))
  size = math.prod(prefix.layers["moe"][0]["k"].shape)
  ops = _ops_of_size(step.lower(state, prefix).compile().as_text(), size)
  in_place = [op for op in ops if "scatter" in op or "dynamic-update-slice" in op]
  assert in_place, ops
  assert not [op for op in ops if "select" in op and op not in in_place], ops
  whole = model(tokens, cache=model.init_cache(4, 24)).cache
  written = kvc.stack(step(state, prefix))
  for name, entry in written.layers["moe"].items():
    np.testing.assert_allclose(np.asarray(entry), np.asarray(whole.layers["moe"][name]), atol=1e-5,
                               err_msg=name)


def test_per_row_decode_write_adds_no_collective_on_a_mesh(devices):
  """On a mesh that splits the cache's rows (data), columns (sequence) and heads (tensor), a decode
  step writing at per-row indices communicates exactly what the step writing at one shared index
  does: the row-indexed write stays local to each device's part of the cache."""
  cfg = _cfg("moe.first_k_dense=0", "model.num_kv_heads=2", "mesh.data=2", "mesh.sequence=2", "mesh.tensor=2")
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, state = nnx.split(model)
  tokens = _tokens(batch=8, length=1, seed=4)

  def step(state, per_row):
    m = nnx.merge(graphdef, state)
    cache = m.init_cache(8, 32)
    weights, cache = m.decode_loop_inputs(kvc.with_row_index(cache) if per_row else cache)
    return m(tokens, cache=cache, layer_weights=weights).logits

  hlo = {per_row: jax.jit(step, static_argnums=1).lower(state, per_row).compile().as_text()
         for per_row in (True, False)}
  shared_index = traffic.collective_bytes(hlo[False])
  assert shared_index  # the mesh does split the step
  assert traffic.collective_bytes(hlo[True]) == shared_index


def test_dense_weight_gradient_reads_its_operands_as_they_lie():
  """The compiled backward of a Dense layer on [B, T, D] inputs with merge_leading (the CPU choice,
  ModelConfig.merge_dense_axes) holds no transposed copy of the input or of the output gradient; the
  contraction over both leading axes (merge_leading=False) does, which shows the check sees such
  copies. Same gradients."""
  from meshrl.model.layers import Dense  # pylint: disable=import-outside-toplevel
  x = jax.random.normal(jax.random.key(1), (4, 32, 64))
  sizes, hlo, grads = (x.size, 4 * 32 * 96), {}, {}
  for merge in (True, False):
    graphdef, weights = nnx.split(Dense(64, 96, ("embed", "mlp"), merge_leading=merge, rngs=nnx.Rngs(0)))
    loss = lambda w, x, graphdef=graphdef: jnp.sum(jnp.tanh(nnx.merge(graphdef, w)(x)))  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo[merge], grads[merge] = step.lower(weights, x).compile().as_text(), step(weights, x)
  assert any(_transposes(hlo[False], size) for size in sizes), "no transposed copy found"
  assert not any(_transposes(hlo[True], size) for size in sizes), [_transposes(hlo[True], s) for s in sizes]
  for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dense_layers_merge_axes_on_cpu_unless_the_sequence_is_split(devices):
  """ModelConfig.merge_dense_axes reaches every Dense layer of the model, GQA or MLA: on for a CPU
  mesh, off when the mesh splits the sequence (the merged axis would be resharded)."""
  from meshrl.model.layers import Dense  # pylint: disable=import-outside-toplevel
  for sequence, expected, attention in ((1, True, []), (2, False, []), (1, True, MLA), (2, False, MLA)):
    cfg = _cfg(f"mesh.fsdp={8 // sequence}", f"mesh.sequence={sequence}", "attention.impl=ring", *attention)
    mc = ModelConfig.from_config(cfg, make_mesh(cfg.mesh))
    assert mc.merge_dense_axes is expected
    model = nnx.eval_shape(lambda mc=mc: build_model(mc))
    flags = {path: module.merge_leading for path, module in nnx.iter_graph(model) if isinstance(module, Dense)}
    assert len(flags) > 8 and set(flags.values()) == {expected}, flags


def test_scan_and_loop_and_remat_agree():
  tokens = _tokens(batch=2)
  ref = build_model(ModelConfig.from_config(_cfg()))(tokens).logits
  for extra in (["model.scan_layers=false"], ["model.remat=full"], ["model.remat=save_attention"]):
    got = build_model(ModelConfig.from_config(_cfg(*extra)))(tokens).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)


def test_routing_replay_and_aux():
  model = build_model(ModelConfig.from_config(_cfg()))
  tokens = _tokens(batch=2)
  out = model(tokens)
  assert out.aux["routing"].shape == (2, 2, 12, 2)  # [L_moe, B, T, K]
  np.testing.assert_allclose(np.asarray(out.aux["expert_load"].sum(-1)), 1.0, atol=1e-6)
  replayed = model(tokens, routing=out.aux["routing"])
  np.testing.assert_allclose(np.asarray(replayed.logits), np.asarray(out.logits), atol=1e-6)


def test_parameter_counts_from_shapes():
  cfg = _cfg()
  counts = parameter_counts(ModelConfig.from_config(cfg))
  model = build_model(ModelConfig.from_config(cfg))
  actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert counts["total"] == actual
  # 2 MoE layers x 4 experts x 3 matrices of 64x32; half the experts are active per token.
  assert counts["total"] - counts["active_per_token"] == 2 * 2 * 3 * 64 * 32


def test_value_head_and_hidden():
  model = build_model(ModelConfig.from_config(_cfg("model.value_head=true")))
  out = model(_tokens(batch=2), return_hidden=True)
  assert out.logits is None and out.hidden.shape == (2, 12, 64) and out.values.shape == (2, 12)


def test_bad_input_errors():
  with pytest.raises(ValueError, match="num_heads=4 is not divisible by model.num_kv_heads=3"):
    ModelConfig.from_config(_cfg("model.num_kv_heads=3"))
  with pytest.raises(ValueError, match="num_experts_per_tok=5 is larger than moe.num_experts=4"):
    ModelConfig.from_config(_cfg("moe.num_experts_per_tok=5"))
  model = build_model(ModelConfig.from_config(_cfg()))
  with pytest.raises(ValueError, match="40 tokens is longer than model.max_seq_len=32"):
    model(_tokens(batch=1, length=40))
  cfg = _cfg("mesh.expert=8", "mesh.fsdp=1", "moe.num_experts=4")
  mesh = make_mesh(cfg.mesh)
  with pytest.raises(ValueError, match="(?i)expert"):
    build_model(ModelConfig.from_config(cfg, mesh), mesh)


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_uncached_self_attention_scores_query_halves(monkeypatch, variant):
  """The reference kernel's uncached self-attention of at least REFERENCE_SPLIT_MIN_LEN tokens (the
  update's and log-probs' forward) takes the split path (two query halves, attention.KernelConfig):
  the model's logits on packed rows equal those of one whole block, in fewer compiled FLOPs."""
  from meshrl.model import attention  # pylint: disable=import-outside-toplevel
  cfg = _cfg("model.max_seq_len=128", *(MLA if variant == "mla" else []))
  model = build_model(ModelConfig.from_config(cfg))
  graphdef, state = nnx.split(model)
  length = attention.REFERENCE_SPLIT_MIN_LEN + 16
  tokens = _tokens(batch=2, length=length, seed=5)
  segments = jnp.asarray((np.arange(length)[None] >= np.array([[30], [50]])) + 1, jnp.int32)
  positions = jnp.asarray(np.where(np.arange(length)[None] >= np.array([[30], [50]]),
                                   np.arange(length)[None] - np.array([[30], [50]]), np.arange(length)[None]),
                          jnp.int32)
  results = {}
  for name, threshold in (("split", attention.REFERENCE_SPLIT_MIN_LEN), ("whole", 10**9)):
    monkeypatch.setattr(attention, "REFERENCE_SPLIT_MIN_LEN", threshold)
    fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, positions=positions, segment_ids=segments).logits)
    results[name] = (fn(state, tokens), fn.lower(state, tokens).compile().cost_analysis()["flops"])
  np.testing.assert_allclose(np.asarray(results["split"][0]), np.asarray(results["whole"][0]), atol=1e-5)
  assert results["split"][1] < results["whole"][1], (results["split"][1], results["whole"][1])
