"""Exact resume under SIGKILL: the demo run once straight, once killed N times and resumed.

  python scripts/resume_check.py --kills 20 --json resume_check.json

Runs `scripts/rl.py --config=configs/tiny.py` (shortened: fewer SFT and RL steps, a checkpoint every
step; the overrides are written into the JSON) in a fresh process, uninterrupted, as the reference.
Then runs it again in a second work directory and kills it with SIGKILL (the whole process group) N
times at random moments: after a random number of finished steps (SFT or RL), either a random time
later (which may fall in start-up, restore, compilation, a step or a save) or the moment a
checkpoint is being written (an orbax `*.orbax-checkpoint-tmp-*` folder exists). After every kill
each committed checkpoint is read back whole (a corrupt one is counted), and the run is started
again with the same command; it resumes from its latest checkpoint. The last start runs to the end.

Writes {"kills", "resumed", "identical_metrics", "identical_params", "corrupt_checkpoints", ...}:
metrics compares every step's record of metrics.jsonl, sft/metrics.jsonl and eval.jsonl with
`loop.metrics_equal` (time fields and compile counts aside); params compares every saved array of
the final checkpoint (parameters, router biases, optimizer state, step) bit for bit.

Both runs share a persistent compilation cache (jax_compilation_cache_dir in the work folder), so a
restart loads its programs instead of compiling them again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from meshrl.configs import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ("rl.num_steps=10", "rl.sft_steps=6", "checkpoint.every=1", "checkpoint.max_to_keep=2",
         "eval.every=5", "eval.num_prompts=32", "log.progress_bar=false", "log.tensorboard=false",
         "log.plot=false")


def _command(workdir: str, overrides: tuple[str, ...]) -> list[str]:
  return [sys.executable, os.path.join(REPO, "scripts", "rl.py"), "--config=configs/tiny.py",
          f"--workdir={workdir}"] + [f"--config.{o}" for o in overrides]


def _env(cache: str) -> dict:
  env = dict(os.environ)
  env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
  return env


def _steps(path: str) -> int:
  """The highest step recorded in a metrics.jsonl (0 when none)."""
  from meshrl.train.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  return max((r.get("step", 0) for r in read_jsonl(path)), default=0) if os.path.exists(path) else 0


def _progress(workdir: str) -> int:
  """Steps done so far: SFT steps, then RL steps."""
  return (_steps(os.path.join(workdir, "sft", "metrics.jsonl"))
          + _steps(os.path.join(workdir, "metrics.jsonl")))


def _tmp_folders(workdir: str) -> set[str]:
  """The orbax temporary step folders (a checkpoint being written) in the run's checkpoint folders."""
  found = set()
  for folder in (os.path.join(workdir, "checkpoints"), os.path.join(workdir, "sft", "checkpoints")):
    try:
      found |= {os.path.join(folder, n) for n in os.listdir(folder) if "orbax-checkpoint-tmp" in n}
    except FileNotFoundError:
      continue
  return found


def _check_checkpoints(workdir: str) -> tuple[int, set, set, list[str]]:
  """(checked, corrupt, half_deleted, errors) over every step folder of the run.

  A step folder holding `_CHECKPOINT_METADATA` (written when orbax finalizes it) is read back whole;
  one that fails is corrupt. A folder without it that is older than the latest good step is an old
  checkpoint whose deletion (checkpoint.max_to_keep) the kill interrupted: never restored (restore
  takes the latest), deleted again by the next save; counted apart. One without it at the latest
  step would be restored, so it counts as corrupt."""
  # pylint: disable-next=import-outside-toplevel
  from meshrl.train.checkpoint import CheckpointError, committed_steps, load_params
  checked, corrupt, half_deleted, errors = 0, set(), set(), []
  for folder in (os.path.join(workdir, "checkpoints"), os.path.join(workdir, "sft", "checkpoints")):
    steps = committed_steps(folder)
    good = [s for s in steps if os.path.isfile(os.path.join(folder, str(s), "_CHECKPOINT_METADATA"))]
    for step in steps:
      checked += 1
      step_dir = os.path.join(folder, str(step))
      if step not in good:
        (half_deleted if good and step < good[-1] else corrupt).add(step_dir)
        continue
      try:
        load_params(step_dir, parts=None)
        for item in ("data", "config"):
          with open(os.path.join(step_dir, item, "metadata"), encoding="utf-8") as f:
            json.load(f)
      except (CheckpointError, OSError, ValueError) as e:
        corrupt.add(step_dir)
        errors.append(f"{step_dir}: {e}"[:300])
  return checked, corrupt, half_deleted, errors


def _final_arrays(workdir: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import load_params  # pylint: disable=import-outside-toplevel
  tree = load_params(os.path.join(workdir, "checkpoints"), parts=None)  # every saved array
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _records(workdir: str, name: str) -> list[dict]:
  from meshrl.train.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, name)
  return read_jsonl(path) if os.path.exists(path) else []


def _start(cmd, env, log):
  return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)


def _kill(proc) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the run and any worker processes it started
  except ProcessLookupError:
    pass
  proc.wait()


MARKER = ".meshrl_resume_check"  # in a scratch folder this script made, so it may replace it


def check_inputs(args, overrides) -> None:
  """ValueError in one line, before anything is written or deleted: the demo's config with the
  --override values must pass the run's checks, the counts must be in range, and --workdir must be
  new, empty or a scratch folder of an earlier resume_check (it deleted whatever --workdir held
  before finding a bad override)."""
  from meshrl.configs import load  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.driver import check_config  # pylint: disable=import-outside-toplevel
  if args.kills < 1:
    raise ValueError(f"--kills={args.kills} must be at least 1.")
  check_config(load(os.path.join(REPO, "configs", "tiny.py"), overrides))
  workdir = args.workdir
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file; give a new or empty folder.")
  if os.path.isdir(workdir) and os.listdir(workdir) and not os.path.exists(os.path.join(workdir, MARKER)):
    raise ValueError(f"--workdir={workdir!r} holds files this script did not make; give a new or empty "
                     "folder (it is emptied and reused on every run).")


def fresh_scratch(workdir: str) -> None:
  """An empty `workdir` marked as this script's: an earlier run's scratch folder (marked) is
  replaced; anything else was refused by `check_inputs`."""
  if os.path.exists(os.path.join(workdir, MARKER)):
    shutil.rmtree(workdir)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, MARKER), "w", encoding="utf-8") as f:
    f.write("scratch folder of scripts/resume_check.py; replaced by its next run\n")


def main(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--kills", type=int, default=20, help="SIGKILLs during the second run")
  parser.add_argument("--json", required=True, help="where to write the result")
  parser.add_argument("--workdir", default="/tmp/meshrl_resume_check",
                      help="scratch folder: new, empty, or made by an earlier run of this script (replaced)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
  parser.add_argument("--override", action="append", default=[],
                      help="extra config overrides a.b=value, after the built-in short demo ones")
  args = parser.parse_args(argv)
  overrides = SHORT + tuple(args.override)
  check_inputs(args, overrides)  # before the scratch folder is touched
  rng = random.Random(args.seed)
  fresh_scratch(args.workdir)
  env = _env(os.path.join(args.workdir, "xla_cache"))
  reference, killed = os.path.join(args.workdir, "reference"), os.path.join(args.workdir, "killed")
  t_start = time.perf_counter()

  with open(os.path.join(args.workdir, "reference.log"), "w") as log:
    proc = _start(_command(reference, overrides), env, log)
    if proc.wait() != 0:
      print(f"the reference run failed (exit {proc.returncode}); see {log.name}", file=sys.stderr)
      return 1
  reference_s = time.perf_counter() - t_start
  total = _progress(reference)
  times = sorted(r["time_s"] for name in ("metrics.jsonl", "sft/metrics.jsonl")
                 for r in _records(reference, name) if isinstance(r.get("time_s"), (int, float)))
  step_s = times[len(times) // 2] if times else reference_s / max(total, 1)  # a step's median time
  print(f"reference: {total} steps in {reference_s:.0f} s")

  # Kill after 0 .. total-5 finished steps: a kill waits a little (or for the next save) after its
  # target, and the run must not finish before the last kill.
  targets = sorted(rng.randrange(max(total - 4, 1)) for _ in range(args.kills))
  kill_log, resumed, corrupt, half_deleted, corrupt_errors, failures = [], 0, set(), set(), [], []
  finished_early = False
  log = open(os.path.join(args.workdir, "killed.log"), "w")  # pylint: disable=consider-using-with
  try:
    for index, target in enumerate(targets):
      mode = "save" if index % 2 else "random"
      stale = _tmp_folders(killed)  # left by the last kill; the restart deletes them
      proc = _start(_command(killed, overrides), env, log)
      while _progress(killed) < target and proc.poll() is None:
        time.sleep(0.05)
      if mode == "random":
        deadline = time.perf_counter() + rng.uniform(0, 0.6 * step_s)
        while time.perf_counter() < deadline and proc.poll() is None:
          time.sleep(0.01)
      else:  # the moment a new checkpoint is being written (a kill's leftovers do not count)
        deadline = time.perf_counter() + 300  # a save follows every step; start-up comes first
        while (not _tmp_folders(killed) - stale and time.perf_counter() < deadline
               and proc.poll() is None):
          time.sleep(0.002)
        mode = "save" if _tmp_folders(killed) - stale else "save-missed"
      if proc.poll() is not None:  # it ended before the kill
        if proc.returncode != 0:
          failures.append(f"start {index + 1} exited {proc.returncode} before its kill")
        else:
          finished_early = True  # the run is done; the remaining kills cannot happen
        resumed += int(index > 0 and proc.returncode == 0)
        break
      _kill(proc)
      resumed += int(index > 0)  # the start after kill `index` ran (and resumed) until this kill
      checked, bad, partial, errors = _check_checkpoints(killed)
      corrupt, half_deleted, corrupt_errors = corrupt | bad, half_deleted | partial, corrupt_errors + errors
      kill_log.append({"kill": index + 1, "after_steps": _progress(killed), "mode": mode,
                       "checkpoints_checked": checked, "corrupt": len(bad), "half_deleted": len(partial)})
      print(f"kill {index + 1}/{args.kills}: {mode:11s} at {_progress(killed)}/{total} steps, "
            f"{checked} checkpoints checked, {len(bad)} corrupt, {len(partial)} half-deleted old ones",
            flush=True)
    if not finished_early and not failures:
      proc = _start(_command(killed, overrides), env, log)
      if proc.wait() == 0:
        resumed += int(bool(targets))  # the start after the last kill ran to the end
      else:
        failures.append(f"the last start exited {proc.returncode}")
  finally:
    log.close()

  finished = not failures and _progress(killed) == total
  result = {"kills": len(kill_log), "resumed": resumed,
            "identical_metrics": False, "identical_params": False,
            "corrupt_checkpoints": len(corrupt)}
  if finished:
    from meshrl.rl.step.driver import metrics_equal  # pylint: disable=import-outside-toplevel
    result["identical_metrics"] = all(
        metrics_equal(_records(reference, name), _records(killed, name))
        for name in ("metrics.jsonl", "sft/metrics.jsonl", "eval.jsonl"))
    want, got = _final_arrays(reference), _final_arrays(killed)
    result["identical_params"] = want.keys() == got.keys() and all(
        want[k].dtype == got[k].dtype and (want[k] == got[k]).all() for k in want)
    result["num_arrays"] = len(want)
  result.update(
      kills_during_save=sum(k["mode"] == "save" for k in kill_log), failures=failures,
      half_deleted_old_checkpoints=len(half_deleted),
      corrupt_errors=corrupt_errors[:5], steps=total, config="configs/tiny.py " + " ".join(overrides),
      reference_s=round(reference_s, 1), wall_s=round(time.perf_counter() - t_start, 1),
      seed=args.seed, kill_log=kill_log)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: result[k] for k in ("kills", "resumed", "identical_metrics", "identical_params",
                                           "corrupt_checkpoints", "kills_during_save", "wall_s")}))
  ok = (finished and result["identical_metrics"] and result["identical_params"] and not corrupt
        and resumed == len(kill_log) == args.kills)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
