"""What int8 generation costs against full precision, measured through the generation engine.

  report = int8_quality(mc, params, extra, prompts, new_tokens=256)

Each variant (int8 KV cache, int8 weights, both) generates greedily through a Generator (the same
decode core as rollouts and the server), and its first divergence is measured against full
precision's greedy text; the logits' error is measured teacher-forced over prompt + the full-precision
continuation with the variant's cache and weights. scripts/quant_report.py runs it on a checkpoint.

Axis legend: P prompts, Lp prompt length, N new tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.model import kv_cache as kvc
from meshrl.model import quant
from meshrl.model.transformer import ModelConfig
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import Generator, model_graph
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.generation.weights import WeightsSpec


def _generator(mc: ModelConfig, prompt_len: int, new_tokens: int, *, kv: str, weights: str) -> Generator:
  """Greedy, no stop token (every row runs N tokens), one sample per prompt."""
  total = prompt_len + new_tokens
  mc = dataclasses.replace(mc, max_seq_len=max(mc.max_seq_len, total), kv_cache_dtype=kv)
  spec = GenerationSpec(step=StepConfig(sampler=Sampler(0.0), stop_tokens=(), pad_id=0), group_size=1,
                        prompt_len=prompt_len, max_new_tokens=new_tokens, weights=WeightsSpec(weights=weights))
  return Generator(spec, mc)


def int8_quality(mc: ModelConfig, params, extra, prompts, *, new_tokens: int = 256) -> dict[str, float]:
  """params/extra: the model's full-precision Param and non-Param States; prompts [P, Lp] int token
  ids, no padding. Returns floats:
    int8_kv_greedy_agreement       fraction of the P x N greedy tokens equal to full precision's,
                                   position by position (a divergence counts every token after it)
    int8_kv_max_logit_err          max |logit - full-precision logit| teacher-forced over prompt + the
                                   full-precision continuation (the int8 cache read by every position)
    int8_kv_cache_bytes_ratio      bytes of the int8 cache (values + scales) / a bfloat16 cache's
    int8_weights_greedy_agreement, int8_weights_max_logit_err   the same for int8 weights
    int8_all_greedy_agreement      int8 weights and int8 cache together
  """
  prompts = jnp.asarray(prompts, jnp.int32)
  num, prompt_len = prompts.shape
  mask = jnp.ones_like(prompts, bool)
  key = jax.random.key(0)

  def greedy(kv: str, weights: str) -> jax.Array:
    out = _generator(mc, prompt_len, new_tokens, kv=kv, weights=weights)(params, extra, prompts, mask, key)
    return out.tokens[:, prompt_len:]

  reference = greedy("model", "full")
  sequence = jnp.concatenate([prompts, reference], axis=1)

  @functools.cache
  def teacher_forced(kv: str, weights: str):
    gen = _generator(mc, prompt_len, new_tokens, kv=kv, weights=weights)

    @jax.jit
    def logits(p):
      model = nnx.merge(gen.graphdef, p, extra)
      return model(sequence, cache=model.init_cache(num, sequence.shape[1])).logits
    return logits(gen.prepare(params))

  agreement = lambda tokens: float(jnp.mean(tokens == reference))  # noqa: E731
  max_err = lambda logits: float(jnp.max(jnp.abs(logits - teacher_forced("model", "full"))))  # noqa: E731
  int8_mc = dataclasses.replace(mc, kv_cache_dtype="int8")
  graphdef_q8 = model_graph(int8_mc)[0]
  int8_cache = jax.eval_shape(lambda: nnx.merge(graphdef_q8, params, extra).init_cache(num, sequence.shape[1]))
  bf16_cache = jax.eval_shape(lambda: kvc.init_cache(mc.cache_entry_shapes(), num, sequence.shape[1], jnp.bfloat16))
  return {
      "int8_kv_greedy_agreement": agreement(greedy("int8", "full")),
      "int8_kv_max_logit_err": max_err(teacher_forced("int8", "full")),
      "int8_kv_cache_bytes_ratio": quant.kv_cache_bytes(int8_cache) / quant.kv_cache_bytes(bf16_cache),
      "int8_weights_greedy_agreement": agreement(greedy("model", "int8")),
      "int8_weights_max_logit_err": max_err(teacher_forced("model", "int8")),
      "int8_all_greedy_agreement": agreement(greedy("int8", "int8")),
  }

