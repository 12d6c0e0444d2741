"""The environment quality gate and the quarantine list.

  report = run_gate(["tasks/"], k=3, repeats=5)      # scripts/env_qa.py
  -> {"tasks": n, "quarantined": [ids], "reasons": {id: reason}, "curriculum": {id: flag}, ...}

Per task (terminal directory format, rl/envs/terminal.py), in one sandbox run (Terminal-Bench task
directories, rl/envs/tbench.py, get the same checks in sandbox sessions: `inspect_tbench_task`):
  - the oracle, each time in a fresh work directory, must make check.sh pass k out of k times, and
    must itself exit 0;
  - check.sh on the work directory as set up (the empty solution) must fail;
  - check.sh repeated `repeats` times on the oracle's and on the empty work directory must agree
    (flaky or stateful checks disagree);
  - every oracle and check run must finish inside the task's timeout_s; a check that crashes (exit
    126/127, a signal) is broken.
A directory whose files are broken (missing check.sh, invalid task.json, ...) is quarantined under its
folder name. With a policy callable, tasks that `samples` episodes always or never solve are flagged
for the curriculum (not quarantined).

This follows the checks terminal-bench's harness runs on its oracle solutions and SWE-bench's
fail-to-pass rule (research notes, rl_posttraining.md section 10); none of the RL trainers surveyed
gates environments before training.

`Quarantine(path)` is the list (JSONL of {"id", "reason", "source"}) the domain mixture honours
(rl/envs/registry.py); `Quarantine.record_failure` is the hook the episode driver and the scheduler
call with environment failures seen during training (rl/envs/driver.py `env_scheduler` wires it): a
task that fails `threshold` times joins it. `state()` / `restore()` carry the list and the failure
counts through a checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from typing import Callable, Sequence

from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.envs.terminal import ShellRunner, Step, TerminalEnv, TerminalTask, load_tasks


# --- the quarantine list ----------------------------------------------------------------------


class Quarantine:
  """Task ids kept out of training, stored as JSONL at `path` ("" keeps it in memory only).

  Args:
    path: the list file; a missing file is an empty list; lines are only ever appended.
    threshold: environment failures of one task (`record_failure`) that quarantine it.
  """

  def __init__(self, path: str = "", *, threshold: int = 2):
    if threshold < 1:
      raise ValueError(f"Quarantine threshold={threshold} must be >= 1.")
    self.path, self.threshold = path, int(threshold)
    self.reasons: dict[str, str] = {}
    self.failures: dict[str, int] = {}
    self._lock = threading.Lock()
    if path and os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
          if not line.strip():
            continue
          try:
            row = json.loads(line)
            self.reasons[str(row["id"])] = str(row.get("reason", ""))
          except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: a quarantine line must be a JSON object with an "
                             f"'id', got {line.strip()[:80]!r}.") from None

  @property
  def ids(self) -> frozenset:
    return frozenset(self.reasons)

  def __contains__(self, task_id) -> bool:
    return task_id in self.reasons

  def add(self, task_id: str, reason: str, *, source: str = "qa") -> bool:
    """Quarantines `task_id` (appending to the file); False if it already was."""
    with self._lock:
      if task_id in self.reasons:
        return False
      self.reasons[task_id] = reason
      if self.path:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
          f.write(json.dumps({"id": task_id, "reason": reason, "source": source}) + "\n")
      return True

  def state(self) -> dict:
    """What a checkpoint keeps: the quarantined ids with their reasons and the failure counts of
    tasks not (yet) quarantined (JSON-serialisable)."""
    with self._lock:
      return {"reasons": dict(self.reasons), "failures": dict(self.failures),
              "threshold": self.threshold}

  def restore(self, state: dict) -> None:
    """Resumes from `state()`: quarantined ids come back (and are appended to the file if it lacks
    them), failure counts go on from where they were. ValueError for a malformed state."""
    if not isinstance(state, dict) or not isinstance(state.get("reasons"), dict) \
        or not isinstance(state.get("failures"), dict):
      raise ValueError(f"a quarantine state is {{'reasons': {{id: reason}}, 'failures': {{id: count}}}}, "
                       f"got {str(state)[:80]!r}.")
    for task_id, reason in state["reasons"].items():
      self.add(str(task_id), str(reason), source="checkpoint")
    with self._lock:
      for task_id, count in state["failures"].items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
          raise ValueError(f"quarantine state: failures[{task_id!r}]={count!r} must be a count.")
        self.failures[str(task_id)] = max(self.failures.get(str(task_id), 0), count)

  def record_failure(self, task, reason: str) -> bool:
    """An environment failure of `task` (an id, a TerminalTask or an example with "task_id") seen
    during training; True when this one quarantined it."""
    task_id = getattr(task, "id", None) or (task.get("task_id") if isinstance(task, dict) else task)
    if not task_id:
      return False
    with self._lock:
      self.failures[task_id] = self.failures.get(task_id, 0) + 1
      count = self.failures[task_id]
    if count >= self.threshold:
      return self.add(str(task_id), f"{count} environment failures, last: {reason}", source="training")
    return False


# --- judging one task -------------------------------------------------------------------------


def gate_steps(task: TerminalTask, *, k: int, repeats: int) -> tuple[list[str], list[Step]]:
  """(labels, steps) of one task's gate run: k times (fresh dir, oracle, check), the first followed
  by repeats - 1 more checks; then (fresh dir, check) repeated `repeats` times."""
  labels, steps, t = [], [], task.timeout_s
  for run in range(k):
    labels += [f"oracle{run}", f"check_oracle{run}"]
    steps += [Step(task.oracle, t, reset=True), Step(task.check, t)]
    if run == 0:
      labels += ["check_oracle0"] * (repeats - 1)
      steps += [Step(task.check, t)] * (repeats - 1)
  labels += ["check_empty"] * repeats
  steps += [Step(task.check, t, reset=True)] + [Step(task.check, t)] * (repeats - 1)
  return labels, steps


def judge(task: TerminalTask, labels: Sequence[str], outcomes: Sequence, k: int) -> list[str]:
  """The reasons a task fails the gate, from its labelled step outcomes (pure; [] = sound)."""
  reasons = []
  for label, outcome in zip(labels, outcomes):
    if outcome.timed_out:
      what = "oracle.sh" if label.startswith("oracle") else "check.sh"
      return [f"{what} did not finish inside timeout_s={task.timeout_s:g}"]
  pairs = list(zip(labels, outcomes))
  for label, outcome in pairs:
    if label.startswith("check") and outcome.check_status == "error":
      tail = outcome.output.decode("utf-8", "replace").strip()[-120:]
      return [f"check.sh crashed ({outcome.describe()}): {tail!r}"]
  bad_oracle = sorted({o.describe() for l, o in pairs if l.startswith("oracle") and o.exit_code != 0})
  if bad_oracle:
    reasons.append(f"oracle.sh fails itself ({', '.join(bad_oracle)})")
  first = [o.check_status for l, o in pairs if l == "check_oracle0"]
  empty = [o.check_status for l, o in pairs if l == "check_empty"]
  if len(set(first)) > 1:
    reasons.append(f"flaky check: on the oracle's work dir it passed {first.count('pass')} of "
                   f"{len(first)} repeats")
  if len(set(empty)) > 1:
    reasons.append(f"flaky check: on the empty work dir it passed {empty.count('pass')} of "
                   f"{len(empty)} repeats")
  after_oracle = {}  # run label -> status of the check right after that run's oracle
  for label, outcome in pairs:
    if label.startswith("check_oracle"):
      after_oracle.setdefault(label, outcome.check_status)
  passes = list(after_oracle.values()).count("pass")
  if passes < k:
    reasons.append(f"check.sh fails after the oracle in {k - passes} of {k} runs")
  if "pass" in empty:
    reasons.append("check.sh passes on the empty work directory (setup only)")
  return reasons


@dataclasses.dataclass(frozen=True)
class Verdict:
  task_id: str
  reasons: tuple
  seconds: float
  curriculum: str | None = None  # "always_solved" / "never_solved" with a policy


def inspect_task(task: TerminalTask, runner: ShellRunner, *, k: int = 3, repeats: int = 5) -> Verdict:
  """Runs the gate on one loaded task (one sandbox run)."""
  started = time.monotonic()
  labels, steps = gate_steps(task, k=k, repeats=repeats)
  report = runner.run(steps, task.setup, initial=task.setup, snapshot=False, stop_after_timeout=True)
  if report.env_failure or report.unreadable:
    reasons = [f"could not be checked: {report.env_failure or report.unreadable}"]
  else:
    reasons = judge(task, labels, report.steps, k)
  return Verdict(task.id, tuple(reasons), time.monotonic() - started)


def curriculum_flag(task: TerminalTask, policy: Callable, *, samples: int,
                    budget: Budget | None = None) -> tuple[str | None, str | None]:
  """(flag, env failure) from `samples` policy episodes: "always_solved", "never_solved" or None."""
  solved = 0
  for _ in range(samples):
    env = TerminalEnv()
    episode = run_episode(env, task, policy, budget or Budget(max_turns=task.max_turns))
    if episode.env_failure:
      return None, episode.env_failure
    solved += episode.solved
  return ("never_solved" if solved == 0 else "always_solved" if solved == samples else None), None


def inspect_tbench_task(task, *, k: int, repeats: int, runtime: str) -> Verdict:
  """The gate on one Terminal-Bench task (rl/envs/tbench.py `gate_task`, in sandbox sessions)."""
  from meshrl.rl.envs import tbench  # pylint: disable=import-outside-toplevel
  started = time.monotonic()
  try:
    task = task.with_runtime(tbench.resolve_runtime(task.environment.runtime, runtime))
    reasons = tbench.gate_task(task, k=k, repeats=repeats)
  except (ValueError, RuntimeError, OSError) as error:  # a runtime that cannot be had, a sandbox
    reasons = [f"could not be checked: {error}"]
  return Verdict(task.id, tuple(reasons), time.monotonic() - started)


def run_gate(paths: Sequence[str], *, k: int = 3, repeats: int = 5, workers: int = 2,
             runner: ShellRunner | None = None, policy: Callable | None = None, samples: int = 4,
             quarantine: Quarantine | None = None, runtime: str = "build") -> dict:
  """The gate over every task directory under `paths` (see the module docstring); Terminal-Bench
  task directories get their runtimes by `runtime` ("build" or "host", rl/envs/tbench.py).

  Returns {"tasks": n, "quarantined": [ids or folder names], "reasons": {id: reason},
  "curriculum": {id: flag}, "seconds": {id: s}}; quarantined ids are also added to `quarantine`.
  """
  if k < 1 or repeats < 2 or workers < 1:
    raise ValueError(f"k={k} must be >= 1, repeats={repeats} >= 2, workers={workers} >= 1.")
  runner = runner or ShellRunner()
  tasks, broken = load_tasks(paths)
  reasons = dict(broken)
  seconds, curriculum = {}, {}

  def one(task):
    if isinstance(task, TerminalTask):
      verdict = inspect_task(task, runner, k=k, repeats=repeats)
    else:
      verdict = inspect_tbench_task(task, k=k, repeats=repeats, runtime=runtime)
      if not verdict.reasons:
        from meshrl.rl.envs import tbench  # pylint: disable=import-outside-toplevel
        task = task.with_runtime(tbench.resolve_runtime(task.environment.runtime, runtime))
    flag = None
    if policy is not None and not verdict.reasons:
      flag, failure = curriculum_flag(task, policy, samples=samples)
      if failure:
        return dataclasses.replace(verdict, reasons=(f"environment failure in a policy episode: "
                                                     f"{failure}",))
    return dataclasses.replace(verdict, curriculum=flag)

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for verdict in pool.map(one, tasks):
      seconds[verdict.task_id] = round(verdict.seconds, 3)
      if verdict.reasons:
        reasons[verdict.task_id] = "; ".join(verdict.reasons)
      if verdict.curriculum:
        curriculum[verdict.task_id] = verdict.curriculum
  if quarantine is not None:
    for task_id, reason in reasons.items():
      quarantine.add(task_id, reason, source="qa")
  return {"tasks": len(tasks) + len(broken), "quarantined": sorted(reasons), "reasons": reasons,
          "curriculum": curriculum, "seconds": seconds}
