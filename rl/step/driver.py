"""The RL driver: check the config, warm start, then RL steps with hooks for metrics, evaluation and
checkpoints.

  check_config(cfg, num_devices)    every config error a run would hit, before anything runs
                                    (building the run spec, rl/step/run_spec.py)
  run(cfg, workdir)                 the whole job (scripts/rl.py)
  setup(cfg, mesh=, model=)         the RLRun and its prompt stream, for tests and benchmarks
  train_steps(run, prompts, ...)    RL steps (rl/step/program.py) with hooks at the edge

Plain Python around the jitted programs of rl/step/program.py; side effects (files, threads, the progress bar)
live here and in the hooks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshrl.configs import save_config
from meshrl.rl.step.bootstrap import bootstrap_hooks
from meshrl.rl.step.groups import shared_prompts
from meshrl.rl.envs import TaskMixture
from meshrl.rl.envs.env_work import EnvWork, mixture_options, run_quarantine
from meshrl.rl.envs.levels import warm_start_source
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.registry import DomainMixture
from meshrl.rl.step.evaluation import Evaluator, held_out_examples
from meshrl.rl.step.episodes import EPISODE_FAMILIES
from meshrl.rl.step.episode_collect import Demonstrations, MultiTurnEvaluator
from meshrl.rl.step.episode_collect import held_out as multiturn_held_out
from meshrl.rl.envs.prompts import PromptStream
from meshrl.rl.step.program import RLRun, build_run, in_flight_state, restore_in_flight, rl_step
from meshrl.rl.step.run_spec import RunSpec, build_spec, check_config, domain_specs  # noqa: F401 (build_spec: API)
from meshrl.rl.step.sources import task_mixture
from meshrl.sharding import make_mesh
from meshrl.sharding.mesh import EXPERT_AXIS, axis_size, platform
from meshrl.train.checkpoint import Checkpointer, check_readable, check_saved_config, committed_steps
from meshrl.train.init_from import initial_model
from meshrl.model.transformer import ModelConfig
from meshrl.train.profile import StepProfiler
from meshrl.train.metrics import CompileCounter, MetricsWriter, peak_flops, plot_curve, read_jsonl, truncate_jsonl
from meshrl.sharding import hosts
from meshrl.train.preemption import Preemption
from meshrl.train.stops import NonFiniteError, NonFiniteStreak  # noqa: F401 (NonFiniteError: loop API)
from meshrl.configs.cli import disk_full
from meshrl.train.workdir import check_free_space, check_workdir, clear_outputs, disk_full_message

Hook = Callable[[int, RLRun, dict], None]


# --- prompts ------------------------------------------------------------------------------------


def train_source(cfg) -> TaskMixture | DomainMixture:
  """The training prompts: the domains of data.domains (batches composed by their quotas, the
  quarantine list data.quarantine honoured), else data.tasks (and the file pools, weight 1 each), on
  the train side of the held-out split (data.eval_fraction; every prompt when 0)."""
  split = "train" if cfg.data.eval_fraction > 0 and not cfg.eval.jsonl else "all"
  if cfg.data.domains:
    if cfg.data.jsonl or cfg.data.get("array_record"):
      raise ValueError("data.domains and data.jsonl/data.array_record are both set: declare the file "
                       "as a domain (source jsonl:<path>) in data.domains.")
    return DomainMixture(domain_specs(cfg), seed=cfg.seed, split=split, eval_fraction=cfg.data.eval_fraction,
                         batch_size=cfg.rl.prompts_per_step, **mixture_options(cfg, run_quarantine(cfg)))
  return task_mixture(cfg, split=split, seed=cfg.seed)


def env_work_for(cfg, source) -> EnvWork:
  """The run's environment work (rl/envs/env_work.py): its scheduler under the domains' policies and
  the quarantine the training source draws by (a DomainMixture's), so a task quarantined by its
  failures leaves the draws."""
  quarantine = getattr(source, "quarantine", None)
  if not isinstance(quarantine, Quarantine):
    quarantine = run_quarantine(cfg)
  return EnvWork.from_config(cfg, getattr(source, "policies", None), quarantine)


def prompt_stream(source, position: int = 0, *, per_step: int = 1, shared: bool = False) -> PromptStream:
  """This host's stream of training examples (grain, rl/envs/prompts.py): its blocks of
  per_step / process_count examples of `source`, so the hosts' blocks side by side are the
  `per_step` prompts one process would draw; with `shared` (partial rollouts, whose groups end
  unevenly over the hosts, or fewer prompts than hosts: rl/step.shared_prompts) the whole stream on
  every host."""
  hosts = 1 if shared else jax.process_count()
  index = 0 if shared else jax.process_index()
  return PromptStream(source, position, shard=(index, hosts), block=max(per_step // hosts, 1))


def skipped_rows(source: TaskMixture) -> str:
  """One line on the malformed file rows skipped (file:line: reason of the first few), or ""."""
  bad = [row for pool in getattr(source, "pools", {}).values() for row in getattr(pool, "bad", ())]
  if not bad:
    return ""
  shown = "; ".join(f"{b.file}:{b.line}: {b.reason}" for b in bad[:3])
  return f"skipped {len(bad)} malformed data rows ({shown}{'; ...' if len(bad) > 3 else ''})"


def train_prompts(source: TaskMixture) -> list[str]:
  """The prompts training may draw from fixed pools (JSONL), for the eval overlap check."""
  return [e["prompt"] for name, pool in source.pools.items() if name not in EPISODE_FAMILIES
          for e in pool]  # noqa (reads each file once; generated episode pools are endless)


# --- building a run -----------------------------------------------------------------------------


def setup(cfg, *, mesh=None, model=None, tokenizer=None, position: int = 0) -> tuple[RLRun, PromptStream]:
  """The RLRun (train state and jitted programs) and the training prompt stream for `cfg`."""
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  spec = check_config(cfg, mesh=mesh, tokenizer=tokenizer)
  if model is None:
    model = initial_model(cfg, mesh, numbers=spec.model)
  source = train_source(cfg)
  return build_run(cfg, mesh, model, spec.tokenizer, env_work=env_work_for(cfg, source), spec=spec), prompt_stream(
      source, position, per_step=cfg.rl.prompts_per_step, shared=shared_prompts(cfg))


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


def checkpoint_hook(checkpointer: Checkpointer, prompts: PromptStream,
                    extra_state: Callable[[], dict] | None = None) -> Hook:
  """Saves every checkpoint.every steps, and at once when the run is about to stop (non-finite
  updates or preemption: metrics["stopping"]). The checkpoint holds the train state (params,
  optimizer, step, router biases), the prompt stream's position, the resolved config and
  `extra_state()` (e.g. carried rollouts, a quarantine list; JSON values); the step's PRNG key is
  derived from (seed, step), so nothing else is needed to continue exactly."""
  def hook(step: int, run: RLRun, metrics: dict) -> None:
    force = bool(metrics.get("stopping"))
    if not (force or checkpointer.should_save(step)):
      return  # the carried state waits for the rollouts in flight and copies them to the host: only to save
    carried = extra_state() if extra_state else None  # first: it waits for rollouts in flight, which may draw prompts
    checkpointer.save(step, run.state, data_state={"step": step, **prompts.get_state()},
                      config=run.cfg, extra_state=carried, force=force)
  return hook


def carried_state(run: RLRun) -> dict:
  """What a step carries to the next besides the train state (JSON): partial rollouts' groups and
  asynchronous RL's rollouts in flight."""
  state = {}
  if run.in_flight:  # first: settling them may advance the partial pool (asynchronous partial episodes)
    state["in_flight"] = in_flight_state(run)
  if run.partial is not None:
    state["partial"] = run.partial.get_state()
  if run.env_work is not None:  # the quarantine of tasks whose environments kept failing
    state["env"] = run.env_work.state()
  if run.bootstrap is not None:  # last: rollouts settled above may have drawn prompts (issue 33)
    state["bootstrap"] = run.bootstrap.get_state()
  if run.replay is not None:  # issue 33's stored successes
    state["replay"] = run.replay.get_state()
  return state


def restore_carried_state(run: RLRun, state: dict) -> None:
  """Continues from `carried_state`'s output."""
  if run.partial is not None:
    run.partial.set_state(state.get("partial", {}))
  if run.env_work is not None and "env" in state:
    run.env_work.restore(state["env"])
  restore_in_flight(run, state.get("in_flight", []))
  if run.bootstrap is not None and "bootstrap" in state:
    run.bootstrap.set_state(state["bootstrap"])
  if run.replay is not None and "replay" in state:
    run.replay.set_state(state["replay"])


def _abstract(tree):
  """Arrays -> ShapeDtypeStructs; mesh shardings kept, single-device (uncommitted) ones dropped."""
  def spec(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=sharding if isinstance(sharding, NamedSharding) else None)
  return jax.tree.map(lambda x: spec(x) if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


class PhaseCost:
  """Throughput and MFU of generation and update separately, from the FLOPs of the run's compiled
  rollout and update programs.

  Wraps `run.rollout` / `run.update` to see the first step's arguments; after that step the two
  programs' optimised HLO is read once (`jitted.lower(...).compile()`, a cache hit, no new compile)
  and counted by `train.metrics.program_flops`, which multiplies loop bodies by their trip counts
  (XLA's cost_analysis counts a scanned layer or a decode step once). The decode loop stops when
  every sequence has, so each rollout's FLOPs are fixed + per_step * (its longest response). Each
  step then adds gen_flops_per_s, gen_tokens_per_s (generated tokens / rollout_s), update_flops_per_s,
  update_tokens_per_s (update rows x row length x epochs / update_s) and, where the chips' peak is known
  (train.metrics.peak_flops), gen_mfu and update_mfu. A compiled SPMD program is one device's share:
  its count times the mesh size is what all chips execute, work a layout repeats on several
  devices included (so MFU here is hardware FLOPs utilisation of the matmuls).
  """

  def __init__(self, run: RLRun, peak: float | None):
    self.peak, self.cfg = peak, run.cfg
    self.update_shape = (run.run_spec.update_rows, run.run_spec.update_row_len)  # [rows, row_len]
    self.devices = run.mesh.size if run.mesh is not None else 1  # the programs are per device
    self._rollout, self._update = run.rollout, run.update
    self._rollout_args = self._update_args = None
    self.rollout_flops = self.update_flops = None
    self._decode_steps: list[int] = []
    self.error: str | None = None
    run.rollout, run.update = self._rollout_call, self._update_call

  def _rollout_call(self, *args):
    if self._rollout_args is None:
      self._rollout_args = _abstract(args)
    out = self._rollout(*args)
    lengths = getattr(out, "lengths", None)
    if lengths is not None:
      self._decode_steps.append(int(np.max(hosts.to_host(lengths))))
    return out

  def _update_call(self, *args):
    if self._update_args is None:
      self._update_args = _abstract(args)
    return self._update(*args)

  def _count(self) -> None:
    from meshrl.train.metrics import program_flops  # pylint: disable=import-outside-toplevel
    self.rollout_flops = program_flops(self._rollout.lower(*self._rollout_args).compile().as_text())
    self.update_flops = program_flops(self._update.lower(*self._update_args).compile().as_text()).fixed

  def __call__(self, metrics: dict) -> dict:
    """The phase metrics of the step whose `metrics` (rl_step's) are given."""
    steps, self._decode_steps = self._decode_steps, []
    if self.error or self._rollout_args is None or self._update_args is None:
      return {}
    if self.rollout_flops is None:
      try:
        self._count()
      except Exception as e:  # pylint: disable=broad-except  (a wrapped or replaced program)
        self.error = f"{type(e).__name__}: {e}"
        print(f"phase FLOPs not counted: {self.error[:200]}")
        return {}
    gen = self.devices * sum(self.rollout_flops.at(n) for n in steps)
    rows, row_len = self.update_shape
    # rl.packed_row_buckets: this step's update took metrics["update_rows"] rows; the update's FLOPs
    # grow with its rows (each row is its own sequence), the first step's program was counted.
    counted = getattr(self._update_args[1], "tokens", None)  # the batch of the counted call
    step_rows = int(metrics.get("update_rows", rows))
    slots = step_rows * row_len * self.cfg.rl.epochs
    rollout_s, update_s = max(metrics["rollout_s"], 1e-9), max(metrics["update_s"], 1e-9)
    update_flops = self.update_flops * (step_rows / counted.shape[0] if counted is not None else 1.0)
    out = {"gen_flops_per_s": gen / rollout_s, "gen_tokens_per_s": metrics["generated_tokens"] / rollout_s,
           "update_flops_per_s": self.devices * update_flops / update_s,
           "update_tokens_per_s": slots / update_s}
    if self.peak:
      out["gen_mfu"] = out["gen_flops_per_s"] / self.peak
      out["update_mfu"] = out["update_flops_per_s"] / self.peak
    return out


def without_unmeasured(metrics: dict) -> dict:
  """A step's metrics without the update's measurements when no minibatch was applied (every one
  empty or non-finite: rl/algo/update.py reports NaN for them): a record holds nothing for what did not
  run (it had reported entropy=0)."""
  if metrics.get("updated_minibatches", 1.0) > 0:
    return metrics
  return {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}


def train_steps(run: RLRun, prompts: PromptStream, *, start_step: int = 0, num_steps: int | None = None,
                hooks: tuple[Hook, ...] = (), writer: MetricsWriter | None = None,
                checkpoint: Hook | None = None, preemption: Preemption | None = None,
                phase_cost: PhaseCost | None = None, profiler: StepProfiler | None = None) -> list[dict]:
  """RL steps start_step + 1 .. num_steps; returns their metric records. After each step the hooks
  run in order (evaluation adds to the record), then the record is written, then `checkpoint` runs
  (so a checkpoint never runs ahead of metrics.jsonl: a kill between the two redoes the step; the
  last step is always saved). Step
  k's PRNG key is derived from (seed, k), so a resumed run draws what the uninterrupted one would.

  With `preemption` (train/preemption.py), a SIGTERM during a step ends the loop after that step:
  the step is checkpointed at once (metrics["stopping"]) and the records so far are returned. With
  `phase_cost`, each record gets generation and update throughput and MFU (`PhaseCost`). With
  `profiler` (train/profile.py, log.profile_start), its steps' `rl_step` calls are traced.

  Each record's `step_wall_s` is the loop's wall time since the previous record: the step, its hooks
  (evaluation) and the previous step's checkpoint; `time_s` counts `rl_step` alone. `host_cpu_s` is
  the process's CPU time over the same span (every thread, user and system: time.process_time), so
  host_cpu_s / step_wall_s is how many of the host's cores the step kept busy (on a CPU backend the
  devices' work included)."""
  num_steps = run.cfg.rl.num_steps if num_steps is None else num_steps
  streak = NonFiniteStreak(run.cfg.rl.max_nonfinite_steps, what="RL", field="rl.max_nonfinite_steps")
  key = jax.random.key(run.cfg.seed + 1)
  records, counter = [], CompileCounter()
  run.version = start_step  # one policy update per RL step
  since, cpu_since = time.perf_counter(), time.process_time()
  try:
    for step in range(start_step + 1, num_steps + 1):
      with profiler.step(step) if profiler is not None else contextlib.nullcontext():
        metrics = without_unmeasured(rl_step(run, prompts, jax.random.fold_in(key, step)))
      if phase_cost is not None:
        metrics.update(phase_cost(metrics))
      metrics["compiles"] = counter.count()
      nonfinite = streak.update(metrics["nonfinite_minibatches"] >= 1.0)  # every minibatch skipped
      metrics["nonfinite_streak"] = streak.streak
      preempted = preemption is not None and preemption.requested() and step < num_steps
      metrics["stopping"] = nonfinite or preempted
      for hook in hooks:
        hook(step, run, metrics)
      stopping = metrics.pop("stopping")
      now, cpu_now = time.perf_counter(), time.process_time()
      metrics["step_wall_s"], since = now - since, now
      metrics["host_cpu_s"], cpu_since = cpu_now - cpu_since, cpu_now
      records.append(writer.write(step, metrics) if writer is not None else {"step": step, **metrics})
      if checkpoint is not None:
        checkpoint(step, run, {**metrics, "stopping": stopping or step == num_steps})
      if nonfinite:
        raise streak.error(step, saved=checkpoint is not None)
      if preempted:
        print(preemption.stopped_message("RL", step, num_steps, saved=checkpoint is not None), flush=True)
        break
  finally:
    counter.close()
    if profiler is not None:
      profiler.close()
  return records


# --- the whole job ------------------------------------------------------------------------------


def dispatch_summary(spec: RunSpec, mesh) -> str:
  """One line: which MoE expert dispatch each phase of the RL step runs (moe.dispatch=auto picks
  per backend and phase, model/moe_dispatch.py `choose`), for the run's console summary."""
  from meshrl.model import moe_dispatch  # pylint: disable=import-outside-toplevel
  mc = spec.model
  if not mc.num_moe_layers:
    return "moe dispatch: no MoE layers"
  rl = spec.cfg.rl
  rows = rl.prompts_per_step * rl.group_size
  tokens = {"train": rows * (rl.max_prompt_len + rl.max_new_tokens) // rl.num_minibatches,
            "prefill": rl.prompts_per_step * rl.max_prompt_len, "decode": rows}
  if axis_size(mesh, EXPERT_AXIS) > 1:
    from meshrl.model.moe import ep_weights_plan  # pylint: disable=import-outside-toplevel
    layouts = ", ".join(f"{p} {layout}" for p, (layout, _) in ep_weights_plan(mc, mesh, tokens).items())
    return (f"moe dispatch: expert_parallel all-to-all over {axis_size(mesh, EXPERT_AXIS)} devices ({mc.dispatch}); "
            f"expert weights ({mc.ep_weights}): {layouts}")
  backend = platform(mesh)
  chosen = moe_dispatch.plan(mc.dispatch, backend=backend, k=mc.num_experts_per_tok,
                             num_experts=mc.num_experts, tokens_by_phase=tokens)
  return f"moe dispatch ({mc.dispatch} on {backend}): " + ", ".join(f"{p} {n}" for p, n in chosen.items())



def run(cfg, workdir: str, *, mesh=None, overwrite: bool = False) -> list[dict]:
  """Warm start (SFT) if configured, then RL with evaluation and checkpoints; writes into `workdir`:
  config.json, metrics.jsonl, eval.jsonl, tb/, reward_curve.png, sft/ and checkpoints/.

  Everything that can refuse the run is checked before the first write (`prepare`): the config, a
  work directory holding another run (refused unless this run resumes it or `overwrite`, which
  removes that run's outputs first), a damaged checkpoint to resume from, the data and held-out
  files, the initial model, and room on disk for a checkpoint.

  SIGTERM or Ctrl-C (SIGINT) at any point (warm start or RL) finishes the step in flight, saves it
  and returns (the records so far; none when it came during the warm start): running the same
  command resumes. A second Ctrl-C stops at once (KeyboardInterrupt; the last checkpoint stays)."""
  with Preemption() as preemption:
    return _run(cfg, workdir, mesh, preemption, overwrite)


class _Prepared(NamedTuple):
  mesh: Any
  spec: RunSpec
  source: Any
  held_out: list
  model: Any
  resuming: bool
  leftovers: list  # an earlier run's outputs to remove first (overwrite)
  checkpoint_bytes: int  # one checkpoint of the train state, for the disk checks


def _latest_step_dir(folder: str) -> str | None:
  steps = committed_steps(folder)
  return os.path.join(folder, str(steps[-1])) if steps else None


def checkpoint_bytes(model: ModelConfig, optim) -> int:
  """Bytes of one checkpoint of the train state of `model` under the optimizer of `optim` (cfg.optim;
  train/state.state_bytes; from shapes)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import Transformer  # pylint: disable=import-outside-toplevel
  from meshrl.train.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import state_bytes  # pylint: disable=import-outside-toplevel
  return state_bytes(lambda: Transformer(model, rngs=nnx.Rngs(0)), make_optimizer(optim))


def prepare(cfg, workdir: str, mesh=None, *, overwrite: bool = False) -> _Prepared:
  """Every check of a run and what it reads, before anything is written (see `run`)."""
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  spec = check_config(cfg, mesh=mesh)
  step_dirs = [d for d in (_latest_step_dir(os.path.join(workdir, "checkpoints")),
                           _latest_step_dir(os.path.join(workdir, "sft", "checkpoints"))) if d]
  resuming = bool(cfg.checkpoint.enabled and cfg.checkpoint.restore and step_dirs and not overwrite)
  leftovers = check_workdir(workdir, cfg, resuming=resuming, overwrite=overwrite)
  if resuming:  # a damaged checkpoint, or one of another model, stops the run here
    for step_dir in step_dirs:
      check_readable(step_dir)
      check_saved_config(step_dir, cfg)
  source = train_source(cfg)
  if skipped_rows(source):
    print(skipped_rows(source))
  held_out = []
  if cfg.eval.every:
    pools = source.pools if isinstance(source, TaskMixture) else None  # the data files are read once
    held_out = (multiturn_held_out if cfg.rl.multi_turn else held_out_examples)(
        cfg, train_prompts=train_prompts(source), pools=pools)
    if not held_out:
      raise ValueError("eval.every > 0 but there are no held-out prompts (eval.jsonl, data.eval_fraction).")
  size = checkpoint_bytes(spec.model, cfg.optim)
  if cfg.checkpoint.enabled and hosts.is_primary():
    check_free_space(workdir, size)
  model = initial_model(cfg, mesh, numbers=spec.model)
  return _Prepared(mesh, spec, source, held_out, model, resuming, leftovers, size)


def _run(cfg, workdir: str, mesh, preemption: Preemption, overwrite: bool) -> list[dict]:
  ready = prepare(cfg, workdir, mesh, overwrite=overwrite)
  mesh = ready.mesh
  primary = hosts.is_primary()  # process 0 writes the run's files; every process checkpoints
  if primary:
    clear_outputs(workdir, ready.leftovers)
  os.makedirs(workdir, exist_ok=True)
  if primary:
    save_config(cfg, workdir)
  print(dispatch_summary(ready.spec, mesh))
  print(ready.spec.model.kernel.summary())  # which attention kernel runs
  checkpointer = None
  if cfg.checkpoint.enabled:
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                                max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save)
  try:
    return _train(cfg, workdir, ready, checkpointer, preemption)
  except Exception as error:  # pylint: disable=broad-except
    if not disk_full(error):
      raise
    latest = committed_steps(os.path.join(workdir, "checkpoints"))
    raise OSError(errno.ENOSPC, disk_full_message(workdir, ready.checkpoint_bytes,
                                                  latest[-1] if latest else None)) from error


def warm_start(cfg, folder: str, *, mesh, model, source, tokenizer, preemption=None, numbers=None):
  """The run's warm start (rl.sft_steps of SFT into `folder`, resumed from a checkpoint there): on
  `source`'s examples at rl.sft_difficulty, as multi-turn demonstrations when episodes are
  multi-turn -> train/sft.run_sft's result (.model, .preempted). The driver runs it before RL; the
  reward model's policy pairs (rl/rewards/rm_first.py) run it first, into the same folder."""
  from meshrl.train.sft import run_sft  # pylint: disable=import-outside-toplevel
  sft_source = warm_start_source(cfg, source)  # its generated domains at rl.sft_difficulty
  if cfg.rl.multi_turn:
    sft_source = Demonstrations(sft_source, tokenizer=tokenizer, max_obs_tokens=cfg.rl.max_obs_tokens)
  return run_sft(cfg, folder, mesh=mesh, model=model, source=sft_source, tokenizer=tokenizer,
                 preemption=preemption, numbers=numbers)


def _train(cfg, workdir: str, ready: _Prepared, checkpointer: Checkpointer | None,
           preemption: Preemption) -> list[dict]:
  """The warm start, then RL steps with their hooks (after `prepare` and the first writes)."""
  mesh, tokenizer, source, model = ready.mesh, ready.spec.tokenizer, ready.source, ready.model
  multi_turn, primary = bool(cfg.rl.multi_turn), hosts.is_primary()
  if cfg.rl.sft_steps:
    try:
      warm = warm_start(cfg, os.path.join(workdir, "sft"), mesh=mesh, model=model, source=source,
                        tokenizer=tokenizer, preemption=preemption, numbers=ready.spec.model)
    except BaseException:
      if checkpointer is not None:
        checkpointer.close()
      raise
    if warm.preempted:
      if checkpointer is not None:
        checkpointer.close()
      return []
    model = warm.model
  rl_run = build_run(cfg, mesh, model, tokenizer, env_work=env_work_for(cfg, source), spec=ready.spec)
  prompts = prompt_stream(source, per_step=cfg.rl.prompts_per_step, shared=shared_prompts(cfg))
  hooks, start_step, restored = bootstrap_hooks(rl_run), 0, None  # issue 33's RFT rounds, before evaluation
  evaluator = initial = None
  try:
    if checkpointer is not None and checkpointer.latest_step() is not None and cfg.checkpoint.restore:
      restored = checkpointer.restore(rl_run.state)
      rl_run.state, start_step = restored.state, restored.step
      prompts.set_state(restored.data_state)
      restore_carried_state(rl_run, restored.extra_state)
      print(f"resumed from {checkpointer.directory} at step {start_step}")
    if cfg.eval.every:
      evaluator = (MultiTurnEvaluator(cfg, mesh, tokenizer, ready.held_out) if multi_turn else
                   Evaluator(cfg, mesh, tokenizer, ready.held_out,
                             rm_scorer=getattr(rl_run.pool, "scorers", {}).get("reward_model")))
      eval_path = os.path.join(workdir, "eval.jsonl") if primary else None
      if start_step == 0:
        initial = evaluator(rl_run.state.params, rl_run.state.extra)
        if eval_path:
          with open(eval_path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"step": 0, **initial}) + "\n")
        print(f"held-out greedy accuracy before RL: {initial['eval/accuracy']:.3f} "
              f"({initial['eval/num_prompts']} prompts)")
      elif eval_path:
        truncate_jsonl(eval_path, start_step)  # evaluations after the checkpoint are redone
      hooks.append(eval_hook(evaluator, cfg.eval.every, cfg.rl.num_steps, eval_path))
    save = None
    if checkpointer is not None:
      save = checkpoint_hook(checkpointer, prompts, extra_state=lambda: carried_state(rl_run))
    records = []
    if start_step < cfg.rl.num_steps:
      phase_cost = PhaseCost(rl_run, peak_flops(mesh.devices.flat))
      with MetricsWriter(workdir, tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar,
                         total_steps=cfg.rl.num_steps, resume_step=start_step,
                         bar_keys=("reward_mean", "kl", "entropy", "tokens_per_s")) as writer:
        if initial is not None:  # the evaluation before RL: every domain's step 0 in TensorBoard too
          writer.scalars(0, initial)
        records = train_steps(rl_run, prompts, start_step=start_step, hooks=tuple(hooks), writer=writer,
                              checkpoint=save, preemption=preemption, phase_cost=phase_cost,
                              profiler=StepProfiler.from_config(cfg, workdir, name="rl"))
  finally:
    if checkpointer is not None:
      checkpointer.wait()
      checkpointer.close()
    rl_run.close()
    if evaluator is not None:
      evaluator.close()
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if cfg.log.plot and primary and os.path.exists(metrics_path) and read_jsonl(metrics_path):
    plot_curve(metrics_path, "reward_mean", os.path.join(workdir, "reward_curve.png"))
  return records


def metrics_equal(a: list[dict], b: list[dict], *, ignore=lambda key: key.endswith("_s")
                  or key.endswith("_mfu") or key in ("mfu", "compiles")) -> bool:
  """Whether two runs' metric records agree exactly, time fields (durations, rates, MFU) aside
  (determinism checks).

  `compiles` is left out too: it counts backend compilations, which a persistent compilation cache
  turns into cache hits, so it describes the process, not the run."""
  strip = lambda r: {k: v for k, v in r.items() if not ignore(k)}  # noqa: E731
  return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))
