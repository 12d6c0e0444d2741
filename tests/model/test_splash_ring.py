"""Ring attention with splash computing its block pairs (model/splash_ring.py, issue 9).

On CPU the Pallas kernels run in interpret mode, on 8 simulated devices: the splash ring must equal
the jnp ring (outputs and q/k/v gradients, fp32, GQA, packed documents whose boundaries fall inside
chunks, positions restarting) in both layouts; the model's loss and parameter gradients on a zigzag
batch, and the ring prefill's logits, cache and greedy rollout, must equal the jnp kernel's; calls
it cannot serve fall back; and a ring model compiles for a v5p topology with splash's kernels and the
ring's collective permutes, when libtpu is installed.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import ring_attention as ra
from meshrl.model import splash_ring
from meshrl.model.attention import KernelConfig
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import make_mesh

B, T, N, K, H = 2, 1024, 4, 2, 32  # 4 sequence shards: zigzag chunks of 128, GQA 2 heads per kv head
SEQUENCE = 4


def _mesh(**axes):
  cfg = configs.load("configs/tiny.py", [f"mesh.{name}={size}" for name, size in axes.items()])
  return make_mesh(cfg.mesh)


def _inputs(attention_cases, zigzag: bool):
  """Row 0 packs three documents cut at 300 and 700 (inside chunks and shards); row 1 is one
  document; all put in the zigzag layout when asked."""
  arrays = attention_cases.packed_inputs(B, T, N, K, H, cuts=(300, 700))
  if zigzag:
    arrays = tuple(ra.zigzag(x, SEQUENCE) for x in arrays)
  return arrays



@pytest.mark.parametrize("zigzag", [
    True,
    # suite budget: the contiguous forward runs in test_a_full_cache_call_in_token_order_is_not_taken_for_zigzag
    pytest.param(False, marks=pytest.mark.slow)])
def test_splash_ring_equals_jnp_ring_with_gradients(attention_cases, zigzag):
  """fsdp=2 x sequence=4. Zigzag: each step j > 0 is one rectangle picked at run time (all queries
  against the first key chunk, or the second query chunk against both); contiguous: whole or
  nothing. A flipped choice, a merge by the wrong log-sum-exp, or a backward fed with the pair's
  own log-sum-exp instead of the global one each breaks this."""
  mesh = _mesh(fsdp=2, sequence=SEQUENCE)
  q, k, v, d_out, seg, pos = (jnp.asarray(x) for x in _inputs(attention_cases, zigzag))
  impls = {
      "splash": lambda q, k, v: splash_ring.ring_splash_attend(
          q, k, v, seg, mesh=mesh, zigzag=zigzag, scale=0.2, block_q=128, block_kv=128, interpret=True),
      "jnp": lambda q, k, v: ra.attend(q, k, v, impl="ring", mesh=mesh, q_positions=pos,
                                       kv_positions=pos, segment_ids=seg, scale=0.2, block_q=128,
                                       block_kv=128)}
  results = attention_cases.outputs_and_grads(impls, q, k, v, d_out)
  out, grads = results["splash"]
  assert float(jnp.abs(out).max()) > 0.5
  np.testing.assert_allclose(out, results["jnp"][0], atol=1e-5)
  for name, g, g_jnp in zip("qkv", grads, results["jnp"][1]):
    assert float(jnp.abs(g_jnp).max()) > 0.5
    np.testing.assert_allclose(g, g_jnp, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


def test_unsupported_calls_fall_back_and_bad_kernels_are_named(attention_cases):
  """A length whose chunks are not whole 128-lane blocks, separate query/key ids or other positions
  run the jnp ring (no Pallas call, the same result) under local_kernel="splash"."""
  mesh = _mesh(fsdp=2, sequence=SEQUENCE)
  kernel = KernelConfig("ring", 64, 64, mesh, local_kernel="splash", zigzag=True, inputs_zigzag=True)
  assert kernel.local_kernel_name == "splash" and "ring over `sequence`, splash" in kernel.summary()
  assert KernelConfig("ring", mesh=mesh).local_kernel_name == "jnp"  # auto on CPU
  q, k, v, _, seg, pos = (jnp.asarray(x) for x in _inputs(attention_cases, True))
  call = lambda q, k, v, pos=pos, seg=seg: kernel(q, k, v, q_positions=pos, kv_positions=pos,  # noqa: E731
                                                  segment_ids=seg, scale=0.2)
  assert attention_cases.calls_pallas(call, q, k, v)
  short = (q[:, :512], k[:, :512], v[:, :512])  # chunks of 64 tokens
  reason = splash_ring.unsupported_reason(short[0], short[1], mesh=mesh, q_positions=pos, kv_positions=pos,
                                          segment_ids=seg, zigzag=True)
  assert reason == "length 512 is not a multiple of 8 chunks x 128 lanes (mesh.sequence=4, zigzag)"
  short_call = lambda q, k, v: call(q, k, v, pos=pos[:, :512], seg=seg[:, :512])  # noqa: E731
  assert not attention_cases.calls_pallas(short_call, *short)
  jnp_kernel = dataclasses.replace(kernel, local_kernel="jnp")
  np.testing.assert_allclose(
      jax.jit(short_call)(*short),
      jax.jit(lambda q, k, v: jnp_kernel(q, k, v, q_positions=pos[:, :512], kv_positions=pos[:, :512],
                                         segment_ids=seg[:, :512], scale=0.2))(*short), atol=1e-6)
  for kw in (dict(q_positions=pos, kv_positions=pos + 0, segment_ids=seg),
             dict(q_positions=pos, kv_positions=pos, segment_ids=(seg, seg))):
    assert splash_ring.unsupported_reason(q, k, mesh=mesh, zigzag=True, **kw) is not None
    assert not attention_cases.calls_pallas(lambda q, k, v, kw=kw: kernel(q, k, v, scale=0.2, **kw), q, k, v)
  with pytest.raises(ValueError, match=r"local_kernel='splash' needs attention.impl='blockwise' or "
                                       r"'ring', got 'reference'"):
    KernelConfig("reference", local_kernel="splash")


# Dense (the MoE layers do not touch attention; suite budget), two layers so that the second layer's
# keys and values depend on the first one's attention.
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.num_experts=0", "model.max_seq_len=512", "model.init_std=0.3",
         "attention.impl=ring", "attention.block_q=128", "attention.block_kv=128"]


def _with_kernel(mc: ModelConfig, local_kernel: str) -> ModelConfig:
  return dataclasses.replace(mc, kernel=dataclasses.replace(mc.kernel, local_kernel=local_kernel))


@pytest.mark.parametrize("zigzag", [True, pytest.param(False, marks=pytest.mark.slow)])  # contiguous: suite budget
def test_model_equals_the_jnp_ring_in_either_layout(attention_cases, zigzag):
  """fsdp=2 x sequence=2 x tensor=2 (heads split too), a packed batch of 512 tokens: the model's logits
  and every parameter gradient of a next-token loss equal the jnp ring's, on a zigzag batch given to
  the model copy told so (`with_kernel(inputs_zigzag=True)`, as the RL update and SFT do) and on a
  token-order batch given to the model as built (distillation, benchmarks: attention.zigzag is on in
  the config, but these callers do not lay their tokens out zigzag)."""
  cfg = configs.load("configs/tiny.py", SMALL + ["mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2"])
  mesh = make_mesh(cfg.mesh)
  mc = ModelConfig.from_config(cfg, mesh)
  assert mc.kernel.zigzag  # the config's default layout for ring attention
  length, rng = 512, np.random.RandomState(0)
  tokens = rng.randint(0, 259, (2, length + 1)).astype(np.int32)
  seg = np.stack([np.repeat([1, 2], [200, 312]), np.ones(length, int)]).astype(np.int32)
  pos = np.stack([np.r_[np.arange(200), np.arange(312)], np.arange(length)]).astype(np.int32)
  weights = (seg == np.roll(seg, -1, axis=1)).astype(np.float32)  # next token in the same document
  layout = (lambda x: ra.zigzag(x, 2)) if zigzag else (lambda x: x)
  batch = [jnp.asarray(layout(x)) for x in (tokens[:, :-1], tokens[:, 1:], seg, pos, weights)]
  results = {}
  for name in ("splash", "jnp"):
    model = build_model(_with_kernel(mc, name), mesh)
    graphdef, state = nnx.split(model.with_kernel(inputs_zigzag=True) if zigzag else model)

    def loss(state, graphdef=graphdef):
      inputs, targets, seg, pos, weights = batch
      logits = nnx.merge(graphdef, state)(inputs, positions=pos, segment_ids=seg).logits
      picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
      return -jnp.sum(picked * weights) / jnp.sum(weights), logits

    assert attention_cases.calls_pallas(loss, state) == (name == "splash")
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    results[name] = (value, logits, jax.tree.leaves(grads))
  np.testing.assert_allclose(results["splash"][0], results["jnp"][0], rtol=1e-6)
  np.testing.assert_allclose(results["splash"][1], results["jnp"][1], atol=1e-4)
  for g, g_jnp in zip(results["splash"][2], results["jnp"][2]):
    np.testing.assert_allclose(g, g_jnp, atol=1e-5, rtol=1e-4)


def test_ring_prefill_with_splash_equals_the_jnp_ring_prefill(attention_cases, reorder_close):
  """Two prompts of up to 500 tokens, left-padded, in a 512-slot cache on data=2 x sequence=2 x
  tensor=2, zigzag: the prefill's block pairs run on splash (keys and values read back from the
  token-order cache and put in the queries' layout) and every layer's cache entries and the next-token
  logits equal the jnp ring prefill's (what the decode steps, the same code for both, start from)."""
  from meshrl.model.tokenizer import ByteTokenizer  # pylint: disable=import-outside-toplevel
  from meshrl.rl.generation.prefill import prefill_prompts  # pylint: disable=import-outside-toplevel
  tok, prompt_len, new = ByteTokenizer(), 500, 12
  base = SMALL + [f"rl.max_prompt_len={prompt_len}", f"rl.max_new_tokens={new}",
                  "mesh.data=2", "mesh.sequence=2", "mesh.tensor=2"]
  texts = ["12+7=19. " * 40 + "3+4=", "a long prompt of bytes " * 10]
  prompts, mask = tok.encode_batch(texts, length=prompt_len, padding="left")
  results = {}
  for name in ("splash", "jnp"):
    cfg = configs.load("configs/tiny.py", base + [f"attention.local_kernel={name}"])
    mesh = make_mesh(cfg.mesh)
    model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
    prefill = lambda p, m, model=model: prefill_prompts(model, p, m, prompt_len + new)[:2]  # noqa: E731
    assert attention_cases.calls_pallas(prefill, prompts, mask) == (name == "splash")
    results[name] = jax.jit(prefill)(prompts, mask)
  (cache, logits), (cache_jnp, logits_jnp) = results["splash"], results["jnp"]
  assert cache.max_len == 512
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_jnp), atol=1e-4)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_jnp)):  # summed in another order
    reorder_close(a, b, what="cache entry")


@pytest.mark.slow  # a libtpu compile, ~20 s
def test_ring_model_compiles_splash_for_v5p():
  """attention.local_kernel=auto, impl=ring on v5p 2x2x2 (fsdp=2 x sequence=2 x tensor=2): the
  model's forward + backward compiles through libtpu with splash's forward, dq and dkv kernels, and
  the ring moves keys and gradients only by collective permutes (no all-gather, no all-reduce)."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import Transformer  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  from meshrl.sharding.rules import rules_from_config  # pylint: disable=import-outside-toplevel
  from meshrl.train.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import abstract_train_state  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", SMALL + ["mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2"])
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5p:2x2x2"))
  mc = ModelConfig.from_config(cfg, mesh)
  assert mc.kernel.local_kernel_name == "splash"  # auto on TPU
  assert "ring over `sequence`, splash kernel" in mc.kernel.summary() and "interpret" not in mc.kernel.summary()
  graphdef, state = abstract_train_state(lambda: Transformer(mc, rngs=nnx.Rngs(0)),
                                         make_optimizer(cfg.optim), mesh, rules_from_config(cfg.mesh))
  batch, length = 4, 512
  split = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=split)

  def loss(params, tokens):
    model = nnx.merge(graphdef, params, state.extra)
    positions = ra.zigzag(jnp.broadcast_to(jnp.arange(length), tokens.shape), 2)
    return model(tokens, positions=positions, segment_ids=(tokens > 3).astype(jnp.int32)).logits.mean()

  hlo = jax.jit(jax.grad(loss)).lower(state.params, tokens).compile().as_text()
  assert set(re.findall(r"splash_mha_(fwd|dq|dkv)_segmented", hlo)) == {"fwd", "dq", "dkv"}
  ring_ops = [line for line in hlo.splitlines() if "ring_splash_attention" in line]
  assert any(" collective-permute-start(" in line for line in ring_ops)  # keys round the ring
  assert not any(" all-gather" in line or " all-reduce" in line for line in ring_ops)


def test_a_full_cache_call_in_token_order_is_not_taken_for_zigzag(attention_cases):
  """A cached call whose queries fill the cache on a model whose training layout is zigzag
  (attention.zigzag) but whose inputs are in token order (not the ring prefill's own copy,
  inputs_zigzag=False): splash runs the contiguous ring and equals the jnp ring."""
  mesh = _mesh(fsdp=2, sequence=SEQUENCE)
  q, k, v, _, seg, pos = (jnp.asarray(x) for x in _inputs(attention_cases, False))
  kw = dict(q_positions=pos, kv_positions=pos + 0, segment_ids=(seg, seg + 0), scale=0.2, cached=True)
  splash_kernel = KernelConfig("ring", 128, 128, mesh, local_kernel="splash", zigzag=True)
  jnp_kernel = dataclasses.replace(splash_kernel, local_kernel="jnp")
  assert attention_cases.calls_pallas(lambda q, k, v: splash_kernel(q, k, v, **kw), q, k, v)
  np.testing.assert_allclose(jax.jit(lambda q, k, v: splash_kernel(q, k, v, **kw))(q, k, v),
                             jax.jit(lambda q, k, v: jnp_kernel(q, k, v, **kw))(q, k, v), atol=1e-5)


def test_the_rl_update_and_log_probs_tell_the_splash_ring_their_batches_are_zigzag():
  """build_run on a ring mesh with attention.zigzag: the update batch is laid out zigzag, and the run's
  log-prob program and loss (rl_loss with the run's LossSpec, as make_update calls it) on it equal the
  jnp ring's under splash (a splash ring left at token order gives other numbers)."""
  from meshrl.model.tokenizer import ByteTokenizer  # pylint: disable=import-outside-toplevel
  from meshrl.rl.batches.handover import UpdateBatch, zigzag_batch  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.program import build_run  # pylint: disable=import-outside-toplevel
  from meshrl.rl.algo.update import rl_loss  # pylint: disable=import-outside-toplevel
  base = SMALL + ["mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2", "rl.max_prompt_len=500",
                  "rl.max_new_tokens=12", "rl.prompts_per_step=2", "rl.group_size=2", "rl.kl_coef=0.0"]
  rng = np.random.RandomState(0)
  shape = (4, 512)
  tokens = rng.randint(0, 259, shape).astype(np.int32)
  mask = np.zeros(shape, bool)
  mask[:, 500:] = True
  host = UpdateBatch(tokens=tokens, positions=np.broadcast_to(np.arange(512, dtype=np.int32), shape).copy(),
                     segment_ids=np.ones(shape, np.int32), targets=np.roll(tokens, -1, axis=1), loss_mask=mask,
                     old_logprobs=np.full(shape, -5.0, np.float32),
                     advantages=rng.normal(size=shape).astype(np.float32))
  results = {}
  for name in ("splash", "jnp"):
    cfg = configs.load("configs/tiny.py", base + [f"attention.local_kernel={name}"])
    mesh = make_mesh(cfg.mesh)
    run = build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), ByteTokenizer())
    assert run.zigzag_shards == 2 and run.spec.zigzag_inputs
    batch = jax.tree.map(jnp.asarray, zigzag_batch(host, run.zigzag_shards))
    logp, _ = run.logprob_fn(run.state.params, run.state.extra, batch)
    loss, _ = jax.jit(lambda params, extra, batch, run=run: rl_loss(params, extra, run.graphdef, batch, run.spec))(
        run.state.params, run.state.extra, batch)
    results[name] = (np.asarray(logp), float(loss))
    run.close()
  np.testing.assert_allclose(results["splash"][0], results["jnp"][0], atol=1e-4)  # log-probs of ~-10
  np.testing.assert_allclose(results["splash"][1], results["jnp"][1], rtol=1e-5)


@pytest.mark.slow  # ~25 s: two SFT steps compiled, one in interpret mode
def test_the_sft_step_tells_the_splash_ring_its_rows_are_zigzag():
  """make_sft_step on a ring mesh with attention.zigzag lays its rows out zigzag and tells splash's
  ring so: its loss equals the jnp ring's."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs import TaskMixture
  from meshrl.sharding.rules import rules_from_config
  from meshrl.train.data import make_sft_data
  from meshrl.train.optim import make_optimizer
  from meshrl.train.sft import batch_sharding, make_sft_step, put_batch, zigzag_shards
  from meshrl.train.state import create_train_state, shardings_of
  # pylint: enable=import-outside-toplevel
  base = SMALL + ["mesh.fsdp=2", "mesh.sequence=2", "mesh.tensor=2", "data.seq_len=512", "rl.sft_batch_size=4"]
  losses = {}
  for name in ("splash", "jnp"):
    cfg = configs.load("configs/tiny.py", base + [f"attention.local_kernel={name}"])
    mesh = make_mesh(cfg.mesh)
    tx = make_optimizer(cfg.optim)
    graphdef, state = create_train_state(build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), tx, mesh)
    step = make_sft_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state))
    host = next(make_sft_data(cfg, source=TaskMixture("arithmetic:1.0,reverse:1.0", seed=0)))
    assert zigzag_shards(cfg, mesh) == 2
    rows = put_batch(host, batch_sharding(mesh, rules_from_config(cfg.mesh)), zigzag_over=2)
    _, metrics = step(state, rows)
    losses[name] = float(metrics["loss"])
  np.testing.assert_allclose(losses["splash"], losses["jnp"], rtol=1e-5)
