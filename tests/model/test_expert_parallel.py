"""Expert parallelism that scales: expert weights never gathered (read from the compiled HLO), any
token count, both exchanges equal to the one-device dense reference in outputs and gradients, drops
counted against a numpy model of the capacity rule, and ragged_all_to_all compiled for a TPU."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.model import expert_parallel, moe_dispatch
from meshrl.model.moe import MoE
from meshrl.model.moe_dispatch import ExpertWeights
from meshrl.rl.step import aot
from meshrl.sharding import make_mesh, traffic

D, F, E, K = 32, 48, 4, 2  # D, F distinct, so a gathered expert weight is recognisable by shape


def _mesh(fsdp=2, expert=2, tensor=2, devices=None):
  return make_mesh(ml_collections.ConfigDict(
      dict(data=1, fsdp=fsdp, expert=expert, sequence=1, tensor=tensor, num_slices=1)), devices=devices)


def _inputs(num_tokens, *, skew=False, seed=0):
  """xs [N, D], choices [N, K] (distinct per token), weights [N, K], ExpertWeights, cotangent."""
  rng = np.random.RandomState(seed)
  probs = np.array([0.45, 0.35, 0.1, 0.1]) if skew else None  # skew: device 0 owns experts 0, 1
  choices = np.array([rng.choice(E, K, replace=False, p=probs) for _ in range(num_tokens)])
  weights = rng.uniform(0.1, 1.0, choices.shape)
  keys = jax.random.split(jax.random.key(seed), 5)
  w = ExpertWeights(*(jax.random.normal(k, s) / np.sqrt(s[1])
                      for k, s in zip(keys, [(E, D, F), (E, D, F), (E, F, D)])))
  xs = jax.random.normal(keys[3], (num_tokens, D))
  cot = jax.random.normal(keys[4], (num_tokens, D))
  return (xs, jnp.asarray(choices, jnp.int32), jnp.asarray(weights / weights.sum(1, keepdims=True),
                                                           jnp.float32), w, cot)


def _training_layout(w, mesh):
  """Expert weights placed as TRAIN_RULES place them: E on expert, D on fsdp, F on tensor."""
  specs = [PartitionSpec("expert", "fsdp", "tensor")] * 2 + [PartitionSpec("expert", "tensor", "fsdp")]
  return ExpertWeights(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(w, specs)))


def _value_and_grads(fn, xs, choices, weights, w, cot):
  def loss(xs, weights, w):
    ys, dropped = fn(xs, choices, weights, w)
    return jnp.sum(ys * cot), (ys, dropped)
  grads, (ys, dropped) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(xs, weights, w)
  return ys, dropped, grads


def _reference(xs, choices, weights, w, cot):
  """The one-device dense result (every expert on every token): ys and gradients."""
  return jax.jit(functools.partial(_value_and_grads, moe_dispatch.dense))(xs, choices, weights, w, cot)


def _ep(mesh, exchange, capacity_factor=None):
  fn = functools.partial(expert_parallel.expert_parallel, mesh=mesh, exchange=exchange,
                         capacity_factor=capacity_factor)
  return jax.jit(functools.partial(_value_and_grads, fn))


def _assert_matches(got, want):
  ys, dropped, grads = got
  want_ys, _, want_grads = want
  assert int(dropped) == 0
  np.testing.assert_allclose(np.asarray(ys), np.asarray(want_ys), atol=1e-5, rtol=0)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=0)


def _weight_gathers(hlo_text):
  """All-gathers whose result has an expert weight's shape ([L or E, D or D/2, F or F/2] or down's)."""
  inner = {(d, f) for d in (D, D // 2) for f in (F, F // 2)}
  found = []
  for line in hlo_text.splitlines():
    if match := re.search(r"=\s*(.*?)\sall-gather(-start|-done)?\(", line):
      for _, shape in traffic.shape_bytes(match.group(1)):
        dims = tuple(int(x) for x in shape.split("[")[1].rstrip("]").split(",") if x)
        if len(dims) == 3 and (dims[1:] in inner or dims[1:][::-1] in inner):
          found.append(line.strip()[:160])
  return found


def test_all_to_all_keeps_weights_sharded_and_matches_dense_at_3x37_tokens():
  """fsdp=2 x expert=2 x tensor=2, 111 tokens (padded to 112): no expert weight is gathered in the
  forward or backward, and outputs and gradients equal the one-device dense reference."""
  mesh = _mesh()
  xs, choices, weights, w, cot = _inputs(3 * 37)
  w_sharded = _training_layout(w, mesh)
  step = _ep(mesh, "all_to_all")
  hlo = step.lower(xs, choices, weights, w_sharded, cot).compile().as_text()
  assert not _weight_gathers(hlo), _weight_gathers(hlo)
  collectives = traffic.collective_bytes(hlo)
  assert collectives.get("all-to-all", 0) > 0 and collectives.get("all-reduce", 0) > 0
  got = step(xs, choices, weights, w_sharded, cot)
  _assert_matches(got, _reference(xs, choices, weights, w, cot))
  grad_gate = got[2][2].gate
  assert grad_gate.sharding.shard_shape(grad_gate.shape) == (E // 2, D // 2, F // 2)  # grads stay sharded


def _row_scatters(jaxpr) -> list[tuple[int, ...]]:
  """Shapes of the `scatter`s (not scatter-add) into arrays of rows x features ([M, D]: a value, or
  the id array of a scatter's JVP) anywhere in a jaxpr, sub-jaxprs (shard_map, custom_vjp, while,
  cond) included; scatters into 1-D bookkeeping arrays are not counted."""
  from jax.extend import core  # pylint: disable=import-outside-toplevel
  found = []

  def walk(inner):
    for eqn in inner.eqns:
      if eqn.primitive.name == "scatter" and eqn.invars[0].aval.ndim >= 2:
        found.append(tuple(eqn.invars[0].aval.shape))
      for value in eqn.params.values():
        for sub in (value if isinstance(value, (list, tuple)) else [value]):
          if isinstance(sub, core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, core.Jaxpr):
            walk(sub)
  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("exchange", ["all_to_all", "ragged"])
def test_rows_go_back_by_a_gather_not_a_scatter(exchange):
  """Expert outputs return to their rows by a gather through the inverse permutation: the forward
  and backward have no scatter into [rows, D] arrays (JAX's JVP of `zeros.at[order].set(x)` builds an
  id array the size of x and masks through it: 4.1 GiB per chip of temporaries in the paper_3t
  update). The ragged exchange is traced for a v5e 2x2 (its collective exists only on TPU)."""
  devices = None
  if exchange == "ragged":
    pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
    devices = aot.topology_devices("v5e:2x2")
  mesh = _mesh(tensor=1, devices=devices) if devices is not None else _mesh()
  xs, choices, weights, w, cot = _inputs(24, seed=2)
  fn = functools.partial(expert_parallel.expert_parallel, mesh=mesh, exchange=exchange)
  jaxpr = jax.make_jaxpr(functools.partial(_value_and_grads, fn))(xs, choices, weights, w, cot)
  assert _row_scatters(jaxpr) == []
  # The check is live: the scatter it replaced is seen.
  order = jnp.arange(8)[::-1]
  assert _row_scatters(jax.make_jaxpr(jax.grad(
      lambda x: jnp.sum(jnp.zeros_like(x).at[order].set(x) ** 2)))(jnp.ones((8, 3))))
  np.testing.assert_array_equal(expert_parallel.inverse_permutation(order)[order], jnp.arange(8))


def test_gathered_weights_are_seen_gathered_and_match():
  """ep_weights="gathered" (D gathered over fsdp per call) equals the reference too, and the HLO
  check above sees its gathers: the check is live."""
  mesh = _mesh()
  xs, choices, weights, w, _ = _inputs(24, seed=3)
  fn = jax.jit(functools.partial(expert_parallel.expert_parallel, mesh=mesh, weights="gathered"))
  w_sharded = _training_layout(w, mesh)
  assert _weight_gathers(fn.lower(xs, choices, weights, w_sharded).compile().as_text())
  ys, dropped = fn(xs, choices, weights, w_sharded)
  assert int(dropped) == 0
  np.testing.assert_allclose(np.asarray(ys), np.asarray(moe_dispatch.dense(xs, choices, weights, w)[0]),
                             atol=1e-5, rtol=0)


def test_d_split_over_sequence_stays_sharded_and_matches():
  """paper_3t's rule `embed=fsdp,sequence` splits the experts' D over `sequence`: with d_axes naming
  it, the D-slices are traded with the sequence peers and no expert weight is gathered (the check
  sees the gathers when d_axes is left at fsdp, which the weights are not split over); outputs and
  gradients equal the one-device dense reference."""
  mesh = make_mesh(ml_collections.ConfigDict(
      dict(data=1, fsdp=1, expert=2, sequence=2, tensor=2, num_slices=1)))
  assert expert_parallel.d_split_axes(mesh, D, ("fsdp", "sequence")) == ("sequence",)
  assert expert_parallel.d_split_axes(mesh, D + 1, ("fsdp", "sequence")) == ()  # 2 does not divide 33
  xs, choices, weights, w, cot = _inputs(3 * 11, seed=5)
  specs = [PartitionSpec("expert", "sequence", "tensor")] * 2 + [PartitionSpec("expert", "tensor", "sequence")]
  w_sharded = ExpertWeights(*(jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(w, specs)))

  def step(d_axes):
    fn = functools.partial(expert_parallel.expert_parallel, mesh=mesh, weights="sharded", d_axes=d_axes)
    return jax.jit(functools.partial(_value_and_grads, fn))
  split = step(("fsdp", "sequence"))
  assert not _weight_gathers(split.lower(xs, choices, weights, w_sharded, cot).compile().as_text())
  assert _weight_gathers(step(("fsdp",)).lower(xs, choices, weights, w_sharded, cot).compile().as_text())
  _assert_matches(split(xs, choices, weights, w_sharded, cot), _reference(xs, choices, weights, w, cot))


def test_ragged_bookkeeping_matches_dense_at_2_prompts_of_11_tokens():
  """The ragged exchange's offsets (over an emulated ragged_all_to_all, since XLA:CPU lacks it):
  22 tokens on fsdp=2 x expert=2 (x tensor=2), padded to 24, equal the dense reference."""
  mesh = _mesh()
  xs, choices, weights, w, cot = _inputs(2 * 11, seed=1)
  got = _ep(mesh, "emulated")(xs, choices, weights, _training_layout(w, mesh), cot)
  _assert_matches(got, _reference(xs, choices, weights, w, cot))


def _ragged_kept(choices, *, shards, num_shards, capacity_factor):
  """numpy model of the ragged capacity rule: each receiver takes senders in device order into
  ceil(factor * n * K) rows; a sender's slots go choice-major; what overflows is dropped."""
  n = -(-len(choices) // shards)
  kept = np.zeros(choices.shape, bool)
  recv_rows = math.ceil(capacity_factor * n * K)
  groups = shards // num_shards  # token shards along the other axes; the expert axis is innermost
  for g in range(groups):
    filled = np.zeros(num_shards, int)
    for e in range(num_shards):
      s = g * num_shards + e
      for j in range(K):
        for t in range(s * n, min((s + 1) * n, len(choices))):
          dest = choices[t, j] // (E // num_shards)
          kept[t, j] = filled[dest] < recv_rows
          filled[dest] += 1
  return kept


def test_ragged_capacity_drops_are_counted():
  """capacity_factor=0.75 with routing skewed to device 0: the dropped count and the output follow
  the receiver-capacity rule (dense reference with the dropped slots' weights zeroed)."""
  mesh = _mesh(fsdp=4, expert=2, tensor=1)
  xs, choices, weights, w, _ = _inputs(40, skew=True, seed=2)
  fn = jax.jit(functools.partial(expert_parallel.expert_parallel, mesh=mesh, exchange="emulated",
                                 capacity_factor=0.75))
  ys, dropped = fn(xs, choices, weights, w)
  kept = _ragged_kept(np.asarray(choices), shards=8, num_shards=2, capacity_factor=0.75)
  assert 0 < int(dropped) == (~kept).sum()
  want, _ = moe_dispatch.dense(xs, choices, weights * kept, w)
  np.testing.assert_allclose(np.asarray(ys), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.slow  # about 13 s: one more 8-device compile
def test_moe_pads_tokens_out_of_the_statistics():
  """The MoE layer on fsdp=2 x expert=2 x tensor=2 with 2 x 11 tokens: output and every router
  statistic equal the one-device layer's (padding happens after routing, so it is never counted)."""
  mesh = _mesh()
  x = jax.random.normal(jax.random.key(3), (2, 11, D))
  ep = MoE(D, F, E, K, mesh=mesh, rngs=nnx.Rngs(0))
  one = MoE(D, F, E, K, dispatch="dense", rngs=nnx.Rngs(0))
  one.router[...] = ep.router[...] = jax.random.normal(jax.random.key(4), (D, E))
  apply = nnx.jit(lambda m, x: m(x))
  (y, aux), (y_ref, aux_ref) = apply(ep, x), apply(one, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=0)
  for name in ("aux_loss", "z_loss", "expert_load", "dropped_fraction"):
    np.testing.assert_allclose(np.asarray(aux[name]), np.asarray(aux_ref[name]), atol=1e-6, rtol=1e-6)
  assert float(aux["dropped_fraction"]) == 0


def test_ragged_all_to_all_compiles_for_tpu():
  """The update-like program (forward and backward) on a v5e 2x2 (fsdp=2 x expert=2) moves tokens
  with ragged-all-to-all and gathers no expert weight."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  mesh = _mesh(tensor=1, devices=aot.topology_devices("v5e:2x2"))
  assert mesh.devices.flat[0].platform == "tpu"
  moe = nnx.eval_shape(lambda: MoE(D, F, E, K, mesh=mesh, dispatch="capacity", ep_weights="sharded",
                                   rngs=nnx.Rngs(0)))
  assert expert_parallel.resolve_exchange(moe.ep_exchange, moe.backend()) == "ragged"  # auto on TPU
  graph, state = nnx.split(moe)
  specs = {"gate": PartitionSpec("expert", "fsdp"), "up": PartitionSpec("expert", "fsdp"),
           "down": PartitionSpec("expert", None, "fsdp")}
  state = jax.tree_util.tree_map_with_path(
      lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          mesh, specs.get(str(path[0].key), PartitionSpec()))), state)
  x = jax.ShapeDtypeStruct((3, 37, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))

  def grads(state, x):
    return jax.grad(lambda s: jnp.sum(nnx.merge(graph, s)(x)[0] ** 2))(state)

  hlo = jax.jit(grads).lower(state, x).compile().as_text()
  collectives = traffic.collective_bytes(hlo)
  assert collectives.get("ragged-all-to-all", 0) > 0, collectives
  assert not _weight_gathers(hlo)


def test_auto_exchange_gives_tpu_decode_steps_fixed_buffers():
  """moe.ep_exchange="auto" on TPU: a decode-phase call (paper_3t's decode step is refused by libtpu
  with ragged-all-to-all) moves its tokens with all-to-all, a prefill-phase call with
  ragged-all-to-all (fails if the phase is not passed on, or ignored)."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  mesh = _mesh(tensor=1, devices=aot.topology_devices("v5e:2x2"))
  moe = nnx.eval_shape(lambda: MoE(D, F, E, K, mesh=mesh, dispatch="capacity", ep_weights="sharded",
                                   rngs=nnx.Rngs(0)))
  graph, state = nnx.split(moe)
  state = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())), state)
  x = jax.ShapeDtypeStruct((4, 1, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))

  def collectives(phase):
    forward = lambda s, x: nnx.merge(graph, s)(x, phase=phase)[0]  # noqa: E731
    return traffic.collective_bytes(jax.jit(forward).lower(state, x).compile().as_text())
  decode, prefill = collectives("decode"), collectives("prefill")
  assert decode.get("all-to-all", 0) > 0 and "ragged-all-to-all" not in decode, decode
  assert prefill.get("ragged-all-to-all", 0) > 0, prefill


def test_ragged_backward_sums_no_token_rows():
  """ragged_all_to_all's result takes the varying axes of its `output` buffer: with an invariant zeros
  buffer the rows it received were typed identical on every device, so the backward psum'd their
  cotangents over the token axes, adding other devices' rows into each device's (wrong gradients)
  and two activation-sized all-reduces. Compiled for a v5p 2x2x2 (fsdp=2 x expert=2 x tensor=2), the
  ragged program's backward has no all-reduce (nor has the all_to_all program's: its rows arrive
  typed from the rows sent)."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  mesh = _mesh(devices=aot.topology_devices("v5p:2x2x2"))
  xs, choices, weights, w, cot = _inputs(64, seed=2)
  fn = functools.partial(expert_parallel.expert_parallel, mesh=mesh, exchange="ragged")
  hlo = jax.jit(functools.partial(_value_and_grads, fn)).lower(xs, choices, weights, w, cot).compile().as_text()
  sums = [line for line in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", line)]
  assert sums  # the check is live: the forward's partial sums over fsdp and tensor are there
  assert [line for line in sums if "transpose(jvp())" in line] == []


@pytest.mark.parametrize("kw,match", [
    (dict(ep_exchange="ragged"), r"moe.ep_exchange='ragged' needs jax.lax.ragged_all_to_all, which "
                                 r"XLA:CPU lacks \(the experts' backend is 'cpu'\)"),
    (dict(ep_exchange="nccl"), r"moe.ep_exchange='nccl' is unknown; choose one of"),
    (dict(ep_weights="replicated"), r"moe.ep_weights='replicated' is unknown; choose one of"),
])
def test_bad_exchange_raises(kw, match):
  with pytest.raises(ValueError, match=match):
    MoE(D, F, E, K, mesh=_mesh(), rngs=nnx.Rngs(0), **kw)
  with pytest.raises(ValueError, match=match):
    expert_parallel.check_exchange(kw.get("ep_exchange", "auto"), "cpu", kw.get("ep_weights", "sharded"))


# --- moe.ep_weights=auto: per call, the layout that moves/holds fewer bytes ----------------------


def _break_even_rows(mesh, *, act_bytes=4, weight_bytes=4):
  """M* from the shapes, written out independently of expert_parallel: sharded costs
  (Pf - 1) M (7 F' + 2 D / Pf) act bytes, gathered 6 L D F' (Pf - 1) / Pf weight bytes."""
  pf, local_f, local_e = mesh.shape["fsdp"], F // mesh.shape["tensor"], E // mesh.shape["expert"]
  return 6 * local_e * D * local_f * weight_bytes / (pf * (7 * local_f + 2 * D / pf) * act_bytes)


def _received_rows(mesh, num_tokens, capacity_factor, exchange):
  """M: the rows one device's experts receive (static buffers of `expert_parallel`)."""
  shards = mesh.shape["fsdp"] * mesh.shape["expert"]  # token axes here: fsdp and expert
  slots, p = -(-num_tokens // shards) * K, mesh.shape["expert"]
  if capacity_factor is None:
    return p * slots
  if exchange == "ragged":
    return min(p * slots, math.ceil(capacity_factor * slots))
  return p * min(slots, math.ceil(capacity_factor * slots / p))


@pytest.mark.parametrize("capacity_factor,exchange", [(None, "all_to_all"), (1.25, "all_to_all"),
                                                      (1.25, "ragged")])
def test_auto_weights_flip_at_the_break_even(capacity_factor, exchange):
  """ep_weights=auto keeps the weights sharded while the received rows are at most the break-even
  M* computed from the shapes and gathers them above it: a decode-sized call (one token per row
  of a few rows) is sharded, a training-sized one gathered."""
  mesh = _mesh()
  shapes = dict(k=K, num_experts=E, embed=D, hidden=F, capacity_factor=capacity_factor, exchange=exchange)
  even = _break_even_rows(mesh)
  chosen = {n: expert_parallel.resolve_weights("auto", mesh, num_tokens=n, **shapes) for n in range(1, 129)}
  for n, layout in chosen.items():
    rows = _received_rows(mesh, n, capacity_factor, exchange)
    assert layout == ("sharded" if rows <= even else "gathered"), (n, rows, even)
  assert chosen[4] == "sharded" and chosen[128] == "gathered"
  # Half the bytes per weight (bf16 weights, f32 rows) halves the break-even.
  half = {n for n in chosen if expert_parallel.resolve_weights("auto", mesh, num_tokens=n, weight_bytes=2,
                                                           **shapes) == "sharded"}
  assert max(_received_rows(mesh, n, capacity_factor, exchange) for n in half) <= even / 2
  # Without fsdp nothing is gathered either way; an fsdp not dividing D leaves only "gathered".
  assert expert_parallel.resolve_weights("auto", _mesh(fsdp=1, expert=2, tensor=4), num_tokens=512,
                                      **shapes) == "sharded"
  odd = dict(shapes, embed=D + 1)
  assert expert_parallel.resolve_weights("auto", mesh, num_tokens=4, **odd) == "gathered"


@pytest.mark.slow  # ~10 s; the sharded and gathered layouts' numerics are tested above by default
def test_auto_weights_match_dense_on_both_sides_of_the_break_even():
  """ep_weights=auto, forward and backward, at 8 tokens (sharded: no expert weight gathered) and at
  48 (gathered: its gathers seen in the HLO): both equal the one-device dense reference."""
  mesh = _mesh()
  shapes = dict(k=K, num_experts=E, embed=D, hidden=F)
  step = jax.jit(functools.partial(_value_and_grads, functools.partial(
      expert_parallel.expert_parallel, mesh=mesh, exchange="all_to_all", weights="auto")))
  for num_tokens, layout in ((8, "sharded"), (48, "gathered")):
    assert expert_parallel.resolve_weights("auto", mesh, num_tokens=num_tokens, **shapes) == layout
    xs, choices, weights, w, cot = _inputs(num_tokens, seed=num_tokens)
    w_sharded = _training_layout(w, mesh)
    compiled = step.lower(xs, choices, weights, w_sharded, cot).compile()
    assert bool(_weight_gathers(compiled.as_text())) == (layout == "gathered"), layout
    _assert_matches(compiled(xs, choices, weights, w_sharded, cot),
                    _reference(xs, choices, weights, w, cot))


def test_bad_ep_weights_names_the_field_and_choices():
  expected = r"moe.ep_weights='sharded_fsdp' is unknown; choose one of \('auto', 'sharded', 'gathered'\)"
  xs, choices, weights, w, _ = _inputs(8)
  with pytest.raises(ValueError, match=expected):
    expert_parallel.expert_parallel(xs, choices, weights, w, mesh=_mesh(), weights="sharded_fsdp")
  with pytest.raises(ValueError, match=expected):
    MoE(D, F, E, K, mesh=_mesh(), ep_weights="sharded_fsdp", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=expected):
    expert_parallel.resolve_weights("sharded_fsdp", _mesh(), num_tokens=8, k=K, num_experts=E, embed=D,
                                 hidden=F)
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=expected):  # the run config, as a run would read it
    ModelConfig.from_config(configs.load("configs/tiny.py", ["moe.ep_weights=sharded_fsdp"]))


def test_run_summary_prints_the_layout_per_phase():
  """The RL run's console line (rl/step/driver.py dispatch_summary) names the layout each phase runs under
  the default moe.ep_weights=auto: here decode's 32 one-token rows stay sharded and training's
  192-token minibatches gather (fsdp=4 x expert=2, 512-wide experts)."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.moe import ep_weights_plan  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.driver import build_spec, dispatch_summary  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["mesh.fsdp=4", "mesh.expert=2", "moe.expert_mlp_dim=512",
                                         "rl.prompts_per_step=4"])
  assert cfg.moe.ep_weights == "auto"
  mesh = make_mesh(cfg.mesh)
  rows = cfg.rl.prompts_per_step * cfg.rl.group_size
  tokens = {"train": rows * (cfg.rl.max_prompt_len + cfg.rl.max_new_tokens) // cfg.rl.num_minibatches,
            "prefill": cfg.rl.prompts_per_step * cfg.rl.max_prompt_len, "decode": rows}
  plan = ep_weights_plan(ModelConfig.from_config(cfg, mesh), mesh, tokens)
  assert plan["train"][0] == "gathered" and plan["decode"][0] == "sharded", plan
  for layout, cost in plan.values():
    assert layout == min(("sharded", "gathered"), key=cost.get)
  assert dispatch_summary(build_spec(cfg, mesh), mesh).endswith(
      "expert weights (auto): " + ", ".join(f"{p} {layout}" for p, (layout, _) in plan.items()))
