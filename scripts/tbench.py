"""Runs Terminal-Bench tasks (rl/envs/tbench.py) and reports the pass rate, per task and overall.

  python scripts/tbench.py --tasks tasks/tbench --oracle --json /tmp/tbench_oracle.json
  python scripts/tbench.py --tasks tasks/tbench --null --json /tmp/tbench_null.json
  python scripts/tbench.py --tasks tasks/tbench --checkpoint RUN --config configs/tiny.py \
      [--config.a.b=v ...] --json /tmp/tbench_policy.json [--max-turns 8]

--tasks is a task directory or a folder of them (Terminal-Bench's layout). Exactly one policy:
--oracle runs each task's solution.sh, --null does nothing and submits, --checkpoint plays episodes
with a meshrl checkpoint of the --config model (the policy interface is rl/envs/episode.py's
`generate(conversation) -> action text`; scripts/env_qa.py's CheckpointPolicy implements it with
serve/engine.py's Engine.generate, `<cmd>` actions, the turn cut at its stop string). Then each
task's tests run in the same sandbox session; a task passes when run-tests.sh exits 0.

--runtime build (default) builds each task's declared runtime once with mmdebstrap (cached by its
hash, rl/sandbox/runtimes.py; needs mmdebstrap and Debian's archive); --runtime host runs on the
host's /usr and refuses tasks whose packages the host lacks.

Writes {"pass_rate": fraction of tasks passed, "tasks": {id: true/false}, "policy", "runtime",
"details": {id: {"status": pass/fail/error, "reason", "seconds", "turns"?}}, "runtimes": {id:
digest}, "errors": n, "wall_s"}. A task the tests could not judge (status "error": a sandbox
failure, a test run that timed out or crashed) counts as not passed and is listed in "errors".
Every task is loaded, and every runtime resolved, before any runs: a task.yaml or Dockerfile line
outside the supported subset stops the script (exit 2) naming the file, the line and why, and
nothing is written. Exit 0 otherwise, whatever the pass rate.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time

from meshrl.configs import cli
from meshrl.rl.envs import tbench
from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.envs.terminal import TaskError, TerminalEnv, task_dirs


def load(paths: list[str], runtime: str, workers: int = 2) -> list:
  """Every task under `paths` with its runtime resolved; ValueError naming the first bad one."""
  tasks, problems = [], []
  for directory in task_dirs(paths):
    try:
      tasks.append(tbench.load_tbench_task(directory))
    except TaskError as error:
      problems.append(f"{directory}: {error}")
  if problems:
    raise ValueError("; ".join(problems))
  if not tasks:
    raise ValueError(f"--tasks {paths}: no task directories found.")
  ids = [t.id for t in tasks]
  if len(set(ids)) != len(ids):
    raise ValueError(f"task ids repeat: {sorted(i for i in set(ids) if ids.count(i) > 1)}.")
  def resolve(task):
    try:
      return task.with_runtime(tbench.resolve_runtime(task.environment.runtime, runtime)), None
    except (ValueError, RuntimeError) as error:
      return None, f"{task.directory}: runtime {task.environment.base}: {error}"

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # distinct runtimes build in parallel
    resolved = list(pool.map(resolve, tasks))
  problems = [problem for _, problem in resolved if problem]
  if problems:
    raise ValueError("; ".join(problems))
  return [task for task, _ in resolved]


def policy_run(task, policy, max_turns: int) -> tbench.TaskRun:
  """One episode of `policy` in the task (TerminalEnv, `<cmd>` actions), graded by its tests."""
  started = time.monotonic()
  env = TerminalEnv(call_timeout_s=min(60.0, task.agent_timeout_s))
  episode = run_episode(env, task, policy, Budget(max_turns=max_turns))
  if episode.env_failure:
    status, reason = "error", episode.env_failure
  else:
    status, reason = ("pass", "tests passed") if episode.solved else ("fail", f"episode end: {episode.end}")
  run = tbench.TaskRun(task.id, status, reason, time.monotonic() - started)
  return run, episode.turns


def main(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", nargs="+", required=True)
  parser.add_argument("--json", required=True)
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--oracle", action="store_true", help="run each task's solution.sh")
  mode.add_argument("--null", action="store_true", help="do nothing, then run the tests")
  mode.add_argument("--checkpoint", default="", help="a meshrl checkpoint of the --config model")
  parser.add_argument("--config", default="", help="the checkpoint's preset, e.g. configs/tiny.py")
  parser.add_argument("--runtime", choices=tbench.RUNTIME_MODES, default="build")
  parser.add_argument("--max-turns", type=int, default=8, help="policy turns per episode")
  parser.add_argument("--workers", type=int, default=2, help="tasks run at once")
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
  args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
  if bool(args.checkpoint) != bool(args.config) or (overrides and not args.checkpoint):
    parser.error("--checkpoint needs --config (the checkpoint's preset), and --config / --config.* "
                 "need --checkpoint")
  if args.checkpoint and not os.path.isdir(args.checkpoint):
    parser.error(f"--checkpoint {args.checkpoint!r}: no such directory")
  if args.max_turns < 1 or args.workers < 1:
    parser.error("--max-turns and --workers must be >= 1")
  for path in args.tasks:
    if not os.path.isdir(path):
      parser.error(f"--tasks {path!r}: no such directory")
  try:
    tasks = load(args.tasks, args.runtime, args.workers)
  except ValueError as error:
    parser.error(str(error))
  policy, name = None, "oracle" if args.oracle else "null" if args.null else "checkpoint"
  if args.checkpoint:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from env_qa import CheckpointPolicy  # pylint: disable=import-outside-toplevel,import-error

    from meshrl.configs.loader import ConfigError  # pylint: disable=import-outside-toplevel
    from meshrl.configs.loader import load as load_config  # pylint: disable=import-outside-toplevel
    from meshrl.train.checkpoint import CheckpointError  # pylint: disable=import-outside-toplevel
    try:
      policy = CheckpointPolicy(load_config(args.config, overrides), args.checkpoint)
    except (ConfigError, CheckpointError, ValueError) as error:
      parser.error(f"--checkpoint {args.checkpoint} --config {args.config}: {error}")

  def one(task):
    if policy is None:
      return tbench.run_task(task, name), None
    return policy_run(task, policy, args.max_turns)

  started = time.monotonic()
  try:
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
      runs = list(pool.map(one, tasks))
  finally:
    if policy is not None:
      policy.close()
  report = {"pass_rate": round(sum(run.passed for run, _ in runs) / len(runs), 4),
            "tasks": {run.task_id: run.passed for run, _ in runs}, "policy": name,
            "runtime": args.runtime, "errors": sum(run.status == "error" for run, _ in runs),
            "details": {run.task_id: {"status": run.status, "reason": run.reason,
                                      "seconds": round(run.seconds, 2),
                                      **({"turns": turns} if turns is not None else {})}
                        for run, turns in runs},
            "runtimes": {t.id: ("host" if args.runtime == "host" else t.environment.runtime.digest)
                         for t in tasks},
            "wall_s": round(time.monotonic() - started, 2)}
  if policy is not None:
    report["policy_stats"] = dict(policy.stats)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as handle:
    json.dump(report, handle, indent=1)
  for run, _ in runs:
    print(f"{'PASS' if run.passed else run.status.upper():<6}{run.task_id:<24}{run.seconds:>7.2f} s  "
          f"{run.reason[:90]}")
  print(f"{name}: pass rate {report['pass_rate']:.2%} over {len(runs)} tasks ({report['errors']} "
        f"errors) in {report['wall_s']} s; report {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
