"""The RL driver: check the config, warm start, then RL steps with hooks for metrics, evaluation and
checkpoints.

  check_config(cfg, num_devices)    every config error a run would hit, before anything runs
  run(cfg, workdir)                 the whole job (scripts/rl.py)
  setup(cfg, mesh=, model=)         the RLRun and its prompt stream, for tests and benchmarks
  train_steps(run, prompts, ...)    RL steps (rl/step.py) with hooks at the edge

Plain Python around the jitted programs of rl/step.py; side effects (files, threads, the progress bar)
live here and in the hooks.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import jax

from meshrl.configs import save_config
from meshrl.model.tokenizer import tokenizer_from_config
from meshrl.rl import advantages as adv_lib
from meshrl.rl import losses
from meshrl.rl.envs import TaskMixture, load_jsonl
from meshrl.rl.evaluation import Evaluator, held_out_examples
from meshrl.rl.rewards import compose
from meshrl.rl.rewards.shaping import overlong_penalty
from meshrl.rl.sampling import Sampler
from meshrl.rl.step import RLRun, build_run, rl_step
from meshrl.sharding import MESH_AXES, make_mesh, mesh_shape_for
from meshrl.sharding.rules import data_parallel_size
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.init_from import check_initial_model, initial_model
from meshrl.train.metrics import CompileCounter, MetricsWriter, plot_curve

Hook = Callable[[int, RLRun, dict], None]


# --- one check of every setting, before anything runs ------------------------------------------


def _check_file(field: str, path: str) -> None:
  if path and not os.path.isfile(path):
    raise ValueError(f"{field}={path!r}: no such file.")


def check_config(cfg, num_devices: int | None = None) -> None:
  """Raises ValueError naming the field for every setting the run would fail on, before the warm
  start, any compilation or any file written. With `num_devices`, also the mesh-dependent checks."""
  rl = cfg.rl
  estimator = adv_lib.make_estimator(rl.advantage, eps=rl.adv_eps, gamma=rl.gamma, lam=rl.gae_lambda)
  if estimator.needs_groups and rl.group_size < 2:
    raise ValueError(f"rl.advantage={rl.advantage!r} is group-relative and needs rl.group_size >= 2,"
                     f" got {rl.group_size}.")
  if estimator.needs_critic and not cfg.model.value_head:
    raise ValueError("rl.advantage='gae' needs a critic: set model.value_head=true.")
  losses.LossSpec.from_config(cfg, needs_critic=estimator.needs_critic)
  Sampler(rl.temperature, rl.top_k, rl.top_p)
  for field in ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "epochs",
                "reward_workers"):
    if rl[field] < 1:
      raise ValueError(f"rl.{field}={rl[field]} must be at least 1.")
  if not rl.reward_timeout_s > 0:
    raise ValueError(f"rl.reward_timeout_s={rl.reward_timeout_s} must be positive.")
  batch = rl.prompts_per_step * rl.group_size
  if batch % rl.num_minibatches or rl.num_minibatches < 1:
    raise ValueError(f"rl.num_minibatches={rl.num_minibatches} must divide the batch of {batch} sequences "
                     f"(rl.prompts_per_step * rl.group_size).")
  total = rl.max_prompt_len + rl.max_new_tokens
  if total > cfg.model.max_seq_len:
    raise ValueError(f"rl.max_prompt_len={rl.max_prompt_len} + rl.max_new_tokens={rl.max_new_tokens} "
                     f"exceeds model.max_seq_len={cfg.model.max_seq_len}.")
  if rl.prompt_overflow not in ("truncate", "reject"):
    raise ValueError(f"rl.prompt_overflow={rl.prompt_overflow!r}; choose truncate or reject.")
  overlong_penalty([0], max_len=rl.max_new_tokens, buffer=rl.overlong_buffer, penalty=rl.overlong_penalty)
  compose(rl.rewards)
  _check_file("data.jsonl", cfg.data.jsonl)
  _check_file("eval.jsonl", cfg.eval.jsonl)
  if cfg.data.tasks:
    TaskMixture(cfg.data.tasks, difficulty=cfg.data.difficulty, seed=cfg.seed,
                pools={name: [{}] for name in _pool_names(cfg)})
  elif not cfg.data.jsonl:
    raise ValueError("data.tasks is empty and data.jsonl is not set: there are no prompts.")
  if cfg.eval.every < 0 or cfg.eval.num_prompts < 1 or cfg.eval.batch_size < 1 or cfg.eval.pass_k < 0:
    raise ValueError(f"eval.every={cfg.eval.every} must be >= 0, eval.num_prompts={cfg.eval.num_prompts} "
                     f"and eval.batch_size={cfg.eval.batch_size} >= 1, eval.pass_k={cfg.eval.pass_k} >= 0.")
  if cfg.eval.every and not cfg.eval.jsonl and not 0.0 < cfg.data.eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction={cfg.data.eval_fraction} must lie strictly between 0 and 1 "
                     "to hold out evaluation prompts (or give eval.jsonl).")
  check_initial_model(cfg)
  if rl.sft_steps:
    if cfg.data.seq_len > cfg.model.max_seq_len:
      raise ValueError(f"data.seq_len={cfg.data.seq_len} is longer than model.max_seq_len="
                       f"{cfg.model.max_seq_len}.")
  if num_devices is None:
    return
  sizes = dict(zip(MESH_AXES, mesh_shape_for(cfg.mesh, num_devices)))
  sizes["data"] *= cfg.mesh.num_slices
  shards = data_parallel_size(sizes)
  if batch % shards:
    raise ValueError(f"the rollout batch of {batch} sequences (rl.prompts_per_step * rl.group_size) is "
                     f"not divisible by the data-parallel axes data*fsdp*expert = {shards}.")
  if rl.sft_steps and rl.sft_batch_size % shards:
    raise ValueError(f"rl.sft_batch_size={rl.sft_batch_size} is not divisible by the data-parallel axes "
                     f"data*fsdp*expert = {shards}.")
  sequence = sizes["sequence"]
  if sequence > 1:
    multiple = 2 * sequence if cfg.attention.zigzag and cfg.attention.impl == "ring" else sequence
    for field, length in (("rl.max_prompt_len + rl.max_new_tokens", total),
                          ("data.seq_len", cfg.data.seq_len if rl.sft_steps else multiple)):
      if length % multiple:
        raise ValueError(f"{field} = {length} is not divisible by {multiple} (mesh.sequence={sequence}"
                         f"{', x2 for attention.zigzag' if multiple != sequence else ''}).")


def _pool_names(cfg) -> list[str]:
  return ["jsonl"] if cfg.data.jsonl else []


# --- prompts ------------------------------------------------------------------------------------


class PromptStream:
  """Training examples in order from the train side of the task mixture; `position` (the index of
  the next example) is saved with checkpoints so a resumed run continues exactly there."""

  def __init__(self, source, position: int = 0):
    self.source, self.position = source, int(position)

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    self.position += 1
    return self.source[self.position - 1]


def train_source(cfg) -> TaskMixture:
  """The training prompts: data.tasks (and data.jsonl as the pool "jsonl"), on the train side of the
  held-out split (data.eval_fraction; every prompt when 0)."""
  pools, spec = None, cfg.data.tasks
  if cfg.data.jsonl:
    loaded = load_jsonl(cfg.data.jsonl, skip_bad=cfg.data.skip_bad_rows)
    if not loaded.examples:
      raise ValueError(f"data.jsonl={cfg.data.jsonl!r} holds no valid rows ({loaded.num_bad} malformed).")
    pools = {"jsonl": loaded.examples}
    spec = "jsonl:1.0" if not spec else f"{spec},jsonl:1.0"
  split = "train" if cfg.data.eval_fraction > 0 and not cfg.eval.jsonl else "all"
  return TaskMixture(spec, difficulty=cfg.data.difficulty, seed=cfg.seed, pools=pools, split=split,
                     eval_fraction=cfg.data.eval_fraction)


def train_prompts(source: TaskMixture) -> list[str]:
  """The prompts training may draw from fixed pools (JSONL), for the eval overlap check."""
  return [e["prompt"] for pool in source.pools.values() for e in pool]


# --- building a run -----------------------------------------------------------------------------


def setup(cfg, *, mesh=None, model=None, tokenizer=None, position: int = 0) -> tuple[RLRun, PromptStream]:
  """The RLRun (train state and jitted programs) and the training prompt stream for `cfg`."""
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  check_config(cfg, mesh.size)
  tokenizer = tokenizer_from_config(cfg) if tokenizer is None else tokenizer
  if model is None:
    model = initial_model(cfg, mesh)
  return build_run(cfg, mesh, model, tokenizer), PromptStream(train_source(cfg), position)


# --- hooks: metrics, evaluation, checkpoints ----------------------------------------------------


def eval_hook(evaluator: Evaluator, every: int, last_step: int, eval_path: str | None) -> Hook:
  """Evaluates every `every` steps and at the last step; adds eval/* to the step's metrics and
  appends them to `eval_path` (JSONL)."""
  def hook(step: int, run: RLRun, metrics: dict) -> None:
    if step % every and step != last_step:
      return
    results = evaluator(run.state.params, run.state.extra)
    metrics.update(results)
    if eval_path:
      with open(eval_path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **results}) + "\n")
  return hook


def checkpoint_hook(checkpointer: Checkpointer, prompts: PromptStream) -> Hook:
  """Saves every checkpoint.every steps, and at once when the run is about to stop on non-finite
  updates (metrics["stopping"])."""
  def hook(step: int, run: RLRun, metrics: dict) -> None:
    checkpointer.save(step, run.state, data_state={"step": step, "next_example": prompts.position},
                      config=run.cfg, force=bool(metrics.get("stopping")))
  return hook


class NonFiniteError(RuntimeError):
  """Raised when rl.max_nonfinite_steps steps in a row had only non-finite updates."""


def train_steps(run: RLRun, prompts: PromptStream, *, start_step: int = 0, num_steps: int | None = None,
                hooks: tuple[Hook, ...] = (), writer: MetricsWriter | None = None) -> list[dict]:
  """RL steps start_step + 1 .. num_steps; returns their metric records. After each step the hooks
  run in order (evaluation adds to the record), then the record is written. Step k's PRNG key is
  derived from (seed, k), so a resumed run draws what the uninterrupted one would have."""
  num_steps = run.cfg.rl.num_steps if num_steps is None else num_steps
  limit = int(run.cfg.rl.max_nonfinite_steps)
  key = jax.random.key(run.cfg.seed + 1)
  records, counter, streak = [], CompileCounter(), 0
  try:
    for step in range(start_step + 1, num_steps + 1):
      metrics = rl_step(run, prompts, jax.random.fold_in(key, step))
      metrics["compiles"] = counter.count()
      streak = streak + 1 if metrics["nonfinite_minibatches"] >= 1.0 else 0
      metrics["nonfinite_streak"] = streak
      metrics["stopping"] = bool(limit and streak >= limit)
      for hook in hooks:
        hook(step, run, metrics)
      stopping = metrics.pop("stopping")
      records.append(writer.write(step, metrics) if writer is not None else {"step": step, **metrics})
      if stopping:
        raise NonFiniteError(
            f"{streak} RL steps in a row (up to step {step}) had a non-finite loss or gradient in every "
            f"minibatch; none was applied, the parameters are those of step {step - streak}, saved "
            f"in the checkpoint of step {step} (rl.max_nonfinite_steps={limit}).")
  finally:
    counter.close()
  return records


# --- the whole job ------------------------------------------------------------------------------


def dispatch_summary(cfg, mesh) -> str:
  """One line: which MoE expert dispatch each phase of the RL step runs (moe.dispatch=auto picks
  per backend and phase, model/moe_dispatch.py `choose`), for the run's console summary."""
  from meshrl.model import moe_dispatch  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  mc = ModelConfig.from_config(cfg, mesh)
  if not mc.num_moe_layers:
    return "moe dispatch: no MoE layers"
  if mesh.shape["expert"] > 1:
    return f"moe dispatch: expert_parallel all-to-all over {mesh.shape['expert']} devices ({mc.dispatch})"
  rl = cfg.rl
  rows = rl.prompts_per_step * rl.group_size
  tokens = {"train": rows * (rl.max_prompt_len + rl.max_new_tokens) // rl.num_minibatches,
            "prefill": rl.prompts_per_step * rl.max_prompt_len, "decode": rows}
  backend = mesh.devices.flat[0].platform
  chosen = moe_dispatch.plan(mc.dispatch, backend=backend, k=mc.num_experts_per_tok,
                             num_experts=mc.num_experts, tokens_by_phase=tokens)
  return f"moe dispatch ({mc.dispatch} on {backend}): " + ", ".join(f"{p} {n}" for p, n in chosen.items())



def run(cfg, workdir: str, *, mesh=None) -> list[dict]:
  """Warm start (SFT) if configured, then RL with evaluation and checkpoints; writes into `workdir`:
  config.json, metrics.jsonl, eval.jsonl, tb/, reward_curve.png, sft/ and checkpoints/."""
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  check_config(cfg, mesh.size)
  os.makedirs(workdir, exist_ok=True)
  save_config(cfg, workdir)
  print(dispatch_summary(cfg, mesh))
  tokenizer = tokenizer_from_config(cfg)
  source = train_source(cfg)
  held_out = held_out_examples(cfg, train_prompts=train_prompts(source)) if cfg.eval.every else []
  model = initial_model(cfg, mesh)
  if cfg.rl.sft_steps:
    from meshrl.train.sft import run_sft  # pylint: disable=import-outside-toplevel
    model = run_sft(cfg, os.path.join(workdir, "sft"), mesh=mesh, model=model, source=source,
                    tokenizer=tokenizer).model
  rl_run = build_run(cfg, mesh, model, tokenizer)
  prompts = PromptStream(source)
  hooks, checkpointer, start_step = [], None, 0
  if cfg.checkpoint.enabled:
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                                max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save)
    if cfg.checkpoint.restore and checkpointer.latest_step() is not None:
      restored = checkpointer.restore(rl_run.state)
      rl_run.state, start_step = restored.state, restored.step
      prompts.position = int(restored.data_state.get("next_example", 0))
      print(f"resumed from {checkpointer.directory} at step {start_step}")
  evaluator = None
  if cfg.eval.every:
    evaluator = Evaluator(cfg, mesh, tokenizer, held_out)
    eval_path = os.path.join(workdir, "eval.jsonl")
    if start_step == 0:
      initial = evaluator(rl_run.state.params, rl_run.state.extra)
      with open(eval_path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"step": 0, **initial}) + "\n")
      print(f"held-out greedy accuracy before RL: {initial['eval/accuracy']:.3f} "
            f"({initial['eval/num_prompts']} prompts)")
    hooks.append(eval_hook(evaluator, cfg.eval.every, cfg.rl.num_steps, eval_path))
  if checkpointer is not None:
    hooks.append(checkpoint_hook(checkpointer, prompts))
  try:
    with MetricsWriter(workdir, tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar,
                       total_steps=cfg.rl.num_steps, resume_step=start_step or None,
                       bar_keys=("reward_mean", "kl", "entropy", "tokens_per_s")) as writer:
      records = train_steps(rl_run, prompts, start_step=start_step, hooks=tuple(hooks), writer=writer)
  finally:
    if checkpointer is not None:
      checkpointer.wait()
      checkpointer.close()
    rl_run.close()
    if evaluator is not None:
      evaluator.close()
  if cfg.log.plot:
    plot_curve(os.path.join(workdir, "metrics.jsonl"), "reward_mean",
               os.path.join(workdir, "reward_curve.png"))
  return records


def metrics_equal(a: list[dict], b: list[dict], *, ignore=lambda key: key.endswith("_s")
                  or key in ("tokens_per_s", "time_s", "compiles")) -> bool:
  """Whether two runs' metric records agree exactly, time fields aside (determinism checks).

  `compiles` is left out too: it counts backend compilations, which a persistent compilation cache
  turns into cache hits, so it describes the process, not the run."""
  strip = lambda r: {k: v for k, v in r.items() if not ignore(k)}  # noqa: E731
  return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))
