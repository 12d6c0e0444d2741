"""Every expert-dispatch implementation equals a per-token loop, in outputs and gradients; `auto` is exact."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import expert_parallel, moe_dispatch
from meshrl.model.block_swiglu import block_swiglu
from meshrl.model.moe import MoE
from meshrl.model.moe_dispatch import ExpertWeights
from meshrl.model.transformer import ModelConfig, phase_of

D, F, E = 16, 8, 8


def _weights(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = [(E, D, F), (E, D, F), (E, F, D)]
  return ExpertWeights(*(jax.random.normal(k, s) / np.sqrt(s[1]) for k, s in zip(keys, shapes)))


def _routing(case):
  """(expert choices [N, K] int32, combine weights [N, K]) for a named routing shape."""
  rng = np.random.RandomState(0)
  if case == "empty_experts":  # six tokens over experts {0, 1, 2}: five experts get nothing
    choices = np.array([rng.permutation(3)[:2] for _ in range(6)])
  elif case == "one_token":
    choices = np.array([[6, 1]])
  elif case == "one_expert":  # K = 1 and every token on expert 3
    choices = np.full((12, 1), 3)
  elif case == "one_expert_k2":  # every token's first choice is expert 5
    choices = np.array([[5, e] for e in rng.choice([0, 1, 2, 3, 4, 6, 7], 12)])
  elif case == "balanced":  # 4 slots per expert: fits the capacity_factor=1 buffer exactly
    choices = np.array([[n % E, (n + 3) % E] for n in range(16)])
  else:  # random top-2 of 24 tokens
    choices = np.array([rng.permutation(E)[:2] for _ in range(24)])
  weights = rng.uniform(0.1, 1.0, choices.shape)
  return jnp.asarray(choices, jnp.int32), jnp.asarray(weights / weights.sum(1, keepdims=True), jnp.float32)


def _loop(xs, choices, weights, w):
  """The per-token reference: each slot through its expert's SwiGLU, one token at a time."""
  rows = []
  for n, experts in enumerate(np.asarray(choices)):
    row = jnp.zeros((D,))
    for j, e in enumerate(experts):
      hidden = jax.nn.silu(xs[n] @ w.gate[e]) * (xs[n] @ w.up[e])
      row = row + weights[n, j] * (hidden @ w.down[e])
    rows.append(row)
  return jnp.stack(rows)


def _np_loop(xs, choices, weights, w):
  """The same loop in float64 numpy."""
  xs, weights = np.asarray(xs, np.float64), np.asarray(weights, np.float64)
  gate, up, down = (np.asarray(a, np.float64) for a in w)
  silu = lambda a: a / (1 + np.exp(-a))
  ys = np.zeros_like(xs)
  for n, experts in enumerate(np.asarray(choices)):
    for j, e in enumerate(experts):
      ys[n] += weights[n, j] * (silu(xs[n] @ gate[e]) * (xs[n] @ up[e])) @ down[e]
  return ys


CASES = ["empty_experts", "one_token", "one_expert", "one_expert_k2", "balanced", "random"]
# capacity only with a buffer that holds every slot (E / K >= 1 rows per token); buffered with the
# tightest one, so skewed cases fall back to blocks and "balanced" takes the buffer.
IMPLEMENTATIONS = {"dropless": {}, "blocks": {}, "blocks_b8": {"block": 8}, "dense": {}, "gather": {},
                   "ladder": {},
                   "buffered": {"capacity_factor": 1.0}, "capacity": {"capacity_factor": float(E)}}


def _impl(name):
  fn = moe_dispatch.IMPLEMENTATIONS[name.split("_")[0]]
  kw = IMPLEMENTATIONS[name]
  return lambda xs, choices, weights, w: fn(xs, choices, weights, w, **kw)


def _inputs(case):
  choices, weights = _routing(case)
  xs = jax.random.normal(jax.random.key(1), (choices.shape[0], D))
  cot = jax.random.normal(jax.random.key(2), (choices.shape[0], D))
  return choices, weights, xs, cot, _weights()


def _value_and_grads(fn, choices, weights, xs, cot, w):
  """(ys [N, D], gradients of sum(ys * cot) w.r.t. xs, combine weights and expert weights)."""
  def loss(xs, weights, w):
    ys = fn(xs, choices, weights, w)
    ys = ys[0] if isinstance(ys, tuple) else ys
    return jnp.sum(ys * cot), ys

  grads, ys = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(xs, weights, w)
  return ys, grads


@functools.lru_cache(maxsize=None)
def _reference(case):
  """float64 numpy outputs and fp32 per-token-loop gradients, once per case."""
  choices, weights, xs, _, w = _inputs(case)
  return _np_loop(xs, choices, weights, w), _value_and_grads(_loop, *_inputs(case))[1]


# ladder's gradients compile every branch (6-12 s a case): its first-rung, last-rung and skewed cases
# run by default, the other two are `slow`.
SLOW_CASES = {("ladder", "empty_experts"), ("ladder", "random")}


@pytest.mark.parametrize("name,case", [
    pytest.param(n, c, marks=pytest.mark.slow) if (n, c) in SLOW_CASES else (n, c)
    for n, c in itertools.product(IMPLEMENTATIONS, CASES)])
def test_implementation_matches_per_token_loop(name, case):
  ys, grads = jax.jit(functools.partial(_value_and_grads, _impl(name)))(*_inputs(case))
  want_ys, want_grads = _reference(case)
  np.testing.assert_allclose(np.asarray(ys), want_ys, atol=1e-5, rtol=0)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)
  g_w = grads[2]
  if case == "empty_experts":  # experts nobody chose get exactly zero gradient
    assert not np.asarray(g_w.gate[3:]).any() and np.abs(np.asarray(g_w.gate[:3])).max() > 0


def test_buffered_cases_take_both_branches():
  """The parity cases above really exercise both of buffered's branches."""
  cap = lambda c: moe_dispatch.expert_capacity(c.shape[0], c.shape[1], E, 1.0)
  counts = lambda c: np.bincount(np.asarray(c).ravel(), minlength=E)
  balanced, skewed = _routing("balanced")[0], _routing("one_expert_k2")[0]
  assert counts(balanced).max() <= cap(balanced) < counts(balanced).sum()  # buffer, via lax.cond
  assert counts(skewed).max() > cap(skewed)  # blocks


def test_ladder_cases_take_every_kind_of_branch():
  """ladder against the loop on every kind of branch: the parity cases above hold no spill (balanced:
  every expert within the first rung), a spill beside the first rung (one_expert_k2) and every slot
  spilled (one_expert); here a spill beside a higher rung, and `blocks` when two experts outgrow the
  last rung (16 experts, whose top rung is half the slots)."""
  counts = lambda c, e=E: np.bincount(np.asarray(c).ravel(), minlength=e)  # noqa: E731
  rungs = lambda c, e=E: moe_dispatch.ladder_rungs(c.shape[0], c.shape[1], e)  # noqa: E731
  balanced, skewed, one_expert = (_routing(c)[0] for c in ("balanced", "one_expert_k2", "one_expert"))
  assert counts(balanced).max() <= rungs(balanced)[0]
  assert np.sort(counts(skewed))[-2] <= rungs(skewed)[0] < counts(skewed).max()
  assert np.sort(counts(one_expert))[-2] == 0 and counts(one_expert).max() == rungs(one_expert)[-1]

  n = np.arange(64)  # expert 1: 60 slots; expert 2: 30, past the first two rungs; the rest 3 .. 7
  higher = np.stack([np.where(n < 60, 1, 2), np.where(n < 26, 2, n % 5 + 3)], 1)
  ladder = rungs(higher)
  assert np.sort(counts(higher))[-2] > ladder[1] and counts(higher).max() > ladder[2]
  two_busy = np.stack([np.full(600, 2), np.full(600, 5)], 1)  # 600 slots each, top rung 300
  assert moe_dispatch.ladder_rungs(600, 2, 16)[-1] < 600
  for choices, experts in ((higher, E), (two_busy, 16)):
    keys = jax.random.split(jax.random.key(4), 4)
    w = ExpertWeights(*(jax.random.normal(key, shape) / np.sqrt(shape[1]) for key, shape in
                        zip(keys, [(experts, D, F), (experts, D, F), (experts, F, D)])))
    choices = jnp.asarray(choices, jnp.int32)
    weights = jax.random.uniform(keys[3], choices.shape, minval=0.1, maxval=1.0)
    xs = jax.random.normal(jax.random.key(3), (choices.shape[0], D))
    ys, dropped = jax.jit(moe_dispatch.ladder)(xs, choices, weights, w)
    np.testing.assert_allclose(np.asarray(ys), _np_loop(xs, choices, weights, w), atol=1e-5)
    assert int(dropped) == 0


@pytest.mark.parametrize("tokens,k,experts", [(32, 2, 8), (16, 2, 8), (128, 2, 8), (8, 8, 64)])
def test_ladder_rungs_pad_the_busiest_expert_by_at_most_a_third(tokens, k, experts):
  """Whatever the busiest expert holds (from the first rung up to every slot), the rung that takes it
  is at most 1.3 x its count (+1 for rounding): the buffers' E x C rows stay near the work (doubling
  rungs padded up to 2x), with log(E / 1.25) / log(1.3) + 1 branches at most to compile."""
  rungs = moe_dispatch.ladder_rungs(tokens, k, experts)
  assert len(rungs) <= math.log(experts / 1.25) / math.log(1.3) + 2 and list(rungs) == sorted(set(rungs))
  assert rungs[-1] == tokens * k  # every slot on one expert fits: no fallback in generation
  for busiest in range(rungs[0] + 1, tokens * k + 1):
    taken = next(r for r in rungs if r >= busiest)
    assert taken <= 1.3 * busiest + 1, (busiest, taken, rungs)


@pytest.mark.parametrize("backend", ["cpu", "tpu", "gpu"])
def test_auto_is_always_exact(backend):
  for phase, tokens, k, experts in itertools.product(moe_dispatch.PHASES, [1, 3, 4, 63, 64, 65, 2560],
                                                     [1, 2, 8], [8, 64]):
    chosen = moe_dispatch.choose("auto", backend=backend, phase=phase, num_tokens=tokens, k=k,
                                 num_experts=experts)
    assert chosen in moe_dispatch.EXACT, (phase, tokens, k, experts, chosen)
  pick = lambda phase, tokens: moe_dispatch.choose("auto", backend=backend, phase=phase,
                                                   num_tokens=tokens, k=2, num_experts=8)
  if backend == "cpu":
    assert pick("decode", 1) == "gather" and pick("decode", 32) == "ladder"
    assert pick("train", 1) == "blocks" and pick("prefill", 512) == "ladder"
    assert pick("train", 2560) == "blocks"  # gradients: never a switch over buffers
  else:
    assert {pick(p, 2560) for p in moe_dispatch.PHASES} == {"dropless"}
  assert moe_dispatch.choose("capacity", backend=backend, phase="train", num_tokens=8, k=2,
                             num_experts=8) == "capacity"


def test_phase_from_static_shapes():
  assert phase_of(False, 80) == "train" and phase_of(False, 1) == "train"
  assert phase_of(True, 1) == "decode" and phase_of(True, 16) == "prefill"


def test_moe_auto_is_exact_in_every_phase():
  moe = MoE(D, F, E, 2, dispatch="auto", rngs=nnx.Rngs(0))
  moe.router[...] = jax.random.normal(jax.random.key(4), moe.router.shape)
  apply = nnx.jit(lambda m, x, phase: m(x, phase=phase), static_argnums=2)
  for phase, shape, want in [("decode", (2, 1, D), "gather"), ("decode", (16, 1, D), "ladder"),
                             ("prefill", (2, 8, D), "ladder"), ("train", (2, 1, D), "blocks")]:
    x = jax.random.normal(jax.random.key(5), shape)
    assert moe.implementation(phase, shape[0] * shape[1]) == want
    y, aux = apply(moe, x, phase)
    moe.dispatch = "dense"  # exact: equals the per-token loop above
    y_ref, _ = apply(moe, x, phase)
    moe.dispatch = "auto"
    assert aux["dropped_fraction"] == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("override,match", [
    ("moe.dispatch=sparse", r"moe.dispatch='sparse' is unknown; choose one of \('auto', 'dropless'"),
    ("moe.capacity_factor=0.0", "moe.capacity_factor=0.0 must be positive"),
    ("moe.capacity_factor=-1.0", "moe.capacity_factor=-1.0 must be positive"),
    ("moe.ep_exchange=ragged", r"moe.ep_exchange='ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU "
                               r"lacks \(the experts' backend is 'cpu'\)"),
    ("moe.ep_exchange=alltoall", r"moe.ep_exchange='alltoall' is unknown; choose one of"),
])
def test_bad_dispatch_config_raises(override, match):
  cfg = configs.load("configs/tiny.py", ["moe.dispatch=capacity", override])
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_config(cfg)
  with pytest.raises(ValueError, match="phase='verify' is unknown"):
    moe_dispatch.choose("auto", backend="cpu", phase="verify", num_tokens=1, k=1, num_experts=2)


def test_expert_parallel_token_layout():
  """Tokens split over every axis of size > 1 but tensor; any count is padded to the shards."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from meshrl.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  mesh = make_mesh(ml_collections.ConfigDict(
      dict(data=1, fsdp=2, expert=2, sequence=1, tensor=2, num_slices=1)))
  assert expert_parallel.token_axes(mesh) == ("fsdp", "expert")
  assert [expert_parallel.padded_tokens(mesh, n) for n in (1, 4, 22, 111)] == [4, 4, 24, 112]
  specs = expert_parallel.expert_weight_specs(mesh, 16, 8)
  assert specs.gate == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
  assert specs.down == jax.sharding.PartitionSpec("expert", "tensor", "fsdp")
  assert expert_parallel.expert_weight_specs(mesh, 15, 8).gate[1] is None  # 15 does not split over fsdp=2
  assert expert_parallel.resolve_exchange("auto", "tpu") == "ragged"
  assert expert_parallel.resolve_exchange("auto", "tpu", "prefill") == "ragged"
  assert expert_parallel.resolve_exchange("auto", "tpu", "decode") == "all_to_all"  # libtpu refuses ragged there
  assert expert_parallel.resolve_exchange("ragged", "tpu", "decode") == "ragged"  # an explicit choice stands
  assert expert_parallel.resolve_exchange("auto", "cpu") == "all_to_all"


def test_block_swiglu_matches_gathered_weights_and_stops_at_the_last_used_block():
  """model/block_swiglu.py's loop and custom backward equal the batched matmul over a [G, D, F] copy
  of each block's expert weights, for the blocks before `used_blocks`; the blocks after it (padding
  in the `blocks` layout) are not computed: zero outputs and no gradient, although their rows are not
  zero here."""
  w = _weights()
  block_xs = jax.random.normal(jax.random.key(4), (5, 4, D))  # G = 5 blocks of 4 rows
  block_experts = jnp.asarray([1, 1, 6, 0, 0], jnp.int32)
  cot = jax.random.normal(jax.random.key(5), (5, 4, D))
  used = 3

  def gathered(block_xs, w):
    gate_w, up_w, down_w = (weight[block_experts] for weight in w)
    hidden = jax.nn.silu(jnp.einsum("gbd,gdf->gbf", block_xs, gate_w)) * jnp.einsum("gbd,gdf->gbf", block_xs, up_w)
    out = jnp.einsum("gbf,gfd->gbd", hidden, down_w)
    return out * (jnp.arange(5) < used)[:, None, None]

  def loss(fn):
    return lambda block_xs, w: (jnp.sum(fn(block_xs, w) * cot), fn(block_xs, w))

  ours = lambda block_xs, w: block_swiglu(block_xs, block_experts, jnp.int32(used), *w)  # noqa: E731
  (grads, out) = jax.jit(jax.grad(loss(ours), argnums=(0, 1), has_aux=True))(block_xs, w)
  (want_grads, want_out) = jax.grad(loss(gathered), argnums=(0, 1), has_aux=True)(block_xs, w)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5, rtol=0)
  # a call without gradients takes the primal path, which keeps no residuals: the same outputs
  np.testing.assert_array_equal(np.asarray(jax.jit(ours)(block_xs, w)), np.asarray(out))
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  assert not np.asarray(out[used:]).any() and not np.asarray(grads[0][used:]).any()
  assert np.abs(np.asarray(grads[1].gate[1])).max() > 0 and not np.asarray(grads[1].gate[0]).any()
  # bfloat16 operands: bfloat16 outputs and gradients, within bfloat16's rounding of the fp32 ones
  bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)  # noqa: E731
  (grads16, out16) = jax.jit(jax.grad(loss(ours), argnums=(0, 1), has_aux=True))(bf16(block_xs), bf16(w))
  assert out16.dtype == jnp.bfloat16 and {g.dtype for g in jax.tree.leaves(grads16)} == {jnp.dtype(jnp.bfloat16)}
  for got, want in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads)):
    want = np.asarray(want)
    assert np.abs(np.asarray(got, np.float32) - want).max() < 0.02 * np.abs(want).max()

def test_block_swiglu_sums_an_experts_weight_gradients_in_float32():
  """bfloat16 operands, 512 blocks of one expert, every block's weight gradient the same positive
  matrix: the per-expert sums are accumulated in float32 (within bfloat16's final rounding of 512x
  one block's gradient). Summed in bfloat16 instead, each running sum stops growing once a block's
  term falls under half its spacing (8 bits of mantissa: near 256 terms), about half the true sum."""
  blocks, rows, width = 512, 4, 8
  x = jnp.full((blocks, rows, width), 0.5, jnp.bfloat16)
  w = ExpertWeights(*(jnp.full((1, width, width), 0.125, jnp.bfloat16) for _ in range(3)))
  experts = jnp.zeros((blocks,), jnp.int32)
  grads = jax.jit(jax.grad(lambda w: jnp.sum(block_swiglu(x, experts, jnp.int32(blocks), *w)
                                             .astype(jnp.float32))))(w)
  one_block = jax.grad(lambda w: jnp.sum(block_swiglu(x[:1].astype(jnp.float32), experts[:1], jnp.int32(1),
                                                      *jax.tree.map(lambda a: a.astype(jnp.float32), w))))(w)
  for got, per_block in zip(jax.tree.leaves(grads), jax.tree.leaves(one_block)):
    want = blocks * np.asarray(per_block, np.float64)
    assert got.dtype == jnp.bfloat16 and np.all(want > 0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8)


def test_blocks_layout_counts_the_used_blocks():
  """`_block_layout`'s used_blocks is sum_e ceil(count_e / b): the loop's trip count."""
  choices, _ = _routing("random")
  for block in (4, 8):
    _, _, used, num_blocks = moe_dispatch._block_layout(choices.reshape(-1), E, block)  # pylint: disable=protected-access
    counts = np.bincount(np.asarray(choices).ravel(), minlength=E)
    assert int(used) == sum(-(-c // block) for c in counts) <= num_blocks


def test_blocks_backward_holds_no_per_block_copy_of_the_weights():
  """The compiled forward + backward of `blocks` needs less temporary memory than one [G, D, F]
  copy of the blocks' expert weights: the weights are read in place and their gradients summed per
  expert (a batched matmul over gathered weights held three such copies as residuals: 19.8 MB here
  against 2.0 MB)."""
  tokens, k, experts, width = 64, 2, 8, 256
  keys = jax.random.split(jax.random.key(6), 5)
  w = ExpertWeights(*(jax.random.normal(key, (experts, width, width)) for key in keys[:3]))
  xs = jax.random.normal(keys[3], (tokens, width))
  choices = jax.random.randint(keys[4], (tokens, k), 0, experts)
  weights = jnp.full((tokens, k), 0.5)
  loss = lambda xs, w: jnp.sum(moe_dispatch.blocks(xs, choices, weights, w)[0] ** 2)  # noqa: E731
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(xs, w).compile()
  block = moe_dispatch.block_size(tokens * k, experts)
  num_blocks = (tokens * k + experts * (block - 1)) // block
  assert compiled.memory_analysis().temp_size_in_bytes < num_blocks * width * width * 4
