"""Ring-attention prefill into a sequence-sharded KV cache (rl/generation/prefill.py `prefill_prompts`, issue 14
part 5): on 8 simulated devices (data=2 x sequence=4) it equals the unsharded prefill and greedy
rollout in both layouts (zigzag, the default, and contiguous), the zigzag layout gives every device
the same causal work, its cache is split over `sequence`, and its compiled program gathers no
key/value over `sequence` (the cached-decode-kernel prefill it replaces does)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import attention as attention_module
from meshrl.model.attention import KernelConfig
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.generation.prefill import prefill_prompts, uses_ring_prefill
from meshrl.rl.step.spec import make_generator
from meshrl.sharding import make_mesh

TOK = ByteTokenizer()
PROMPT, NEW = 16, 6  # cache of 22 slots: the ring prefill rounds it up to 24 (sequence=4)
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", f"rl.max_prompt_len={PROMPT}", f"rl.max_new_tokens={NEW}",
         "model.max_seq_len=32", "model.init_std=0.5", "rl.temperature=0.0", "rl.group_size=2",
         "attention.block_q=4", "attention.block_kv=4"]
RING = ["attention.impl=ring", "mesh.data=2", "mesh.sequence=4"]


MLA = ["model.attention_type=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16"]


@pytest.mark.parametrize("zigzag,attention", [
    (True, "gqa"),
    # ~20 s each; the contiguous layout's prefill equals the zigzag one's in the default
    # test_zigzag_ring_prefill_balances_the_causal_work_and_keeps_the_cache_in_token_order.
    pytest.param(False, "gqa", marks=pytest.mark.slow),
    pytest.param(True, "mla", marks=pytest.mark.slow)])
def test_ring_prefill_and_decode_equal_the_unsharded_rollout(zigzag, attention):
  """Both layouts; MLA's cache entries (latent, rope key) take the same zigzag write-back."""
  extra = MLA if attention == "mla" else []
  cfg = configs.load("configs/tiny.py", SMALL + RING + extra + [f"attention.zigzag={zigzag}"])
  ref_cfg = configs.load("configs/tiny.py", SMALL + extra + ["attention.impl=reference"])
  mesh = make_mesh(cfg.mesh)
  _, params, extra = nnx.split(build_model(ModelConfig.from_config(cfg, mesh), mesh), nnx.Param, ...)
  prompts, mask = TOK.encode_batch(["1+2=3 and 4+5=", "33+4="], length=PROMPT, padding="left")
  assert uses_ring_prefill(ModelConfig.from_config(cfg, mesh))
  assert not uses_ring_prefill(ModelConfig.from_config(ref_cfg, None))

  # Ring prefill + sequence-sharded decode (log-sum-exp merge) vs one device, greedy: the same tokens,
  # and the same log-probabilities (so the same logits) at every step.
  ring = make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  ref = make_generator(ref_cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  a = ring(params, extra, prompts, mask, jax.random.key(0))
  b = ref(params, extra, prompts, mask, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4)
  assert np.asarray(a.response_mask).sum() > 2 * 2  # it did decode
  np.testing.assert_array_equal(np.asarray(a.routing), np.asarray(b.routing))  # prompt + response


def _prefill_with_ring_ids(cfg, prompts):
  """Runs prefill_prompts (jit) on `prompts` (all real tokens) and records the ids every ring
  attention call got -> (cache, logits, routing, [(q_pos, q_seg, kv_pos, kv_seg) per layer])."""
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  calls, real_attend = [], attention_module.attend

  def recording_attend(q, k, v, **kw):
    if kw["impl"] == "ring":
      record = lambda *ids: calls.append(tuple(np.asarray(x) for x in ids))  # noqa: E731
      jax.debug.callback(record, kw["q_positions"], kw["segment_ids"][0], kw["kv_positions"],
                         kw["segment_ids"][1])
    return real_attend(q, k, v, **kw)

  attention_module.attend = recording_attend
  try:
    cache, logits, routing = jax.jit(lambda t: prefill_prompts(model, t, t >= 0, prompts.shape[1] + 2))(
        prompts)
    jax.block_until_ready(logits)
  finally:
    attention_module.attend = real_attend
  return cache, logits, routing, calls


def _causal_pairs_per_device(q_pos, q_seg, kv_pos, kv_seg, devices):
  """Unmasked (prompt query, key) pairs of each device's query shard: [devices]."""
  live = (q_pos[:, :, None] >= kv_pos[:, None, :]) & (q_seg[:, :, None] == kv_seg[:, None, :])
  live &= (q_seg == 1)[:, :, None]  # the prompt's own tokens (the empty tail is not its work)
  return live.sum(axis=(0, 2)).reshape(devices, -1).sum(axis=1)


def test_zigzag_ring_prefill_balances_the_causal_work_and_keeps_the_cache_in_token_order(reorder_close):
  """62 prompt tokens + 2 new on sequence=4: with the zigzag layout every device's queries have
  within 10% of the mean causal work (contiguous: the last device 1.6x the mean, the first 0.3x),
  and the cache, logits and routing are those of the contiguous layout (token order)."""
  sizes = ["rl.max_prompt_len=62", "rl.max_new_tokens=2", "model.max_seq_len=64"]
  prompts = jax.random.randint(jax.random.key(3), (2, 62), 3, 200)
  runs = {}
  for zigzag in (True, False):
    cfg = configs.load("configs/tiny.py", SMALL + RING + sizes + [f"attention.zigzag={zigzag}"])
    runs[zigzag] = _prefill_with_ring_ids(cfg, prompts)
    calls = runs[zigzag][3]
    assert len(calls) == cfg.model.num_layers
    work = _causal_pairs_per_device(*calls[0], devices=4)
    assert work.sum() == 2 * 62 * 63 // 2  # every prompt pair once, whatever the layout
    balance = work.max() / work.mean()
    assert (balance < 1.1) if zigzag else (balance > 1.5), (zigzag, work)
  (zig_cache, zig_logits, zig_routing, _), (cache, logits, routing, _) = runs[True], runs[False]
  np.testing.assert_array_equal(np.asarray(zig_cache.positions), np.asarray(cache.positions))
  np.testing.assert_array_equal(np.asarray(zig_cache.segment_ids), np.asarray(cache.segment_ids))
  for a, b in zip(jax.tree.leaves(zig_cache.layers), jax.tree.leaves(cache.layers)):
    reorder_close(a, b, what="cache entry")
  assert all(s.spec[2] == "sequence" for s in
             (x.sharding for x in jax.tree.leaves(zig_cache.layers)))
  np.testing.assert_allclose(np.asarray(zig_logits), np.asarray(logits), atol=1e-4)
  np.testing.assert_array_equal(np.asarray(zig_routing), np.asarray(routing))


def _prefill_gathers(cfg, length):
  """All-gathers of floating-point arrays with a `length`-long axis (the cache's keys/values) in the
  compiled prefill of rl/step/aot.py, and the compiled program."""
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  program = aot.prefill_program(cfg, make_mesh(cfg.mesh))
  compiled = program.fn.lower(*program.args).compile()
  gathers = re.findall(r"= ((?:f32|bf16)\[[\d,]*\]).*? all-gather(?:-start)?\(", compiled.as_text())
  return [g for g in gathers if re.search(rf"[\[,]{length}[\],]", g)], compiled


def test_compiled_ring_prefill_gathers_no_keys_or_values():
  sizes = ["rl.max_prompt_len=92", "rl.max_new_tokens=4", "model.max_seq_len=96",
           "rl.prompts_per_step=2", "attention.block_q=8", "attention.block_kv=8", "model.num_layers=1"]
  ring_gathers, compiled = _prefill_gathers(configs.load("configs/tiny.py:dense", SMALL + RING + sizes), 96)
  assert ring_gathers == []
  cache_out = compiled.output_shardings[0]  # the prefilled cache: cache_length split over `sequence`
  assert all(s.spec[2] == "sequence" for s in jax.tree.leaves(cache_out.layers))
  # The prefill it replaces (the decode kernel, queries replicated) gathers the cache's K/V.
  old_gathers, _ = _prefill_gathers(configs.load("configs/tiny.py:dense", SMALL + sizes + [
      "attention.impl=blockwise", "mesh.data=2", "mesh.sequence=4"]), 96)
  assert old_gathers


def test_ring_prefill_names_a_cache_that_cannot_be_split():
  cfg = configs.load("configs/tiny.py", SMALL + RING + ["model.max_seq_len=22"])
  mesh = make_mesh(cfg.mesh)
  model = nnx.eval_shape(lambda: Transformer(ModelConfig.from_config(cfg, mesh), rngs=nnx.Rngs(0)))
  prompts = jnp.zeros((2, PROMPT), jnp.int32)
  with pytest.raises(ValueError, match=r"rounded up to a multiple of 2 x mesh.sequence=8 "
                                       r"\(attention.zigzag\) is 24, above model.max_seq_len=22"):
    jax.eval_shape(lambda t: prefill_prompts(model, t, t > 0, PROMPT + NEW), prompts)
  cfg = configs.load("configs/tiny.py", SMALL + RING + ["model.max_seq_len=22", "attention.zigzag=false"])
  model = nnx.eval_shape(lambda: Transformer(ModelConfig.from_config(cfg, mesh), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"rounded up to a multiple of mesh.sequence=4 is 24, above "
                                       r"model.max_seq_len=22"):
    jax.eval_shape(lambda t: prefill_prompts(model, t, t > 0, PROMPT + NEW), prompts)
  with pytest.raises(ValueError, match=r"inputs_zigzag .* needs impl='ring' and a mesh; got "
                                       r"impl='blockwise'"):
    KernelConfig("blockwise", mesh=mesh, inputs_zigzag=True)


@pytest.mark.slow  # about 10 s on a loaded 2-core machine (a libtpu compile)
def test_ring_prefill_compiles_for_tpu_without_gathering_keys_or_values():
  """The ring prefill lowers for TPU (v5p 2x2x1: expert=2 x sequence=2): the keys/values move only
  round the ring (collective-permute); what is all-gathered is smaller than one layer's prompt K/V."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (the tpu extra)")
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [
      "rl.prompts_per_step=4", "rl.max_prompt_len=8", "rl.max_new_tokens=8", "model.max_seq_len=16",
      "mesh.expert=2", "mesh.sequence=2", "attention.impl=ring"])
  report = aot.compile_steps(cfg, "v5p:2x2x1", ["prefill"])[0]
  mc = ModelConfig.from_config(cfg)
  layer_kv = 4 * 16 * mc.num_kv_heads * mc.head_dim * 2 * jnp.dtype(mc.dtype).itemsize
  assert report.fits is True and report.collective_bytes["collective-permute"] > 0
  assert report.collective_bytes.get("all-gather", 0) < layer_kv
