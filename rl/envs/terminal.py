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

Each episode runs in one persistent sandbox session (rl/sandbox/session.py): the task's setup/ is
written into /work, every command runs in the session's shell under the per-call timeout, so files,
the current directory, variables and background processes persist between turns (a task may say
"start the service, then query it"); at the end check.sh runs in the same session, beside the shell,
its verdict taken where the policy cannot forge it, and the session is closed (`TerminalEnv.close()`
also ends it, e.g. when an episode is abandoned). check.sh and oracle.sh are never in the work
directory, so the policy cannot read them.

`ShellRunner` runs `Step`s over a `WorkState` in one fresh one-shot sandbox per call (the quality
gate's repeated oracle and check runs, rl/envs/quality.py).
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

from meshrl.model.tool_calls import plain_tool_results
from meshrl.rl.envs.base import DONE, StepResult, parse_action
from meshrl.rl.envs.tools import Toolbox
from meshrl.rl.sandbox import Limits, Sandbox
from meshrl.rl.sandbox import result as sandbox_result
from meshrl.rl.sandbox.session import SESSION_ENDED, CommandResult, Session, SessionSpec
from meshrl.rl.sandbox.session_pool import PoolSet, SessionPool

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

  # What TerminalEnv needs of a task (rl/envs/tbench.py's TBenchTask has the same).
  def session_spec(self, limits: Limits) -> SessionSpec:
    return SessionSpec(limits)

  @property
  def setup_entries(self) -> tuple:
    return self.setup.entries

  @property
  def env(self) -> dict:
    return {}

  def check_call(self) -> dict:
    return {"argv": ["bash", "-c", self.check, "check.sh"], "timeout_s": self.timeout_s}


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
             for name in ("task.json", "check.sh", "oracle.sh", "setup", "task.yaml", "run-tests.sh"))


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


def load_tasks(paths: Sequence[str]) -> tuple[list, dict[str, str]]:
  """(good tasks, {folder name: reason} of the broken ones): TerminalTasks and Terminal-Bench tasks
  (rl/envs/tbench.py; runtimes not resolved). A second task with an id already seen is broken too
  (ids name tasks in quarantine lists and metrics)."""
  from meshrl.rl.envs import tbench  # pylint: disable=import-outside-toplevel  (tbench imports this module)
  tasks, broken, seen = [], {}, {}
  for directory in task_dirs(paths):
    name = os.path.basename(os.path.normpath(directory))
    try:
      task = tbench.load_tbench_task(directory) if tbench.is_tbench_dir(directory) else load_task(directory)
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


# --- the environment ---------------------------------------------------------------------------

# Per-process and per-session limits of an episode's session (per-command timeouts come per call).
EPISODE_LIMITS = Limits(timeout_s=10.0, cpu_s=60.0, memory_mb=1024, max_processes=64, disk_mb=256,
                        max_files=20000, max_output_bytes=64 << 10)
# A session that ends for one of these did so because of what the policy ran (reward 0, not an
# environment failure); any other end (sandbox_error: ...) is the environment's.
POLICY_SESSION_ENDS = ("session_timeout", "file_count_limit", "output_limit", "shell_failed")
_DEFAULT_SESSIONS: PoolSet | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sessions() -> PoolSet:
  """The process-wide warm episode sessions, one pool per session spec (runtime, work dir)."""
  global _DEFAULT_SESSIONS  # pylint: disable=global-statement
  with _DEFAULT_LOCK:
    if _DEFAULT_SESSIONS is None:
      _DEFAULT_SESSIONS = PoolSet(warm=2)
    return _DEFAULT_SESSIONS


def load_any_task(example_or_dir, *, runtime_mode: str = "build"):
  """A TerminalTask (task.json layout) or a Terminal-Bench task (task.yaml layout, its runtime
  resolved: rl/envs/tbench.py) from a directory or a mixture example with "task_dir" (and an optional
  "runtime": "build" | "host"); TaskError for a broken one."""
  from meshrl.rl.envs import tbench  # pylint: disable=import-outside-toplevel  (tbench imports this module)
  if isinstance(example_or_dir, dict):
    directory = example_or_dir["task_dir"]
    runtime_mode = example_or_dir.get("runtime", runtime_mode)
  else:
    directory = example_or_dir
  if not tbench.is_tbench_dir(directory):
    return load_task(directory)
  task = tbench.load_tbench_task(directory)
  if isinstance(example_or_dir, dict) and example_or_dir.get("max_turns"):
    task = dataclasses.replace(task, max_turns=int(example_or_dir["max_turns"]))
  return task.with_runtime(tbench.resolve_runtime(task.environment.runtime, runtime_mode))


def observation_text(outcome: StepOutcome | CommandResult, cap: int) -> tuple[str, bool]:
  """(what the policy sees of a command, whether its output was UTF-8); long output keeps its head
  and tail."""
  output = outcome.output if isinstance(outcome, StepOutcome) else outcome.stdout + outcome.stderr
  try:
    text, valid = output.decode("utf-8"), True
  except UnicodeDecodeError:
    text, valid = output.decode("utf-8", errors="replace"), False
  if len(text) > cap:
    text = text[:cap // 2] + "\n...\n" + text[-cap // 2:]
  truncated = outcome.truncated if isinstance(outcome, StepOutcome) else (
      outcome.stdout_truncated or outcome.stderr_truncated)
  if truncated:
    text += "\n[output truncated]"
  note = ""
  if isinstance(outcome, CommandResult) and outcome.shell_restarted:
    note = "; the shell was restarted in the work directory"
  return f"{text}[{outcome.describe()}{note}]", valid


def session_end(result: CommandResult) -> tuple[str | None, str | None]:
  """(policy end, environment failure) of a command whose session ended (both None if it lives)."""
  reason = result.killed_reason or ""
  if not reason.startswith(SESSION_ENDED):
    return None, None
  return classify_end(reason[len(SESSION_ENDED) + 2:])


def classify_end(why: str) -> tuple[str | None, str | None]:
  """(policy end, environment failure) of a session that ended for `why` (Session.ended)."""
  return (why, None) if why in POLICY_SESSION_ENDS else (None, f"sandbox session: {why}")


def session_timeout_s(max_turns: int, call_timeout_s: float, check_timeout_s: float) -> float:
  """Wall clock of an episode's session: every turn at its timeout, the check, and slack."""
  return max_turns * (call_timeout_s + 2.0) + check_timeout_s + 30.0


class TerminalEnv:
  """A terminal task as an environment: actions run in the episode's persistent session; `<done>`
  (or a `submit` call), or the task's max_turns, runs check.sh there (reward 1 solved, 0 not; a
  checker error is an env failure) and ends the session.

  Actions are `<cmd>...</cmd>` turns (base.parse_action), or with a `toolbox` (rl/envs/tools.py)
  JSON tool calls: `env.tools` are the schemas to render into the prompt, each observation is the
  plain rendering of the turn's tool results and `info["tool_messages"]` the results themselves, for
  a loop that renders them with the tokenizer's chat template (Toolbox.observation).

  Args:
    sessions: where sessions come from (default: `default_sessions()`).
    call_timeout_s: seconds one command may run (capped by the task's timeout_s).
    observation_chars: most characters of a command's output shown to the policy.
    toolbox: tool-call actions instead of `<cmd>` (e.g. Toolbox.standard()).
  """

  def __init__(self, sessions: SessionPool | PoolSet | None = None, *, call_timeout_s: float = 10.0,
               observation_chars: int = 2000, toolbox: Toolbox | None = None,
               limits: Limits = EPISODE_LIMITS):
    self.sessions, self.toolbox, self.limits = sessions, toolbox, limits
    self.call_timeout_s, self.observation_chars = float(call_timeout_s), int(observation_chars)
    self.task = None
    self.session: Session | None = None
    self.turns, self.invalid_utf8 = 0, 0

  def reset(self, task) -> str:
    """`task`: a TerminalTask, a Terminal-Bench task (rl/envs/tbench.py, its runtime resolved), or a
    mixture example with "task_dir" (TaskError if it is broken). Starts the episode's session (one
    that cannot start raises SessionStartError / SandboxUnavailable: an environment failure)."""
    if isinstance(task, dict):
      task = load_any_task(task)
    if not hasattr(task, "session_spec"):
      raise ValueError(f"TerminalEnv.reset takes a terminal task or an example with 'task_dir', "
                       f"got {type(task).__name__}.")
    self.close()
    timeout = min(self.call_timeout_s, task.timeout_s)
    budget = session_timeout_s(task.max_turns, timeout, getattr(task, "test_timeout_s", task.timeout_s))
    self.session = self._acquire(task.session_spec(self.limits), task.env, budget)
    try:
      self.session.write_entries(task.setup_entries)
    except BaseException:
      self.close()
      raise
    self.task, self.turns, self.invalid_utf8 = task, 0, 0
    return task.prompt

  def _acquire(self, spec: SessionSpec, env: dict, budget: float) -> Session:
    if isinstance(self.sessions, SessionPool):
      given = self.sessions.spec
      if (given.work, given.runtime, tuple(given.extra_writable)) != (
          spec.work, spec.runtime, tuple(spec.extra_writable)):
        raise ValueError(f"the TerminalEnv's session pool is for work dir {given.work} and runtime "
                         f"{given.runtime}, the task needs {spec.work} and {spec.runtime}: pass a "
                         f"PoolSet (or None) to serve tasks of several runtimes.")
      return self.sessions.acquire(env=env, session_timeout_s=budget)
    return (self.sessions or default_sessions()).acquire(spec, env=env, session_timeout_s=budget)

  def close(self) -> None:
    """Ends the episode's session: handed back to its pool, which recycles it (every process and
    file of the episode gone) or ends it; safe to call twice."""
    if self.session is not None:
      session, self.session = self.session, None
      (self.sessions or default_sessions()).release(session)

  def _finish(self, reward: float, info: dict) -> StepResult:
    self.task = None
    self.close()
    return StepResult("", reward, True, {"turns": self.turns, "invalid_utf8_outputs": self.invalid_utf8,
                                         **info})

  def _check(self) -> StepResult:
    task = self.task
    call = task.check_call()
    result = self.session.check(call["argv"], files=call.get("files"), env=call.get("env"),
                                timeout_s=call["timeout_s"])
    ended, failure = session_end(result)
    if ended is not None:
      return self._finish(0.0, {"solved": False, "session_ended": ended})
    if failure is None and (result.timed_out or result.exit_code is None
                            or result.exit_code in CHECK_ERROR_EXITS):
      failure = f"check.sh: {result.describe()}"
    if failure is not None:
      return self._finish(0.0, {"env_failure": failure, "task_id": task.id})
    solved = result.exit_code == 0
    return self._finish(1.0 if solved else 0.0, {"solved": solved})

  @property
  def tools(self) -> list[dict]:
    """The tool schemas to offer the policy ([] for `<cmd>` actions)."""
    return self.toolbox.schemas() if self.toolbox is not None else []

  def _tool_step(self, action_text) -> StepResult:
    timeout = min(self.call_timeout_s, self.task.timeout_s)
    outcome = self.toolbox.step(action_text, self.session, timeout_s=timeout, turn=self.turns)
    if not self.session.alive:
      ended, failure = classify_end(self.session.ended or "sandbox_error: the sandbox exited")
      if failure is not None:
        return self._finish(0.0, {"env_failure": failure, "task_id": self.task.id})
      return self._finish(0.0, {"solved": False, "session_ended": ended})
    info = {"tool_messages": outcome.messages, "tool_errors": outcome.errors}
    if outcome.errors and outcome.errors >= outcome.calls:  # nothing usable: a malformed turn
      info["error"] = outcome.messages[0]["content"]
    if outcome.submitted:
      result = self._check()
      result.info.update(info, answer=outcome.answer)
      return result
    return StepResult(plain_tool_results(outcome.messages), 0.0, False, info)

  def step(self, action_text: str) -> StepResult:
    if self.task is None:
      raise RuntimeError("step() before reset() or after the episode ended.")
    if self.toolbox is not None:
      self.turns += 1
      if action_text == DONE:  # the episode driver ends a turn-limited episode this way
        return self._check()
      result = self._tool_step(action_text)
      if not result.done and self.turns >= self.task.max_turns:
        return self._check()
      return result
    action = parse_action(action_text)
    self.turns += 1
    if action.kind == "done":
      return self._check()
    if action.kind == "error":
      result = StepResult(f"error: {action.error}", 0.0, False, {"error": action.error})
    else:
      timeout = min(self.call_timeout_s, self.task.timeout_s)
      outcome = self.session.run(action.command, timeout_s=timeout)
      ended, failure = session_end(outcome)
      if failure is not None:
        return self._finish(0.0, {"env_failure": failure, "task_id": self.task.id})
      if ended is not None:  # the policy's doing: the episode ends unsolved
        return self._finish(0.0, {"solved": False, "session_ended": ended})
      text, valid = observation_text(outcome, self.observation_chars)
      self.invalid_utf8 += not valid
      result = StepResult(text, 0.0, False, {})
    if self.turns >= self.task.max_turns:
      return self._check()
    return result


def terminal_reward(completion: str, example: dict) -> float:
  """The one-step episode as a reward `(completion, example) -> float`, for the single-turn loop:
  runs the completion's tool call (if any) in the task's session, then check.sh. Raises on an
  environment failure, which the reward pool counts as an error, not as a wrong answer."""
  env = TerminalEnv()
  try:
    env.reset(example)
    result = env.step(completion)
    if not result.done:
      result = env.step("<done>")
  finally:
    env.close()
  if result.info.get("env_failure"):
    raise RuntimeError(f"terminal task {example.get('task_id')}: {result.info['env_failure']}")
  return result.reward
