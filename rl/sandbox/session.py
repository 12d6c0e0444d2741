"""Persistent sessions: one sandbox that lives across an episode's turns.

  with SessionPool(SessionSpec(Limits(timeout_s=10)), warm=2) as pool:   # session_pool.py
    session = pool.acquire()                       # a warm one: bwrap, supervisor and bash are up
    session.run("python3 -m http.server 8000 >/dev/null 2>&1 &")
    session.run("cd /tmp; X=1")
    session.run("curl -s localhost:8000 || python3 -c ...; echo $PWD $X")   # /tmp 1
    session.check(["bash", "-c", "test -f done"])  # a task's tests, beside the shell
    session.close()                                # every process and file of the session is gone

A session is a bubblewrap sandbox (bwrap.py: the same namespaces, read-only runtime and private
tmpfs mounts as a one-shot `Sandbox`, with the work directory at any path, e.g. a Dockerfile's
WORKDIR) whose PID 1 is a supervisor (session_shell.py) holding one interactive bash. Commands run in
that shell, so the working directory, variables, functions and `&` jobs persist between them; a
command's output and exit status come back with a per-command timeout (Ctrl-C semantics: the
foreground is interrupted, background jobs live on; see session_shell.py). A check (a task's tests)
runs beside the shell with an exit status taken by waitpid inside the sandbox, which no process of
the session can forge.

Limits (`Limits`, limits.py) apply per process (cpu_s, memory_mb, max_file_mb, max_open_files as
rlimits of every process; max_processes for the session's processes together), per command
(timeout_s is the default command timeout; max_output_bytes per stream, a command past
`OUTPUT_KILL_FACTOR` times it is interrupted), and per session (disk_mb per writable mount,
max_files inodes across them, and `session_timeout_s` of wall clock). A session that passes a session
limit ends: its PID namespace and mount namespace, with every process and file in them, are gone.
The host is the backstop: a supervisor that does not answer `HOST_GRACE_S` after a request's own
deadline has its sandbox killed (through bwrap's --info-fd child pid and a pidfd, as runner.py).

Sessions are started on one long-lived thread (`_SPAWNER`): bwrap's --die-with-parent follows the
thread that started it, so a session must not die with a short-lived worker thread.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import marshal
import os
import pathlib
import posixpath
import queue
import select
import subprocess
import threading
import time
import weakref
from typing import Mapping, Sequence

from meshrl.rl.sandbox import result as res
from meshrl.rl.sandbox.bwrap import WORK, Runtime, base_env, bwrap_argv, check_bwrap, check_mounts
from meshrl.rl.sandbox.limits import HOST_GRACE_S, OUTPUT_KILL_FACTOR, Limits
from meshrl.rl.sandbox.runner import UID_BASE, _UIDS, _kill_sandbox, _wait_or_kill

# The supervisor's program: its helpers, then the supervisor (`python3 -c` runs one source text).
_SUPERVISOR = "\n".join((pathlib.Path(__file__).parent / name).read_text()
                         for name in ("session_support.py", "session_shell.py"))
START_TIMEOUT_S = 20.0  # bwrap, the supervisor and bash up and answering
ESCALATION_S = 1.5  # the supervisor's interrupt, kill and restart steps after a command's timeout
DEFAULT_SESSION_S = 1800.0
IDLE_WARM_S = 3600.0  # a warm session nobody takes ends by itself after this
MAX_COMMAND_BYTES = 128 << 10  # the shell reads its input a byte at a time
# killed_reason values of a session (besides timeout / output_limit / "signal N" of one command)
SESSION_ENDED = "session_ended"  # "session_ended: <why>": every later call reads the same


class SessionStartError(RuntimeError):
  """A session that could not be started (an environment failure, never the policy's)."""


@dataclasses.dataclass(frozen=True)
class CommandResult:
  """What one command (or check) of a session did.

  exit_code: the shell's `$?` (128 + N when a signal N ended the command; for a check, its exit
  status), None when the command was interrupted or the session ended. killed_reason: None when the
  command ended by itself; "timeout", "output_limit", "signal N" (a check killed by a signal), or
  "session_ended: <reason>" (session_timeout, file_count_limit, output_limit, closed, sandbox_error).
  shell_restarted: the shell exited (e.g. `exit`) or had to be killed; a fresh one was started in
  the work directory (variables and the current directory are reset; files and `&` jobs remain).
  stdout holds stderr too unless the command asked for `stderr="separate"`.
  """
  exit_code: int | None
  stdout: bytes
  stderr: bytes
  stdout_truncated: bool
  stderr_truncated: bool
  timed_out: bool
  killed_reason: str | None
  seconds: float
  shell_restarted: bool = False

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and self.killed_reason is None

  @property
  def output_text(self) -> str:
    return (self.stdout + self.stderr).decode("utf-8", errors="replace")

  def describe(self) -> str:
    if self.timed_out:
      return f"timed out after {self.seconds:.1f} s"
    if self.killed_reason is not None:
      return self.killed_reason
    return f"exit {self.exit_code}"


def _ended(reason: str, seconds: float = 0.0) -> CommandResult:
  return CommandResult(exit_code=None, stdout=b"", stderr=b"", stdout_truncated=False,
                       stderr_truncated=False, timed_out=False,
                       killed_reason=f"{SESSION_ENDED}: {reason}", seconds=seconds)


class _Spawner:
  """One daemon thread that starts every session's bwrap (see the module docstring)."""

  def __init__(self):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()

  def _loop(self):
    while True:
      fn, future = self._jobs.get()
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn())
        except BaseException as error:  # pylint: disable=broad-except
          future.set_exception(error)

  def call(self, fn):
    with self._lock:
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._loop, name="session-spawner", daemon=True)
        self._thread.start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._jobs.put((fn, future))
    return future.result()


_SPAWNER = _Spawner()


@dataclasses.dataclass(frozen=True)
class SessionSpec:
  """What a session is built with (fixed at start; a pool keeps warm sessions per spec).

  limits: see the module docstring. runtime: what the sandbox sees read-only (default: the host's
  /usr). work: the working directory and HOME. extra_writable: more private tmpfs mounts.
  """
  limits: Limits = Limits()
  runtime: Runtime | None = None
  work: str = WORK
  extra_writable: tuple[str, ...] = ()

  def __post_init__(self):
    if not isinstance(self.limits, Limits):
      raise ValueError(f"limits must be a Limits, got {type(self.limits).__name__}.")
    check_mounts(self.work, tuple(self.extra_writable))


def _frame(message: dict) -> bytes:
  data = marshal.dumps(message)
  return len(data).to_bytes(4, "big") + data


class Session:
  """One persistent sandbox (see the module docstring). Thread-safe: calls are serialised.

  Use `SessionPool.acquire()` or `Session.start(spec)`; always `close()` (also a context manager;
  a session that is garbage collected is closed too). Bad arguments raise ValueError; everything the
  commands do is in the results, never raised.
  """

  def __init__(self, spec: SessionSpec, handle: "_Handle"):
    self.spec = spec
    self._handle = handle
    self._buffer = b""
    self._lock = threading.Lock()
    self._ids = 0
    self.ended: str | None = None  # why the session is over (None while it lives)
    self.commands = 0
    self._finalizer = weakref.finalize(self, handle.shutdown)

  # --- starting ---

  @classmethod
  def launch(cls, spec: SessionSpec, *, env: Mapping[str, str] | None = None) -> "Session":
    """Starts a session whose wall clock is not yet running (`begin` starts it); raises
    SandboxUnavailable where bubblewrap cannot run, SessionStartError if it does not come up."""
    runtime = spec.runtime or Runtime.host()
    bwrap = check_bwrap(runtime, uid=UID_BASE if os.geteuid() == 0 else None)
    argv = bwrap_argv(runtime, disk_mb=spec.limits.disk_mb, work=spec.work,
                      extra_writable=tuple(spec.extra_writable))
    argv[0] = bwrap
    try:
      session = _SPAWNER.call(lambda: cls._popen(spec, argv, runtime))
    except (OSError, RuntimeError) as error:  # bwrap not startable, every sandbox uid in use
      raise SessionStartError(f"a sandbox session did not start: {error}") from None
    limits = spec.limits
    rlimits = [(n, s + 1, h + 1) if n == "RLIMIT_NPROC" else (n, s, h)  # +1: the shell
               for n, s, h in limits.rlimits()]
    init = {"workdir": spec.work, "env": {**base_env(spec.work), **dict(env or {})},
            "rlimits": rlimits, "max_output_bytes": int(limits.max_output_bytes),
            "kill_output_bytes": int(limits.max_output_bytes) * OUTPUT_KILL_FACTOR,
            "max_files": int(limits.max_files),
            "watch": list(check_mounts(spec.work, tuple(spec.extra_writable))),
            "idle_timeout_s": IDLE_WARM_S}
    session._send(init)
    reply = session._receive(None, time.monotonic() + START_TIMEOUT_S)
    if not (isinstance(reply, dict) and reply.get("ready") is True):
      session._kill(f"sandbox_error: the session did not start ({reply!r:.200})")
      raise SessionStartError(f"a sandbox session did not start: {session.ended}")
    return session

  @classmethod
  def _popen(cls, spec: SessionSpec, argv: list[str], runtime: Runtime) -> "Session":
    request_r, request_w = os.pipe2(os.O_CLOEXEC)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    argv = argv + ["--info-fd", str(info_w), "--", runtime.python, "-I", "-S", "-c", _SUPERVISOR,
                   str(request_r), str(report_w)]
    uid = _UIDS.acquire()
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
      proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, pass_fds=(request_r, report_w, info_w),
                              env={}, start_new_session=True, **user)
    except OSError:
      for fd in (request_w, report_r, info_r):
        os.close(fd)
      _UIDS.release(uid)
      raise
    finally:
      for fd in (request_r, report_w, info_w):
        os.close(fd)
    return cls(spec, _Handle(proc, request_w, report_r, info_r, uid))

  @classmethod
  def start(cls, spec: SessionSpec | None = None, *, env: Mapping[str, str] | None = None,
            session_timeout_s: float = DEFAULT_SESSION_S) -> "Session":
    """A new session, its wall clock running."""
    session = cls.launch(spec or SessionSpec(), env=env)
    session.begin(session_timeout_s)
    return session

  def begin(self, session_timeout_s: float = DEFAULT_SESSION_S, env: Mapping[str, str] | None = None):
    """Starts the session's wall clock (`session_timeout_s`) and exports `env` into its shell."""
    if not (isinstance(session_timeout_s, (int, float)) and 0 < session_timeout_s < float("inf")):
      raise ValueError(f"session_timeout_s={session_timeout_s!r} must be a positive number.")
    reply = self._call({"op": "start", "timeout_s": float(session_timeout_s)}, START_TIMEOUT_S)
    if reply is None or "fatal" in reply:
      raise SessionStartError(f"a sandbox session did not start: {self.ended}")
    if env:
      self.set_env(env)

  # --- the pipe protocol ---

  def _send(self, message: dict) -> bool:
    data = memoryview(_frame(message))
    try:
      while data:
        data = data[os.write(self._handle.request_w, data):]
    except OSError:
      return False
    return True

  def _receive(self, want_id, deadline: float):
    """The supervisor's next reply with id `want_id` (None: the first line), {"fatal": reason}, or
    None when nothing comes before `deadline` or the pipe closed."""
    while True:
      while b"\n" in self._buffer:
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
          reply = json.loads(line)
        except ValueError:
          continue
        if not isinstance(reply, dict):
          continue
        if "fatal" in reply or want_id is None or reply.get("id") == want_id:
          return reply
      left = deadline - time.monotonic()
      if left <= 0:
        return None
      handle = self._handle
      ready, _, _ = select.select([handle.report_r] + ([handle.info_r] if handle.info_r >= 0 else []),
                                  [], [], left)
      if handle.info_r >= 0 and handle.info_r in ready:
        handle.read_info()
      if handle.report_r in ready:
        chunk = os.read(handle.report_r, 1 << 20)
        if not chunk:
          return None
        self._buffer += chunk

  def _kill(self, reason: str):
    """Ends the session from the host: kills its sandbox, frees its uid."""
    if self.ended is None:
      self.ended = reason
    self._finalizer()

  def _call(self, message: dict, wait_s: float) -> dict | None:
    """Sends a request and returns its reply: the answer, or a {"fatal": reason, ...} line (the
    session has ended); None (and the session ended) when the supervisor is gone or does not answer
    within wait_s + HOST_GRACE_S."""
    if self.ended is not None:
      return None
    self._ids += 1
    message = dict(message, id=self._ids)
    if not self._send(message):
      self._kill("sandbox_error: the supervisor is gone")
      return None
    reply = self._receive(self._ids, time.monotonic() + wait_s + HOST_GRACE_S)
    if reply is None:
      self._kill("sandbox_error: the supervisor did not answer" if self._handle.proc.poll() is None
                 else "sandbox_error: the sandbox exited")
      return None
    if "fatal" in reply:
      self._kill(str(reply["fatal"])[:200])
    return reply

  # --- commands ---

  def run(self, command: str | bytes, *, timeout_s: float | None = None,
          stderr: str = "merge") -> CommandResult:
    """Runs `command` (shell text) in the session's shell; see CommandResult.

    Args:
      timeout_s: this command's wall clock (default: limits.timeout_s).
      stderr: "merge" (one stream, as a terminal shows it) or "separate".
    """
    data = command.encode() if isinstance(command, str) else command
    if not isinstance(data, bytes) or b"\0" in data or len(data) > MAX_COMMAND_BYTES:
      size = len(data) if isinstance(data, bytes) else "?"
      raise ValueError(f"command must be str or bytes of at most {MAX_COMMAND_BYTES} bytes without "
                       f"NUL, got {type(command).__name__} of {size}.")
    if stderr not in ("merge", "separate"):
      raise ValueError(f"stderr={stderr!r}: choose 'merge' or 'separate'.")
    timeout = self._timeout(timeout_s)
    with self._lock:
      self.commands += 1
      started = time.monotonic()
      reply = self._call({"op": "run", "cmd": data, "timeout": timeout, "stderr": stderr},
                         timeout + ESCALATION_S)
      return self._result(reply, time.monotonic() - started)

  def check(self, argv: Sequence[str], *, files: Mapping[str, str | bytes] | None = None,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            timeout_s: float | None = None) -> CommandResult:
    """Runs `argv` beside the shell (a task's tests): `files` {absolute or work-relative path:
    data} are written first; its exit status cannot be forged from inside the session."""
    argv = list(argv)
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
      raise ValueError(f"argv={argv!r} must be a non-empty list of strings without NUL.")
    timeout = self._timeout(timeout_s)
    with self._lock:
      started = time.monotonic()
      if files:
        failure = self._write(_entries(files))
        if failure is not None:
          return failure
      reply = self._call({"op": "check", "argv": argv, "env": dict(env or {}), "cwd": cwd,
                          "timeout": timeout}, timeout + ESCALATION_S)
      return self._result(reply, time.monotonic() - started)

  def write_files(self, files: Mapping[str, str | bytes], *, relative_to: str = "work") -> None:
    """Writes files (absolute paths inside a writable mount, or relative to the work directory, or
    with relative_to="shell" to the shell's current directory); ValueError for a bad path, OSError
    naming the files the sandbox could not write, RuntimeError if the session has ended."""
    if relative_to not in ("work", "shell"):
      raise ValueError(f"relative_to={relative_to!r}: choose 'work' or 'shell'.")
    with self._lock:
      failure = self._write(_entries(files, strict=relative_to == "work"), base=relative_to)
    _raise_write(failure)

  def write_entries(self, entries: Sequence[tuple[str, str, int, object]]) -> None:
    """Writes (relative path, "d"/"f"/"l", mode, bytes or link target) entries (a WorkState's)."""
    with self._lock:
      failure = self._write([(p, k, int(m), d) for p, k, m, d in entries])
    _raise_write(failure)

  def _write(self, entries, base: str = "work") -> CommandResult | None:
    reply = self._call({"op": "write", "entries": entries, "base": base}, 30.0)
    if reply is None or "fatal" in reply:
      return _ended(self.ended or "closed")
    if reply.get("errors"):
      return dataclasses.replace(_ended(""), killed_reason=f"{res.SETUP_ERROR}: "
                                 f"{'; '.join(map(str, reply['errors']))[:500]}")
    return None

  def read_file(self, path: str, *, max_bytes: int = 1 << 16) -> tuple[bytes, bool]:
    """(the first `max_bytes` of `path`, whether there was more); `path` is relative to the shell's
    current directory. OSError (FileNotFoundError, IsADirectoryError, ...) for a file that cannot be
    read, RuntimeError if the session has ended."""
    if not isinstance(path, str) or not path or "\0" in path:
      raise ValueError(f"path={path!r} must be a non-empty string without NUL.")
    with self._lock:
      reply = self._call({"op": "read", "path": path, "max_bytes": int(max_bytes)}, 10.0)
    if reply is None or "fatal" in reply:
      raise RuntimeError(f"the session has ended: {self.ended}")
    if "error" in reply:
      raise OSError(str(reply["error"])[:300])
    return base64.b64decode(reply["data"]), bool(reply["truncated"])

  def set_env(self, env: Mapping[str, str]) -> None:
    """Exports `env` in the shell and into every later shell and check of the session."""
    for name, value in env.items():
      if not (isinstance(name, str) and name.isidentifier() and name.isascii()) \
          or not isinstance(value, str) or "\0" in value:
        raise ValueError(f"env {name!r}={value!r:.40}: names are shell identifiers, values strings "
                         f"without NUL.")
    with self._lock:
      self._call({"op": "env", "env": dict(env)}, 10.0)

  def _timeout(self, timeout_s) -> float:
    timeout = self.spec.limits.timeout_s if timeout_s is None else timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
      raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds.")
    return float(timeout)

  def _result(self, reply: dict | None, seconds: float) -> CommandResult:
    if reply is None:
      return _ended(self.ended or "closed", seconds)
    try:
      stdout, stderr = base64.b64decode(reply["stdout"]), base64.b64decode(reply["stderr"])
      if "fatal" in reply:  # the session ended during the command: what it wrote until then
        reply = dict(reply, exit=None, killed=f"{SESSION_ENDED}: {self.ended}", timed_out=False)
      exit_code, killed = reply["exit"], reply["killed"]
      if not (exit_code is None or type(exit_code) is int) \
          or not (killed is None or isinstance(killed, str)):
        raise ValueError("bad status")
      return CommandResult(exit_code=None if killed else exit_code, stdout=stdout, stderr=stderr,
                           stdout_truncated=int(reply["stdout_seen"]) > len(stdout),
                           stderr_truncated=int(reply["stderr_seen"]) > len(stderr),
                           timed_out=bool(reply["timed_out"]), killed_reason=killed,
                           seconds=seconds, shell_restarted=reply.get("shell") is not None)
    except (KeyError, ValueError, TypeError) as error:
      self._kill(f"sandbox_error: unreadable reply ({error})")
      return _ended(self.ended, seconds)

  # --- ending ---

  @property
  def alive(self) -> bool:
    return self.ended is None and self._handle.proc.poll() is None

  def recycle(self) -> bool:
    """Makes this session a just-started one for another episode (session_shell.Supervisor.recycle:
    every process killed, the writable mounts emptied, the start's environment, a fresh shell, the
    wall clock stopped until `begin`); True if it is. When the supervisor finds something it cannot
    remove, or does not answer, the session is ended instead (False)."""
    with self._lock:
      reply = self._call({"op": "recycle"}, START_TIMEOUT_S + 2 * HOST_GRACE_S)
      if reply is None or "fatal" in reply or not reply.get("clean"):
        self._kill("not_recycled: the fresh shell did not answer")  # keeps an earlier reason
        return False
      self.commands = 0
      return True

  def close(self) -> None:
    """Kills every process of the session; its files (tmpfs mounts) go with its namespaces."""
    with self._lock:
      self._kill("closed")

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc):
    self.close()


def _raise_write(failure: CommandResult | None) -> None:
  if failure is None:
    return
  if failure.killed_reason.startswith(res.SETUP_ERROR):
    raise OSError(failure.killed_reason[len(res.SETUP_ERROR) + 2:])
  raise RuntimeError(f"writing files into the session: {failure.killed_reason}")


class _Handle:
  """The host's hold on a session's sandbox: bwrap's process, the pipes, the leased uid."""

  def __init__(self, proc: subprocess.Popen, request_w: int, report_r: int, info_r: int,
               uid: int | None):
    self.proc, self.request_w, self.report_r, self.info_r, self.uid = (
        proc, request_w, report_r, info_r, uid)
    self.info = b""  # bwrap's --info-fd JSON: {"child-pid": PID 1's host pid}

  def read_info(self):
    chunk = os.read(self.info_r, 4096)
    self.info += chunk
    if not chunk:
      os.close(self.info_r)
      self.info_r = -1

  def shutdown(self):
    """Closing the request pipe makes the supervisor kill everything and exit; the host kills the
    sandbox if it does not, then frees the uid (only once its processes are gone)."""
    if self.request_w < 0:
      return
    os.close(self.request_w)
    self.request_w = -1
    try:
      self.proc.wait(timeout=HOST_GRACE_S)
    except subprocess.TimeoutExpired:
      while self.info_r >= 0 and select.select([self.info_r], [], [], 0)[0]:
        self.read_info()
      _kill_sandbox(self.proc, self.info)
      _wait_or_kill(self.proc)
    for fd in (self.report_r, self.info_r):
      if fd >= 0:
        os.close(fd)
    self.report_r = self.info_r = -1
    _UIDS.release(self.uid)
    self.uid = None


def _entries(files: Mapping[str, str | bytes], *, strict: bool = True) -> list[tuple[str, str, int, bytes]]:
  """[(path, "f", 0o644, bytes)]; `strict`: paths must be normalised, without '..' (setup files);
  otherwise any non-empty path without NUL (a tool call's, resolved in the sandbox)."""
  if not isinstance(files, Mapping):
    raise ValueError(f"files must be a mapping of path -> str or bytes, got {type(files).__name__}.")
  entries = []
  for path, data in files.items():
    if not isinstance(path, str) or not path or "\0" in path:
      raise ValueError(f"files path {path!r} must be a non-empty string without NUL.")
    if strict and (posixpath.normpath(path) != path.rstrip("/") or path.startswith("../")
                   or path == ".."):
      raise ValueError(f"files path {path!r} must be a normalised path without '..'.")
    if isinstance(data, str):
      data = data.encode()
    if not isinstance(data, (bytes, bytearray)):
      raise ValueError(f"files[{path!r}] must be str or bytes, got {type(data).__name__}.")
    entries.append((path, "f", 0o644, bytes(data)))
  return entries
