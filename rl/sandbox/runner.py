"""`Sandbox(limits).run(argv or code, files=..., stdin=...) -> SandboxResult`.

One run: check the input, spawn bubblewrap (bwrap.py) with the supervisor (launcher.py) as the
sandbox's PID 1 (`launch`; a pool starts some ahead of time), send it the program, files and stdin
through a pipe (`Launch.send`), read stdout/stderr with caps, and turn the supervisor's report into
a `SandboxResult` (`collect`). The host is the backstop: if the supervisor has not reported
`HOST_GRACE_S` after the timeout, or a stream floods, the host kills the sandbox's PID 1 (found
through bwrap's --info-fd, signalled through a pidfd), and with it every process of the namespace;
bwrap's process group is the fallback, and `--die-with-parent` covers a host that dies.

When the host runs as root, each concurrent run gets its own unprivileged host uid (from
`UID_BASE`), so a run owns nothing of the host's and two runs share no uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import marshal
import os
import pathlib
import posixpath
import selectors
import signal
import subprocess
import threading
import time
from typing import Mapping, Sequence

from meshrl.rl.sandbox import result as res
from meshrl.rl.sandbox.bwrap import WORK, WRITABLE, Runtime, bwrap_argv, check_bwrap
from meshrl.rl.sandbox.limits import HOST_GRACE_S, OUTPUT_KILL_FACTOR, Limits

UID_BASE = 61000
UID_COUNT = 1024
MAX_FILES_IN = 1000  # entries of `files=`
CODE_FILE = "main.py"  # where run(code) puts the code
_LAUNCHER = (pathlib.Path(__file__).parent / "launcher.py").read_text()


class _UidPool:
  """Lease of distinct unprivileged host uids (only when the host is root), exclusive across threads
  and across processes: a uid is held by an flock on its lock file in `lock_dir`, so two trainers (or
  two test workers) on one host never hand the same uid to two sandboxes at once."""

  def __init__(self, base: int, count: int, lock_dir: str = "/tmp/meshrl-sandbox-uids"):
    self._free = list(range(base + count - 1, base - 1, -1))
    self._held: dict[int, int] = {}  # uid -> fd of its locked file
    self._lock = threading.Lock()
    self._lock_dir = lock_dir

  def _try_lock(self, uid: int) -> int | None:
    os.makedirs(self._lock_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(self._lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      return None
    return fd

  def acquire(self) -> int | None:
    if os.geteuid() != 0:
      return None
    with self._lock:
      for index in range(len(self._free) - 1, -1, -1):
        uid = self._free[index]
        fd = self._try_lock(uid)
        if fd is not None:
          del self._free[index]
          self._held[uid] = fd
          return uid
      raise RuntimeError(f"all {UID_COUNT} sandbox uids are in use.")

  def release(self, uid: int | None):
    if uid is not None:
      with self._lock:
        fd = self._held.pop(uid, None)
        if fd is not None:
          os.close(fd)  # drops the flock
        self._free.append(uid)


_UIDS = _UidPool(UID_BASE, UID_COUNT)


def check_files(files: Mapping[str, str | bytes] | None, limits: Limits
                ) -> list[tuple[str, bytes]]:
  """[(normalised relative path, bytes)] for `files=`; ValueError naming the bad entry."""
  if files is None:
    return []
  if not isinstance(files, Mapping):
    raise ValueError(f"files must be a mapping of relative path -> str or bytes, got "
                     f"{type(files).__name__}.")
  if len(files) > MAX_FILES_IN:
    raise ValueError(f"files has {len(files)} entries; at most {MAX_FILES_IN} are allowed.")
  checked, total = [], 0
  for path, data in files.items():
    if not isinstance(path, str) or not path or "\0" in path:
      raise ValueError(f"files path {path!r} must be a non-empty string without NUL.")
    norm = posixpath.normpath(path)
    if posixpath.isabs(path) or norm == ".." or norm.startswith("../") or norm == ".":
      raise ValueError(f"files path {path!r} is outside the work directory {WORK}; "
                       f"give a path relative to it, without '..'.")
    if isinstance(data, str):
      data = data.encode()
    if not isinstance(data, (bytes, bytearray)):
      raise ValueError(f"files[{path!r}] must be str or bytes, got {type(data).__name__}.")
    total += len(data)
    checked.append((norm, bytes(data)))
  if total > limits.disk_mb << 20:
    raise ValueError(f"files hold {total} bytes, more than Limits.disk_mb={limits.disk_mb} MiB.")
  names = [path for path, _ in checked]
  if len(set(names)) != len(names):
    raise ValueError(f"files names a path twice after normalising: {sorted(names)}.")
  return checked


def _program(cmd: str | Sequence[str], runtime: Runtime) -> tuple[list[str], list[tuple]]:
  """(argv, extra files): a str is Python code run as /work/main.py, a sequence is an argv."""
  if isinstance(cmd, str):
    return [runtime.python, "-s", CODE_FILE], [(CODE_FILE, cmd.encode())]
  argv = list(cmd)
  if not argv or not all(isinstance(arg, str) and "\0" not in arg for arg in argv):
    raise ValueError(f"argv={cmd!r} must be a non-empty list of strings without NUL.")
  return argv, []


class _Streams:
  """Reads stdout, stderr, the supervisor's report and bwrap's info until EOF, keeping `cap`
  bytes of each output stream."""

  def __init__(self, proc: subprocess.Popen, fds: dict[str, int], cap: int):
    self.cap = cap
    self.kept = {name: bytearray() for name in ("stdout", "stderr", *fds)}
    self.seen = dict.fromkeys(self.kept, 0)
    self.selector = selectors.DefaultSelector()
    for name, fd in (("stdout", proc.stdout.fileno()), ("stderr", proc.stderr.fileno()),
                     *fds.items()):
      os.set_blocking(fd, False)
      self.selector.register(fd, selectors.EVENT_READ, name)

  def pump(self, timeout: float) -> bool:
    """Reads what is ready within `timeout`; False once every stream is closed."""
    for key, _ in self.selector.select(max(timeout, 0.0)):
      try:
        chunk = os.read(key.fd, 1 << 16)
      except BlockingIOError:
        continue
      if not chunk:
        self.selector.unregister(key.fd)
        continue
      name = key.data
      self.seen[name] += len(chunk)
      room = (self.cap if name in ("stdout", "stderr") else 1 << 16) - len(self.kept[name])
      if room > 0:
        self.kept[name] += chunk[:room]
    return bool(self.selector.get_map())

  def flooded(self) -> bool:
    return max(self.seen["stdout"], self.seen["stderr"]) > self.cap * OUTPUT_KILL_FACTOR

  def close(self):
    self.selector.close()


class Launch:
  """A started sandbox whose supervisor waits for its payload: `Sandbox.launch()`, then
  `send(payload)` and `Sandbox.collect(launch)`, or `discard()`. A pool keeps some ready (warm),
  so a run does not wait for bwrap and the interpreter to start."""

  def __init__(self, proc: subprocess.Popen, payload_w: int, fds: dict[str, int], uid: int | None):
    self.proc, self.payload_w, self.fds, self.uid = proc, payload_w, fds, uid
    self.sent_at: float | None = None

  def alive(self) -> bool:
    return self.proc.poll() is None and self.payload_w >= 0

  def send(self, payload: dict):
    """Hands the supervisor its run; a dead sandbox is noticed by `collect` (no report)."""
    self.sent_at = time.monotonic()
    data = memoryview(marshal.dumps(payload))
    try:
      while data:
        data = data[os.write(self.payload_w, data):]
    except OSError:
      pass
    finally:
      os.close(self.payload_w)
      self.payload_w = -1

  def close(self):
    for fd in (self.payload_w, *self.fds.values()):
      if fd >= 0:
        os.close(fd)
    self.payload_w, self.fds = -1, {}
    _UIDS.release(self.uid)
    self.uid = None

  def discard(self):
    """Stops an unsent launch: an empty payload makes its supervisor exit (bwrap reaps it)."""
    if self.payload_w >= 0:
      os.close(self.payload_w)
      self.payload_w = -1
    _wait_or_kill(self.proc)
    self.close()


class Sandbox:
  """Runs untrusted programs isolated by bubblewrap under `limits` (see limits.py, bwrap.py).

  Thread-safe: one Sandbox may run many programs at once from different threads.
  Raises SandboxUnavailable when built where bwrap cannot run (never runs code unisolated).
  """

  def __init__(self, limits: Limits | None = None, *, runtime: Runtime | None = None):
    self.limits = limits or Limits()
    if not isinstance(self.limits, Limits):
      raise ValueError(f"limits must be a Limits, got {type(self.limits).__name__}.")
    self.runtime = runtime or Runtime.host()
    self.bwrap = check_bwrap(self.runtime, uid=UID_BASE if os.geteuid() == 0 else None)
    self._prefix = bwrap_argv(self.runtime, disk_mb=self.limits.disk_mb)
    self._prefix[0] = self.bwrap

  def run(self, cmd: str | Sequence[str], *, files: Mapping[str, str | bytes] | None = None,
          stdin: str | bytes | None = None) -> SandboxResult:
    """Runs `cmd` (an argv list, or Python code as a str) in a fresh sandbox.

    Args:
      cmd: argv (argv[0] found on the sandbox's PATH) or Python source run as /work/main.py.
      files: {relative path: str or bytes} written into /work before the program starts.
      stdin: bytes or text fed to the program's stdin (default: empty).

    Raises:
      ValueError for bad arguments (a path outside /work, a non-string argv, ...). Everything
      the program does is recorded in the result, never raised.
    """
    payload = self.prepare(cmd, files=files, stdin=stdin)
    called = time.monotonic()
    launch = self.launch()
    if isinstance(launch, SandboxResult):
      return launch
    launch.send(payload)
    return self.collect(launch, since=called)

  def prepare(self, cmd: str | Sequence[str], *, files: Mapping[str, str | bytes] | None = None,
              stdin: str | bytes | None = None) -> dict:
    """The supervisor's payload for a run, after checking every argument (ValueError)."""
    argv, extra = _program(cmd, self.runtime)
    checked = check_files(files, self.limits)
    if extra and any(path == CODE_FILE for path, _ in checked):
      raise ValueError(f"files names {CODE_FILE!r}, where run(code) puts the code; rename it "
                       f"or pass an argv.")
    if stdin is not None and not isinstance(stdin, (str, bytes)):
      raise ValueError(f"stdin must be str or bytes, got {type(stdin).__name__}.")
    return {"argv": argv, "files": extra + checked, "timeout_s": float(self.limits.timeout_s),
            "stdin": stdin.encode() if isinstance(stdin, str) else (stdin or b""),
            "max_files": int(self.limits.max_files), "watch": list(WRITABLE),
            "rlimits": self.limits.rlimits()}

  def launch(self) -> Launch | SandboxResult:
    """Starts a sandbox whose supervisor waits for `Launch.send` (a failed result if bwrap
    cannot even be started)."""
    payload_r, payload_w = os.pipe2(os.O_CLOEXEC)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    argv = self._prefix + ["--info-fd", str(info_w), "--", self.runtime.python, "-I", "-S", "-c",
                           _LAUNCHER, str(payload_r), str(report_w)]
    uid = _UIDS.acquire()
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
      proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, pass_fds=(payload_r, report_w, info_w),
                              env={}, start_new_session=True, **user)
    except OSError as error:
      for fd in (payload_w, report_r, info_r):
        os.close(fd)
      _UIDS.release(uid)
      return res.failed(f"{res.SANDBOX_ERROR}: cannot start bwrap: {error}")
    finally:
      for fd in (payload_r, report_w, info_w):
        os.close(fd)
    return Launch(proc, payload_w, {"report": report_r, "info": info_r}, uid)

  def collect(self, launch: Launch, *, since: float | None = None) -> SandboxResult:
    """Reads a sent launch to its end; `since` (default: when it was sent) starts the clocks of
    `startup_s` and `wall_s`."""
    sent = launch.sent_at if launch.sent_at is not None else time.monotonic()
    since = sent if since is None else since
    proc = launch.proc
    streams = _Streams(proc, launch.fds, self.limits.max_output_bytes)
    deadline = sent + self.limits.timeout_s + HOST_GRACE_S
    host_reason = None
    try:
      while streams.pump(min(0.25, deadline - time.monotonic())):
        if host_reason is None:
          if streams.flooded():
            host_reason = res.OUTPUT_LIMIT
          elif time.monotonic() > deadline:
            host_reason = res.TIMEOUT
          if host_reason is not None:
            _kill_sandbox(proc, bytes(streams.kept["info"]))
            deadline = time.monotonic() + HOST_GRACE_S
        elif time.monotonic() > deadline:
          break  # Something kept a pipe open after the kill: stop reading.
    finally:
      streams.close()
      _wait_or_kill(proc)
      launch.close()
    wall = time.monotonic() - since
    return _result(streams, host_reason, wall, since, self.limits)


def _kill_sandbox(proc: subprocess.Popen, info: bytes):
  """Kills the sandbox's PID 1 (so bwrap reaps it and exits), else bwrap's process group.

  The PID comes from bwrap's --info-fd; a pidfd, opened only while that process is still bwrap's
  child, makes sure the signal cannot reach a recycled PID.
  """
  try:
    child = int(json.loads(info.decode())["child-pid"])
    pidfd = os.pidfd_open(child)
  except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError):
    _kill_group(proc)
    return
  try:
    with open(f"/proc/{child}/stat", "rb") as handle:
      parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
    if parent != proc.pid:
      raise ProcessLookupError(child)
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
  except OSError:
    _kill_group(proc)
  finally:
    os.close(pidfd)


def _kill_group(proc: subprocess.Popen):
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)


def _wait_or_kill(proc: subprocess.Popen):
  try:
    proc.wait(timeout=HOST_GRACE_S)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    proc.wait()


_REPORT_TYPES = {"status": (int, type(None)), "reason": (str, type(None)),
                 "cpu_s": (int, float), "maxrss_kb": (int,), "started": (int, float)}


def _parse_report(raw: bytes) -> dict | None:
  """The supervisor's report if it is well formed (a setup error, or every field typed)."""
  try:
    report = json.loads(raw.decode())
  except (UnicodeDecodeError, ValueError):
    return None
  if not isinstance(report, dict):
    return None
  if isinstance(report.get("setup_error"), str):
    return report
  if any(not isinstance(report.get(key), kinds) for key, kinds in _REPORT_TYPES.items()):
    return None
  return report


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def _result(streams: _Streams, host_reason: str | None, wall: float, started: float,
            limits: Limits) -> SandboxResult:
  """Turns what the host read into a SandboxResult (pure)."""
  stdout, stderr = bytes(streams.kept["stdout"]), bytes(streams.kept["stderr"])
  common = dict(stdout=stdout, stderr=stderr, wall_s=wall,
                stdout_truncated=streams.seen["stdout"] > len(stdout),
                stderr_truncated=streams.seen["stderr"] > len(stderr))
  report = _parse_report(bytes(streams.kept["report"]))
  if host_reason is not None or report is None:
    reason = host_reason or (f"{res.SANDBOX_ERROR}: no report from the supervisor; stderr: "
                             f"{stderr[-500:].decode(errors='replace').strip()!r}")
    return res.SandboxResult(exit_code=None, timed_out=host_reason == res.TIMEOUT,
                             killed_reason=reason, cpu_s=None, peak_memory_mb=None,
                             startup_s=None, **common)
  if "setup_error" in report:
    return res.SandboxResult(exit_code=None, timed_out=False, cpu_s=None, peak_memory_mb=None,
                             killed_reason=f"{res.SETUP_ERROR}: {report['setup_error']}",
                             startup_s=None, **common)
  status, reason = report["status"], report["reason"]
  cpu = float(report["cpu_s"])
  exit_code, signal_name = None, None
  if isinstance(status, int):
    if os.WIFEXITED(status):
      exit_code = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
      signal_name = _signal_name(os.WTERMSIG(status))
  if reason is None and signal_name is not None:
    if signal_name == "SIGXCPU" or (signal_name == "SIGKILL" and cpu >= limits.cpu_s - 0.05):
      reason = res.CPU_LIMIT
    elif signal_name == "SIGXFSZ":
      reason = res.FILE_SIZE_LIMIT
    else:
      reason = f"signal {signal_name}"
  if reason is not None:
    exit_code = None
  return res.SandboxResult(
      exit_code=exit_code, timed_out=reason == res.TIMEOUT, killed_reason=reason, cpu_s=cpu,
      peak_memory_mb=report["maxrss_kb"] / 1024.0,
      startup_s=max(float(report["started"]) - started, 0.0), signal=signal_name,
      **common)


SandboxResult = res.SandboxResult
