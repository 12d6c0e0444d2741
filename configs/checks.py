"""Checks of a run config that need nothing but the config: signs, ranges and files, section by section.

  checks.check_sections(cfg, "run", "rl", "data", "eval", "checkpoint", "log")

Each check raises ValueError naming the field, the value and what is allowed, before anything runs
or is written. `rl/step/run_spec.check_config` (RL runs) and the other scripts call the sections they use;
fields whose meaning belongs to another layer are checked where that layer turns the config into its
spec (model.* / moe.* / attention.* in `ModelConfig.from_config`, optim.* in `train/optim.py`).
This module imports no jax.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable


def value_of(cfg, field: str):
  """cfg's value at a dotted field name ("rl.num_steps")."""
  node = cfg
  for part in field.split("."):
    node = node[part]
  return node


def at_least(cfg, field: str, low: float, meaning: str = "") -> None:
  """ValueError unless `field` >= `low` (and finite)."""
  value = value_of(cfg, field)
  if not (math.isfinite(value) and value >= low):
    raise ValueError(f"{field}={value} must be at least {low}{meaning}.")


def positive(cfg, field: str, meaning: str = "") -> None:
  """ValueError unless `field` > 0 (and finite)."""
  value = value_of(cfg, field)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{field}={value} must be positive{meaning}.")


def between(cfg, field: str, low: float, high: float, *, high_open: bool = False) -> None:
  """ValueError unless low <= `field` <= high (< high with `high_open`)."""
  value = value_of(cfg, field)
  inside = low <= value < high if high_open else low <= value <= high
  if not inside:
    raise ValueError(f"{field}={value} must lie in [{low}, {high}{')' if high_open else ']'}.")


def one_of(cfg, field: str, choices) -> None:
  """ValueError unless `field` is one of `choices`."""
  value = value_of(cfg, field)
  if value not in choices:
    raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, choices))}.")


def existing_file(field: str, path: str) -> None:
  """ValueError unless `path` ("" = unset) is a readable file."""
  if path and not os.path.isfile(path):
    raise ValueError(f"{field}={path!r}: no such file.")


def check_run(cfg) -> None:
  """name, workdir and seed: the work directory is `workdir` with {name} filled in; the seed feeds
  jax keys and grain's shuffles, which take non-negative 31-bit integers."""
  between(cfg, "seed", 0, 2 ** 31 - 1)
  if not str(cfg.name).strip():
    raise ValueError("name='' is empty; give the run a name (it fills {name} in workdir).")
  if not str(cfg.workdir).strip():
    raise ValueError("workdir='' is empty; give a folder for the run's outputs (or --workdir).")


def check_rl(cfg) -> None:
  """rl.*: step counts, minibatches, coefficients, budgets; the algorithm's own choices
  (estimator, loss, sampler, engine) are checked by their builders in rl/step/run_spec.check_config."""
  at_least(cfg, "rl.num_steps", 0, " (0 = the warm start alone)")
  at_least(cfg, "rl.sft_steps", 0, " (0 = no warm start)")
  at_least(cfg, "rl.num_minibatches", 1)
  at_least(cfg, "rl.packed_row_buckets", 1, " (1 = the one static packed shape)")
  at_least(cfg, "rl.sft_batch_size", 1)
  if cfg.rl.sft_steps:
    positive(cfg, "rl.sft_learning_rate", " (a warm start with a rate <= 0 does not descend)")
  for field in ("max_resample_rounds", "max_nonfinite_steps", "packed_rows", "packed_row_len",
                "decode_slots", "rollout_token_budget", "overlong_buffer"):
    at_least(cfg, f"rl.{field}", 0)
  for field in ("speculative_k", "ngram_n"):
    at_least(cfg, f"rl.{field}", 1)
  for field in ("entropy_coef", "value_coef", "value_clip", "kl_coef", "overlong_penalty", "clip_low",
                "clip_high", "dual_clip"):
    at_least(cfg, f"rl.{field}", 0)
  positive(cfg, "rl.adv_eps", " (it keeps an all-equal group's std from dividing by zero)")
  for field in ("gamma", "gae_lambda"):
    between(cfg, f"rl.{field}", 0.0, 1.0)
  try:
    [int(t) for t in str(cfg.rl.stop_tokens).split(",") if t.strip()]
  except ValueError:
    raise ValueError(f"rl.stop_tokens={cfg.rl.stop_tokens!r} must be comma-separated token ids, "
                     "e.g. '13,198'.") from None
  check_model_rewards(cfg)
  check_kv_memory(cfg)


def check_kv_memory(cfg, host_memory_bytes: int | None = None) -> None:
  """rl.prefill_chunk (a whole number of tokens, 0 = one pass) and rl.kv_host_bytes (the host tier of
  the KV cache: at most the host's physical memory, `host_memory_bytes` when given)."""
  for field in ("prefill_chunk", "kv_host_bytes"):
    value = value_of(cfg, f"rl.{field}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      unit = "tokens" if field == "prefill_chunk" else "bytes"
      raise ValueError(f"rl.{field}={value!r} must be a whole number of {unit} >= 0 (0 = off).")
  if host_memory_bytes is None:
    host_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if cfg.rl.kv_host_bytes > host_memory_bytes:
    raise ValueError(f"rl.kv_host_bytes={cfg.rl.kv_host_bytes} is more than this host's memory "
                     f"({host_memory_bytes} bytes); give at most that (0 = no host tier).")


def check_model_rewards(cfg) -> None:
  """rl.reward_sources' model sources, as far as the config alone tells: their checkpoints exist, the
  length guard and the judge's numbers are in range (the sources themselves, the checkpoints' heads
  and tokenizers and the rubrics are checked by rl/rewards/sources.check_reward_sources)."""
  for field in ("reward_model_checkpoint", "judge_checkpoint"):
    path = cfg.rl[field]
    if path and not os.path.exists(path):
      raise ValueError(f"rl.{field}={path!r} does not exist.")
  at_least(cfg, "rl.rm_length_penalty", 0.0, " (0 = off)")
  one_of(cfg, "rl.reward_norm", ("none", "domain"))
  one_of(cfg, "rl.packed_row_spacing", ("halve", "even"))  # rl/batches/packing.row_ladder
  positive(cfg, "rl.judge_max_score", " (the top of the judge's scale)")
  for field in ("judge_prompt_len", "judge_max_tokens"):
    at_least(cfg, f"rl.{field}", 1)


def check_moe(cfg) -> None:
  """moe.* loss weights and rates (the layer's numbers are checked by ModelConfig.from_config)."""
  for field in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
    at_least(cfg, f"moe.{field}", 0.0)


def check_data(cfg) -> None:
  """data.*: lengths, workers, the held-out share and the files (rows are checked as they load)."""
  at_least(cfg, "data.seq_len", 1)
  at_least(cfg, "data.num_workers", 0, " (0 = in-process)")
  at_least(cfg, "data.difficulty", 1)
  between(cfg, "data.eval_fraction", 0.0, 1.0, high_open=True)
  existing_file("data.jsonl", cfg.data.jsonl)
  for path in filter(None, cfg.data.array_record.split(",")):
    existing_file("data.array_record", path)
  existing_file("data.domains", cfg.data.domains)
  quarantine_dir = os.path.dirname(os.path.abspath(cfg.data.quarantine)) if cfg.data.quarantine else ""
  if quarantine_dir and not os.path.isdir(quarantine_dir):
    raise ValueError(f"data.quarantine={cfg.data.quarantine!r}: its folder {quarantine_dir} does not "
                     "exist (environment failures are appended to this file).")
  check_env_work(cfg)
  check_env_backend(cfg)
  check_bootstrap(cfg)


def check_bootstrap(cfg) -> None:
  """Bootstrapping hard tasks (issue 33): rl.retry_unsolved / rl.retry_share, and the level
  curriculum data.level_curriculum*: its numbers in range, its domains generated domains of the run
  and its levels theirs (rl/envs/levels.py; read only when the curriculum is on)."""
  at_least(cfg, "rl.retry_unsolved", 0, " (0 = off)")
  if not (math.isfinite(cfg.rl.retry_share) and 0 < cfg.rl.retry_share <= 1):
    raise ValueError(f"rl.retry_share={cfg.rl.retry_share} must lie in (0, 1] (a round's share of retried prompts).")
  at_least(cfg, "rl.replay_groups", 0, " (0 = off)")
  if cfg.rl.replay_groups:
    check_replay_memory(cfg)
  at_least(cfg, "rl.rft_every", 0, " (0 = off)")
  at_least(cfg, "rl.rft_steps", 1)
  at_least(cfg, "rl.rft_bank", 1)
  if not (math.isfinite(cfg.rl.rft_learning_rate) and cfg.rl.rft_learning_rate > 0):
    raise ValueError(f"rl.rft_learning_rate={cfg.rl.rft_learning_rate} must be a positive number.")
  if cfg.rl.rft_every:
    if cfg.data.seq_len > cfg.model.max_seq_len:
      raise ValueError(f"data.seq_len={cfg.data.seq_len} (the rows of rl.rft_every's SFT rounds) is longer than "
                       f"model.max_seq_len={cfg.model.max_seq_len}.")
  from meshrl.rl.envs import levels  # pylint: disable=import-outside-toplevel  (no jax)
  levels.check_warm_start(cfg)
  data = cfg.data
  if not str(data.level_curriculum).strip():
    return
  at_least(cfg, "data.level_curriculum_floor", 1)
  at_least(cfg, "data.level_curriculum_max", 0, " (0 = each family's top level)")
  at_least(cfg, "data.level_curriculum_window", 1)
  for field in ("level_curriculum_promote", "level_curriculum_demote"):
    between(cfg, f"data.{field}", 0.0, 1.0)
  if not data.level_curriculum_demote < data.level_curriculum_promote:
    raise ValueError(f"data.level_curriculum_demote={data.level_curriculum_demote} must be below "
                     f"data.level_curriculum_promote={data.level_curriculum_promote}.")
  if data.level_curriculum_max and data.level_curriculum_max < data.level_curriculum_floor:
    raise ValueError(f"data.level_curriculum_max={data.level_curriculum_max} must be 0 or at least "
                     f"data.level_curriculum_floor={data.level_curriculum_floor}.")
  available, start = levels.generated_domains(cfg)
  families = levels.governed_domains(data.level_curriculum, available, field="data.level_curriculum")
  levels.check_levels(families, floor=data.level_curriculum_floor, top=data.level_curriculum_max,
                      start=start, field="data.level_curriculum")


def check_replay_memory(cfg, memory_bytes: int | None = None) -> None:
  """rl.replay_groups stored groups must fit in half the host's memory (`memory_bytes`, default this
  machine's): G x S tokens of 7 four-byte fields each, plus the MoE routes with routing replay
  (rl/step/replay.group_bytes)."""
  rl = cfg.rl
  experts = cfg.moe.num_experts_per_tok if cfg.moe.num_experts and rl.replay_routing else 0
  per_group = rl.group_size * (rl.max_prompt_len + rl.max_new_tokens) * (7 * 4 + cfg.model.num_layers * experts * 4)
  if memory_bytes is None:
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if rl.replay_groups * per_group > memory_bytes // 2:
    raise ValueError(f"rl.replay_groups={rl.replay_groups} would hold {rl.replay_groups * per_group / 2**30:.1f} GiB "
                     f"({per_group / 2**20:.1f} MiB a group) in host memory, more than half of its "
                     f"{memory_bytes / 2**30:.1f} GiB; keep at most {memory_bytes // 2 // per_group} groups.")


def check_env_work(cfg) -> None:
  """The environment work of training (rl/envs/env_work.py): rl.env_retries / rl.env_backoff_s,
  data.quarantine_after, and the curriculum (data.curriculum, a gate report with a "curriculum"
  object; data.flagged_weight in (0, 1])."""
  at_least(cfg, "rl.env_retries", 0, " (0 = no retries)")
  at_least(cfg, "rl.env_backoff_s", 0.0)
  at_least(cfg, "data.quarantine_after", 1)
  weight = cfg.data.flagged_weight
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 < weight <= 1.0:
    raise ValueError(f"data.flagged_weight={weight!r} must lie in (0, 1]: flagged tasks are drawn less, "
                     "never not at all.")
  existing_file("data.curriculum", cfg.data.curriculum)
  if cfg.data.curriculum:
    try:
      with open(cfg.data.curriculum, encoding="utf-8") as f:
        flags = json.load(f).get("curriculum")
    except (OSError, ValueError, AttributeError) as error:
      raise ValueError(f"data.curriculum={cfg.data.curriculum!r}: not a quality-gate report "
                       f"(scripts/env_qa.py --json): {error}") from None
    if not isinstance(flags, dict):
      raise ValueError(f"data.curriculum={cfg.data.curriculum!r}: the report has no 'curriculum' object "
                       "(write it with scripts/env_qa.py --json and a policy).")


def check_env_backend(cfg) -> None:
  """rl.env_backend: where the generated multi-turn families run (rl/envs/file_sandbox.BACKENDS)."""
  backend = cfg.rl.env_backend
  if backend not in ("memory", "sandbox"):
    raise ValueError(f"rl.env_backend={backend!r} is not one of 'memory' (an in-memory shell) or 'sandbox' "
                     "(a bubblewrap session).")


def check_eval(cfg) -> None:
  """eval.*: counts and the held-out file."""
  at_least(cfg, "eval.every", 0, " (0 = no evaluation)")
  at_least(cfg, "eval.num_prompts", 1)
  at_least(cfg, "eval.batch_size", 1)
  at_least(cfg, "eval.pass_k", 0, " (0 = greedy only)")
  existing_file("eval.jsonl", cfg.eval.jsonl)


def check_checkpoint(cfg) -> None:
  at_least(cfg, "checkpoint.every", 1)
  at_least(cfg, "checkpoint.max_to_keep", 1)


def check_log(cfg) -> None:
  at_least(cfg, "log.every", 1)
  at_least(cfg, "log.profile_start", 0, " (0 = no profile)")
  at_least(cfg, "log.profile_steps", 1)


def check_serve(cfg) -> None:
  """serve.*: slots, lengths and the prefix cache."""
  for field in ("slots", "decode_chunk", "prefix_block"):
    at_least(cfg, f"serve.{field}", 1)
  at_least(cfg, "serve.prefix_cache_mb", 0.0, " (0 = no prefix cache)")
  between(cfg, "serve.max_len", 0, cfg.model.max_seq_len)  # 0 = model.max_seq_len


def check_rm(cfg) -> None:
  """rm.*: counts, the margin, the overflow rule and the pair files (rows are checked as they load)."""
  for field in ("steps", "batch_size", "synthetic_pairs", "eval_pairs"):
    at_least(cfg, f"rm.{field}", 1)
  positive(cfg, "rm.learning_rate", " (a rate <= 0 does not descend)")
  at_least(cfg, "rm.eval_every", 0, " (0 = only before the first step and at the end)")
  at_least(cfg, "rm.warmup_steps", -1, " (-1 = optim.warmup_steps)")
  at_least(cfg, "rm.lm_coef", 0.0, " (0 = Bradley-Terry alone)")
  at_least(cfg, "rm.margin", 0.0, " (the score gap a pair's chosen side must clear)")
  at_least(cfg, "rm.max_len", 0, " (0 = model.max_seq_len)")
  one_of(cfg, "rm.overflow", ("reject", "truncate"))
  one_of(cfg, "rm.negatives", ("near_misses", "policy_errors"))
  check_rm_pairs(cfg)
  existing_file("rm.train_jsonl", cfg.rm.train_jsonl)
  existing_file("rm.eval_jsonl", cfg.rm.eval_jsonl)
  if not (cfg.rm.train_jsonl and cfg.rm.eval_jsonl):
    between(cfg, "data.eval_fraction", 0.0, 1.0, high_open=True)
    if cfg.data.eval_fraction == 0.0:
      raise ValueError("data.eval_fraction=0.0 holds out no prompts: the reward model's held-out pairs come "
                       "from that share (or give both rm.train_jsonl and rm.eval_jsonl).")


def check_rm_pairs(cfg) -> None:
  """rm.pairs_from and its sample counts (rl/rewards/policy_pairs.py; one in 8 prompts is held out)."""
  one_of(cfg, "rm.pairs_from", ("synthetic", "policy", "policy+synthetic"))
  one_of(cfg, "rm.init", ("model", "policy"))
  at_least(cfg, "rm.policy_prompts", 8, " (one in 8 gives the held-out pairs)")
  at_least(cfg, "rm.policy_samples", 2, " (a pair needs a right and a wrong sample of one prompt)")
  temperatures = str(cfg.rm.policy_temperatures)
  for item in filter(None, (t.strip() for t in temperatures.split(","))):
    try:
      value = float(item)
    except ValueError:
      value = -1.0
    if not 0.0 < value < math.inf:
      raise ValueError(f"rm.policy_temperatures={temperatures!r}: {item!r} is not a positive number; give "
                       "temperatures like '0.3,0.7' ('' = rl.temperature).")
  if cfg.rm.init == "policy" and cfg.rl.sft_steps < 1:
    raise ValueError(f"rm.init='policy' starts the reward model from the warm-started policy, but "
                     f"rl.sft_steps={cfg.rl.sft_steps}: set rl.sft_steps >= 1, or rm.init=model.")
  if "policy" in cfg.rm.pairs_from:
    if cfg.rl.sft_steps < 1:
      raise ValueError(f"rm.pairs_from={cfg.rm.pairs_from!r} samples the warm-started policy, but "
                       f"rl.sft_steps={cfg.rl.sft_steps}: set rl.sft_steps >= 1, or rm.pairs_from=synthetic.")


SECTIONS: dict[str, Callable] = {
    "run": check_run, "rl": check_rl, "moe": check_moe, "data": check_data, "eval": check_eval,
    "checkpoint": check_checkpoint, "log": check_log, "serve": check_serve, "rm": check_rm,
}


def check_sections(cfg, *names: str) -> None:
  """Runs the checks of the named sections (keys of SECTIONS), in order; the first error raises."""
  for name in names:
    SECTIONS[name](cfg)
