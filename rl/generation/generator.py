"""Generators: the one decode core behind a call, for every consumer.

  gen = Generator(spec, mc, mesh=mesh, rules=rules, draft=(draft_mc, draft_params))
  batch = gen(params, extra, prompts [P, Lp], prompt_mask, key, max_lengths=None, version=0)
  gen.metrics                          # the last call's acceptance rate and tokens per forward
  pool, counters = gen.run_pool(params, extra, pool, prompts, prompt_mask, version)   # budgeted calls
  engine = gen.slot_engine(per_row_sampling=...)   # host-driven slots (episodes, the server)

`params`/`extra` are the train state's own arrays; they are made into the generation weights
(rl/generation/weights.py: int8, the gathered layout) by a jitted program of their own, then read by
the generation program, which is one `lax.while_loop` for the pool-known schedulers
(rl/generation/loop.py). A sample b draws its t-th token with the key (key, b, t), so its tokens do
not depend on the scheduler, the slots or the proposer (tests/rl/test_generation.py).

Axis legend: P prompts, G group size, B = P * G samples, Lp prompt columns, N new tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.generation import core, loop
from meshrl.rl.generation.host import Graphs, SlotEngine
from meshrl.rl.generation.output import rollout_batch
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.generation.state import Pool, new_pool
from meshrl.rl.generation.weights import make_prepare


def model_graph(mc: ModelConfig):
  """(GraphDef, abstract params State, abstract non-param State) of a Transformer of `mc`."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)


def routing_shape(mc: ModelConfig) -> tuple[int, int] | None:
  """(MoE layers, experts per token) of the routes a generator records; None for a dense model."""
  return (mc.num_moe_layers, mc.num_experts_per_tok) if mc.num_experts and mc.num_moe_layers else None


def check_draft(target: ModelConfig, draft: ModelConfig) -> None:
  """A draft must propose tokens the target reads."""
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"draft model vocab_size={draft.vocab_size} differs from the target's "
                     f"vocab_size={target.vocab_size}: speculative decoding needs one tokenizer.")


class Generator:
  """A generation call of `spec` on the mesh (see the module docstring).

  mc: the model numbers with the generation rules (and the KV cache dtype); mesh/rules: for the
  weights' shardings; draft: (draft ModelConfig, draft params State) when spec's proposer is "draft";
  own_weights: the generation weights never alias the train state's (a caller that keeps them past
  the next update)."""

  def __init__(self, spec: GenerationSpec, mc: ModelConfig, *, mesh=None, rules=None,
               draft: tuple[ModelConfig, Any] | None = None, own_weights: bool = False):
    proposer = spec.step.proposer.method
    if proposer == "draft" and draft is None:
      raise ValueError("rl.speculative='draft' needs a draft model (rl.draft_config and rl.draft_checkpoint).")
    if spec.cache_len > mc.max_seq_len:
      slack = max(spec.step.proposer.window, spec.extension)
      what = "rl.speculative_k" if slack == spec.step.proposer.window else "rl.max_obs_tokens"
      raise ValueError(f"rl.max_prompt_len={spec.prompt_len} + rl.max_new_tokens={spec.columns}"
                       + (f" + {what}={slack} (the cache's slack past a sample's end)" if slack else "")
                       + f" = {spec.cache_len} exceeds model.max_seq_len={mc.max_seq_len}.")
    self.spec, self.mc, self.own_weights, self.mesh = spec, mc, own_weights, mesh
    self.graphdef, abstract, self.rest = model_graph(mc)
    self.routing_shape = routing_shape(mc)
    self.draft_graph = self.draft_rest = self.draft_params = None
    if proposer == "draft":
      draft_mc, self.draft_params = draft
      check_draft(mc, draft_mc)
      self.draft_graph, _, self.draft_rest = model_graph(draft_mc)
      if jax.tree.leaves(self.draft_rest):
        raise ValueError("the draft model carries non-parameter state (moe.aux_free_bias) that a draft "
                         "checkpoint does not hold; use a draft without it.")
    self.prepare = make_prepare(spec.weights, abstract, mesh, rules, own=own_weights)
    self._generate = jax.jit(self._generate_fn)
    self._run_pool = jax.jit(self._run_pool_fn)
    self.metrics = None

  # --- the jitted programs -----------------------------------------------------------------------

  def _models(self, params, extra, draft_params) -> core.Models:
    target = nnx.merge(self.graphdef, params, extra)
    draft = None if self.draft_graph is None else nnx.merge(self.draft_graph, draft_params, self.draft_rest)
    return core.bind(target, draft)

  def new_pool(self, prompts, prompt_mask, keys, max_lengths=None) -> Pool:
    """Fresh samples, G per prompt, keys [B] typed keys."""
    spec = self.spec
    return new_pool(prompts, prompt_mask, keys, group_size=spec.group_size,
                    width=spec.prompt_len + spec.columns, pad_id=spec.step.pad_id, max_lengths=max_lengths,
                    max_new_tokens=spec.max_new_tokens, routing_shape=self.routing_shape)

  def _run_pool_fn(self, params, extra, draft_params, pool, prompts, prompt_mask, version):
    spec = self.spec
    num = pool.num_samples
    max_steps = spec.max_steps(num) if spec.scheduler == "budgeted" else 0
    return loop.run(self._models(params, extra, draft_params), spec.step, pool, prompts, prompt_mask,
                    slots=spec.num_slots(num) if spec.scheduler != "static" else num,
                    cache_len=spec.cache_len, version=jnp.asarray(version, jnp.int32), max_steps=max_steps,
                    prefill_chunk=spec.prefill_chunk)

  def _generate_fn(self, params, extra, draft_params, prompts, prompt_mask, key, max_lengths, version):
    num = prompts.shape[0] * self.spec.group_size
    pool = self.new_pool(prompts, prompt_mask, sample_keys(key, jnp.arange(num)), max_lengths)
    pool, counters = self._run_pool_fn(params, extra, draft_params, pool, prompts, prompt_mask, version)
    return rollout_batch(pool, prompts.shape[1], self.spec.step.pad_id), counters.metrics()

  # --- calls -----------------------------------------------------------------------------------------

  def __call__(self, params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
    """prompts [P, Lp] left-padded -> RolloutBatch of B = P * G samples (max_lengths [B] each
    sample's response limit; version stamped on the generated tokens)."""
    batch, self.metrics = self._generate(self.prepare(params), extra, self.draft_params, prompts, prompt_mask,
                                         key, max_lengths, version)
    return batch

  def lower(self, params, extra, prompts, prompt_mask, key, max_lengths=None, version=0):
    """The generation program lowered for these arguments (FLOP counts, tests)."""
    return self._generate.lower(self.prepare(params), extra, self.draft_params, prompts, prompt_mask, key,
                                max_lengths, version)

  def run_pool(self, params, extra, pool: Pool, prompts, prompt_mask, version):
    """Decodes an existing pool (budgeted: at most spec.token_budget // slots steps) -> (pool, metrics)."""
    pool, counters = self._run_pool(self.prepare(params), extra, self.draft_params, pool, prompts, prompt_mask,
                                    version)
    self.metrics = counters.metrics()
    return pool, self.metrics

  def slot_engine(self, *, per_row_sampling: bool = False, num_slots: int | None = None) -> SlotEngine:
    """Host-driven slots over the same models and decode step (episodes; the server)."""
    return SlotEngine(Graphs(self.graphdef, self.rest, self.draft_graph, self.draft_rest), self.spec.step,
                      slots=num_slots or self.spec.slots, cache_len=self.spec.cache_len,
                      per_row_sampling=per_row_sampling, prefill_chunk=self.spec.prefill_chunk)

  def weights(self, params) -> tuple:
    """(generation params, draft params) for the slot engine's programs, made now."""
    return self.prepare(params), self.draft_params
