"""MoE: routing matches a plain numpy reference, every dispatch agrees, balancing moves the load."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.moe import (MoE, RouterBias, expert_load, load_balancing_loss, route, top_k_indices,
                              router_z_loss, update_router_bias)
from meshrl.model.params import sharded_init
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import make_mesh

B, T, D, F, E, K = 8, 4, 16, 8, 8, 2

SOFTMAX = dict(score_func="softmax")
DEEPSEEK = dict(score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                num_shared_experts=2, shared_expert_mlp_dim=4, aux_free_bias=True)


def _mesh(expert):
  return make_mesh(ml_collections.ConfigDict(
      dict(data=1, fsdp=-1, expert=expert, sequence=1, tensor=1, num_slices=1)))


def _moe(mesh=None, **kw):
  """A tiny MoE with O(1) outputs, a router far from uniform, and a random bias."""
  moe = MoE(D, F, E, K, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  for i, name in enumerate(("router", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")):
    if (weight := getattr(moe, name)) is not None:
      fan_in = 1 if name == "router" else weight.shape[-2]
      weight[...] = jax.random.normal(jax.random.key(10 + i), weight.shape) / math.sqrt(fan_in)
  if moe.router_bias is not None:
    moe.router_bias[...] = 0.3 * jax.random.normal(jax.random.key(2), (E,))
  return moe


def _x(seed=3):
  return jax.random.normal(jax.random.key(seed), (B, T, D))


@nnx.jit
def _apply(moe, x, routing=None):
  return moe(x, routing=routing)


def _loss(moe, x, cot, routing=None):
  y, aux = moe(x, routing=routing)
  return jnp.sum(y * cot) + aux["aux_loss"] + 1e-3 * aux["z_loss"]


_grad = nnx.jit(nnx.grad(_loss))


def _np(v):
  return np.asarray(v[...] if isinstance(v, nnx.Variable) else v, np.float64)


def _np_route(logits, bias, *, score_func="softmax", n_group=1, topk_group=1,
              routed_scaling_factor=1.0, norm_topk_prob=True, **_):
  """Hugging Face's routing, token by token, in float64 numpy: ([N, K] weights, [N, K] experts)."""
  weights, experts = [], []
  for row in logits:
    if score_func == "softmax":
      scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    else:
      scores = 1 / (1 + np.exp(-row))
    choice = scores + (0 if bias is None else bias)
    if n_group > 1:
      groups = choice.reshape(n_group, -1)
      group_scores = np.sort(groups, axis=1)[:, -2:].sum(1)
      kept = np.argsort(-group_scores)[:topk_group]
      mask = np.zeros(n_group, bool)
      mask[kept] = True
      choice = np.where(np.repeat(mask, E // n_group), choice, -np.inf)
    chosen = np.argsort(-choice, kind="stable")[:K]
    w = scores[chosen]
    if norm_topk_prob:
      w = w / (w.sum() + (1e-20 if score_func == "sigmoid" else 0))
    weights.append(w * routed_scaling_factor)
    experts.append(chosen)
  return np.array(weights), np.array(experts)


def _np_moe(moe, x, experts=None, kept=None, **cfg):
  """Dense per-token loop over the chosen experts (+ shared experts): y [B, T, D], experts [N, K]."""
  xs = np.asarray(x, np.float64).reshape(-1, D)
  bias = None if moe.router_bias is None else _np(moe.router_bias)
  weights, chosen = _np_route(xs @ _np(moe.router), bias, **cfg)
  if experts is not None:  # replay: weights from the router at the given experts
    scores = xs @ _np(moe.router)
    scores = (np.exp(scores) / np.exp(scores).sum(1, keepdims=True) if cfg["score_func"] == "softmax"
              else 1 / (1 + np.exp(-scores)))
    chosen = np.asarray(experts)
    weights = np.take_along_axis(scores, chosen, 1)
    weights = weights / weights.sum(1, keepdims=True) * cfg.get("routed_scaling_factor", 1.0)
  silu = lambda a: a / (1 + np.exp(-a))
  gate, up, down = _np(moe.gate), _np(moe.up), _np(moe.down)
  y = np.zeros_like(xs)
  for n in range(xs.shape[0]):
    for j in range(K):
      if kept is None or kept[n, j]:
        e = chosen[n, j]
        y[n] += weights[n, j] * (silu(xs[n] @ gate[e]) * (xs[n] @ up[e])) @ down[e]
    if moe.shared_gate is not None:
      y[n] += (silu(xs[n] @ _np(moe.shared_gate)) * (xs[n] @ _np(moe.shared_up))) @ _np(moe.shared_down)
  return y.reshape(B, T, D), chosen


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_top_k_indices_equal_lax_top_k_ties_included(k):
  """The argmax passes give top_k's experts in top_k's order, ties (scores on a coarse grid) to the
  lower index."""
  scores = jnp.asarray(np.random.default_rng(k).integers(0, 4, (64, 8)), jnp.float32) / 4
  np.testing.assert_array_equal(top_k_indices(scores, k), jax.lax.top_k(scores, k)[1])


def test_routing_keeps_token_sharded_scores_split():
  """Routing tokens split over fsdp (a decode step's) gathers nothing: XLA's CPU partitioner
  all-gathers the tokens of a sharded lax.top_k, which every layer of every decode step paid."""
  mesh = make_mesh(configs.load("configs/tiny.py", ["mesh.fsdp=2"]).mesh, jax.devices()[:2])
  logits = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float32),
                          NamedSharding(mesh, PartitionSpec("fsdp")))
  compiled = jax.jit(lambda x: route(x, None, k=2)[:2]).lower(logits).compile().as_text()
  assert "all-gather" not in compiled


@pytest.mark.parametrize("cfg", [SOFTMAX, DEEPSEEK], ids=["qwen3_softmax", "deepseek_sigmoid_groups"])
def test_dropless_matches_dense_loop(cfg):
  moe = _moe(dispatch="dropless", **cfg)
  x = _x()
  y, aux = _apply(moe, x)
  want, chosen = _np_moe(moe, x, **cfg)
  np.testing.assert_array_equal(np.sort(aux["routing"].reshape(-1, K), 1), np.sort(chosen, 1))
  assert np.abs(np.asarray(y) - want).max() <= 1e-5
  assert aux["dropped_fraction"] == 0
  np.testing.assert_allclose(aux["expert_load"].sum(), 1.0, rtol=1e-6)


def test_capacity_matches_dropless_when_ample():
  moe = _moe(**DEEPSEEK)
  x = _x()
  y, aux = _apply(moe, x)
  moe.dispatch, moe.capacity_factor = "capacity", float(E)  # capacity = N * K: nothing can drop
  y_cap, aux_cap = _apply(moe, x)
  assert aux_cap["dropped_fraction"] == 0
  assert np.abs(np.asarray(y_cap - y)).max() <= 1e-5


def test_capacity_drops_overflow_in_choice_major_order():
  moe = _moe(dispatch="capacity", capacity_factor=0.5, **SOFTMAX)
  x = _x()
  y, aux = _apply(moe, x)
  chosen = np.asarray(aux["routing"]).reshape(-1, K)
  cap = math.ceil(0.5 * B * T * K / E)
  kept, filled = np.zeros_like(chosen, bool), np.zeros(E, int)
  for j in range(K):  # every first choice before any second choice, then token order
    for n in range(B * T):
      kept[n, j] = filled[chosen[n, j]] < cap
      filled[chosen[n, j]] += 1
  assert 0 < aux["dropped_fraction"] == pytest.approx((~kept).sum() / chosen.size)
  want, _ = _np_moe(moe, x, kept=kept, **SOFTMAX)
  assert np.abs(np.asarray(y) - want).max() <= 1e-5


@pytest.mark.parametrize("expert,cfg", [(2, SOFTMAX), (4, DEEPSEEK), (8, SOFTMAX)])
def test_expert_parallel_matches_single_device(expert, cfg):
  mesh = _mesh(expert)
  single = _moe(**cfg)
  sharded = sharded_init(lambda: _moe(mesh=mesh, **cfg), mesh)
  assert sharded.gate[...].sharding.spec[0] == "expert"
  x = jax.device_put(_x(), NamedSharding(mesh, PartitionSpec(("fsdp", "expert"))))
  y, aux = _apply(sharded, x)
  y_ref, aux_ref = _apply(single, x)
  assert np.abs(np.asarray(y - y_ref)).max() <= 1e-5
  np.testing.assert_array_equal(aux["routing"], aux_ref["routing"])
  assert aux["dropped_fraction"] == 0


def test_expert_parallel_gradients_match_single_device():
  mesh = _mesh(4)
  single = _moe(**DEEPSEEK)
  sharded = sharded_init(lambda: _moe(mesh=mesh, **DEEPSEEK), mesh)
  x, cot = _x(), _x(seed=4)
  g_ep, g_ref = _grad(sharded, x, cot), _grad(single, x, cot)
  errors = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g_ep, g_ref)
  assert max(jax.tree.leaves(errors)) <= 1e-4, errors  # composite: fp32 sums in another order
  assert float(jnp.abs(g_ref["gate"][...]).max()) > 0 and float(jnp.abs(g_ref["router"][...]).max()) > 0


def test_expert_parallel_capacity_drops_per_destination():
  mesh = _mesh(4)
  moe = sharded_init(lambda: _moe(mesh=mesh, dispatch="capacity", capacity_factor=0.5, **SOFTMAX), mesh)
  x = _x()
  y, aux = _apply(moe, x)
  chosen = np.asarray(aux["routing"]).reshape(-1, K)
  shards, local_experts = 8, E // 4  # tokens split over fsdp=2 x expert=4 devices
  n = B * T // shards
  cap = math.ceil(0.5 * n * K / 4)
  kept = np.zeros_like(chosen, bool)
  for s in range(shards):
    filled = np.zeros(4, int)
    for j in range(K):
      for t in range(s * n, (s + 1) * n):
        dest = chosen[t, j] // local_experts
        kept[t, j] = filled[dest] < cap
        filled[dest] += 1
  assert 0 < aux["dropped_fraction"] == pytest.approx((~kept).sum() / chosen.size)
  want, _ = _np_moe(moe, x, kept=kept, **SOFTMAX)
  assert np.abs(np.asarray(y) - want).max() <= 1e-5


def _runs_shard_map(moe, x):
  graphdef, state = nnx.split(moe)
  return "shard_map" in str(jax.make_jaxpr(lambda st, v: nnx.merge(graphdef, st)(v))(state, x))


def _dp_mesh(tensor=1):
  return make_mesh(ml_collections.ConfigDict(
      dict(data=2, fsdp=-1, expert=1, sequence=1, tensor=tensor, num_slices=1)))


@pytest.mark.parametrize("dispatch,tensor", [("blocks", 1), ("ladder", 1), ("dropless", 2), ("dense", 2),
                                             ("gather", 1), ("buffered", 2)])
def test_per_device_dispatch_matches_single_device(dispatch, tensor):
  """Without expert parallelism each device dispatches its own tokens (model/moe_local.py): outputs
  and every gradient equal one device's, with F split over 'tensor' (outputs summed over it) or whole."""
  mesh = _dp_mesh(tensor)
  single = _moe(dispatch=dispatch, **DEEPSEEK)
  sharded = sharded_init(lambda: _moe(mesh=mesh, dispatch=dispatch, **DEEPSEEK), mesh)
  assert sharded.gate[...].sharding.spec[1] == "fsdp"  # D split: the call gathers it
  x = jax.device_put(_x(), NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
  y, aux = _apply(sharded, x)
  y_ref, aux_ref = _apply(single, x)
  assert np.abs(np.asarray(y - y_ref)).max() <= 1e-5
  np.testing.assert_array_equal(aux["routing"], aux_ref["routing"])
  cot = _x(seed=4)
  g, g_ref = _grad(sharded, x, cot), _grad(single, x, cot)
  errors = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g, g_ref)
  assert max(jax.tree.leaves(errors)) <= 1e-4, errors
  assert _runs_shard_map(sharded, x)  # the per-device path ran, not the global program


def test_per_device_dispatch_with_tokens_split_over_batch_and_sequence():
  """fsdp=2 x sequence=2 x tensor=2 (as ring attention's training batches lie: B over fsdp, T over
  sequence): the flattened tokens split over both, F over tensor; outputs and gradients equal one
  device's."""
  mesh = make_mesh(ml_collections.ConfigDict(
      dict(data=1, fsdp=2, expert=1, sequence=2, tensor=2, num_slices=1)))
  single = _moe(dispatch="blocks", **SOFTMAX)
  sharded = sharded_init(lambda: _moe(mesh=mesh, dispatch="blocks", **SOFTMAX), mesh)
  x = jax.device_put(_x(), NamedSharding(mesh, PartitionSpec("fsdp", "sequence")))
  y, y_ref = _apply(sharded, x)[0], _apply(single, x)[0]
  assert np.abs(np.asarray(y - y_ref)).max() <= 1e-5
  cot = _x(seed=4)
  errors = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), _grad(sharded, x, cot), _grad(single, x, cot))
  assert max(jax.tree.leaves(errors)) <= 1e-4, errors
  assert _runs_shard_map(sharded, x)


def test_per_device_capacity_counts_each_devices_tokens():
  """`capacity` without expert parallelism keeps ceil(cf * n * K / E) rows per expert of each device's
  n tokens (the global program kept ceil(cf * N * K / E) of all N): the drops follow the device."""
  mesh = _dp_mesh()
  moe = sharded_init(lambda: _moe(mesh=mesh, dispatch="capacity", capacity_factor=0.5, **SOFTMAX), mesh)
  x = _x()
  y, aux = _apply(moe, x)
  chosen = np.asarray(aux["routing"]).reshape(-1, K)
  shards = 8
  n = B * T // shards
  cap = math.ceil(0.5 * n * K / E)
  kept = np.zeros_like(chosen, bool)
  for s in range(shards):
    filled = np.zeros(E, int)
    for j in range(K):  # choice-major inside each device's tokens
      for t in range(s * n, (s + 1) * n):
        kept[t, j] = filled[chosen[t, j]] < cap
        filled[chosen[t, j]] += 1
  assert 0 < aux["dropped_fraction"] == pytest.approx((~kept).sum() / chosen.size)
  want, _ = _np_moe(moe, x, kept=kept, **SOFTMAX)
  assert np.abs(np.asarray(y) - want).max() <= 1e-5


def test_per_device_dispatch_falls_back_to_one_program_for_uneven_tokens():
  """3 x 5 tokens do not split over 8 devices: the call runs as one program, still exact."""
  mesh = _dp_mesh()
  single = _moe(dispatch="blocks", **SOFTMAX)
  sharded = sharded_init(lambda: _moe(mesh=mesh, dispatch="blocks", **SOFTMAX), mesh)
  x = jax.random.normal(jax.random.key(5), (3, 5, D))
  y, y_ref = _apply(sharded, x)[0], _apply(single, x)[0]
  assert np.abs(np.asarray(y - y_ref)).max() <= 1e-5
  assert not _runs_shard_map(sharded, x)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_gradients_flow_in_every_mode(dispatch):
  moe = _moe(dispatch=dispatch, capacity_factor=1.0, **DEEPSEEK)
  grads = _grad(moe, _x(), _x(seed=4))
  for name in ("router", "gate", "up", "down", "shared_gate", "shared_up", "shared_down"):
    g = np.asarray(grads[name][...])
    assert np.isfinite(g).all() and np.abs(g).max() > 0, name
  assert "router_bias" not in grads  # the bias is state, not a parameter


@pytest.mark.parametrize("cfg", [SOFTMAX, DEEPSEEK], ids=["softmax", "sigmoid"])
def test_routing_replay_reproduces_output(cfg):
  moe = _moe(**cfg)
  x = _x()
  y, aux = _apply(moe, x)
  y_replay, aux_replay = _apply(moe, x, aux["routing"])
  np.testing.assert_array_equal(y_replay, y)
  np.testing.assert_array_equal(aux_replay["routing"], aux["routing"])
  # Replaying other experts: weights are the router's scores at those experts.
  other = (aux["routing"] + 1) % E
  y_other, _ = _apply(moe, x, other)
  want, _ = _np_moe(moe, x, experts=np.asarray(other).reshape(-1, K), **cfg)
  assert np.abs(np.asarray(y_other) - want).max() <= 1e-5
  router_grad = _grad(moe, x, _x(seed=4), other)["router"][...]
  assert np.abs(np.asarray(router_grad)).max() > 0


def test_aux_free_bias_balances_skewed_router():
  logits = jax.random.normal(jax.random.key(5), (512, E)) + jnp.linspace(2.0, -2.0, E)  # [N, E]

  def step(bias, _):
    _, indices, _ = route(logits, bias, k=K, score_func="sigmoid", n_group=4, topk_group=2)
    load = expert_load(indices, E)
    return update_router_bias(bias, load, 0.02), load

  _, loads = jax.lax.scan(step, jnp.zeros(E), None, length=300)
  ratio = lambda load: float(load.max() / max(float(load.min()), 1.0 / 512))
  assert ratio(loads[0]) > 20
  assert ratio(loads[-20:].mean(0)) < 1.5


def test_loss_values():
  logits = jax.random.normal(jax.random.key(6), (64, E))
  probs = jax.nn.softmax(logits)
  indices = jax.lax.top_k(probs, K)[1]
  load = np.bincount(np.asarray(indices).ravel(), minlength=E) / indices.size
  want = E * np.sum(load * np.asarray(probs).mean(0))
  np.testing.assert_allclose(load_balancing_loss(probs, indices), want, rtol=1e-6)
  uniform = jnp.full((E, E), 1.0 / E)
  assert load_balancing_loss(uniform, jnp.arange(E)[:, None]) == pytest.approx(1.0)
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(1))
  np.testing.assert_allclose(router_z_loss(logits), np.mean(lse ** 2), rtol=1e-6)
  bias = update_router_bias(jnp.zeros(E), jnp.asarray(load), 0.1)
  np.testing.assert_allclose(bias, 0.1 * np.sign(load.mean() - load))


def test_params_carry_logical_axes():
  moe = MoE(D, F, E, K, num_shared_experts=1, aux_free_bias=True, rngs=nnx.Rngs(0))
  assert moe.gate.axes == ("experts", "embed", "expert_mlp")
  assert moe.down.axes == ("experts", "expert_mlp", "embed")
  assert moe.router.axes == ("embed", None)
  assert moe.shared_down.axes == ("mlp", "embed")
  assert isinstance(moe.router_bias, RouterBias) and moe.router_bias.axes == (None,)
  assert moe.router_bias[...].dtype == jnp.float32 and not moe.router_bias[...].any()


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(n_group=3), "n_group=3"),
    (dict(n_group=2, topk_group=3), "topk_group=3"),
    (dict(n_group=8), "at least 2"),
    (dict(num_experts_per_tok=3, n_group=4, topk_group=1), "exceeds the 2 experts"),
    (dict(score_func="relu"), "score_func='relu'"),
    (dict(dispatch="sparse"), "moe.dispatch='sparse' is unknown; choose one of"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
])
def test_bad_arguments_raise(kw, match):
  args = dict(embed_dim=D, expert_mlp_dim=F, num_experts=E, num_experts_per_tok=K) | kw
  with pytest.raises(ValueError, match=match):
    MoE(**args, rngs=nnx.Rngs(0))


def test_bad_mesh_and_inputs_raise():
  with pytest.raises(ValueError, match="num_experts=6 must be divisible"):
    MoE(D, F, 6, K, mesh=_mesh(4), rngs=nnx.Rngs(0))
  moe = MoE(D, F, E, K, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="expected"):
    moe(jnp.zeros((B, T, D + 1)))
  with pytest.raises(ValueError, match="routing has shape"):
    moe(_x(), routing=jnp.zeros((B, T, K + 1), jnp.int32))
  ep = MoE(D, F, E, K, mesh=_mesh(8), rngs=nnx.Rngs(0))  # 3 tokens on 8 expert shards: padded, not refused
  x = jax.random.normal(jax.random.key(7), (1, 3, D))
  np.testing.assert_allclose(np.asarray(ep(x)[0]), np.asarray(MoE(D, F, E, K, rngs=nnx.Rngs(0))(x)[0]),
                             atol=1e-5, rtol=0)


def test_per_device_dispatch_keeps_no_gathered_experts_for_the_backward(devices):
  """In a scan of MoE layers on fsdp=8, the per-device dispatch gathers each layer's expert weights
  (D split over fsdp) in the forward and again in the backward, as FSDP does: the compiled
  forward + backward needs less temporary memory than half of all layers' gathered experts. Saved for
  the backward, the gathered copies of every layer stayed alive at once (blocks and dropless alike)."""
  layers, experts, embed, hidden = 8, 8, 64, 256
  cfg = configs.load("configs/tiny.py", [
      f"model.num_layers={layers}", "moe.first_k_dense=0", f"model.embed_dim={embed}", "model.head_dim=16",
      "model.mlp_dim=64", f"moe.num_experts={experts}", f"moe.expert_mlp_dim={hidden}", "model.max_seq_len=32",
      "mesh.fsdp=8"])
  mesh = make_mesh(cfg.mesh)
  tokens = jax.device_put(jnp.asarray(np.random.RandomState(0).randint(0, 259, (8, 16)), jnp.int32),
                          NamedSharding(mesh, PartitionSpec("fsdp")))
  gathered_bytes = layers * 3 * experts * embed * hidden * 4  # every layer's experts, whole, fp32
  for dispatch in ("blocks", "dropless"):
    cfg.moe.dispatch = dispatch
    graphdef, params, rest = nnx.split(build_model(ModelConfig.from_config(cfg, mesh), mesh), nnx.Param, ...)
    assert params["moe_stack"]["mlp"]["gate"].sharding.spec[2] == "fsdp"  # [L, E, D, F]: D split
    loss = lambda p, t: jnp.mean(nnx.merge(graphdef, p, rest)(t).logits)  # noqa: E731
    temp = jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    assert temp < gathered_bytes / 2, (dispatch, temp, gathered_bytes)
