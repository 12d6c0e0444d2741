"""The RL driver: prompts -> rollout -> rewards -> dynamic sampling -> advantages -> update -> metrics.

Plain Python around two jitted functions built once (`make_rollout`, `make_update`). Both run on the
one mesh and read the same parameter arrays: the rollout takes `state.params` as they are, and the
update donates and replaces them. Everything with side effects (reward code, files, the progress
bar, checkpoints) happens here, between the jitted calls.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl.configs import save_config
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl import advantages as adv_lib
from meshrl.rl.batch import informative_groups, next_prompts, score_rollout, select_groups
from meshrl.rl.envs import TaskMixture, load_jsonl
from meshrl.rl.losses import kl_reward_penalty
from meshrl.rl.rewards import compose
from meshrl.rl.rollout import make_rollout
from meshrl.rl.update import make_logprob_fn, make_update
from meshrl.sharding import MESH_AXES, make_mesh, mesh_shape_for
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.metrics import CompileCounter, MetricsWriter, plot_curve
from meshrl.train.optim import make_optimizer
from meshrl.train.state import TrainState, create_train_state


@dataclasses.dataclass
class RLRun:
  """What `setup` builds for a run; `train_steps` drives it."""
  cfg: Any
  mesh: Any
  graphdef: Any
  state: TrainState
  ref_params: Any  # the initial params, kept only when a KL term is on
  rollout: Any
  update: Any
  logprob_fn: Any
  tokenizer: Any
  tasks: Any
  reward_fn: Any
  estimator: Any


def check_config(cfg, num_devices: int | None = None) -> None:
  """Rejects settings the loop cannot run, naming the fields, before anything is compiled.

  With `num_devices`, also checks that the rollout batch splits over the data-parallel mesh axes.
  """
  estimator = adv_lib.make_estimator(cfg.rl.advantage, eps=cfg.rl.adv_eps, gamma=cfg.rl.gamma,
                                     lam=cfg.rl.gae_lambda)
  if not estimator.needs_critic and cfg.rl.group_size < 2:
    raise ValueError(f"rl.advantage={cfg.rl.advantage!r} is group-relative and needs rl.group_size >= 2,"
                     f" got {cfg.rl.group_size}.")
  if estimator.needs_critic and not cfg.model.value_head:
    raise ValueError("rl.advantage='gae' needs a critic: set model.value_head=true.")
  if num_devices is not None:
    sizes = dict(zip(MESH_AXES, mesh_shape_for(cfg.mesh, num_devices)))
    data_parallel = sizes["data"] * cfg.mesh.num_slices * sizes["fsdp"] * sizes["expert"]
    batch = cfg.rl.prompts_per_step * cfg.rl.group_size
    if batch % data_parallel:
      raise ValueError(f"the rollout batch of {batch} sequences (rl.prompts_per_step * rl.group_size) is "
                       f"not divisible by the data-parallel axes data*fsdp*expert = {data_parallel}.")


def setup(cfg, *, mesh=None, model=None) -> RLRun:
  """Builds the mesh, model, optimizer state and the jitted rollout/update for `cfg`."""
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  check_config(cfg, mesh.size)
  if model is None:
    model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=cfg.seed)
  tx = make_optimizer(cfg.optim)
  graphdef, state = create_train_state(model, tx, mesh)
  tokenizer = ByteTokenizer()
  if cfg.model.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                     f"{tokenizer.vocab_size}.")
  pools = None
  spec = cfg.data.tasks
  if cfg.data.jsonl:
    loaded = load_jsonl(cfg.data.jsonl, skip_bad=cfg.data.skip_bad_rows)
    pools = {"jsonl": loaded.examples}
    spec = "jsonl:1.0" if not spec else f"{spec},jsonl:1.0"
  tasks = TaskMixture(spec, difficulty=cfg.data.difficulty, seed=cfg.seed, pools=pools)
  ref_params = jax.tree.map(jnp.copy, state.params) if cfg.rl.kl_coef else None
  return RLRun(
      cfg=cfg, mesh=mesh, graphdef=graphdef, state=state, ref_params=ref_params,
      rollout=make_rollout(cfg, mesh, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id),
      update=make_update(cfg, graphdef, tx), logprob_fn=make_logprob_fn(cfg, graphdef),
      tokenizer=tokenizer, tasks=tasks, reward_fn=compose(cfg.rl.rewards),
      estimator=adv_lib.make_estimator(cfg.rl.advantage, eps=cfg.rl.adv_eps, gamma=cfg.rl.gamma,
                                       lam=cfg.rl.gae_lambda))


def _to_numpy(batch) -> dict:
  arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
  if arrays["routing"] is None:
    del arrays["routing"]
  else:
    arrays["routing"] = jnp.swapaxes(arrays["routing"], 0, 1)  # [B, L, S, K]
  return jax.tree.map(np.asarray, arrays)


def collect(run: RLRun, examples, key) -> tuple[dict, dict]:
  """Rollout(s) and rewards for one step -> (update batch arrays, metrics). Host side."""
  cfg = run.cfg.rl
  rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
  rollouts, prompt_stats, generated = [], {"rejected": 0, "truncated": 0}, 0
  t0 = time.perf_counter()
  rollout_s = reward_s = 0.0
  for round_index in range(rounds):
    prompts = next_prompts(examples, run.tokenizer, count=cfg.prompts_per_step, max_len=cfg.max_prompt_len,
                           overflow=cfg.prompt_overflow)
    prompt_stats["rejected"] += prompts.rejected
    prompt_stats["truncated"] += prompts.truncated
    t_roll = time.perf_counter()
    out = run.rollout(run.state.params, run.state.extra, prompts.tokens, prompts.mask,
                      jax.random.fold_in(key, round_index))
    arrays = _to_numpy(out)
    rollout_s += time.perf_counter() - t_roll
    generated += int(arrays["lengths"].sum())
    t_reward = time.perf_counter()
    scored = score_rollout(arrays, prompts.examples, run.tokenizer, run.reward_fn, group_size=cfg.group_size,
                           max_new_tokens=cfg.max_new_tokens, overlong_buffer=cfg.overlong_buffer,
                           overlong_penalty_value=cfg.overlong_penalty)
    reward_s += time.perf_counter() - t_reward
    rollouts.append(scored)
    useful = sum(int(informative_groups(r.rewards, cfg.group_size).sum()) for r in rollouts)
    if not cfg.dynamic_sampling or useful >= cfg.prompts_per_step:
      break
  arrays, rewards, correct, group_valid = select_groups(
      rollouts, num_groups=cfg.prompts_per_step, group_size=cfg.group_size, dynamic=cfg.dynamic_sampling)
  first = rollouts[0]
  metrics = {
      "reward_mean": float(first.correct.mean()), "reward_std": float(first.correct.std()),
      "shaped_reward_mean": float(first.rewards.mean()),
      "batch_reward_mean": float(correct.mean()),
      "response_len_mean": float(first.arrays["lengths"].mean()),
      "truncated_frac": float(first.arrays["truncated"].mean()),
      "reward_errors": sum(r.info.get("reward_errors", 0) for r in rollouts),
      "rollout_rounds": len(rollouts), "groups_kept": int(group_valid.sum()),
      "prompts_rejected": prompt_stats["rejected"], "prompts_truncated": prompt_stats["truncated"],
      "empty_responses": int((first.arrays["lengths"] <= 1).sum()),
      "rollout_s": rollout_s, "reward_s": reward_s, "generated_tokens": generated,
      "collect_s": time.perf_counter() - t0, "sample_text": first.info["texts"][0][:40],
  }
  return {"arrays": arrays, "rewards": rewards, "group_valid": group_valid}, metrics


def advantages_for(run: RLRun, collected: dict) -> dict:
  """The update batch: arrays, old log-probs, advantages (and reference log-probs / critic targets)."""
  cfg = run.cfg.rl
  arrays = collected["arrays"]
  sample_valid = np.repeat(collected["group_valid"], cfg.group_size)
  response_mask = arrays["response_mask"] & sample_valid[:, None]
  batch = {"tokens": arrays["tokens"], "positions": arrays["positions"],
           "segment_ids": arrays["segment_ids"], "response_mask": response_mask,
           "old_logprobs": arrays["logprobs"]}
  if "routing" in arrays:
    batch["routing"] = arrays["routing"]
  rewards = jnp.asarray(collected["rewards"])
  if run.ref_params is not None:
    batch["ref_logprobs"], _ = run.logprob_fn(run.ref_params, run.state.extra, batch)
  if run.estimator.needs_critic:
    _, values = run.logprob_fn(run.state.params, run.state.extra, batch)
  if run.estimator.needs_critic or (cfg.kl_in_reward and "ref_logprobs" in batch):
    token_rewards = adv_lib.outcome_token_rewards(rewards, jnp.asarray(response_mask))
    if cfg.kl_in_reward and "ref_logprobs" in batch:
      token_rewards = token_rewards - kl_reward_penalty(
          jnp.asarray(batch["old_logprobs"]), batch["ref_logprobs"], jnp.asarray(response_mask),
          coef=cfg.kl_coef, kind=cfg.kl_estimator)
    if run.estimator.needs_critic:
      advantages, returns = run.estimator(token_rewards, values, jnp.asarray(response_mask))
      batch.update(advantages=advantages, returns=returns, old_values=values)
    else:
      batch["advantages"] = adv_lib.reinforce_pp_tokens(token_rewards, jnp.asarray(response_mask),
                                                        gamma=cfg.gamma)
  else:
    batch["advantages"] = run.estimator(rewards, group_size=cfg.group_size,
                                        mask=jnp.asarray(sample_valid))
  return batch


def train_steps(run: RLRun, workdir: str, *, num_steps: int | None = None, start_step: int = 0,
                start_example: int = 0,
                checkpointer: Checkpointer | None = None, writer: MetricsWriter | None = None) -> list[dict]:
  """Runs RL steps; returns the metric records. Each step compiles nothing new after the first."""
  cfg = run.cfg
  num_steps = cfg.rl.num_steps if num_steps is None else num_steps
  position = {"next": start_example}  # index of the next task example; saved with checkpoints

  def next_example():
    while True:
      position["next"] += 1
      yield run.tasks[position["next"] - 1]
  examples = next_example()
  key = jax.random.key(cfg.seed + 1)
  records, counter = [], CompileCounter()
  try:
    for step in range(start_step + 1, num_steps + 1):
      t0 = time.perf_counter()
      step_key = jax.random.fold_in(key, step)
      collected, metrics = collect(run, examples, jax.random.fold_in(step_key, 0))
      batch = advantages_for(run, collected)
      t_update = time.perf_counter()
      run.state, update_metrics = run.update(run.state, batch, jax.random.fold_in(step_key, 1))
      update_metrics = jax.device_get(update_metrics)
      metrics["update_s"] = time.perf_counter() - t_update
      update_metrics.pop("expert_load", None)
      metrics.update({k: float(v) for k, v in update_metrics.items()})
      metrics["time_s"] = time.perf_counter() - t0
      total_tokens = collected["arrays"]["tokens"].size
      metrics["tokens_per_s"] = total_tokens / metrics["time_s"]
      metrics["compiles"] = counter.count()
      metrics.setdefault("kl", 0.0)
      metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
      if writer is not None:
        records.append(writer.write(step, metrics))
      else:
        records.append({"step": step, **metrics})
      if checkpointer is not None and cfg.checkpoint.enabled:
        checkpointer.save(step, run.state, data_state={"step": step, "next_example": position["next"]},
                          config=cfg)
  finally:
    counter.close()
  return records


def run(cfg, workdir: str, *, mesh=None) -> list[dict]:
  """The whole job: warm start (SFT) if configured, then GRPO/PPO; writes everything into `workdir`."""
  os.makedirs(workdir, exist_ok=True)
  save_config(cfg, workdir)
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=cfg.seed)
  if cfg.rl.sft_steps:
    from meshrl.train.sft import run_sft  # pylint: disable=import-outside-toplevel
    model = run_sft(cfg, os.path.join(workdir, "sft"), mesh=mesh, model=model).model
  rl_run = setup(cfg, mesh=mesh, model=model)
  checkpointer = None
  start_step = start_example = 0
  if cfg.checkpoint.enabled:
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                                max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save)
    if cfg.checkpoint.restore and checkpointer.latest_step() is not None:
      restored = checkpointer.restore(rl_run.state)
      rl_run.state, start_step = restored.state, restored.step
      start_example = int(restored.data_state.get("next_example", 0))
      print(f"resumed from {checkpointer.directory} at step {start_step}")
  with MetricsWriter(workdir, tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar,
                     total_steps=cfg.rl.num_steps, resume_step=start_step or None,
                     bar_keys=("reward_mean", "kl", "entropy", "tokens_per_s")) as writer:
    try:
      records = train_steps(rl_run, workdir, start_step=start_step, start_example=start_example,
                            checkpointer=checkpointer,
                            writer=writer)
    finally:
      if checkpointer is not None:
        checkpointer.wait()
        checkpointer.close()
  if cfg.log.plot:
    plot_curve(os.path.join(workdir, "metrics.jsonl"), "reward_mean",
               os.path.join(workdir, "reward_curve.png"))
  return records
