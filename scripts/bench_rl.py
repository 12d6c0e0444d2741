"""RL step benchmark: seconds and tokens/s per phase of a GRPO step, compile time, recompiles.

Run:  JAX_PLATFORMS=cpu python scripts/bench_rl.py --json runs/bench_rl.json
      (--steps 5 timed steps after one warm-up step; --config=... and --config.a.b=... as in rl.py)

The config (configs/tiny.py by default) runs with rl.sft_steps=0, checkpoints and the progress bar
off; nothing is written but the JSON. Each step is the training job's own step program,
`rl.step.rl_step` (collect -> score -> advantages -> update), which times its phases itself, each
waited on (results pulled to the host).

Phases (mean over the timed steps):
  rollout     generation, to host numpy; tokens = generated (response) tokens, all rounds
  rewards     host reward code on the RewardPool; tokens = generated tokens
  prepare     reference log-probs, critic values and advantages; tokens = update batch B * S
  update      rl.epochs x rl.num_minibatches optimizer steps; tokens = B * S * rl.epochs
  other       the rest of the step (prompt encoding, dynamic-sampling selection)
bare_rollout (single-turn, synchronous, no partial rollouts): after each timed step, the same
generator called alone on the next prompts of the stream (jitted call, waited on): the floor the
rollout phase is compared with, alternating with the steps (`rollout_over_bare`).
compile_s is backend compile time during step 1 (CompileCounter.seconds, no tracing);
first_step_overhead_s = step 1 wall time - mean step_s. compiles_after_first_step must equal
compiles_at_end (the script exits 1 otherwise), unless later steps took update row counts step 1 did
not (rl.packed_row_buckets: each compiles once; listed in new_update_row_counts).
"""

import argparse
import sys
import time

from meshrl.configs import cli

PHASES = ("rollout", "rewards", "prepare", "update", "other")


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")


def timed_step(run, prompts, key) -> dict:
  """One RL step of the step program -> {phase: seconds, phase + "_tokens": tokens, "step": seconds}."""
  from meshrl.rl.step.program import rl_step  # pylint: disable=import-outside-toplevel
  metrics = rl_step(run, prompts, key)
  rows = metrics.get("update_rows", run.run_spec.update_rows)  # rl.packed_row_buckets: this step's rows
  update_tokens = rows * run.run_spec.update_row_len
  times = {"rollout": metrics["rollout_s"], "rewards": metrics["reward_s"],
           "prepare": metrics["prepare_s"], "update": metrics["update_s"], "step": metrics["time_s"]}
  times["other"] = times["step"] - sum(times[p] for p in PHASES[:-1])
  times.update(rollout_tokens=metrics["generated_tokens"], rewards_tokens=metrics["generated_tokens"],
               prepare_tokens=update_tokens, update_tokens=update_tokens * run.cfg.rl.epochs,
               other_tokens=0, rounds=metrics["rollout_rounds"], update_rows=rows)
  return times


def bare_rollout(run, examples, key) -> float:
  """Seconds of one call of the run's generator alone (the bare sampler) on the next prompts."""
  # pylint: disable=import-outside-toplevel
  import jax

  from meshrl.rl.step.groups import next_prompts
  # pylint: enable=import-outside-toplevel
  rl = run.cfg.rl
  prompts = next_prompts(examples, run.tokenizer, count=rl.prompts_per_step, max_len=rl.max_prompt_len,
                         overflow=rl.prompt_overflow)
  start = time.perf_counter()
  jax.block_until_ready(run.rollout(run.state.params, run.state.extra, prompts.tokens, prompts.mask, key, None,
                                    run.version))
  return time.perf_counter() - start


def bench(cfg, steps: int) -> dict:
  """Warm-up step (compiles), then `steps` timed steps -> the report (no "config" yet)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from meshrl.rl.step import driver as loop
  from meshrl.train.metrics import CompileCounter
  # pylint: enable=import-outside-toplevel
  run, examples = loop.setup(cfg)
  key = jax.random.key(cfg.seed + 1)
  with CompileCounter() as counter:
    first = timed_step(run, examples, jax.random.fold_in(key, 1))
    compile_s, compiles_first = counter.seconds, counter.count()
    print(f"  step 1: {first['step']:.2f} s, {compiles_first} compilations "
          f"({compile_s:.2f} s in the backend)", flush=True)
    bare_ok = run.rollout is not None and run.partial is None and not cfg.rl.max_staleness
    records, bare = [], []
    if bare_ok:
      bare_rollout(run, examples, jax.random.fold_in(key, 10_000))  # compiles a call outside the step
    for step in range(2, steps + 2):
      records.append(timed_step(run, examples, jax.random.fold_in(key, step)))
      if bare_ok:
        bare.append(bare_rollout(run, examples, jax.random.fold_in(key, 10_000 + step)))
      print(f"  step {step}: {records[-1]['step']:.2f} s ({records[-1]['rounds']} rollout round(s))"
            + (f", bare sampler {bare[-1]:.3f} s" if bare else ""), flush=True)
    compiles_end = counter.count()
  run.close()
  mean = {k: float(np.mean([r[k] for r in records])) for k in records[0]}
  phases = [{"phase": p, "seconds": mean[p],
             # asynchronous RL: the rollout runs beside the update, its phase takes no step time
             "tokens_per_s": mean[f"{p}_tokens"] / mean[p] if mean[f"{p}_tokens"] and mean[p] > 0 else None}
            for p in PHASES]
  return {"compile_s": compile_s, "first_step_s": first["step"],
          "first_step_overhead_s": first["step"] - mean["step"],
          "compiles_after_first_step": compiles_first, "compiles_at_end": compiles_end,
          # rl.packed_row_buckets: a row count the first step did not take compiles the update once
          "new_update_row_counts": sorted({r["update_rows"] for r in records} - {first["update_rows"]}),
          "phases": phases, "step_s": mean["step"], "rollout_rounds_mean": mean["rounds"],
          "steps": steps, "dispatch": str(cfg.moe.dispatch),
          **({"bare_rollout_s": float(np.median(bare)),
              "rollout_over_bare": float(np.median([r["rollout"] / r["rounds"] for r in records]) / np.median(bare))}
             if bare else {})}


def print_table(report: dict) -> None:
  overrides = "".join(f" --{o}" for o in report["overrides"])
  print(f"\n{report['config']}{overrides}: mean of {report['steps']} steps after a warm-up step")
  print(f"{'phase':<11} {'seconds':>8} {'share':>6} {'tokens/s':>9}")
  for p in report["phases"]:
    tokens_per_s = f"{p['tokens_per_s']:9.0f}" if p["tokens_per_s"] else f"{'-':>9}"
    print(f"{p['phase']:<11} {p['seconds']:8.3f} {100 * p['seconds'] / report['step_s']:5.1f}% "
          f"{tokens_per_s}")
  print(f"{'step':<11} {report['step_s']:8.3f} {100.0:5.1f}%  (rollout rounds/step "
        f"{report['rollout_rounds_mean']:.2f})")
  print(f"first step {report['first_step_s']:.2f} s (+{report['first_step_overhead_s']:.2f} s over "
        f"steady state); backend compile {report['compile_s']:.2f} s")
  if "bare_rollout_s" in report:
    print(f"rollout phase per round over the bare sampler (medians, alternating): "
          f"{report['rollout_over_bare']:.2f}x ({report['bare_rollout_s']:.3f} s bare)")
  print(f"compilations: {report['compiles_after_first_step']} after step 1, "
        f"{report['compiles_at_end']} at the end")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  cli.bare_run(cfg)
  report = {"config": args.config, "overrides": list(args.overrides), **bench(cfg, args.steps)}
  print_table(report)
  cli.write_json(args.json, report)
  if report["compiles_at_end"] != report["compiles_after_first_step"]:
    if report["new_update_row_counts"]:
      print(f"note: later steps compiled the update for the row counts {report['new_update_row_counts']} "
            "(rl.packed_row_buckets), which step 1 did not take")
      return 0
    print("error: steps after the first compiled again", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
