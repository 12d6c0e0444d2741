"""The run spec: an RL run's config read and checked once, into the frozen specs the run is built from.

  spec = check_config(cfg, mesh=mesh)   # or check_config(cfg, num_devices): the checks alone
  run = build_run(cfg, mesh, model, tokenizer, spec=spec)   (rl/step/program.py)
  build_spec(cfg, mesh)                 # the spec's parts without the run's cross-checks
  model_numbers(cfg, mesh)              # its model numbers alone (the AOT programs, the planner)

`check_config` is the validation and returns the spec, each part built once (its builder checks
its own fields) and the cross-checks run on the built parts: every setting a run would fail on raises
ValueError naming the field, before the warm start, any compilation or any file written. The run
then takes its model numbers, estimator, loss, generation and update shape from the spec instead of
reading the config sections again, so what was checked is what runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from meshrl.configs import checks
from meshrl.model import pipeline, splash
from meshrl.model.tokenizer import Tokenizer, tokenizer_from_config
from meshrl.model.transformer import ModelConfig
from meshrl.rl.algo import advantages as adv_lib
from meshrl.rl.algo import losses
from meshrl.rl.batches.packing import row_ladder, update_shape
from meshrl.rl.envs import TaskMixture
from meshrl.rl.envs.file_sandbox import check_backend_runs
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.registry import check_single_turn, load_domains
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.rewards import compose
from meshrl.rl.rewards.sources import check_reward_sources
from meshrl.rl.step.episodes import episode_pools
from meshrl.rl.step.spec import check_generation, episode_stops, generation_spec, rollout_model_config
from meshrl.sharding.mesh import SEQUENCE_AXIS, global_mesh_sizes
from meshrl.sharding.rules import data_parallel_size
from meshrl.train import init_from
from meshrl.train.init_from import check_initial_model
from meshrl.train.optim import check_optim


@dataclasses.dataclass(frozen=True)
class ModelNumbers:
  """An RL run's model numbers on a mesh: `model` under the training rules (the update, SFT, the
  checkpoint), `rollout_model` under the generation rules with rl.kv_cache_dtype (prefill, decode)."""
  model: ModelConfig
  rollout_model: ModelConfig


def model_numbers(cfg, mesh: Mesh | None = None) -> ModelNumbers:
  """The one builder of an RL run's model numbers (the run spec's, the AOT programs', the layout
  planner's trials'): model.* / moe.* / attention.* / mesh.* checked by building them, on `mesh`
  (None: without a layout)."""
  return ModelNumbers(model=init_from.model_config(cfg, mesh), rollout_model=rollout_model_config(cfg, mesh))


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What an RL run is, checked: built once, by `check_config` (or `build_spec`) from the config
  (and the mesh).

  model / rollout_model: the model numbers under the training and the generation rules (mesh-aware
  when built with a Mesh; `model_numbers`); generation: the rollout's scheduler, proposer, sampler
  and options with the tokenizer's stop ids; update_rows x update_row_len: one update batch
  ([rows, row_len], packed or a row per sample)."""
  cfg: Any
  model: ModelConfig
  rollout_model: ModelConfig
  estimator: Any
  loss: losses.LossSpec
  generation: GenerationSpec
  tokenizer: Tokenizer
  multi_turn: bool
  update_rows: int
  update_row_len: int
  update_row_ladder: tuple[int, ...] = ()  # rows an update batch may take, fewest first (update_row_ladder)

  @property
  def batch_size(self) -> int:
    """Samples per rollout: rl.prompts_per_step * rl.group_size."""
    return self.cfg.rl.prompts_per_step * self.cfg.rl.group_size


def check_config(cfg, num_devices: int | None = None, *, mesh: Mesh | None = None,
                 tokenizer: Tokenizer | None = None) -> RunSpec:
  """Raises ValueError naming the field for every setting the run would fail on, before the warm
  start, any compilation or any file written; -> the run spec. Each part of the spec is built once
  here (its builder checks its own fields), then the cross-checks read the built parts. With
  `num_devices` or the run's `mesh`, also the mesh-dependent checks (and, with the mesh, the model
  numbers laid out on it)."""
  checks.check_sections(cfg, "run", "rl", "moe", "data", "eval", "checkpoint", "log")
  numbers = model_numbers(cfg, mesh)
  _check_optimizer(cfg)
  rl = cfg.rl
  estimator, loss = estimator_and_loss(cfg)
  if estimator.needs_groups and rl.group_size < 2:
    raise ValueError(f"rl.advantage={rl.advantage!r} is group-relative and needs rl.group_size >= 2,"
                     f" got {rl.group_size}.")
  if estimator.needs_critic and not cfg.model.value_head:
    raise ValueError("rl.advantage='gae' needs a critic: set model.value_head=true.")
  rows, row_len = _check_shapes(cfg)
  tokenizer = tokenizer_from_config(cfg) if tokenizer is None else tokenizer
  # scheduler, proposer, sampler, int8 and layout options, cache length
  generation = check_generation(cfg, spec=_generation(cfg, tokenizer))
  _check_rl_options(cfg)
  _check_data(cfg)
  check_initial_model(cfg)
  num_devices = mesh.size if mesh is not None else num_devices
  if num_devices is not None:
    _check_mesh(cfg, num_devices, rows, row_len, generation)
  return RunSpec(cfg=cfg, model=numbers.model, rollout_model=numbers.rollout_model, estimator=estimator, loss=loss,
                 generation=generation, tokenizer=tokenizer, multi_turn=bool(cfg.rl.multi_turn), update_rows=rows,
                 update_row_len=row_len, update_row_ladder=update_row_ladder(cfg, num_devices))


def build_spec(cfg, mesh: Mesh | None = None, *, tokenizer: Tokenizer | None = None) -> RunSpec:
  """The run spec of `cfg` on `mesh` (None: model numbers without a layout), its parts built by the
  builders `check_config` uses (each checks its own fields) without the run's cross-checks.
  tokenizer: default cfg.model.tokenizer's."""
  numbers = model_numbers(cfg, mesh)
  estimator, loss = estimator_and_loss(cfg)
  tokenizer = tokenizer_from_config(cfg) if tokenizer is None else tokenizer
  rows, row_len = update_shape(cfg)
  return RunSpec(cfg=cfg, model=numbers.model, rollout_model=numbers.rollout_model, estimator=estimator, loss=loss,
                 generation=_generation(cfg, tokenizer), tokenizer=tokenizer, multi_turn=bool(cfg.rl.multi_turn),
                 update_rows=rows, update_row_len=row_len,
                 update_row_ladder=update_row_ladder(cfg, mesh.size if mesh is not None else None))


def update_row_ladder(cfg, num_devices: int | None) -> tuple[int, ...]:
  """The row counts a packed update batch may take, fewest first (rl/batches/packing.row_ladder):
  rl.packed_row_buckets counts spaced by rl.packed_row_spacing, each one that splits into
  rl.num_minibatches minibatches over the data-parallel axes (and mesh.microbatches); (rows,) for a
  padded batch."""
  rows, _ = update_shape(cfg)
  if not cfg.rl.pack_updates:
    return (rows,)
  shards = data_parallel_size(global_mesh_sizes(cfg.mesh, num_devices)) if num_devices else 1
  minibatches = cfg.rl.num_minibatches

  def fits(count: int) -> bool:
    if count % minibatches or (count // minibatches) % shards:
      return False
    try:
      pipeline.check_batches(cfg.mesh, [("a rung", count // minibatches)], row_shards=shards)
    except ValueError:
      return False
    return True
  return row_ladder(rows, cfg.rl.packed_row_buckets, cfg.rl.packed_row_spacing, fits)


def _estimator(cfg):
  rl = cfg.rl
  return adv_lib.make_estimator(rl.advantage, eps=rl.adv_eps, gamma=rl.gamma, lam=rl.gae_lambda)


def estimator_and_loss(cfg) -> tuple[Any, losses.LossSpec]:
  """(the advantage estimator, the loss spec) of `cfg`, as the run spec holds them: for a program
  built without the whole spec (rl/step/aot.update_program)."""
  estimator = _estimator(cfg)
  return estimator, losses.LossSpec.from_config(cfg, needs_critic=estimator.needs_critic)


def _generation(cfg, tokenizer: Tokenizer) -> GenerationSpec:
  """The rollout's generation spec with the tokenizer's stop ids (and stop strings when multi-turn)."""
  multi_turn = bool(cfg.rl.multi_turn)
  return generation_spec(cfg, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, multi_turn=multi_turn,
                         stop_sequences=episode_stops(tokenizer) if multi_turn else ())


def _check_optimizer(cfg) -> None:
  """optim.* (both peak rates) and the local attention kernel (model.*, moe.*, attention.* and the
  mesh rules are checked by building the model numbers)."""
  check_optim(cfg.optim)
  if cfg.rl.sft_steps:
    check_optim(cfg.optim, learning_rate=cfg.rl.sft_learning_rate, field="rl.sft_learning_rate")
  splash.check_local_kernel(cfg.attention.local_kernel, cfg.attention.impl)


def _check_shapes(cfg) -> tuple[int, int]:
  """rl.* sizes, the update batch and the sequence budget; -> (update rows, row length)."""
  rl = cfg.rl
  for field in ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "epochs",
                "reward_workers"):
    if rl[field] < 1:
      raise ValueError(f"rl.{field}={rl[field]} must be at least 1.")
  batch = rl.prompts_per_step * rl.group_size
  if batch % rl.num_minibatches or rl.num_minibatches < 1:
    raise ValueError(f"rl.num_minibatches={rl.num_minibatches} must divide the batch of {batch} sequences "
                     f"(rl.prompts_per_step * rl.group_size).")
  total = rl.max_prompt_len + rl.max_new_tokens
  rows, row_len = update_shape(cfg)
  if rl.pack_updates:
    if rl.packed_rows < 0 or rl.packed_row_len < 0:
      raise ValueError(f"rl.packed_rows={rl.packed_rows} and rl.packed_row_len={rl.packed_row_len} must be "
                       ">= 0 (0 = one row per sample, the prompt + response budget).")
    if row_len < total or row_len > cfg.model.max_seq_len:
      raise ValueError(f"rl.packed_row_len={row_len} must lie between rl.max_prompt_len + rl.max_new_tokens "
                       f"= {total} (a trajectory fits in a row) and model.max_seq_len={cfg.model.max_seq_len}.")
    if rows % rl.num_minibatches:
      raise ValueError(f"rl.num_minibatches={rl.num_minibatches} must divide the rl.packed_rows={rows} "
                       "packed rows of an update batch.")
  elif rl.packed_row_buckets != 1:
    raise ValueError(f"rl.packed_row_buckets={rl.packed_row_buckets} sizes packed update batches: set "
                     "rl.pack_updates=true (a padded batch has one row per sample).")
  if rl.packed_row_spacing != "halve" and rl.packed_row_buckets == 1:
    raise ValueError(f"rl.packed_row_spacing={rl.packed_row_spacing!r} spaces the row counts of "
                     "rl.packed_row_buckets, which is 1 (one count): set rl.packed_row_buckets > 1.")
  if total > cfg.model.max_seq_len:
    raise ValueError(f"rl.max_prompt_len={rl.max_prompt_len} + rl.max_new_tokens={rl.max_new_tokens} "
                     f"exceeds model.max_seq_len={cfg.model.max_seq_len}.")
  if rl.sft_steps and cfg.data.seq_len > cfg.model.max_seq_len:
    raise ValueError(f"data.seq_len={cfg.data.seq_len} is longer than model.max_seq_len={cfg.model.max_seq_len}.")
  return rows, row_len


def _check_rl_options(cfg) -> None:
  """Prompt overflow, overlong penalty, asynchronous RL, rewards and their sources."""
  rl = cfg.rl
  if not rl.reward_timeout_s > 0:
    raise ValueError(f"rl.reward_timeout_s={rl.reward_timeout_s} must be positive.")
  if rl.prompt_overflow not in ("truncate", "reject"):
    raise ValueError(f"rl.prompt_overflow={rl.prompt_overflow!r}; choose truncate or reject.")
  if rl.overlong_buffer > rl.max_new_tokens:
    raise ValueError(f"rl.overlong_buffer={rl.overlong_buffer} must lie in [0, rl.max_new_tokens="
                     f"{rl.max_new_tokens}] (the penalty ramps over the last tokens of the budget).")
  if rl.max_staleness < 0:
    raise ValueError(f"rl.max_staleness={rl.max_staleness} must be >= 0 (0 = synchronous RL).")
  if rl.max_staleness and rl.tis_level == "none":
    raise ValueError(f"rl.max_staleness={rl.max_staleness} trains on samples of older policies: set "
                     "rl.tis_level to 'token' or 'sequence' so they are importance-corrected.")
  compose(rl.rewards)
  check_reward_sources(cfg)  # per-domain reward sources, their checkpoints, tokenizers and rubrics


def _check_data(cfg) -> None:
  """data.*: the task families, domains, files, quarantine list and the held-out split."""
  if not cfg.rl.multi_turn and episode_pools(cfg):
    raise ValueError(f"data.tasks={cfg.data.tasks!r} names multi-turn families {sorted(episode_pools(cfg))}: "
                     "set rl.multi_turn=true.")
  if episode_pools(cfg):
    check_backend_runs(cfg.rl.env_backend)
  if cfg.data.domains:
    domain_specs(cfg)
  Quarantine(cfg.data.quarantine)  # a malformed list is named by file and line
  if cfg.data.tasks:
    TaskMixture(cfg.data.tasks, difficulty=cfg.data.difficulty, seed=cfg.seed,
                pools={**{name: [{}] for name in file_pool_names(cfg)}, **episode_pools(cfg)})
  elif not cfg.data.jsonl and not cfg.data.array_record and not cfg.data.domains:
    raise ValueError("data.tasks is empty and none of data.domains, data.jsonl or data.array_record is "
                     "set: there are no prompts.")
  if cfg.eval.every and not cfg.eval.jsonl and not 0.0 < cfg.data.eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction={cfg.data.eval_fraction} must lie strictly between 0 and 1 "
                     "to hold out evaluation prompts (or give eval.jsonl).")


def _check_mesh(cfg, num_devices: int, rows: int, row_len: int, generation: GenerationSpec) -> None:
  """The batches and the generation's decode slots against the mesh's data-parallel axes, the
  pipeline's microbatches and the sequence axis."""
  rl = cfg.rl
  batch, total = rl.prompts_per_step * rl.group_size, rl.max_prompt_len + rl.max_new_tokens
  sizes = global_mesh_sizes(cfg.mesh, num_devices)  # stage and data span the slices
  shards = data_parallel_size(sizes)
  if batch % shards:
    raise ValueError(f"the rollout batch of {batch} sequences (rl.prompts_per_step * rl.group_size) is "
                     f"not divisible by the data-parallel axes data*fsdp*expert = {shards}.")
  if rl.pack_updates and (rows // rl.num_minibatches) % shards:
    raise ValueError(f"rl.packed_rows={rows} / rl.num_minibatches={rl.num_minibatches} packed rows per "
                     f"minibatch are not divisible by the data-parallel axes data*fsdp*expert = {shards}.")
  check_generation(cfg, data_parallel=shards, spec=generation)
  if rl.sft_steps and rl.sft_batch_size % shards:
    raise ValueError(f"rl.sft_batch_size={rl.sft_batch_size} is not divisible by the data-parallel axes "
                     f"data*fsdp*expert = {shards}.")
  # The pipeline's microbatches split each training forward's batch shards (model/pipeline.py).
  trained = [("the update's minibatch (rl.prompts_per_step * rl.group_size / rl.num_minibatches, or "
              "rl.packed_rows / rl.num_minibatches)", rows // rl.num_minibatches)]
  if rl.sft_steps:
    trained.append(("rl.sft_batch_size", rl.sft_batch_size))
  pipeline.check_batches(cfg.mesh, trained, row_shards=shards)
  sequence = sizes[SEQUENCE_AXIS]
  if sequence > 1:
    multiple = 2 * sequence if cfg.attention.zigzag and cfg.attention.impl == "ring" else sequence
    for field, length in (("rl.max_prompt_len + rl.max_new_tokens", total),
                          ("rl.packed_row_len", row_len),
                          ("data.seq_len", cfg.data.seq_len if rl.sft_steps else multiple)):
      if length % multiple:
        raise ValueError(f"{field} = {length} is not divisible by {multiple} (mesh.sequence={sequence}"
                         f"{', x2 for attention.zigzag' if multiple != sequence else ''}).")


def domain_specs(cfg):
  """data.domains' specs; terminal (multi-turn) domains only when the run is multi-turn."""
  specs = load_domains(cfg.data.domains)
  if cfg.rl.multi_turn:
    return specs
  try:
    return check_single_turn(specs)
  except ValueError as error:
    raise ValueError(f"{error} Set rl.multi_turn=true to run them as multi-turn episodes.") from None


def file_pool_names(cfg) -> list[str]:
  """The file pools a run draws from besides data.tasks: "jsonl", "array_record"."""
  return [name for name, path in (("jsonl", cfg.data.jsonl), ("array_record", cfg.data.array_record))
          if path]
