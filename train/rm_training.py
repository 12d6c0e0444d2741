"""The reward-model training loop: pairs in, a checkpoint a later RL run loads as its reward model.

  result = run_reward_model(cfg, workdir, mesh, model, train=train_arrays, held_out=eval_arrays)

Each step takes rm.batch_size pairs (epoch by epoch, each epoch a permutation seeded by cfg.seed and
its number, so a resumed run draws the same batches), runs `make_rm_step` and writes metrics.jsonl.
Held-out pairwise accuracy and Bradley-Terry loss ("eval/pairwise_accuracy", "eval/bt_loss") are
measured before the first step, every rm.eval_every steps and at the end. Checkpoints are
train/checkpoint.py's (state, config), so `train/init_from.restore_params` and `model.init_from`
read them like any meshrl checkpoint; train/rm_source.py loads one as a policy's reward model.

Axis legend: N pairs, B = rm.batch_size pairs per step.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshrl.sharding.rules import data_parallel_size, rules_from_config
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.profile import StepProfiler
from meshrl.train.metrics import CompileCounter, MetricsWriter, plot_curve
from meshrl.train.optim import make_optimizer, make_schedule
from meshrl.train.preferences import PairArrays
from meshrl.train.reward_model import make_rm_step, make_scorer, put_pairs, score_pairs
from meshrl.train.state import TrainState, create_train_state, merge_model, shardings_of
from meshrl.train.stops import NonFiniteStreak


class RMResult(NamedTuple):
  model: nnx.Module  # the trained reward model (shares the state's arrays)
  state: TrainState
  graphdef: nnx.GraphDef
  history: list[dict]  # the metrics records written (training steps and evaluations)


def rm_max_len(cfg) -> int:
  """Tokens per row: rm.max_len, or model.max_seq_len when it is 0."""
  return int(cfg.rm.max_len or cfg.model.max_seq_len)


def rm_optim(cfg) -> ml_collections.ConfigDict:
  """The reward model's optimizer settings: optim.* with rm.warmup_steps when it is >= 0 (a policy's
  preset names its reward model's warmup without changing its own)."""
  optim = ml_collections.ConfigDict(cfg.optim.to_dict())
  if cfg.rm.get("warmup_steps", -1) >= 0:
    optim.warmup_steps = int(cfg.rm.warmup_steps)
  return optim


def check_rm_shapes(cfg, mesh: Mesh | None) -> None:
  """ValueError naming the rm.* field when the batch does not split over the mesh's batch axes or
  the rows do not fit the model; called before anything compiles."""
  if cfg.rm.max_len < 0 or rm_max_len(cfg) > cfg.model.max_seq_len:
    raise ValueError(f"rm.max_len={cfg.rm.max_len} must lie in [0, model.max_seq_len={cfg.model.max_seq_len}] "
                     "(0 = model.max_seq_len).")
  if mesh is not None:
    shards = data_parallel_size(mesh, rules_from_config(cfg.mesh))
    if cfg.rm.batch_size % shards:
      raise ValueError(f"rm.batch_size={cfg.rm.batch_size} is not divisible by the {shards} batch shards "
                       f"of the mesh {dict(mesh.shape)}.")


def batch_indices(num_pairs: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """[batch_size] pair indices of step `step` (1-based): consecutive slices of per-epoch
  permutations (`np.random.default_rng([seed, epoch])`), wrapping into the next epoch."""
  start = (step - 1) * batch_size
  orders = {}
  out = []
  for position in range(start, start + batch_size):
    epoch, offset = divmod(position, num_pairs)
    if epoch not in orders:
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(num_pairs)
    out.append(orders[epoch][offset])
  return np.asarray(out, np.int64)


def evaluate(score, state: TrainState, held_out: PairArrays, cfg, mesh: Mesh | None) -> dict:
  """{"eval/pairwise_accuracy", "eval/bt_loss", "eval/score_gap", "eval/pairs"} on every held-out pair."""
  chosen, rejected = score_pairs(score, state.params, state.extra, held_out, batch_size=cfg.rm.batch_size,
                                 mesh=mesh, rules=rules_from_config(cfg.mesh))
  gap = chosen.astype(np.float64) - rejected
  margins = held_out.margins.astype(np.float64) + cfg.rm.margin
  return {"eval/pairwise_accuracy": float(np.mean(chosen > rejected)),
          "eval/bt_loss": float(np.mean(np.logaddexp(0.0, -(gap - margins)))),
          "eval/score_gap": float(np.mean(gap)), "eval/pairs": len(held_out)}


def run_reward_model(cfg, workdir: str, mesh: Mesh | None, model: nnx.Module, *, train: PairArrays,
                     held_out: PairArrays, num_steps: int | None = None) -> RMResult:
  """Trains `model` (its value head is the score) for rm.steps steps on `train`; see the module
  docstring. With checkpoint.restore a run continues from workdir/checkpoints' latest step.

  Args:
    cfg: the locked run config (rm.*, optim.*, moe.*, checkpoint.*, log.*, seed).
    workdir: outputs: metrics.jsonl, tb/, checkpoints/, loss_curve.png.
    mesh: the run's mesh (None: one device); `model`'s parameters already lie on it.
    model: the initial reward model (model/init.py, or train/init_from.initial_model).
    train, held_out: encoded pairs (train/preferences.py).
    num_steps: overrides rm.steps.
  """
  num_steps = cfg.rm.steps if num_steps is None else num_steps
  check_rm_shapes(cfg, mesh)
  rules = rules_from_config(cfg.mesh)
  optim = rm_optim(cfg)
  tx = make_optimizer(optim, learning_rate=cfg.rm.learning_rate, rate_field="rm.learning_rate")
  graphdef, state = create_train_state(model, tx, mesh)
  ckpt = None
  if cfg.checkpoint.enabled:
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                        max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save)
  start = 0
  if ckpt is not None and cfg.checkpoint.restore and ckpt.latest_step() is not None:
    restored = ckpt.restore(state)
    state, start = restored.state, restored.step
  step_fn = make_rm_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state),
                         schedule=make_schedule(optim, learning_rate=cfg.rm.learning_rate))
  score = make_scorer(graphdef, mesh, rules)
  writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar,
                         total_steps=num_steps, resume_step=start, bar_keys=("loss", "accuracy"))
  history, counter = [], CompileCounter()
  profiler = StepProfiler.from_config(cfg, workdir, name="rm")
  streak = NonFiniteStreak(cfg.rl.max_nonfinite_steps, what="reward-model training",
                           field="rl.max_nonfinite_steps")
  try:
    if start == 0:
      history.append(writer.write(0, evaluate(score, state, held_out, cfg, mesh)))
    last_time = time.perf_counter()
    for step in range(start + 1, num_steps + 1):
      batch = put_pairs(train.take(batch_indices(len(train), cfg.rm.batch_size, step, cfg.seed)), mesh, rules)
      with profiler.step(step):
        with jax.transfer_guard("disallow"):
          state, metrics = step_fn(state, batch)
        nonfinite = bool(jax.device_get(metrics["nonfinite"]))
      stop = streak.update(nonfinite)
      last = stop or step == num_steps
      record = {}
      if step % cfg.log.every == 0 or last:
        record = {k: v for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        elapsed, last_time = time.perf_counter() - last_time, time.perf_counter()
        record.update(pairs_per_s=cfg.rm.batch_size * min(cfg.log.every, step - start) / elapsed,
                      compiles=counter.count("rm_step"))
      if (cfg.rm.eval_every and step % cfg.rm.eval_every == 0) or last:
        record.update(evaluate(score, state, held_out, cfg, mesh))
      if record:
        history.append(writer.write(step, record))
      if ckpt is not None and (ckpt.should_save(step) or last):
        ckpt.save(step, state, config=cfg, force=True)
      if stop:
        raise streak.error(step, saved=ckpt is not None)
  finally:
    counter.close()
    profiler.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()
  if cfg.log.plot and history and writer.primary:
    plot_curve(writer.path, "loss", os.path.join(workdir, "loss_curve.png"), title="reward-model loss")
  return RMResult(model=merge_model(graphdef, state), state=state, graphdef=graphdef, history=history)
