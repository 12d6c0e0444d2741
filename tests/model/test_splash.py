"""Splash attention as the blockwise kernel's local compute (model/splash.py).

On CPU splash runs in Pallas interpret mode: it must equal the jnp kernel and the reference
(outputs and q/k/v gradients, fp32, causal, GQA, packed documents cut inside a block, a length
that is padded); the model uses it only for self-attention calls (a KV-cache call or separate
query/key ids fall back to jnp); and on a TPU topology the blockwise model compiles into the three
splash Pallas kernels (forward, dq, dkv) through libtpu, when libtpu is installed.
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
from meshrl.model import splash
from meshrl.model.attention import KernelConfig
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig

B, T, N, K, H = 2, 200, 4, 2, 32  # T pads to 256 = two 128-blocks; GQA with 2 heads per kv head
TINY = ["model.num_layers=1", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
        "moe.num_experts=0", "model.max_seq_len=256", "attention.impl=blockwise"]


def _inputs(attention_cases):
  """Row 0 packs three documents, cut at 100 and 150 (inside the 128-blocks); row 1 is one document."""
  q, k, v, d_out, seg, pos = attention_cases.packed_inputs(B, T, N, K, H, cuts=(100, 150))
  return q, k, v, d_out, jnp.asarray(seg), jnp.asarray(pos)


def test_splash_equals_jnp_kernel_and_reference_with_gradients(attention_cases):
  q, k, v, d_out, seg, pos = _inputs(attention_cases)
  scale = H ** -0.5
  impls = {
      "splash": lambda q, k, v: splash.splash_attend(q, k, v, seg, scale=scale, block_q=128,
                                                     block_kv=128, interpret=True),
      "jnp": lambda q, k, v: ra.attend(q, k, v, impl="blockwise", q_positions=pos, kv_positions=pos,
                                       segment_ids=seg, scale=scale, block_q=64, block_kv=64),
      "reference": lambda q, k, v: ra.attend(q, k, v, impl="reference", q_positions=pos,
                                             kv_positions=pos, segment_ids=seg, scale=scale)}
  results = attention_cases.outputs_and_grads(impls, q, k, v, d_out)
  out, grads = results["splash"]
  assert float(jnp.abs(out).max()) > 0.1
  for other in ("jnp", "reference"):
    np.testing.assert_allclose(out, results[other][0], atol=1e-5, err_msg=other)
    for name, g, g_other in zip("qkv", grads, results[other][1]):
      np.testing.assert_allclose(g, g_other, atol=1e-4, rtol=1e-4, err_msg=f"d{name} vs {other}")


@pytest.mark.slow  # about 10 s on a quiet 2-core machine (interpret-mode kernels compile)
def test_splash_without_segment_ids_equals_reference(attention_cases):
  """One causal document per row: the padded keys are masked by causality alone."""
  q, k, v, d_out, _, _ = _inputs(attention_cases)
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * d_out)
  grads = jax.jit(jax.grad(loss(lambda q, k, v: splash.splash_attend(
      q, k, v, scale=0.2, block_q=512, block_kv=256, interpret=True)), argnums=(0, 1, 2)))(q, k, v)
  expected = jax.grad(loss(lambda q, k, v: ra.attend(q, k, v, impl="reference", scale=0.2)),
                      argnums=(0, 1, 2))(q, k, v)
  for name, g, g_ref in zip("qkv", grads, expected):
    np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")



def test_kernel_config_uses_splash_only_for_self_attention(attention_cases):
  """local_kernel="splash" runs splash for a self-attention call and falls back to the jnp kernel,
  with the same result, for a KV-cache call or separate query/key ids (no error)."""
  q, k, v, _, seg, pos = _inputs(attention_cases)
  kernel = KernelConfig("blockwise", 64, 64, local_kernel="splash")
  assert kernel.local_kernel_name == "splash" and "interpret mode" in kernel.summary()
  assert KernelConfig("blockwise").local_kernel_name == "jnp"  # auto on CPU
  assert KernelConfig("blockwise", local_kernel="jnp").local_kernel_name == "jnp"
  call = lambda **kw: lambda q, k, v: kernel(q, k, v, scale=0.1, **kw)
  assert attention_cases.calls_pallas(call(q_positions=pos, kv_positions=pos, segment_ids=seg), q, k, v)
  jnp_kernel = dataclasses.replace(kernel, local_kernel="jnp")
  unsupported = {
      "cached": dict(q_positions=pos, kv_positions=pos, segment_ids=(seg, seg), cached=True),
      "other positions": dict(q_positions=pos, kv_positions=pos + 0, segment_ids=seg),
      "separate segment ids": dict(q_positions=pos, kv_positions=pos, segment_ids=(seg, seg))}
  for what, kw in unsupported.items():
    assert splash.unsupported_reason(q, k, q_positions=kw["q_positions"],
                                     kv_positions=kw["kv_positions"], segment_ids=kw["segment_ids"],
                                     cached=kw.get("cached", False)) is not None, what
    fallback = str(jax.make_jaxpr(call(**kw))(q, k, v))
    assert "pallas_call" not in fallback, what
    assert fallback == str(jax.make_jaxpr(lambda q, k, v, kw=kw: jnp_kernel(q, k, v, scale=0.1, **kw))(
        q, k, v)), what  # the jnp kernel's own program
  assert splash.unsupported_reason(q, k[:, :128], q_positions=pos, kv_positions=pos,
                                   segment_ids=seg, cached=False).startswith("q_len=200")


def test_bad_local_kernel_names_the_field_and_choices():
  with pytest.raises(ValueError, match=r"attention.local_kernel='flash'; choose one of auto, jnp, "
                                       r"splash"):
    KernelConfig("blockwise", local_kernel="flash")
  KernelConfig("ring", local_kernel="splash")  # ring block pairs: tests/model/test_splash_ring.py
  from meshrl.rl.step.driver import check_config  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"attention.local_kernel='pallas'"):
    check_config(configs.load("configs/tiny.py", ["attention.local_kernel=pallas"]))
  with pytest.raises(ValueError, match=r"needs attention.impl='blockwise' or 'ring', got 'reference'"):
    check_config(configs.load("configs/tiny.py", ["attention.local_kernel=splash"]))


def _with_kernel(mc: ModelConfig, local_kernel: str) -> ModelConfig:
  return dataclasses.replace(mc, kernel=dataclasses.replace(mc.kernel, local_kernel=local_kernel))


@pytest.mark.slow  # about 15 s on a quiet 2-core machine (two models' forward + backward compile)
def test_model_with_splash_equals_jnp_on_rollout_layout(attention_cases):
  """The RL update's layout (rl/generation/core.py): left-padded prompts and an invalid tail, both segment
  0 at position 0, real tokens segment 1. Splash and jnp agree on every real token's logits and on
  the gradient of a loss over real tokens (pad rows may differ: no real token sees them)."""
  mc = ModelConfig.from_config(configs.load("configs/tiny.py", TINY))
  length, pads, tail = 40, np.array([5, 0]), np.array([3, 9])
  index = np.arange(length)[None]
  real = (index >= pads[:, None]) & (index < length - tail[:, None])
  positions = jnp.asarray(np.where(real, index - pads[:, None], 0), jnp.int32)
  segments = jnp.asarray(real, jnp.int32)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 259, (2, length)), jnp.int32)
  results = {}
  for name in ("splash", "jnp"):
    graphdef, state = nnx.split(build_model(_with_kernel(mc, name)))

    def loss(state, graphdef=graphdef):
      logits = nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segments).logits
      logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
      picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      return -jnp.sum(picked * segments[:, :-1] * segments[:, 1:]), logits  # real -> real only

    assert attention_cases.calls_pallas(loss, state) == (name == "splash")
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    results[name] = (np.asarray(logits)[real], jax.tree.leaves(grads))
  np.testing.assert_allclose(results["splash"][0], results["jnp"][0], atol=1e-5)
  for g, g_jnp in zip(results["splash"][1], results["jnp"][1]):
    np.testing.assert_allclose(g, g_jnp, atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # 15-20 s (a TPU compile); CI's tests/scripts AOT compiles cover the TPU lowering
def test_blockwise_model_compiles_splash_for_v5p():
  """attention.local_kernel=auto on a v5p 2x2x1 mesh (fsdp=2 x tensor=2): the model's blockwise
  forward + backward compiles through libtpu with splash's three Pallas kernels in the program."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  from meshrl.sharding.rules import rules_from_config  # pylint: disable=import-outside-toplevel
  from meshrl.train.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import abstract_train_state  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import Transformer  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", TINY + ["mesh.fsdp=2", "mesh.tensor=2"])
  mesh = aot.topology_mesh(cfg, aot.topology_devices("v5p:2x2x1"))
  mc = ModelConfig.from_config(cfg, mesh)
  assert mc.kernel.local_kernel_name == "splash"  # auto on TPU
  assert "splash kernel" in mc.kernel.summary() and "interpret" not in mc.kernel.summary()
  graphdef, state = abstract_train_state(lambda: Transformer(mc, rngs=nnx.Rngs(0)),
                                         make_optimizer(cfg.optim), mesh, rules_from_config(cfg.mesh))
  batch, length = 4, 256
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32,
                                sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))

  def loss(params, tokens):
    model = nnx.merge(graphdef, params, state.extra)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    segments = (tokens > 3).astype(jnp.int32)
    return model(tokens, positions=positions, segment_ids=segments).logits.mean()

  hlo = jax.jit(jax.grad(loss)).lower(state.params, tokens).compile().as_text()
  assert 'custom_call_target="tpu_custom_call"' in hlo
  assert set(re.findall(r"splash_mha_(fwd|dq|dkv)_segmented", hlo)) == {"fwd", "dq", "dkv"}
