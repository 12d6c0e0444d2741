"""Reward-model scoring in the RL step: the step with a reward model of the policy's size scoring every
sample on the mesh, side by side with the same step scored by the host verifier, in one run.

Run:  JAX_PLATFORMS=cpu python scripts/bench_rm_scoring.py --cpu_devices=2 --config=configs/tiny.py:peer \
          --json runs/bench_rm_scoring.json
      (--steps 3 timed steps per side after one warm-up step each; --config.a.b=... as in rl.py)

The reward model is the policy's config with model.value_head=true, randomly initialised and saved to
a temporary folder this script creates and deletes (its scores are noise, its cost is a trained
one's). Both sides run the same RLRun (the same compiled rollout and update): first with the plain
RewardPool of rl.rewards, then with rl/rewards/sources.reward_pool scoring every domain with the
reward model (rl.reward_sources="*=reward_model"). The issue 35 target: scoring <= 25% of the step.
Each step's phases come from the step program's own timers (rl_step's metrics).
"""

import argparse
import os
import shutil
import sys
import tempfile

from meshrl.configs import cli

PHASES = ("rollout_s", "reward_s", "prepare_s", "update_s")


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up step)")


def _save_reward_model(cfg, folder: str) -> None:
  """A random reward model of the policy's shape (value head on) as a meshrl checkpoint in `folder`."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from flax import nnx

  from meshrl.model.init import build_model
  from meshrl.train.init_from import model_config
  from meshrl.train.checkpoint import Checkpointer
  from meshrl.train.state import TrainState
  # pylint: enable=import-outside-toplevel
  rm_cfg = cfg.copy_and_resolve_references()
  with rm_cfg.unlocked():
    rm_cfg.model.value_head = True
  model = build_model(model_config(rm_cfg), None, seed=cfg.seed + 17)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, extra=extra)
  with Checkpointer(os.path.join(folder, "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, state, config=rm_cfg, force=True)


def _side(run, examples, key, steps: int, label: str) -> dict:
  """One warm-up step, then `steps` timed ones -> mean seconds per phase and of the step."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from meshrl.rl.step.program import rl_step
  # pylint: enable=import-outside-toplevel
  rl_step(run, examples, jax.random.fold_in(key, 0))
  records = []
  for step in range(1, steps + 1):
    metrics = rl_step(run, examples, jax.random.fold_in(key, step))
    records.append({p: metrics[p] for p in PHASES} | {"step_s": metrics["time_s"]})
    print(f"  {label} step {step}: {metrics['time_s']:.2f} s (scoring {metrics['reward_s']:.3f} s)", flush=True)
  return {k: float(np.mean([r[k] for r in records])) for k in records[0]}


def bench(cfg, steps: int, folder: str) -> dict:
  # pylint: disable=import-outside-toplevel
  import jax

  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.rewards.sources import reward_pool
  from meshrl.rl.step import driver as loop
  # pylint: enable=import-outside-toplevel
  _save_reward_model(cfg, folder)
  run, examples = loop.setup(cfg)
  key = jax.random.key(cfg.seed + 1)
  verifier = _side(run, examples, key, steps, "verifier")
  rm_cfg = cfg.copy_and_resolve_references()
  with rm_cfg.unlocked():
    rm_cfg.rl.reward_sources = "*=reward_model"
    rm_cfg.rl.reward_model_checkpoint = folder
  run.pool.close()
  run.pool = reward_pool(rm_cfg, run.mesh, tokenizer_from_config(cfg))
  model = _side(run, examples, jax.random.fold_in(key, 1000), steps, "reward model")
  run.close()
  return {"verifier": verifier, "reward_model": model, "steps": steps,
          "rm_share_of_step": model["reward_s"] / model["step_s"],
          "step_ratio_rm_over_verifier": model["step_s"] / verifier["step_s"],
          "scoring_ratio_rm_over_verifier": model["reward_s"] / verifier["reward_s"]}


def print_table(report: dict) -> None:
  overrides = "".join(f" --{o}" for o in report["overrides"])
  print(f"\n{report['config']}{overrides}: mean of {report['steps']} steps per side after a warm-up step")
  print(f"{'phase':<10} {'verifier s':>11} {'RM s':>9} {'RM/verifier':>12}")
  for p in PHASES + ("step_s",):
    a, b = report["verifier"][p], report["reward_model"][p]
    print(f"{p[:-2]:<10} {a:11.3f} {b:9.3f} {b / a if a else float('nan'):12.2f}")
  print(f"reward-model scoring: {100 * report['rm_share_of_step']:.1f}% of the step (target <= 25%)")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  cli.bare_run(cfg)
  folder = tempfile.mkdtemp(prefix="bench_rm_")
  try:
    report = {"config": args.config, "overrides": list(args.overrides), **bench(cfg, args.steps, folder)}
  finally:
    shutil.rmtree(folder, ignore_errors=True)  # the reward model this script wrote
  print_table(report)
  cli.write_json(args.json, report)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
