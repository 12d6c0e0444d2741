"""The run config read once: the frozen specs every RL module takes, built (and so validated) here.

  generation_spec(cfg, stop_ids=..., pad_id=...)   -> rl/generation GenerationSpec
  make_generator(cfg, mesh, tokenizer-ids...)      -> rl/generation Generator (the rollout of a run)
  episode_runner(cfg, mesh, tokenizer)             -> rl/step/episodes.EpisodeRunner (multi-turn runs)
  rollout_model_config(cfg, mesh)                  -> the model numbers under the generation rules

Schedulers from the config: rl.engine = "static" or "continuous"; rl.rollout_token_budget > 0 makes
a continuous engine "budgeted" (partial rollouts); rl.multi_turn makes it "episodic" (turn-synchronous
with rl.engine = "static"). Proposers: rl.speculative = none | draft | ngram. Every other generation
option (sampling, int8 KV cache and weights, the generation layout, routes) is the core's, so it holds
for every scheduler and proposer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from meshrl.model import quant
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.envs.base import STOP_STRINGS
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.proposers import ProposerSpec
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.generation.weights import WeightsSpec
from meshrl.sharding.rules import rules_from_config
from meshrl.train import init_from

ENGINES = ("static", "continuous")


def rollout_model_config(cfg, mesh: Mesh | None) -> ModelConfig:
  """The model numbers with the rollout activation rules (parameters are laid out as in training)
  and the KV cache of rl.kv_cache_dtype."""
  quant.check_generation_options(kv_cache_dtype=cfg.rl.kv_cache_dtype, generation_weights=cfg.rl.generation_weights,
                                 tis_level=cfg.rl.tis_level)
  mc = init_from.model_config(cfg, mesh, rules=rules_from_config(cfg.mesh, "rollout"))
  return dataclasses.replace(mc, kv_cache_dtype=cfg.rl.kv_cache_dtype)


def _stop_tokens(cfg, stop_ids) -> tuple[int, ...]:
  try:
    extra = tuple(int(t) for t in str(cfg.rl.stop_tokens).split(",") if t.strip())
  except ValueError:
    raise ValueError(f"rl.stop_tokens={cfg.rl.stop_tokens!r} must be comma-separated token ids.") from None
  return tuple(dict.fromkeys(tuple(stop_ids) + extra))


def _check_positive(rl, fields) -> None:
  for field in fields:
    value = rl[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"rl.{field}={value!r} must be an integer >= 1.")


def generation_spec(cfg, *, stop_ids, pad_id: int, stop_sequences=(), group_size: int | None = None,
                    temperature: float | None = None, multi_turn: bool | None = None,
                    complete: bool = False) -> GenerationSpec:
  """cfg.rl's generation, checked. group_size / temperature override it (evaluation: 1 and 0);
  stop_sequences: the multi-turn stop strings as token ids (`episode_stops`); complete: every sample
  runs to its end (no rl.rollout_token_budget: evaluation)."""
  rl = cfg.rl
  budget = 0 if complete else rl.rollout_token_budget
  multi_turn = bool(rl.multi_turn) if multi_turn is None else multi_turn
  if rl.engine not in ENGINES:
    raise ValueError(f"rl.engine={rl.engine!r}; choose one of {', '.join(ENGINES)}.")
  _check_positive(rl, ("max_prompt_len", "max_new_tokens"))
  group_size = rl.group_size if group_size is None else group_size
  if group_size < 1:
    raise ValueError(f"rl.group_size={group_size} must be at least 1.")
  sampler = Sampler(rl.temperature if temperature is None else temperature, rl.top_k, rl.top_p)
  proposer = ProposerSpec(rl.speculative, rl.speculative_k, rl.ngram_n)
  if rl.rollout_token_budget < 0:
    raise ValueError(f"rl.rollout_token_budget={rl.rollout_token_budget} must be >= 0 (0 = off).")
  if rl.engine == "static" and (rl.decode_slots or rl.rollout_token_budget):
    raise ValueError(f"rl.decode_slots={rl.decode_slots} and rl.rollout_token_budget={rl.rollout_token_budget} "
                     "schedule decode slots: they need rl.engine='continuous' (rl.engine='static' runs one "
                     "slot per sample, all at once).")
  _check_positive(rl, ("max_turns", "max_turn_tokens", "max_obs_tokens", "env_workers"))  # multi-turn
  if not rl.env_timeout_s > 0:
    raise ValueError(f"rl.env_timeout_s={rl.env_timeout_s!r} must be positive.")
  if multi_turn:
    step = StepConfig(sampler=sampler, stop_tokens=_stop_tokens(cfg, stop_ids), pad_id=pad_id, proposer=proposer,
                      stop_sequences=tuple(stop_sequences), pause_on_stop=True,
                      turn_tokens=min(rl.max_turn_tokens, rl.max_new_tokens))
    scheduler, extension = "episodic", rl.max_obs_tokens
  else:
    step = StepConfig(sampler=sampler, stop_tokens=_stop_tokens(cfg, stop_ids), pad_id=pad_id, proposer=proposer)
    scheduler = "static" if rl.engine == "static" else ("budgeted" if budget else "continuous")
    extension = 0
  return GenerationSpec(step=step, group_size=group_size, prompt_len=rl.max_prompt_len,
                        max_new_tokens=rl.max_new_tokens, scheduler=scheduler, slots=rl.decode_slots,
                        token_budget=budget,
                        weights=WeightsSpec(rl.generation_weights, rl.generation_layout), extension=extension,
                        barrier=multi_turn and rl.engine == "static", prefill_chunk=rl.prefill_chunk,
                        kv_host_bytes=rl.kv_host_bytes)


def episode_stops(tokenizer) -> tuple[tuple[int, ...], ...]:
  """The multi-turn stop strings (rl/envs/base.STOP_STRINGS) as token ids."""
  return tuple(tuple(tokenizer.encode(s, add_bos=False)) for s in STOP_STRINGS)


def draft_run_config(spec: str):
  """The draft's run config from rl.draft_config: "preset[:arg]" then ";"-separated a.b=value overrides,
  e.g. "configs/tiny.py:dense;model.num_layers=1"."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  preset, *overrides = [part.strip() for part in spec.split(";") if part.strip()] or [""]
  if not preset:
    raise ValueError("rl.speculative='draft' needs rl.draft_config (the draft's preset).")
  return configs.load(preset, overrides)


def load_draft(cfg, mesh: Mesh | None):
  """(draft ModelConfig, params State) from rl.draft_config and rl.draft_checkpoint (a meshrl
  checkpoint or work directory holding the draft's params, e.g. from scripts/distill_draft.py)."""
  from meshrl.train.checkpoint import from_nested_dict, load_params  # pylint: disable=import-outside-toplevel
  if not (cfg.rl.draft_checkpoint and cfg.rl.draft_config):
    raise ValueError("rl.speculative='draft' needs rl.draft_checkpoint (a meshrl checkpoint of the draft, e.g. "
                     "from scripts/distill_draft.py) and rl.draft_config.")
  mc = rollout_model_config(draft_run_config(cfg.rl.draft_config), mesh)
  abstract = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0)))
  nested = load_params(cfg.rl.draft_checkpoint)["params"]
  return mc, from_nested_dict(nested, nnx.state(abstract, nnx.Param))


def make_generator(cfg, mesh: Mesh | None, *, stop_ids, pad_id: int, group_size: int | None = None,
                   temperature: float | None = None, draft: tuple[ModelConfig, Any] | None = None,
                   multi_turn: bool | None = None, stop_sequences=(), own_weights: bool = False,
                   complete: bool = False, spec: GenerationSpec | None = None,
                   model_numbers: ModelConfig | None = None) -> Generator:
  """The run's generator (cfg.rl's scheduler, proposer and options) on `mesh`. draft: (draft
  ModelConfig, params State) for rl.speculative = "draft" (default: load_draft). spec / model_numbers:
  the run spec's generation spec and rollout model (rl/step/run_spec.py), else built from cfg with the
  overrides above."""
  if spec is None:
    spec = generation_spec(cfg, stop_ids=stop_ids, pad_id=pad_id, stop_sequences=stop_sequences,
                           group_size=group_size, temperature=temperature, multi_turn=multi_turn, complete=complete)
  if spec.step.proposer.method == "draft" and draft is None:
    draft = load_draft(cfg, mesh)
  model_numbers = rollout_model_config(cfg, mesh) if model_numbers is None else model_numbers
  return Generator(spec, model_numbers, mesh=mesh, rules=rules_from_config(cfg.mesh), draft=draft,
                   own_weights=own_weights)


def episode_runner(cfg, mesh: Mesh | None, tokenizer, *, group_size: int | None = None,
                   temperature: float | None = None, make_env=None, draft=None, complete: bool = False,
                   env_work=None, model_numbers: ModelConfig | None = None):
  """The multi-turn episode runner of cfg (rl.multi_turn): its generator and budgets. complete: no
  token budget (evaluation). With asynchronous RL (rl.max_staleness > 0) its generation weights are
  copies, since episodes run beside the update that donates the train state's. env_work: the run's
  rl/envs/env_work.EnvWork (scheduler, retries, quarantine); default one of its own."""
  from meshrl.rl.step import episodes as multiturn  # pylint: disable=import-outside-toplevel
  rl = cfg.rl
  generator = make_generator(cfg, mesh, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, group_size=group_size,
                             temperature=temperature, draft=draft, multi_turn=True,
                             stop_sequences=episode_stops(tokenizer), complete=complete,
                             own_weights=rl.max_staleness > 0 and not complete, model_numbers=model_numbers)
  budget = multiturn.EpisodeBudget(max_turns=rl.max_turns, max_obs_tokens=rl.max_obs_tokens,
                                   prompt_len=rl.max_prompt_len, episode_len=rl.max_new_tokens,
                                   env_workers=rl.env_workers, env_timeout_s=float(rl.env_timeout_s))
  return multiturn.EpisodeRunner(generator, budget, tokenizer, mesh=mesh, rules=rules_from_config(cfg.mesh),
                                 make_env=make_env or multiturn.default_env, env_work=env_work)


def check_generation(cfg, data_parallel: int | None = None, *, spec: GenerationSpec | None = None) -> GenerationSpec:
  """Checks the run's generation spec without a model: the scheduler, proposer, sampler and options
  (by building it, or `spec`, the run spec's, already built from cfg); the caches' length against
  model.max_seq_len; the draft's files; the decode slots against the data-parallel axes
  (`data_parallel`, their size, when the mesh is known). -> the spec."""
  rl = cfg.rl
  if spec is None:
    stops = ((1,),) if rl.multi_turn else ()
    spec = generation_spec(cfg, stop_ids=(0,), pad_id=0, stop_sequences=stops)
  quant.check_generation_options(kv_cache_dtype=rl.kv_cache_dtype, generation_weights=rl.generation_weights,
                                 tis_level=rl.tis_level)
  if spec.cache_len > cfg.model.max_seq_len:
    slack = max(spec.step.proposer.window, spec.extension)
    what = "rl.speculative_k" if slack == spec.step.proposer.window else "rl.max_obs_tokens"
    raise ValueError(f"rl.max_prompt_len={rl.max_prompt_len} + rl.max_new_tokens={rl.max_new_tokens}"
                     + (f" + {what}={slack} (the cache's slack past a sample's end)" if slack else "")
                     + f" = {spec.cache_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.")
  if spec.step.proposer.method == "draft" and not (rl.draft_checkpoint and rl.draft_config):
    raise ValueError("rl.speculative='draft' needs rl.draft_checkpoint (a meshrl checkpoint of the draft, e.g. "
                     "from scripts/distill_draft.py) and rl.draft_config.")
  batch = rl.prompts_per_step * rl.group_size
  slots = spec.num_slots(batch)
  if spec.token_budget:
    if spec.token_budget < slots:
      raise ValueError(f"rl.rollout_token_budget={spec.token_budget} is less than one token per decode slot "
                       f"(rl.decode_slots resolves to {slots}).")
    if rl.dynamic_sampling and rl.max_resample_rounds:
      raise ValueError(f"rl.rollout_token_budget={spec.token_budget} takes no extra rollout rounds: set "
                       f"rl.max_resample_rounds=0 (now {rl.max_resample_rounds}); dynamic sampling then masks "
                       "the uninformative groups among those that ended.")
  if data_parallel and slots % data_parallel:
    raise ValueError(f"rl.decode_slots={rl.decode_slots} ({slots} slots) is not divisible by the data-parallel "
                     f"axes data*fsdp*expert = {data_parallel}: each slot row must live on one of their shards.")
  return spec
