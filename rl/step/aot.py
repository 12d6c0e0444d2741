"""Ahead-of-time compilation of the real RL programs for a TPU topology, from a CPU: will it fit?

libtpu describes any TPU topology ("v5p:16x16x16") as compile-only devices. `make_mesh` lays the run's
mesh over them, every input is a `jax.ShapeDtypeStruct` carrying its sharding (nothing is allocated),
and XLA compiles the same jitted programs a run executes:

  update   rl/algo/update.py `make_update`: epochs x minibatches of the RL loss, its gradient and the
           optimizer step, on an UpdateBatch of rl.prompts_per_step * rl.group_size rows of
           rl.max_prompt_len + rl.max_new_tokens tokens (TRAIN rules).
  prefill  the prefill of generation engine (rl/generation/prefill.py `prefill_prompts`):
           rl.prompts_per_step prompts of rl.max_prompt_len tokens written into an empty KV cache
           of the full length, last logits kept, and the prompt's MoE routes with routing replay
           (ROLLOUT rules; with attention.impl="ring" and mesh.sequence > 1 the ring prefill, `length` split over
           `sequence` like the cache). With rl.prefill_chunk = T (0 < T < rl.max_prompt_len) the
           chunked prefill the engine runs instead: the chunks back to back, activations of P x T
           tokens at a time over the full cache.
  decode   one decode step of `generate` against a full-length cache: sample, forward one token per
           row of the batch, write it into the cache (ROLLOUT rules; the cache is donated).
  sft      train/sft.py `make_sft_step` on rl.sft_batch_size rows of data.seq_len tokens.
  reshard  the one-off cost of the generation layout: the train-layout weights resharded once per
           rollout into rl.generation_layout = "gathered" (split over tensor/expert only; "decode"
           then reads its weights without a per-token all-gather over fsdp) or, with pipeline stages
           (mesh.stage > 1), into the stage-free layout (sharding/rules.stage_free_shardings: the
           blocks' layers replicated over `stage`, every other axis kept), in which prefill and
           decode run: generation never runs through the pipeline.
  routes   rl/batches/routes.py: the update batch's MoE routes (routing replay) built on the devices from the
           rollout's, rows in any order (dynamic sampling, partial rollouts), so they never cross
           the host.
  batch    the update batch's per-token fields built on the devices from the rollout's (rl/batches/rows.py,
           rl/batches/handover.py `align_on_devices`, zigzag when the update is), rows in any order, so no
           host holds the batch's tokens.

A step's report (`StepReport`) is read off the compiled program: `memory_analysis()` gives the bytes
per chip (arguments, outputs, temporaries, generated code; total = argument + output + temp + code -
aliased), libtpu's own HBM size decides `fits` (total <= HBM_FRACTION of it), `cost_analysis()` the
FLOPs per chip. XLA's cost analysis counts the body of a rolled loop (`lax.scan` over layers, epochs,
minibatches, ring steps, `while_loop`) once, so `flops` is NOT the step's work (train/metrics.py
`program_flops`, which multiplies loop bodies, counts `dot` ops and finds none in TPU HLO, where
matmuls are `convolution`s). The projection uses `model_flops` instead, from train/metrics.py
`model_flops_per_token` (6 N_active + 3 attention per token for training, 2 N_active + attention for
generation) times the step's tokens, and
`projected_step_s = model_flops / (chips * peak bf16 FLOP/s * ASSUMED_MFU)`, divided by 1 - bubble for a
pipelined step (the update and SFT with mesh.stage > 1: `bubble_fraction`, (S - 1) / (M + S - 1) of
each chip's pipeline iterations idle, model/pipeline.py) and multiplied by the stages for prefill and
decode, which every stage group runs whole (pipeline.on_every_stage). `collective_bytes`
adds up the result bytes of every collective op in the compiled HLO, each op once (loop bodies once
too): a lower bound of what moves per step, good for comparing layouts. `ici_bytes`, `dcn_bytes` and
`grad_collective_bytes` are sharding/traffic.py's: the bytes one chip sends under ring algorithms, loop bodies
counted as often as they run, split by link, and the gradients' reductions among them
(optim.grad_collective_dtype sets their wire format: sharding/compress.py).

The host tier (rl.kv_host_bytes > 0, rl/generation/tiers.py) is reported with the decode step:
`kv_host_row_bytes`, the bytes of one paused slot's row the tier moves (target and draft caches of
the full cache length, int8 entries with their scales as stored, next-token logits, position:
`host_tier_row_bytes`, from the abstract shapes) and `kv_host_rows`, how many such rows
rl.kv_host_bytes holds.

A program that does not fit fails to compile on TPU with RESOURCE_EXHAUSTED; both that and a compile
that lands above the HBM fraction give `fits=False` and a `diagnosis` naming the bytes needed, the
bytes available and the largest buffers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.model import kv_cache as kvc
from meshrl.model import pipeline
from meshrl.model.init import parameter_counts
from meshrl.model.ring_attention import zigzag_on_mesh
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.algo import losses
from meshrl.rl.batches import routes
from meshrl.rl.batches.handover import ALIGNED_FROM, UpdateBatch, align_arrays
from meshrl.rl.generation import core
from meshrl.rl.generation.prefill import prefill_prompts
from meshrl.rl.generation.state import Counters, Pool, Slots, empty_slots
from meshrl.rl.generation.tiers import row_bytes
from meshrl.rl.step.aot_report import (  # noqa: F401  (the report's names, read as aot.X by the scripts)
    ASSUMED_MFU, HBM_FRACTION, StepReport, host_tier_line, largest_arguments, markdown_table, oom_diagnosis)
from meshrl.rl.step.run_spec import ModelNumbers, RunSpec, estimator_and_loss, model_numbers
from meshrl.rl.step.spec import draft_run_config, generation_spec, rollout_model_config
from meshrl.rl.algo.update import make_update
from meshrl.sharding import traffic
from meshrl.sharding.traffic import collective_bytes, largest_buffers
from meshrl.sharding.mesh import STAGE_AXIS, axis_size, make_mesh, mesh_shape_for
from meshrl.sharding.rules import data_parallel_size, generation_param_shardings, logical_to_spec, rules_from_config
from meshrl.train.metrics import model_flops_per_token, peak_flops
from meshrl.train.optim import make_optimizer
from meshrl.train.sft import MODEL_FIELDS, make_sft_step, zigzag_shards
from meshrl.train.state import abstract_train_state, shardings_of

STEPS = ("update", "prefill", "decode", "sft", "reshard", "routes", "batch")  # reshard: rl.generation_layout's one-off cost
TOPOLOGY_FORMAT = re.compile(r"^(v4|v5e|v5p|v6e|tpu7x):\d+(x\d+){1,2}$")


# ---------------------------------------------------------------------------------------------
# Devices of a topology and their HBM.


def topology_devices(topology: str, num_slices: int = 1) -> list[jax.Device]:
  """The compile-only devices of a TPU topology ("v5e:2x2", "v5p:16x16x16"), all slices.

  Raises ValueError naming the topology for a malformed or unknown name, and RuntimeError when
  libtpu (the `tpu` extra) is not installed.
  """
  if not TOPOLOGY_FORMAT.match(topology):
    raise ValueError(f"--topology={topology!r} is not a TPU topology: expected GENERATION:AxB[xC] "
                     "with GENERATION one of v4, v5e, v5p, v6e, tpu7x (e.g. v5e:2x2, v5p:16x16x16).")
  if num_slices < 1:
    raise ValueError(f"--num_slices={num_slices} must be at least 1.")
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise RuntimeError("compiling for a TPU topology needs libtpu: pip install -e '.[tpu]'") from None
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return list(topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1), num_slices=num_slices).devices)
  except Exception as error:  # pylint: disable=broad-except  (libtpu raises JaxRuntimeError)
    raise ValueError(f"libtpu does not know the topology {topology!r} ({num_slices} slice(s)): "
                     f"{str(error).splitlines()[0]}") from None


_HBM_CACHE: dict[str, int] = {}


def hbm_bytes(device: jax.Device) -> int | None:
  """Per-chip HBM in bytes as libtpu enforces it (read from its out-of-memory message), or None for
  a device that is not a TPU."""
  if device.platform != "tpu":
    return None
  if device.device_kind not in _HBM_CACHE:
    mesh = Mesh(np.array([device]), ("x",))
    too_big = jax.ShapeDtypeStruct((2 ** 40 // 4,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    try:
      jax.jit(lambda x: x * 2).lower(too_big).compile()
    except Exception as error:  # pylint: disable=broad-except
      found = re.search(r"available HBM \(([\d.]+)([GM])\)", str(error))
      if not found:
        raise RuntimeError(f"could not read the HBM size of {device.device_kind} from libtpu: "
                           f"{str(error)[:300]}") from None
      _HBM_CACHE[device.device_kind] = int(float(found.group(1)) * (2 ** 30 if found.group(2) == "G"
                                                                     else 2 ** 20))
  return _HBM_CACHE[device.device_kind]


def topology_mesh(cfg, devices: Sequence[jax.Device]) -> Mesh:
  """`make_mesh(cfg.mesh)` over `devices`; ValueError naming the mesh sizes and the chip count when
  they do not match (the sizes of cfg.mesh are per slice)."""
  try:
    mesh_shape_for(cfg.mesh, len(devices))
  except ValueError as error:
    raise ValueError(f"the config's mesh does not match the topology's {len(devices)} chips: "
                     f"{error}") from None
  return make_mesh(cfg.mesh, devices=devices)


# ---------------------------------------------------------------------------------------------
# Abstract inputs: shapes and shardings, nothing allocated.


def _struct(mesh: Mesh, rules, shape, dtype, names) -> jax.ShapeDtypeStruct:
  spec = logical_to_spec(names, rules, mesh, shape=shape)
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def abstract_update_batch(cfg, mesh: Mesh, spec: losses.LossSpec, mc: ModelConfig) -> UpdateBatch:
  """The UpdateBatch of one RL step, [B, S] with B = prompts x group, S = prompt + response budget,
  laid out as the run lays it (batch, length) under the TRAIN rules; optional fields as `spec` needs."""
  rules = rules_from_config(cfg.mesh)
  rows, length = cfg.rl.prompts_per_step * cfg.rl.group_size, cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  token = lambda dtype: _struct(mesh, rules, (rows, length), dtype, ("batch", "length"))  # noqa: E731
  fields = dict(tokens=token(jnp.int32), positions=token(jnp.int32), segment_ids=token(jnp.int32),
                targets=token(jnp.int32), loss_mask=token(jnp.bool_), old_logprobs=token(jnp.float32),
                advantages=token(jnp.float32))
  for name in spec.required_fields():
    if name == "routing":
      fields[name] = _struct(mesh, rules, (rows, mc.num_moe_layers, length, mc.num_experts_per_tok),
                             jnp.int32, ("batch", None, "length", None))
    else:
      fields[name] = token(jnp.float32)
  return UpdateBatch(**fields).check(spec)


def abstract_cache(mc: ModelConfig, mesh: Mesh, rules, batch: int, length: int) -> kvc.KVCache:
  """A full KV cache of `length` slots for `batch` rows, each entry (int8 values and their scales
  with mc.kv_cache_dtype = "int8") laid out by kv_cache.CACHE_AXES."""
  dtype = "int8" if mc.kv_cache_dtype == "int8" else mc.dtype
  shapes = jax.eval_shape(lambda: kvc.init_cache(mc.cache_entry_shapes(), batch, length, dtype))
  layers = {stack: {name: _struct(mesh, rules, x.shape, x.dtype, kvc.CACHE_AXES[name])
                    for name, x in entries.items()}
            for stack, entries in shapes.layers.items()}
  ids = lambda: _struct(mesh, rules, (batch, length), jnp.int32, ("batch", "cache_length"))  # noqa: E731
  return kvc.KVCache(layers=layers, positions=ids(), segment_ids=ids(),
                     index=jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec())))


# ---------------------------------------------------------------------------------------------
# The programs.


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted function, its abstract arguments, the model FLOPs and tokens of one call, and for a
  pipelined training step its microbatches and bubble fraction (model/pipeline.py)."""
  fn: Any
  args: tuple
  tokens: int
  model_flops: float
  microbatches: int | None = None
  bubble_fraction: float | None = None
  copies: int = 1  # groups of chips running the same program (generation on every pipeline stage)
  host_tier: dict | None = None  # {kv_host_bytes, kv_host_row_bytes, kv_host_rows} (`host_tier_figures`)


def _pipeline_figures(cfg, mesh: Mesh, rows: int) -> dict:
  """{microbatches, bubble_fraction} of a training forward on `rows` rows with mesh.stage > 1 (the
  microbatch count the model resolves for them), or {} without stages."""
  stages = int(cfg.mesh.get("stage", 1))
  if stages == 1 and int(cfg.mesh.get("microbatches", 0)) <= 1:
    return {}
  count = pipeline.resolve_microbatches(int(cfg.mesh.microbatches), rows=rows, row_shards=data_parallel_size(mesh),
                                        stages=stages)
  return dict(microbatches=count, bubble_fraction=pipeline.bubble_fraction(stages, count))


def _model(cfg, mc: ModelConfig) -> Callable[[], Transformer]:
  return lambda: Transformer(mc, rngs=nnx.Rngs(cfg.seed))


def update_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """rl/algo/update.py `make_update` over the abstract train state and UpdateBatch. numbers: the
  run's model numbers on `mesh` (run_spec.model_numbers, or its RunSpec), default built from cfg;
  every program below takes them."""
  loss = numbers.loss if isinstance(numbers, RunSpec) else estimator_and_loss(cfg)[1]  # the run spec's
  spec = dataclasses.replace(loss, zigzag_inputs=zigzag_shards(cfg, mesh) > 1)
  tx = make_optimizer(cfg.optim)
  mc = _numbers(cfg, mesh, numbers).model
  graphdef, state = abstract_train_state(_model(cfg, mc), tx, mesh, rules_from_config(cfg.mesh))
  rows = cfg.rl.prompts_per_step * cfg.rl.group_size
  update = make_update(spec, graphdef, tx, batch_size=rows, num_minibatches=cfg.rl.num_minibatches,
                       epochs=cfg.rl.epochs, aux_free_bias=cfg.moe.aux_free_bias,
                       bias_update_rate=cfg.moe.bias_update_rate)
  batch = abstract_update_batch(cfg, mesh, spec, mc)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec()))
  length = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  tokens = rows * length * cfg.rl.epochs
  return Program(update, (state, batch, key), tokens,
                 tokens * model_flops_per_token(mc, seq_len=length, training=True),
                 **_pipeline_figures(cfg, mesh, rows // cfg.rl.num_minibatches))


def _numbers(cfg, mesh: Mesh | None, numbers: ModelNumbers | None) -> ModelNumbers:
  """The programs' model numbers: `numbers` (a ModelNumbers or a RunSpec), else the run's builder's."""
  return model_numbers(cfg, mesh) if numbers is None else numbers


def _rollout_state(cfg, mesh: Mesh, numbers: ModelNumbers | None, *, layout: str | None = None):
  """(ModelConfig, graphdef, params, extra) of the rollout: parameters in the TRAIN layout (the
  same arrays the update trains), or in the generation layout `generation_params_shardings` gives
  (rl.generation_layout = "gathered", or pipeline stages); activations by the ROLLOUT rules
  (numbers.rollout_model)."""
  mc = _numbers(cfg, mesh, numbers).rollout_model
  graphdef, state = abstract_train_state(_model(cfg, mc), make_optimizer(cfg.optim), mesh, rules_from_config(cfg.mesh))
  params = state.params
  if layout != "train":
    params = _relaid(params, generation_params_shardings(cfg, jax.tree.map(lambda x: x.sharding, params)))
  return mc, graphdef, params, state.extra


def generation_params_shardings(cfg, shardings):
  """The layout prefill and decode read the parameters in: sharding/rules.generation_param_shardings for
  rl.generation_layout (stage-free with pipeline stages)."""
  return generation_param_shardings(cfg.rl.generation_layout, shardings)


def _relaid(params, shardings):
  """Abstract params -> the same shapes in `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)


def reshard_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """The one-off cost of the generation layout (`generation_params_shardings`): the train-layout
  parameters resharded into it (once per rollout), as a jitted identity with the new out_shardings."""
  _, _, params, _ = _rollout_state(cfg, mesh, numbers, layout="train")
  out = generation_params_shardings(cfg, jax.tree.map(lambda x: x.sharding, params))
  return Program(jax.jit(lambda p: p, out_shardings=out), (params,), 0, 0.0)


def prefill_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """The prompt prefill of the generation core (rl/generation/prefill.prefill_prompts): P prompts of Lp
  tokens into an empty full-length cache; with attention.impl="ring" and mesh.sequence > 1 the ring
  prefill into the sequence-sharded cache. With rl.prefill_chunk = T (0 < T < Lp): the chunked
  prefill, T tokens of every prompt at a time back to back (prefill.prefill_in_chunks, what the static
  and episodic schedulers run), whose peak is one chunk's activations over the full cache, as is
  the continuous scheduler's chunk per loop iteration (prefill.fill_chunk)."""
  mc, graphdef, params, extra = _rollout_state(cfg, mesh, numbers)
  rules = rules_from_config(cfg.mesh, "rollout")
  prompts_n, prompt_len = cfg.rl.prompts_per_step, cfg.rl.max_prompt_len
  total = generation_spec(cfg, stop_ids=(0,), pad_id=0).cache_len

  def prefill(params, extra, prompts, prompt_mask):
    model = nnx.merge(graphdef, params, extra)
    cache, logits, routing = prefill_prompts(model, prompts, prompt_mask, total, cfg.rl.prefill_chunk)
    return cache, logits, routing if cfg.rl.replay_routing else None  # the prompt's routes, kept

  prompts = _struct(mesh, rules, (prompts_n, prompt_len), jnp.int32, ("batch", "length"))
  mask = _struct(mesh, rules, (prompts_n, prompt_len), jnp.bool_, ("batch", "length"))
  tokens = prompts_n * prompt_len
  return Program(jax.jit(prefill), (params, extra, prompts, mask), tokens,
                 tokens * model_flops_per_token(mc, seq_len=prompt_len, training=False),
                 copies=axis_size(mesh, STAGE_AXIS))


def decode_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """One decode step of the generation core (rl/generation/core.decode_step) for B = prompts x group
  slots against a full cache, in the static scheduler's form (one shared write index): draw from the
  last logits, run the new tokens through the model, write them into the cache and the samples'
  buffers (tokens, log-probs, versions and, with routing replay, the MoE routes)."""
  mc, graphdef, params, extra = _rollout_state(cfg, mesh, numbers)
  rules = rules_from_config(cfg.mesh, "rollout")
  rows = cfg.rl.prompts_per_step * cfg.rl.group_size
  gen = generation_spec(cfg, stop_ids=(0,), pad_id=0, multi_turn=False)
  width = cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  batch = lambda shape, dtype, names: _struct(mesh, rules, shape, dtype, names)  # noqa: E731
  per_token = lambda dtype: batch((rows, width), dtype, ("batch", None))  # noqa: E731
  per_sample = lambda dtype: batch((rows,), dtype, ("batch",))  # noqa: E731
  routing = None
  if cfg.rl.replay_routing and mc.num_experts and mc.num_moe_layers:
    routing = _struct(mesh, rules, (mc.num_moe_layers, rows, width, mc.num_experts_per_tok), jnp.int32,
                      (None, "batch", None, None))
  key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  pool = Pool(tokens=per_token(jnp.int32), logprobs=per_token(jnp.float32), versions=per_token(jnp.int32),
              policy=per_token(jnp.bool_), pad=per_sample(jnp.int32), count=per_sample(jnp.int32),
              generated=per_sample(jnp.int32), turn_start=per_sample(jnp.int32), max_lengths=per_sample(jnp.int32),
              keys=batch((rows,) + key_data.shape, key_data.dtype, ("batch", None)),
              group_of=per_sample(jnp.int32), priority=per_sample(jnp.int32), done=per_sample(jnp.bool_),
              stopped=per_sample(jnp.bool_), paused=per_sample(jnp.bool_), routing=routing)
  slots = Slots(sid=per_sample(jnp.int32), cache=abstract_cache(mc, mesh, rules, rows, gen.cache_len),
                draft_cache=None, logits=batch((rows, mc.vocab_size), jnp.float32, ("batch", "vocab")),
                position=per_sample(jnp.int32), window=None, sampling=None)
  version = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

  def decode(params, extra, slots, pool, version):
    models = core.bind(nnx.merge(graphdef, params, extra), unrolled=False)
    slots, pool, _ = core.decode_step(models, gen.step, slots, pool, version, Counters.zeros(rows), lockstep=True)
    return slots, pool

  if axis_size(mesh, STAGE_AXIS) > 1:
    # The whole step on every stage group, not just the model's call (Transformer.__call__ enters the
    # region itself): with `stage` across slices and the cache split over `sequence`, the pool and
    # slot updates left to the partitioner crash libtpu 0.0.42's all-gather simplifier (a CHECK
    # failure, "constant->opcode() == HloOpcode::kConstant (reshape vs. constant)"), for paper_3t on
    # two v5p slices and already on two v5p:4x4x4 slices with expert=8 x sequence=8.
    decode = pipeline.on_every_stage(decode, mesh)

  return Program(jax.jit(decode, donate_argnums=(2, 3)), (params, extra, slots, pool, version),
                 rows, rows * model_flops_per_token(mc, seq_len=width, causal=False, training=False),
                 copies=axis_size(mesh, STAGE_AXIS), host_tier=host_tier_figures(cfg, mesh, numbers))


def host_tier_row_bytes(cfg, mesh: Mesh | None = None, numbers: ModelNumbers | None = None) -> int:
  """Bytes of one paused slot's row that the host tier (rl/generation/tiers.HostTier) moves, from
  abstract shapes (tiers.row_bytes, the tier's own count, over an abstract one-row Slots): the
  target's and (rl.speculative = "draft") the draft's cache rows of the run's cache length (int8
  entries with their scales when rl.kv_cache_dtype = "int8", positions, segment ids, write index),
  the next-token logits and the position. The multi-turn stop-sequence window (a few int32 per row,
  from the tokenizer's stop strings) is left out."""
  gen = generation_spec(cfg, stop_ids=(0,), pad_id=0)
  models = [_numbers(cfg, mesh, numbers).rollout_model]
  if cfg.rl.speculative == "draft":
    models.append(rollout_model_config(draft_run_config(cfg.rl.draft_config), mesh))

  def one_row():
    caches = [kvc.init_cache(mc.cache_entry_shapes(), 1, gen.cache_len,
                             "int8" if mc.kv_cache_dtype == "int8" else mc.dtype) for mc in models]
    return empty_slots(caches[0], caches[1] if len(caches) > 1 else None, num_samples=1,
                       vocab=models[0].vocab_size, window=gen.step.window)
  return row_bytes(jax.eval_shape(one_row))


def host_tier_figures(cfg, mesh: Mesh | None = None, numbers: ModelNumbers | None = None) -> dict | None:
  """{kv_host_bytes: rl.kv_host_bytes, kv_host_row_bytes: `host_tier_row_bytes`, kv_host_rows: the
  rows the budget holds}, or None without a host tier (rl.kv_host_bytes = 0)."""
  budget = int(cfg.rl.kv_host_bytes)
  if budget <= 0:
    return None
  row = host_tier_row_bytes(cfg, mesh, numbers)
  return {"kv_host_bytes": budget, "kv_host_row_bytes": row, "kv_host_rows": budget // row}


def sft_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """train/sft.py `make_sft_step` on rl.sft_batch_size packed rows of data.seq_len tokens."""
  tx = make_optimizer(cfg.optim)
  rules = rules_from_config(cfg.mesh)
  mc = _numbers(cfg, mesh, numbers).model
  graphdef, state = abstract_train_state(_model(cfg, mc), tx, mesh, rules)
  step = make_sft_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state))
  shape = (cfg.rl.sft_batch_size, cfg.data.seq_len)
  dtypes = dict(tokens=jnp.int32, positions=jnp.int32, segment_ids=jnp.int32, targets=jnp.int32,
                weights=jnp.float32)
  batch = {name: _struct(mesh, rules, shape, dtypes[name], ("batch", "length")) for name in MODEL_FIELDS}
  tokens = math.prod(shape)
  return Program(step, (state, batch), tokens,
                 tokens * model_flops_per_token(mc, seq_len=cfg.data.seq_len, training=True),
                 **_pipeline_figures(cfg, mesh, cfg.rl.sft_batch_size))


def routes_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """rl/batches/routes.py's padded assembly: the update batch's MoE routes [B, L, S, K] (donated, filled in)
  built on the devices from a rollout's [L, B, S, K] (taken to be split like the update batch, batch
  axes x `sequence`), rows in any order, zigzag when the update is. Only with routing replay of an
  MoE model."""
  mc = _numbers(cfg, mesh, numbers).model
  if not (cfg.rl.replay_routing and mc.num_moe_layers):
    raise ValueError("--step=routes needs rl.replay_routing=True and MoE layers (nothing to assemble).")
  rules = rules_from_config(cfg.mesh)
  rows, length = cfg.rl.prompts_per_step * cfg.rl.group_size, cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  sharding = NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh, shape=(rows, length)))
  out_sharding = routes.routes_sharding(sharding)  # [B, L, S, K]: (batch, -, sequence, -)
  batch_axes, _, sequence_axes, _ = out_sharding.spec
  source = jax.ShapeDtypeStruct((mc.num_moe_layers, rows, length, mc.num_experts_per_tok), jnp.int32,
                                sharding=NamedSharding(mesh, PartitionSpec(None, batch_axes, sequence_axes, None)))
  order = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
  out = jax.ShapeDtypeStruct((rows, mc.num_moe_layers, length, mc.num_experts_per_tok), jnp.int32,
                             sharding=out_sharding)
  return Program(routes.rows_program(out_sharding, zigzag_shards(cfg, mesh)), (out, source, order), 0, 0.0)


def batch_program(cfg, mesh: Mesh, numbers: ModelNumbers | None = None) -> Program:
  """The update batch's per-token fields [B, S] built on the devices from a rollout's (taken to be
  split like the update batch, batch axes x `sequence`): rows gathered in any order (dynamic
  sampling), shifted to predicting positions (`align_arrays`), zigzag when the update is. A run
  calls the gathers (rl/batches/rows.py), the alignment and the zigzag (rl/batches/layouts.py) as separate programs;
  here they are one, which needs at least as much as any of them. (No model: `numbers` unused.)"""
  del numbers
  rules = rules_from_config(cfg.mesh)
  rows, length = cfg.rl.prompts_per_step * cfg.rl.group_size, cfg.rl.max_prompt_len + cfg.rl.max_new_tokens
  sharding = NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh, shape=(rows, length)))
  dtypes = {"tokens": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32, "response_mask": jnp.bool_,
            "logprobs": jnp.float32}
  sources = {name: jax.ShapeDtypeStruct((rows, length), dtypes[name], sharding=sharding) for name in ALIGNED_FROM}
  replicated = NamedSharding(mesh, PartitionSpec())
  order = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=replicated)
  valid = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=replicated)
  shards = zigzag_shards(cfg, mesh)

  def build(sources, order, valid):
    aligned = align_arrays({name: jnp.take(source, order, axis=0) for name, source in sources.items()}, valid)
    return {name: zigzag_on_mesh(value, mesh, axis=1) for name, value in aligned.items()} if shards > 1 else aligned
  return Program(jax.jit(build, out_shardings=sharding), (sources, order, valid), 0, 0.0)


def default_steps(cfg, numbers: ModelNumbers | None = None) -> tuple[str, ...]:
  """The steps `--step=all` compiles: reshard only when the parameters change layout for generation
  (rl.generation_layout = "gathered", or pipeline stages), routes only with routing replay of an MoE
  model (numbers: the run's model numbers, default built from cfg without a mesh)."""
  skip = set()
  if cfg.rl.generation_layout != "gathered" and int(cfg.mesh.get("stage", 1)) == 1:
    skip.add("reshard")
  if not (cfg.rl.replay_routing and _numbers(cfg, None, numbers).model.num_moe_layers):  # as routes_program
    skip.add("routes")
  return tuple(s for s in STEPS if s not in skip)


def parameter_counts_of(cfg, numbers: ModelNumbers | None = None) -> dict[str, int]:
  """{"total", "active_per_token", "embedding"} of the config's model, from shapes (model/init.py)."""
  return parameter_counts(_numbers(cfg, None, numbers).model)


PROGRAMS = {"update": update_program, "prefill": prefill_program, "decode": decode_program,
            "sft": sft_program, "reshard": reshard_program, "routes": routes_program, "batch": batch_program}


def compile_step(step: str, cfg, mesh: Mesh, topology: str, numbers: ModelNumbers | None = None) -> StepReport:
  """Builds `step` (one of STEPS) for `mesh`, compiles it and reads it (`measure`). numbers: the
  run's model numbers on `mesh` (run_spec.model_numbers), default built from cfg."""
  if step not in PROGRAMS:
    raise ValueError(f"--step={step!r}; choose one of {STEPS} or all.")
  return measure(step, PROGRAMS[step](cfg, mesh, numbers), mesh, topology)


def measure(step: str, program: Program, mesh: Mesh, topology: str) -> StepReport:
  """Lowers and compiles `program` on `mesh` and reads its report. Never raises for a program that
  does not fit: its report says fits=False, with a diagnosis (bytes needed vs available, largest
  buffers)."""
  devices = list(mesh.devices.flat)
  hbm = hbm_bytes(devices[0])
  start = time.perf_counter()
  peak = peak_flops(devices)
  projected = program.model_flops / (peak * ASSUMED_MFU) if peak else None
  if projected is not None and program.bubble_fraction:
    projected /= 1.0 - program.bubble_fraction
  if projected is not None:
    projected *= program.copies  # each copy does all the work on its share of the chips
  common = dict(step=step, topology=topology, chips=len(devices), mesh=dict(mesh.shape),
                hbm_per_chip=hbm, model_flops=program.model_flops, tokens=program.tokens,
                projected_step_s=projected, microbatches=program.microbatches,
                bubble_fraction=program.bubble_fraction, **(program.host_tier or {}))
  try:
    compiled = program.fn.lower(*program.args).compile()
  except Exception as error:  # pylint: disable=broad-except
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
      raise
    return StepReport(per_chip={}, fits=False, flops=None, collective_bytes={},
                      compile_s=time.perf_counter() - start,
                      diagnosis=oom_diagnosis(step, message, hbm, program.args), **common)
  memory = compiled.memory_analysis()
  per_chip = dict(argument=memory.argument_size_in_bytes, output=memory.output_size_in_bytes,
                  temp=memory.temp_size_in_bytes, code=memory.generated_code_size_in_bytes,
                  alias=memory.alias_size_in_bytes)
  per_chip["total"] = (per_chip["argument"] + per_chip["output"] + per_chip["temp"] + per_chip["code"]
                       - per_chip["alias"])
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  fits = None if hbm is None else per_chip["total"] <= HBM_FRACTION * hbm
  diagnosis = ""
  if fits is False:
    diagnosis = (f"step {step!r} does not fit: it needs {per_chip['total']} bytes per chip "
                 f"({per_chip['total'] / 2 ** 30:.2f} GiB), more than {HBM_FRACTION:.0%} of the {hbm} "
                 f"bytes of HBM ({HBM_FRACTION * hbm / 2 ** 30:.2f} GiB); largest buffers: "
                 + " | ".join(largest_buffers(hlo)) + "; largest arguments per chip: "
                 + " | ".join(largest_arguments(program.args)))
  slices = {d.id: getattr(d, "slice_index", 0) for d in devices}
  sent = traffic.traffic(hlo, slice_of=lambda i: slices.get(i, 0))
  return StepReport(per_chip=per_chip, fits=fits, flops=float(cost.get("flops", 0.0)) if cost else None,
                    collective_bytes=collective_bytes(hlo), compile_s=time.perf_counter() - start,
                    diagnosis=diagnosis, grad_collective_bytes=sent.grad, ici_bytes=sent.ici,
                    dcn_bytes=sent.dcn, **common)


def compile_steps(cfg, topology: str, steps: Sequence[str], num_slices: int = 1,
                  devices: Sequence[jax.Device] | None = None) -> list[StepReport]:
  """Compiles each of `steps` for `topology` (its libtpu devices, or `devices` when given)."""
  unknown = [s for s in steps if s not in PROGRAMS]
  if unknown:
    raise ValueError(f"unknown step(s) {unknown}; choose from {STEPS}.")
  devices = topology_devices(topology, num_slices) if devices is None else list(devices)
  mesh = topology_mesh(cfg, devices)
  numbers = model_numbers(cfg, mesh)  # once for every step
  return [compile_step(step, cfg, mesh, topology, numbers) for step in steps]
