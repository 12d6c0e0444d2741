"""Terminal tasks: the directory format, its loader, sandboxed shell steps, and the environment.

A task is a directory anyone can write:
  task.json   {"id": str, "domain": str, "prompt": str, "max_turns": int, "timeout_s": float}
  setup/      files copied into the work directory before the episode (optional)
  check.sh    run (bash) in the work directory after the episode: exit 0 solved, other exits not
              solved; a timeout, a signal or exit 126/127 (a command that is missing or cannot run)
              is a checker error: an environment failure, never taken for a wrong answer
  oracle.sh   a reference solution: run in a fresh work directory, then check.sh must exit 0

`load_task(dir)` raises TaskError with the reason a directory is broken; `load_tasks(paths)` returns
the good tasks and {folder name: reason} for the broken ones, never raising for one bad directory.

Each episode has its own work directory, kept across turns as a `WorkState` (files, modes, links).
Every command runs in a fresh bubblewrap sandbox (rl/sandbox) that gets the state, runs the command
with bash in /work under the per-call timeout (terminal_harness.py) and hands back the new state:
files persist between turns, processes and the current directory do not. check.sh and oracle.sh are
never in the work directory, so the policy cannot read or change them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import pathlib
import stat
import threading
from typing import Sequence

from meshrl.rl.envs.base import StepResult, parse_action
from meshrl.rl.sandbox import Limits, Sandbox
from meshrl.rl.sandbox import result as sandbox_result

_HARNESS = (pathlib.Path(__file__).parent / "terminal_harness.py").read_text()
TASK_FIELDS = {"id": str, "domain": str, "prompt": str, "max_turns": int, "timeout_s": (int, float)}
MAX_SETUP_BYTES = 4 << 20
CHECK_ERROR_EXITS = (126, 127)  # bash: a command that cannot run / is not found


class TaskError(ValueError):
  """A task directory that cannot be used; the message is the reason."""


# --- work directory state ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkState:
  """The files of a work directory: (relative path, kind "d"/"f"/"l", mode, bytes or link target)."""
  entries: tuple = ()

  def to_json(self) -> list:
    return [[p, k, m, base64.b64encode(d).decode() if k == "f" else d] for p, k, m, d in self.entries]

  @classmethod
  def from_json(cls, raw) -> "WorkState":
    """Checked decoding of the harness's (untrusted) snapshot; ValueError if malformed."""
    entries = []
    for item in raw:
      path, kind, mode, data = item
      if not isinstance(path, str) or kind not in ("d", "f", "l") or not isinstance(mode, int) \
          or not isinstance(data, str):
        raise ValueError(f"bad state entry {item!r:.80}")
      entries.append((path, kind, mode, base64.b64decode(data, validate=True) if kind == "f" else data))
    return cls(tuple(entries))

  def files(self) -> dict[str, bytes]:
    return {p: d for p, k, _, d in self.entries if k == "f"}


def read_setup(directory: str) -> WorkState:
  """The state a task's setup/ folder describes; TaskError for links, special files or a size past
  MAX_SETUP_BYTES."""
  entries, total = [], 0
  for root, dirs, files in os.walk(directory):
    for name in sorted(dirs) + sorted(files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, directory)
      info = os.lstat(full)
      if stat.S_ISLNK(info.st_mode):
        raise TaskError(f"setup/{rel} is a symbolic link; setup/ may hold only files and folders")
      if stat.S_ISDIR(info.st_mode):
        entries.append((rel, "d", stat.S_IMODE(info.st_mode), ""))
      elif stat.S_ISREG(info.st_mode):
        total += info.st_size
        if total > MAX_SETUP_BYTES:
          raise TaskError(f"setup/ holds more than {MAX_SETUP_BYTES} bytes")
        entries.append((rel, "f", stat.S_IMODE(info.st_mode), pathlib.Path(full).read_bytes()))
      else:
        raise TaskError(f"setup/{rel} is not a regular file or folder")
  return WorkState(tuple(entries))


# --- the task directory format ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TerminalTask:
  id: str
  domain: str
  prompt: str
  max_turns: int
  timeout_s: float
  check: str  # check.sh text
  oracle: str  # oracle.sh text
  setup: WorkState
  directory: str

  def example(self) -> dict:
    """The task as a mixture example (rl/envs/registry.py): the prompt plus where to find it."""
    return {"prompt": self.prompt, "answer": "", "domain": self.domain, "task_id": self.id,
            "task_dir": self.directory, "verifier": "terminal", "max_turns": self.max_turns,
            "timeout_s": self.timeout_s}


def _read_text(path: str, name: str) -> str:
  if not os.path.isfile(path):
    raise TaskError(f"{name} is missing")
  try:
    return pathlib.Path(path).read_text(encoding="utf-8")
  except UnicodeDecodeError as error:
    raise TaskError(f"{name} is not UTF-8 ({error.reason} at byte {error.start})") from None


def _check_meta(meta) -> dict:
  if not isinstance(meta, dict):
    raise TaskError(f"task.json holds a {type(meta).__name__}, not an object")
  unknown = sorted(set(meta) - set(TASK_FIELDS))
  if unknown:
    raise TaskError(f"task.json has unknown field(s) {unknown}; allowed: {sorted(TASK_FIELDS)}")
  for name, kinds in TASK_FIELDS.items():
    if name not in meta:
      raise TaskError(f"task.json lacks the field {name!r}")
    value = meta[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
      raise TaskError(f"task.json field {name!r}={value!r:.60} has the wrong type")
  if not meta["id"].strip() or not meta["prompt"].strip() or not meta["domain"].strip():
    raise TaskError("task.json: id, domain and prompt must be non-empty")
  if meta["max_turns"] < 1:
    raise TaskError(f"task.json: max_turns={meta['max_turns']} must be >= 1")
  if not (math.isfinite(meta["timeout_s"]) and 0 < meta["timeout_s"] <= 3600):
    raise TaskError(f"task.json: timeout_s={meta['timeout_s']} must lie in (0, 3600]")
  return meta


def load_task(directory: str) -> TerminalTask:
  """The task in `directory`; TaskError saying what is wrong with it."""
  if not os.path.isdir(directory):
    raise TaskError(f"{directory} is not a directory")
  try:
    meta = json.loads(_read_text(os.path.join(directory, "task.json"), "task.json"))
  except json.JSONDecodeError as error:
    raise TaskError(f"task.json is not valid JSON: {error}") from None
  meta = _check_meta(meta)
  check = _read_text(os.path.join(directory, "check.sh"), "check.sh")
  oracle = _read_text(os.path.join(directory, "oracle.sh"), "oracle.sh")
  setup_dir = os.path.join(directory, "setup")
  if os.path.lexists(setup_dir) and (os.path.islink(setup_dir) or not os.path.isdir(setup_dir)):
    raise TaskError("setup exists but is not a folder")
  setup = read_setup(setup_dir) if os.path.isdir(setup_dir) else WorkState()
  return TerminalTask(id=meta["id"], domain=meta["domain"], prompt=meta["prompt"],
                      max_turns=int(meta["max_turns"]), timeout_s=float(meta["timeout_s"]),
                      check=check, oracle=oracle, setup=setup, directory=os.path.abspath(directory))


def _is_task_dir(path: str) -> bool:
  return any(os.path.lexists(os.path.join(path, name))
             for name in ("task.json", "check.sh", "oracle.sh", "setup"))


def task_dirs(paths: Sequence[str]) -> list[str]:
  """Each path is a task directory or a folder of them (its subfolders, sorted)."""
  found = []
  for path in paths:
    if not os.path.isdir(path):
      raise ValueError(f"--tasks {path!r}: no such directory.")
    if _is_task_dir(path):
      found.append(path)
    else:
      found += [os.path.join(path, name) for name in sorted(os.listdir(path))
                if os.path.isdir(os.path.join(path, name))]
  return found


def load_tasks(paths: Sequence[str]) -> tuple[list[TerminalTask], dict[str, str]]:
  """(good tasks, {folder name: reason} of the broken ones). A second task with an id already seen
  is broken too (ids name tasks in quarantine lists and metrics)."""
  tasks, broken, seen = [], {}, {}
  for directory in task_dirs(paths):
    name = os.path.basename(os.path.normpath(directory))
    try:
      task = load_task(directory)
    except (TaskError, OSError) as error:
      broken[name] = str(error)
      continue
    if task.id in seen:
      broken[name] = f"id {task.id!r} is already used by {seen[task.id]}"
      continue
    seen[task.id] = directory
    tasks.append(task)
  return tasks, broken


# --- running shell steps in the sandbox -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
  """One script run with bash in /work; `reset` first restores the initial state."""
  script: str
  timeout_s: float
  reset: bool = False


@dataclasses.dataclass(frozen=True)
class StepOutcome:
  exit_code: int | None
  signal: int | None
  timed_out: bool
  output: bytes
  truncated: bool
  seconds: float

  @property
  def check_status(self) -> str:
    """As a check: "pass" (exit 0), "fail" (other exits), "error" (timeout, signal, 126/127)."""
    if self.timed_out or self.exit_code is None or self.exit_code in CHECK_ERROR_EXITS:
      return "error"
    return "pass" if self.exit_code == 0 else "fail"

  def describe(self) -> str:
    if self.timed_out:
      return f"timed out after {self.seconds:.1f} s"
    if self.exit_code is None:
      return f"killed by signal {self.signal}"
    return f"exit {self.exit_code}"


@dataclasses.dataclass(frozen=True)
class RunReport:
  """Steps in order and the final state; `env_failure` set when the sandbox itself failed,
  `unreadable` when the harness's report could not be read (e.g. a command killed it)."""
  steps: tuple = ()
  state: WorkState | None = None
  env_failure: str | None = None
  unreadable: str | None = None


class ShellRunner:
  """Runs `Step`s over a `WorkState` in one fresh sandbox per call; thread-safe.

  Args:
    limits: base sandbox limits; timeout_s and max_output_bytes are set per call from the steps.
    max_state_bytes: most bytes of files a work directory may hold across turns.
    output_cap: bytes of one step's output kept.
  """

  def __init__(self, limits: Limits | None = None, *, max_state_bytes: int = 4 << 20,
               output_cap: int = 16 << 10):
    self.limits = limits or Limits()
    self.max_state_bytes, self.output_cap = int(max_state_bytes), int(output_cap)
    self._sandboxes: dict[Limits, Sandbox] = {}
    self._lock = threading.Lock()
    self.runs = 0

  def _sandbox(self, steps: Sequence[Step]) -> Sandbox:
    budget = sum(step.timeout_s for step in steps) + 0.5 * len(steps) + 3.0
    limits = dataclasses.replace(
        self.limits, timeout_s=budget, cpu_s=max(self.limits.cpu_s, budget),
        max_output_bytes=3 * self.max_state_bytes + 2 * len(steps) * self.output_cap + (64 << 10))
    with self._lock:
      if limits not in self._sandboxes:
        self._sandboxes[limits] = Sandbox(limits)
      return self._sandboxes[limits]

  def run(self, steps: Sequence[Step], state: WorkState = WorkState(), *,
          initial: WorkState | None = None, snapshot: bool = True,
          stop_after_timeout: bool = False) -> RunReport:
    """Writes `state`, runs `steps` (a reset step restores `initial`), snapshots the result; with
    `stop_after_timeout`, the steps after one that timed out are skipped (fewer outcomes)."""
    request = {"state": state.to_json(), "initial": initial.to_json() if initial else None,
               "snapshot": snapshot, "max_state_bytes": self.max_state_bytes,
               "stop_after_timeout": stop_after_timeout,
               "steps": [{"script": s.script, "timeout": float(s.timeout_s), "reset": s.reset,
                          "output_cap": self.output_cap} for s in steps]}
    sandbox = self._sandbox(steps)
    result = sandbox.run([sandbox.runtime.python, "-I", "-S", "-c", _HARNESS],
                         stdin=json.dumps(request).encode())
    self.runs += 1
    reason = result.killed_reason or ""
    if reason.startswith((sandbox_result.SANDBOX_ERROR, sandbox_result.SETUP_ERROR)):
      return RunReport(env_failure=f"sandbox: {reason}")
    try:
      return _parse_report(result.stdout, len(steps), snapshot, stop_after_timeout)
    except (ValueError, TypeError, KeyError, IndexError) as error:
      detail = result.killed_reason or f"exit {result.exit_code}"
      stderr = result.stderr_text.strip()[-300:]
      return RunReport(unreadable=f"no readable report ({detail}; {error}; stderr: {stderr!r})")


def _parse_report(stdout: bytes, num_steps: int, snapshot: bool, partial: bool) -> RunReport:
  report = json.loads(stdout.decode("utf-8").strip().splitlines()[-1])
  steps = []
  for raw in report["steps"]:
    exit_code, sig = raw["exit"], raw["signal"]
    if not (exit_code is None or type(exit_code) is int) or not (sig is None or type(sig) is int):
      raise ValueError("bad exit status")
    steps.append(StepOutcome(exit_code=exit_code, signal=sig, timed_out=bool(raw["timed_out"]),
                             output=base64.b64decode(raw["output"], validate=True),
                             truncated=bool(raw["truncated"]), seconds=float(raw["seconds"])))
  complete = len(steps) == num_steps or (partial and steps and steps[-1].timed_out
                                         and len(steps) < num_steps)
  if not complete:
    raise ValueError(f"{len(steps)} step results for {num_steps} steps")
  state = None
  if snapshot:
    if report["state"] is None:
      return RunReport(tuple(steps), unreadable=str(report.get("state_error")))
    state = WorkState.from_json(report["state"])
  return RunReport(tuple(steps), state)


_DEFAULT_RUNNER: ShellRunner | None = None


def default_runner() -> ShellRunner:
  global _DEFAULT_RUNNER  # pylint: disable=global-statement
  if _DEFAULT_RUNNER is None:
    _DEFAULT_RUNNER = ShellRunner()
  return _DEFAULT_RUNNER


# --- the environment --------------------------------------------------------------------------


def observation_text(outcome: StepOutcome, cap: int) -> tuple[str, bool]:
  """(what the policy sees of a command, whether its output was UTF-8); long output keeps its head
  and tail."""
  try:
    text, valid = outcome.output.decode("utf-8"), True
  except UnicodeDecodeError:
    text, valid = outcome.output.decode("utf-8", errors="replace"), False
  if len(text) > cap:
    text = text[:cap // 2] + "\n...\n" + text[-cap // 2:]
  if outcome.truncated:
    text += "\n[output truncated]"
  return f"{text}[{outcome.describe()}]", valid


class TerminalEnv:
  """A terminal task as an environment: tool calls run in the episode's own work directory; `<done>`,
  or the task's max_turns, runs check.sh (reward 1 solved, 0 not; a checker error is an env failure).

  Args:
    runner: the sandbox runner (default: a shared one).
    call_timeout_s: seconds one command may run (capped by the task's timeout_s).
    observation_chars: most characters of a command's output shown to the policy.
  """

  def __init__(self, runner: ShellRunner | None = None, *, call_timeout_s: float = 10.0,
               observation_chars: int = 2000):
    self.runner = runner or default_runner()
    self.call_timeout_s, self.observation_chars = float(call_timeout_s), int(observation_chars)
    self.task: TerminalTask | None = None
    self.state, self.turns, self.invalid_utf8 = WorkState(), 0, 0

  def reset(self, task) -> str:
    """`task`: a TerminalTask, or a mixture example with "task_dir" (TaskError if it is broken)."""
    if isinstance(task, dict):
      task = load_task(task["task_dir"])
    if not isinstance(task, TerminalTask):
      raise ValueError(f"TerminalEnv.reset takes a TerminalTask or an example with 'task_dir', "
                       f"got {type(task).__name__}.")
    self.task, self.state, self.turns, self.invalid_utf8 = task, task.setup, 0, 0
    return task.prompt

  def _check(self) -> StepResult:
    task, self.task = self.task, None
    report = self.runner.run([Step(task.check, task.timeout_s)], self.state, snapshot=False)
    info = {"turns": self.turns, "invalid_utf8_outputs": self.invalid_utf8}
    failure = report.env_failure or report.unreadable
    if failure is None and report.steps[0].check_status == "error":
      failure = f"check.sh: {report.steps[0].describe()}"
    if failure is not None:
      return StepResult("", 0.0, True, {**info, "env_failure": failure, "task_id": task.id})
    solved = report.steps[0].check_status == "pass"
    return StepResult("", 1.0 if solved else 0.0, True, {**info, "solved": solved})

  def step(self, action_text: str) -> StepResult:
    if self.task is None:
      raise RuntimeError("step() before reset() or after the episode ended.")
    action = parse_action(action_text)
    self.turns += 1
    if action.kind == "done":
      return self._check()
    if action.kind == "error":
      result = StepResult(f"error: {action.error}", 0.0, False, {"error": action.error})
    else:
      timeout = min(self.call_timeout_s, self.task.timeout_s)
      report = self.runner.run([Step(action.command, timeout)], self.state)
      if report.env_failure:
        self.task = None
        return StepResult("", 0.0, True, {"env_failure": report.env_failure})
      if report.unreadable:  # the command broke the harness: the policy's doing, state unchanged
        result = StepResult(f"error: the command's result could not be read ({report.unreadable:.200})",
                            0.0, False, {"command_error": report.unreadable})
      else:
        self.state = report.state
        text, valid = observation_text(report.steps[0], self.observation_chars)
        self.invalid_utf8 += not valid
        result = StepResult(text, 0.0, False, {})
    if self.turns >= self.task.max_turns:
      return self._check()
    return result


def terminal_reward(completion: str, example: dict) -> float:
  """The one-step episode as a reward `(completion, example) -> float`, for the single-turn loop:
  runs the completion's tool call (if any) in the task's work directory, then check.sh. Raises on an
  environment failure, which the reward pool counts as an error, not as a wrong answer."""
  env = TerminalEnv()
  env.reset(example)
  result = env.step(completion)
  if not result.done:
    result = env.step("<done>")
  if result.info.get("env_failure"):
    raise RuntimeError(f"terminal task {example.get('task_id')}: {result.info['env_failure']}")
  return result.reward
