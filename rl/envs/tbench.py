"""Terminal-Bench tasks: the directory layout, its loader, and running a task in a sandbox session.

A task directory (Terminal-Bench's layout):
  task.yaml      instruction (required), max_agent_timeout_sec (360), max_test_timeout_sec (60),
                 parser_name (pytest: the tests pass when run-tests.sh exits 0), run_tests_in_same_shell,
                 and the descriptive fields (author_name, author_email, difficulty, category, tags,
                 estimated_duration_sec, expert_time_estimate_min, junior_time_estimate_min,
                 disable_asciinema); any other field is refused naming its line
  Dockerfile     the common subset (rl/envs/dockerfile.py): a runtime of Debian and pip packages, the
                 WORKDIR, ENV, files COPY'd into the WORKDIR
  solution.sh    the reference solution (the oracle): run with bash in the work directory
  run-tests.sh   the tests' entry point, run beside the shell in the same session at the end, with
                 $TEST_DIR=/tests holding tests/ and itself; exit 0 = solved
  tests/         the test files (never visible to the policy before the end)
docker-compose.yaml, if present, is not read: the sandbox session takes its place. The sandbox has no
network, so run-tests.sh must use what the runtime holds (Terminal-Bench tasks that install pytest at
test time need it declared in the Dockerfile instead).

`load_tbench_task(dir)` raises TaskError naming the file, the line and why; `resolve_runtime(spec,
mode)` gives the sandbox's read-only runtime: "build" (mmdebstrap, cached by the declaration's hash,
rl/sandbox/runtimes.py) or "host" (the host's /usr, refused unless it has every declared package:
fast, for tests and machines without mmdebstrap). `run_task(task, runtime, "oracle" | "null")` runs
the reference solution or nothing and then the tests; `gate_task` is the quality gate's check of one
task (the solution passes k times, doing nothing fails, repeated test runs agree). TerminalEnv
(rl/envs/terminal.py) runs a policy's episodes of these tasks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import threading
import time

import yaml

from meshrl.rl.envs.dockerfile import DockerEnvironment, DockerfileError, parse_dockerfile
from meshrl.rl.envs.terminal import CHECK_ERROR_EXITS, EPISODE_LIMITS, TaskError, session_timeout_s
from meshrl.rl.sandbox import Limits, Runtime, Session, SessionSpec
from meshrl.rl.sandbox.runtimes import RuntimeCache, RuntimeSpec, host_missing
from meshrl.rl.sandbox.session import CommandResult

TEST_DIR = "/tests"
SOLUTION_PATH = "/tmp/.meshrl-solution.sh"
DEFAULT_MAX_TURNS = 20
_FIELDS = {"instruction": str, "max_agent_timeout_sec": (int, float), "max_test_timeout_sec": (int, float),
           "parser_name": str, "run_tests_in_same_shell": bool}
_DESCRIPTIVE = ("author_name", "author_email", "difficulty", "category", "tags", "estimated_duration_sec",
                "expert_time_estimate_min", "junior_time_estimate_min", "disable_asciinema")
MAX_TEST_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class TBenchTask:
  """A loaded Terminal-Bench task (see the module docstring); `runtime` is set by `with_runtime`."""
  id: str
  instruction: str
  agent_timeout_s: float
  test_timeout_s: float
  environment: DockerEnvironment
  solution: str
  run_tests: str
  tests: tuple  # ((path relative to tests/, bytes, mode), ...)
  directory: str
  max_turns: int = DEFAULT_MAX_TURNS
  runtime: Runtime | None = None
  domain: str = "tbench"

  @property
  def prompt(self) -> str:
    return self.instruction

  @property
  def timeout_s(self) -> float:  # a command's cap in TerminalEnv
    return self.agent_timeout_s

  def with_runtime(self, runtime: Runtime) -> "TBenchTask":
    return dataclasses.replace(self, runtime=runtime)

  def session_spec(self, limits: Limits = EPISODE_LIMITS) -> SessionSpec:
    return SessionSpec(limits, runtime=self.runtime, work=self.environment.workdir,
                       extra_writable=(TEST_DIR,))

  @property
  def setup_entries(self) -> tuple:
    return self.environment.setup

  @property
  def env(self) -> dict:
    return dict(self.environment.env)

  def check_call(self) -> dict:
    """session.check's arguments that run the tests (TerminalEnv's grading)."""
    files = {f"{TEST_DIR}/run-tests.sh": self.run_tests}
    files.update({f"{TEST_DIR}/{path}": data for path, data, _ in self.tests})
    return {"argv": ["bash", f"{TEST_DIR}/run-tests.sh"], "files": files,
            "env": {"TEST_DIR": TEST_DIR}, "timeout_s": self.test_timeout_s}

  def example(self) -> dict:
    """The task as a mixture example (rl/envs/registry.py)."""
    return {"prompt": self.instruction, "answer": "", "domain": self.domain, "task_id": self.id,
            "task_dir": self.directory, "verifier": "terminal", "max_turns": self.max_turns,
            "timeout_s": self.agent_timeout_s, "task_format": "tbench"}


def is_tbench_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "task.yaml"))


def _read(directory: str, name: str) -> str:
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    raise TaskError(f"{name} is missing")
  try:
    with open(path, encoding="utf-8") as handle:
      return handle.read()
  except UnicodeDecodeError as error:
    raise TaskError(f"{name} is not UTF-8 ({error.reason} at byte {error.start})") from None


def parse_task_yaml(text: str, name: str = "task.yaml") -> dict:
  """The supported fields of a task.yaml; TaskError "task.yaml:LINE: field ... why"."""
  try:
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    data = yaml.safe_load(text)
  except yaml.YAMLError as error:
    mark = getattr(error, "problem_mark", None)
    where = f"{name}:{mark.line + 1}" if mark is not None else name
    raise TaskError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
  if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
    raise TaskError(f"{name}: must be a mapping of fields")
  lines = {key.value: key.start_mark.line + 1 for key, _ in root.value}
  for field, value in data.items():
    where = f"{name}:{lines.get(field, '?')}"
    if field == "descriptions":
      raise TaskError(f"{where}: field 'descriptions' (Terminal-Bench's older form) is outside the "
                      f"supported subset; write the task as one 'instruction'")
    if field in _DESCRIPTIVE:
      continue
    if field not in _FIELDS:
      raise TaskError(f"{where}: field {field!r} is outside the supported subset (fields: "
                      f"{', '.join(list(_FIELDS) + list(_DESCRIPTIVE))})")
    if isinstance(value, bool) and _FIELDS[field] is not bool or not isinstance(value, _FIELDS[field]):
      raise TaskError(f"{where}: field {field!r}={value!r:.60} has the wrong type")
    if field.endswith("_sec") and not (math.isfinite(value) and 0 < value <= 86400):
      raise TaskError(f"{where}: field {field!r}={value} must lie in (0, 86400] seconds")
    if field == "parser_name" and value != "pytest":
      raise TaskError(f"{where}: parser_name={value!r}: only 'pytest' (the tests pass when "
                      f"run-tests.sh exits 0)")
  if not isinstance(data.get("instruction"), str) or not data["instruction"].strip():
    raise TaskError(f"{name}: field 'instruction' is missing or empty")
  return data


def _read_tests(directory: str) -> tuple:
  folder = os.path.join(directory, "tests")
  if not os.path.isdir(folder) or os.path.islink(folder):
    raise TaskError("tests/ is missing (the folder of test files run-tests.sh runs)")
  found, total = [], 0
  for root, dirs, files in os.walk(folder):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, folder)
      info = os.lstat(full)
      if not stat.S_ISREG(info.st_mode):
        raise TaskError(f"tests/{rel} is not a regular file")
      total += info.st_size
      if total > MAX_TEST_BYTES:
        raise TaskError(f"tests/ holds more than {MAX_TEST_BYTES} bytes")
      with open(full, "rb") as handle:
        found.append((rel, handle.read(), stat.S_IMODE(info.st_mode)))
  return tuple(found)


def load_tbench_task(directory: str, *, max_turns: int = DEFAULT_MAX_TURNS) -> TBenchTask:
  """The task in `directory`; TaskError naming the file (and line) and why it cannot be used."""
  if not os.path.isdir(directory):
    raise TaskError(f"{directory} is not a directory")
  meta = parse_task_yaml(_read(directory, "task.yaml"))
  try:
    environment = parse_dockerfile(_read(directory, "Dockerfile"), directory)
  except DockerfileError as error:
    raise TaskError(str(error)) from None
  solution = _read(directory, "solution.sh")
  run_tests = _read(directory, "run-tests.sh")
  tests = _read_tests(directory)
  return TBenchTask(id=os.path.basename(os.path.normpath(directory)),
                    instruction=meta["instruction"].strip(),
                    agent_timeout_s=float(meta.get("max_agent_timeout_sec", 360.0)),
                    test_timeout_s=float(meta.get("max_test_timeout_sec", 60.0)),
                    environment=environment, solution=solution, run_tests=run_tests, tests=tests,
                    directory=os.path.abspath(directory), max_turns=max_turns)


# --- runtimes -------------------------------------------------------------------------------------

RUNTIME_MODES = ("build", "host")
_RESOLVED: dict[tuple[str, str], Runtime] = {}
_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def resolve_runtime(spec: RuntimeSpec, mode: str = "build", *,
                    cache: RuntimeCache | None = None) -> Runtime:
  """The sandbox runtime of a declaration: "build" (built once, cached by its hash) or "host" (the
  host's /usr; ValueError listing what the host lacks). Remembered per process; different
  declarations resolve in parallel, one declaration once."""
  if mode not in RUNTIME_MODES:
    raise ValueError(f"runtime mode {mode!r}: choose one of {RUNTIME_MODES}.")
  key = (spec.digest, mode)
  with _LOCKS_LOCK:
    lock = _LOCKS.setdefault(key, threading.Lock())
  with lock:
    if key in _RESOLVED:
      return _RESOLVED[key]
    if mode == "host":
      missing = host_missing(spec)
      if missing:
        raise ValueError(f"the host's /usr lacks {', '.join(missing)}: install them, or build the "
                         f"runtime (--runtime build, needs mmdebstrap)")
      runtime = Runtime.host()
    else:
      runtime = (cache or RuntimeCache()).build(spec).runtime
    _RESOLVED[key] = runtime
    return runtime


# --- running a task -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskRun:
  """How one run of a task ended: `status` "pass", "fail" or "error" (the tests could not judge:
  they timed out, crashed with 126/127, or the sandbox failed), with the reason and times."""
  task_id: str
  status: str
  reason: str
  seconds: float

  @property
  def passed(self) -> bool:
    return self.status == "pass"


def test_status(result: CommandResult) -> tuple[str, str]:
  """("pass" | "fail" | "error", reason) of a run of run-tests.sh."""
  if result.timed_out or result.exit_code is None or result.exit_code in CHECK_ERROR_EXITS:
    tail = result.output_text.strip()[-200:]
    return "error", f"run-tests.sh: {result.describe()} {tail!r}"
  if result.exit_code == 0:
    return "pass", "tests passed"
  return "fail", f"run-tests.sh: exit {result.exit_code}: {result.output_text.strip()[-200:]!r}"


def start_session(task: TBenchTask, limits: Limits = EPISODE_LIMITS, *,
                  turns: int | None = None) -> Session:
  """A session set up for `task` (runtime, work dir, ENV, copied files); its wall clock covers the
  episode and the tests."""
  if task.runtime is None:
    raise ValueError(f"task {task.id}: resolve its runtime first "
                     f"(task.with_runtime(resolve_runtime(...))).")
  budget = session_timeout_s(turns or task.max_turns, min(limits.timeout_s, task.agent_timeout_s),
                             task.test_timeout_s) + task.agent_timeout_s
  session = Session.start(task.session_spec(limits), env=task.env, session_timeout_s=budget)
  try:
    session.write_entries(task.setup_entries)
  except BaseException:
    session.close()
    raise
  return session


def run_tests(task: TBenchTask, session: Session) -> CommandResult:
  call = task.check_call()
  return session.check(call["argv"], files=call["files"], env=call["env"], timeout_s=call["timeout_s"])


def run_solution(task: TBenchTask, session: Session) -> CommandResult:
  """solution.sh with bash in the work directory (its own timeout: the agent's)."""
  session.write_files({SOLUTION_PATH: task.solution})
  return session.run(f"cd {task.environment.workdir} && bash {SOLUTION_PATH}",
                     timeout_s=task.agent_timeout_s)


def run_task(task: TBenchTask, mode: str, *, limits: Limits = EPISODE_LIMITS) -> TaskRun:
  """Runs the reference solution ("oracle") or nothing ("null") in a fresh session, then the tests."""
  if mode not in ("oracle", "null"):
    raise ValueError(f"mode={mode!r}: choose oracle or null.")
  started = time.monotonic()
  session = start_session(task, limits, turns=1)
  try:
    if mode == "oracle":
      solved = run_solution(task, session)
      if solved.killed_reason is not None and solved.killed_reason.startswith("session_ended"):
        return TaskRun(task.id, "error", f"solution.sh: {solved.describe()}", time.monotonic() - started)
    status, reason = test_status(run_tests(task, session))
  finally:
    session.close()
  return TaskRun(task.id, status, reason, time.monotonic() - started)


def gate_task(task: TBenchTask, *, k: int = 3, repeats: int = 5,
              limits: Limits = EPISODE_LIMITS) -> list[str]:
  """The quality gate's reasons against one task ([] = sound): in each of k fresh sessions the
  solution must exit 0 and the tests must pass `repeats` times in a row; in a fresh session where
  nothing was done the tests must fail `repeats` times; a test run that errs breaks the task."""
  reasons = []
  for run in range(k):
    session = start_session(task, limits, turns=1)
    try:
      solved = run_solution(task, session)
      if solved.timed_out:
        return [f"solution.sh did not finish inside max_agent_timeout_sec={task.agent_timeout_s:g}"]
      if solved.exit_code != 0:
        reasons.append(f"solution.sh fails itself ({solved.describe()}: "
                       f"{solved.output_text.strip()[-120:]!r})")
      statuses = [test_status(run_tests(task, session)) for _ in range(repeats if run == 0 else 1)]
    finally:
      session.close()
    errors = [reason for status, reason in statuses if status == "error"]
    if errors:
      return [f"the tests cannot judge: {errors[0]}"]
    passes = [status for status, _ in statuses].count("pass")
    if run == 0 and 0 < passes < len(statuses):
      reasons.append(f"flaky tests: after the solution they passed {passes} of {len(statuses)} runs")
    elif passes == 0:
      reasons.append(f"the tests fail after the solution (run {run + 1} of {k}): {statuses[0][1]}")
  session = start_session(task, limits, turns=1)
  try:
    empty = [test_status(run_tests(task, session)) for _ in range(repeats)]
  finally:
    session.close()
  errors = [reason for status, reason in empty if status == "error"]
  if errors:
    return reasons + [f"the tests cannot judge the untouched task: {errors[0]}"]
  passes = [status for status, _ in empty].count("pass")
  if 0 < passes < repeats:
    reasons.append(f"flaky tests: on the untouched task they passed {passes} of {repeats} runs")
  elif passes:
    reasons.append("the tests pass when nothing was done")
  return reasons
