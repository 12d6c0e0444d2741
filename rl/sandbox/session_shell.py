"""The supervisor of a persistent session: PID 1 inside its sandbox (stdlib only; never imported by
meshrl). rl/sandbox/session.py starts it as `python3 -I -S -c <session_support.py + this file>
REQUEST_FD REPORT_FD`: one program, session_support.py's helpers (frames, streams, processes, the
leftover checks) first.

It keeps one interactive bash alive for the whole session and runs the host's requests through it:
  - requests arrive on REQUEST_FD as frames (4-byte big-endian length + a marshal dict; the host is
    trusted), the first one {"op": "init", ...} (work dir, environment, rlimits, limits);
  - answers go to REPORT_FD as one JSON line each (the host treats them as untrusted text).

Ops (each answered by one line with the same "id"):
  run    one shell command, in the shell itself (so `cd`, variables and functions persist; `&` jobs
         live on). The command reaches bash as one input line,
           eval $'<the command, every byte escaped>' </dev/null 3>&- 4>&- ; __meshrl_done ID $?
         so no file holds it and quoting cannot break out; __meshrl_done writes "ID STATUS" to fd 3
         (a pipe only bash holds; commands run with it closed) and returns STATUS, so `$?` in the next
         command is the previous command's. stdout and stderr are one pipe (a terminal's view), or
         two with "stderr": "separate". At the command's timeout the foreground is interrupted as a
         terminal's Ctrl-C does (SIGINT to the shell's process group: bash abandons the line, `&`
         jobs ignore it); if the shell does not answer a sync line within INTERRUPT_GRACE_S, every
         process started during the command is stopped and killed; if it still does not answer, the
         shell is killed and a fresh one started in the work dir ("shell_restarted").
  check  a program run beside the shell, not through it (a task's tests): its own session and pipes,
         its exit status from waitpid here (nothing in the sandbox can forge it), its own timeout
         (the process group, then everything it started, is killed), RLIMIT_NPROC raised by
         CHECK_PROCESS_RESERVE so processes left by the policy cannot keep it from starting.
  write  files and folders into the sandbox's writable mounts (relative paths from the work dir, or
         with "base": "shell" from the shell's current directory).
  read   the first max_bytes of a file (relative to the shell's current directory).
  env    exports variables in the shell, and into the environment of later shells and checks.
  start  arms the session's wall clock (a warm session is started before its episode is known).
  recycle  makes the session a just-started one for the next episode (see `recycle`), or ends it
         ({"fatal": "not_recycled: <why>"}) when something of the episode could carry over.

Session limits (checked every loop): the wall clock, the inodes in use across the writable mounts
(max_files), and output produced while no command runs (OUTPUT_FLOOD_BYTES). Past any of them the
session ends: every process is killed, a {"fatal": reason} line is written, and this process exits
(the namespaces, and every file of the session, go with it). Orphans re-parent here and are reaped.

This process makes itself non-dumpable (prctl), so no process of the sandbox can open its file
descriptors through /proc/1/fd (the report pipe) or trace it; signals from inside the PID namespace
cannot kill a PID 1 either.
"""

import base64
import fcntl
import json
import marshal
import os
import select

import _signal
import resource

INTERRUPT_GRACE_S = 0.3
CHECK_PROCESS_RESERVE = 64
OUTPUT_FLOOD_BYTES = 32 << 20
SHELL_START_S = 5.0
MAX_SHELL_FAILURES = 3
_ESCAPE = {c: chr(c) for c in range(0x20, 0x7f)}
_ESCAPE.update({ord("\\"): "\\\\", ord("'"): "\\'"})


def quote(data):
  """bash's $'...' spelling of `data` (bytes without NUL): printable ASCII as is, every other byte
  as \\xHH, so a command of any bytes is one line of input."""
  return "$'" + "".join(_ESCAPE.get(b) or "\\x%02x" % b for b in data) + "'"


class Supervisor:
  def __init__(self, request_fd, report_fd, init):
    self.request_fd, self.report_fd = request_fd, report_fd
    self.workdir = init["workdir"]
    self.env = dict(init["env"])
    self.rlimits = init["rlimits"]
    self.check_rlimits = [(n, s + CHECK_PROCESS_RESERVE, h + CHECK_PROCESS_RESERVE)
                          if n == "RLIMIT_NPROC" else (n, s, h) for n, s, h in self.rlimits]
    self.cap = init["max_output_bytes"]
    self.kill_bytes = init["kill_output_bytes"]
    self.max_files, self.watch = init["max_files"], init["watch"]
    self.idle_timeout_s = init["idle_timeout_s"]
    self.deadline = _now() + self.idle_timeout_s
    self.init_env = dict(init["env"])
    self.mount_modes = {path: os.stat(path).st_mode & 0o7777 for path in self.watch}
    self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    _signal.set_wakeup_fd(wake_w)
    self.baseline = self._inodes()
    self.next_inode_check = 0.0
    self.shell = None  # pid
    self.shell_failures = 0
    self.background_seen = 0  # output bytes while no command runs
    self.statuses = {}  # pid -> wait status of processes this supervisor started and reaped

  # --- processes ---

  def _spawn(self, argv, fds, env, cwd, rlimits, new_session):
    """Forks `argv` with `fds` {target fd: source fd} (everything else closed), default signals."""
    pid = os.fork()
    if pid:
      return pid
    try:
      if new_session:
        os.setsid()
      moved = {target: fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 100)  # out of the way first
               for target, source in fds.items()}
      for target, source in moved.items():
        os.dup2(source, target, inheritable=True)
      os.closerange(max(fds) + 1 if fds else 0, 1 << 16)
      _signal.set_wakeup_fd(-1)
      for name in ("SIGPIPE", "SIGXFSZ", "SIGINT", "SIGCHLD"):
        _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
      _signal.pthread_sigmask(_signal.SIG_SETMASK, [])
      for name, soft, hard in rlimits:
        resource.setrlimit(getattr(resource, name), (soft, hard))
      try:
        os.chdir(cwd)
      except OSError:  # e.g. the policy made the work dir unreadable: start somewhere
        os.chdir("/")
      os.execvpe(argv[0], argv, env)
    except BaseException as error:  # pylint: disable=broad-except
      os.write(2, ("session: cannot start %r: %s\n" % (argv[0], error)).encode())
    os._exit(127)

  def _clear_wake(self) -> None:
    """Empties the wake pipe (a SIGCHLD's byte) so the next select waits again."""
    try:
      os.read(self.wake_r, 512)
    except BlockingIOError:
      pass

  def _reap(self):
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      self.statuses[pid] = status

  def _kill_new(self, before, keep):
    """Stops, then kills, every process not in `before` or `keep` (a fork bomb cannot outrun it:
    stopped processes do not fork)."""
    stopped = set()
    for _ in range(200):
      fresh = _pids() - before - keep - stopped - {1}
      if not fresh:
        break
      for pid in fresh:
        try:
          os.kill(pid, _signal.SIGSTOP)
        except OSError:
          pass
      stopped |= fresh
    for pid in stopped:
      try:
        os.kill(pid, _signal.SIGKILL)
      except OSError:
        pass
    self._reap()

  def kill_everything(self):
    try:
      os.kill(-1, _signal.SIGKILL)  # from PID 1: every other process of the namespace
    except ProcessLookupError:
      pass
    while True:
      try:
        os.waitpid(-1, 0)
      except ChildProcessError:
        return

  # --- the shell ---

  def start_shell(self):
    """Starts a fresh interactive bash in the work dir (start-up noise is dropped); ends the session
    ("shell_failed") when MAX_SHELL_FAILURES starts in a row do not answer."""
    cmd_r, self.cmd_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    noise_r, noise_w = os.pipe2(os.O_CLOEXEC)
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    env = dict(self.env, PS1="", PS2="", PS4="+ ")
    # fd 2 of the shell itself (its start-up warnings, the newline it prints after a Ctrl-C) is
    # read and dropped; each command's stderr is redirected to fd 1 or 4 (see `run`).
    self.shell = self._spawn(["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"],
                             {0: cmd_r, 1: out_w, 2: noise_w, 3: status_w, 4: err_w}, env,
                             self.workdir, self.rlimits, True)
    for fd in (cmd_r, out_w, err_w, noise_w, status_w):
      os.close(fd)
    self.out, self.err = Stream(out_r, self.cap), Stream(err_r, self.cap)
    self.noise = Stream(noise_r, 0)
    self.status_r, self.status_buf = status_r, b""
    os.set_blocking(status_r, False)
    setup = ("unset HISTFILE MAIL MAILPATH PROMPT_COMMAND; set +H +m; HISTSIZE=0; "
             "__meshrl_done() { printf '%s %d\\n' \"$1\" \"$2\" >&3; return \"$2\"; }; "
             "__meshrl_done ready 0\n")
    os.set_blocking(self.cmd_w, False)
    deadline = _now() + SHELL_START_S
    ready = self._wait_status("ready", deadline) if self._send(setup.encode(), deadline) else "timeout"
    self.out.take()
    self.err.take()
    self.shell_failures = 0 if isinstance(ready, int) else self.shell_failures + 1
    if self.shell_failures >= MAX_SHELL_FAILURES:
      self.fatal("shell_failed")
    return ready

  def _send(self, line, deadline):
    """Writes `line` to the shell's input by `deadline` (False if it could not: a shell that does
    not read, or one that is gone)."""
    view = memoryview(line)
    while view:
      try:
        view = view[os.write(self.cmd_w, view):]
      except BlockingIOError:
        left = deadline - _now()
        if left <= 0:
          return False
        select.select([], [self.cmd_w], [], min(left, 0.1))
      except OSError:
        return False
    return True

  def _shell_gone(self):
    return self.shell in self.statuses

  def _pump_status(self):
    """New "ID STATUS" lines from the shell (None at EOF)."""
    try:
      chunk = os.read(self.status_r, 4096)
    except BlockingIOError:
      return []
    if not chunk:
      return None
    self.status_buf += chunk
    *lines, self.status_buf = self.status_buf.split(b"\n")
    return [line.decode("ascii", "replace").split(" ") for line in lines]

  def _wait_status(self, want, deadline, stop_on_output=None):
    """Waits for the shell's line "want STATUS"; returns STATUS (int), "eof" if the shell died,
    "timeout" past `deadline`, "output" when `stop_on_output()` says the output is a flood."""
    while True:
      left = deadline - _now()
      if left <= 0:
        return "timeout"
      ready, _, _ = select.select([self.status_r, self.out.fd, self.err.fd, self.noise.fd,
                                   self.wake_r], [], [], min(left, 0.1))
      if self.noise.fd in ready:
        self.noise.pump()
      if self.wake_r in ready:
        self._clear_wake()
        self._reap()
      if self.out.fd in ready:
        self.out.pump()
      if self.err.fd in ready:
        self.err.pump()
      if stop_on_output is not None and stop_on_output():
        return "output"
      if self.status_r in ready:
        lines = self._pump_status()
        if lines is None:
          return "eof"
        for line in lines:
          if len(line) == 2 and line[0] == want:
            try:
              return int(line[1])
            except ValueError:
              pass
      if self._shell_gone():
        return "eof"
      self.check_session_limits()

  def _sync(self, tag):
    deadline = _now() + INTERRUPT_GRACE_S
    return (self._send(("__meshrl_done %s 0\n" % tag).encode(), deadline)
            and isinstance(self._wait_status(tag, deadline), int))

  def _restart_shell(self):
    """Kills the shell (if alive) and starts a fresh one: 'cwd and variables were reset'."""
    if not self._shell_gone():  # only the shell: `&` jobs of earlier commands live on
      try:
        os.kill(self.shell, _signal.SIGKILL)
      except OSError:
        pass
      try:
        _, status = os.waitpid(self.shell, 0)
        self.statuses[self.shell] = status
      except ChildProcessError:
        pass
    status = self.statuses.pop(self.shell, None)
    for fd in (self.cmd_w, self.out.fd, self.err.fd, self.noise.fd, self.status_r):
      os.close(fd)
    self.start_shell()
    return status

  def run(self, request):
    started = _now()
    before = _pids()
    line_id = "c%d" % request["id"]
    redirect = "2>&4" if request.get("stderr") == "separate" else "2>&1"
    deadline = started + request["timeout"]
    sent = self._send(("eval %s </dev/null %s 3>&- 4>&- ; __meshrl_done %s $?\n"
                       % (quote(request["cmd"]), redirect, line_id)).encode(), deadline)
    flooded = lambda: max(self.out.seen, self.err.seen) > self.kill_bytes
    result = self._wait_status(line_id, deadline, flooded) if sent else "timeout"
    reply = {"exit": None, "timed_out": False, "killed": None, "shell": None}
    if isinstance(result, int):
      reply["exit"] = result
    elif result == "eof":
      status = self._restart_shell()
      reply["shell"] = "exited"
      if status is not None and os.WIFEXITED(status):
        reply["exit"] = os.WEXITSTATUS(status)
      elif status is not None and os.WIFSIGNALED(status):
        reply["killed"] = "signal %d" % os.WTERMSIG(status)
    else:  # timeout or output flood: interrupt as Ctrl-C does, then escalate
      reply["timed_out"] = result == "timeout"
      reply["killed"] = "timeout" if result == "timeout" else "output_limit"
      try:
        os.killpg(self.shell, _signal.SIGINT)
      except OSError:
        pass
      if not self._sync("s%d" % request["id"]):
        self._kill_new(before, {self.shell})
        if not self._sync("t%d" % request["id"]):
          self._restart_shell()
          reply["shell"] = "restarted"
    self.out.pump()
    self.err.pump()
    return dict(reply, seconds=_now() - started, **self._take_output())

  def _take_output(self):
    out, out_seen = self.out.take()
    err, err_seen = self.err.take()
    return {"stdout": base64.b64encode(out).decode(), "stderr": base64.b64encode(err).decode(),
            "stdout_seen": out_seen, "stderr_seen": err_seen}

  # --- checks ---

  def check(self, request):
    started = _now()
    before = _pids()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    env = dict(self.env, **request.get("env", {}))
    pid = self._spawn(request["argv"], {0: null, 1: out_w, 2: err_w}, env,
                      request.get("cwd") or self.workdir, self.check_rlimits, True)
    for fd in (out_w, err_w, null):
      os.close(fd)
    out, err = Stream(out_r, self.cap), Stream(err_r, self.cap)
    deadline = started + request["timeout"]
    reason, open_fds, ended = None, {out_r, err_r}, None
    while True:
      # Done when the check has exited and its pipes are closed, or INTERRUPT_GRACE_S after it
      # exited if something it started still holds them (a check may close its own output early
      # and go on working: its exit, not its pipes, ends it).
      now = _now()
      if pid in self.statuses:
        ended = now if ended is None else ended
        if not open_fds or now >= ended + INTERRUPT_GRACE_S:
          break
      if now >= deadline or max(out.seen, err.seen) > self.kill_bytes:
        reason = "timeout" if now >= deadline else "output_limit"
        break
      ready, _, _ = select.select(list(open_fds) + [self.wake_r, self.out.fd, self.err.fd,
                                                    self.noise.fd], [], [], min(deadline - now, 0.05))
      for stream in (out, err):
        if stream.fd in ready and stream.fd in open_fds and not stream.pump():
          open_fds.discard(stream.fd)
      if self.wake_r in ready:
        self._clear_wake()
      self._reap()
      self._drain_background()
      self.check_session_limits()
    try:
      os.killpg(pid, _signal.SIGKILL)  # what the check started in its session goes with it
    except OSError:
      pass
    if reason is not None:
      self._kill_new(before, {self.shell})
    while pid not in self.statuses:
      try:
        _, status = os.waitpid(pid, 0)
        self.statuses[pid] = status
      except ChildProcessError:
        break
    out.pump()
    err.pump()
    for fd in (out_r, err_r):
      os.close(fd)
    status = self.statuses.pop(pid, None)
    reply = {"exit": None, "timed_out": reason == "timeout", "killed": reason, "shell": None}
    if reason is None and status is not None:
      if os.WIFEXITED(status):
        reply["exit"] = os.WEXITSTATUS(status)
      elif os.WIFSIGNALED(status):
        reply["killed"] = "signal %d" % os.WTERMSIG(status)
    out_data, out_seen = out.take()
    err_data, err_seen = err.take()
    return dict(reply, seconds=_now() - started, stdout=base64.b64encode(out_data).decode(),
                stderr=base64.b64encode(err_data).decode(), stdout_seen=out_seen,
                stderr_seen=err_seen)

  # --- files ---

  def _path(self, path, base):
    return path if path.startswith("/") else os.path.join(base, path)

  def _shell_cwd(self):
    try:
      return os.readlink("/proc/%d/cwd" % self.shell)
    except OSError:
      return self.workdir

  def write(self, request):
    errors = []
    base = self._shell_cwd() if request.get("base") == "shell" else self.workdir
    for path, kind, mode, data in request["entries"]:
      full = self._path(path, base)
      try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if kind == "d":
          os.makedirs(full, exist_ok=True)
          os.chmod(full, mode & 0o7777 | 0o700)
        elif kind == "l":
          os.symlink(data, full)
        else:
          fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
          try:
            _write_all(fd, data)
            os.fchmod(fd, mode & 0o7777)
          finally:
            os.close(fd)
      except OSError as error:
        errors.append("%s: %s" % (path, error))
    return {"errors": errors}

  def read(self, request):
    full = self._path(request["path"], self._shell_cwd())
    try:
      fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
      try:
        data = os.read(fd, request["max_bytes"] + 1)
      finally:
        os.close(fd)
    except OSError as error:
      return {"error": "%s: %s" % (full, error.strerror or error)}
    return {"data": base64.b64encode(data[:request["max_bytes"]]).decode(),
            "truncated": len(data) > request["max_bytes"], "path": full}

  def set_env(self, request):
    names = []
    for name, value in request["env"].items():
      self.env[name] = value
      names.append("export %s=%s" % (name, quote(value.encode())))
    line_id = "e%d" % request["id"]
    deadline = _now() + SHELL_START_S
    line = ("%s; __meshrl_done %s 0\n" % ("; ".join(names) or ":", line_id)).encode()
    ok = self._wait_status(line_id, deadline) if self._send(line, deadline) else "timeout"
    self.out.take()
    self.err.take()
    return {"ok": isinstance(ok, int)}

  # --- recycling ---

  def recycle(self, request):
    """Back to the state a fresh session starts in, for another episode: every process but this one
    killed (stopped first, so a fork bomb cannot outrun it) and reaped, every writable mount emptied
    and its mode restored, the environment of `init`, a fresh shell, the idle clock. The session
    ends instead (fatal "not_recycled: <why>") when anything could carry over that this process
    cannot remove: a process left, a SysV IPC object, a kernel key still listed, a file that will not
    go (kernel keys: the user, user-session and persistent keyrings are cleared, which leaves every
    other key of the episode unreachable, and the kernel collects it).
    (POSIX message queues cannot be listed from here; RLIMIT_MSGQUEUE 0 keeps them from being made.)"""
    for fd in (self.cmd_w, self.out.fd, self.err.fd, self.noise.fd, self.status_r):
      os.close(fd)
    self._kill_new(set(), set())
    self.kill_everything()
    self.statuses.clear()
    why = _leftovers(self.watch, self.mount_modes)
    if why is not None:
      self.fatal("not_recycled: " + why)
    self.env = dict(self.init_env)
    self.deadline = _now() + self.idle_timeout_s
    self.baseline, self.background_seen = self._inodes(), 0
    return {"clean": isinstance(self.start_shell(), int)}

  # --- the loop ---

  def _inodes(self):
    used = 0
    for path in self.watch:
      stat = os.statvfs(path)
      used += stat.f_files - stat.f_ffree
    return used

  def check_session_limits(self):
    now = _now()
    if now >= self.deadline:
      self.fatal("session_timeout")
    if now >= self.next_inode_check:
      self.next_inode_check = now + 0.05
      if self._inodes() - self.baseline > self.max_files:
        self.fatal("file_count_limit")

  def _drain_background(self):
    self.noise.pump()
    for stream in (self.out, self.err):
      seen = stream.seen
      stream.pump()
      self.background_seen += stream.seen - seen
    if self.background_seen > OUTPUT_FLOOD_BYTES:
      self.fatal("output_limit")

  def reply(self, data):
    _write_all(self.report_fd, (json.dumps(data) + "\n").encode())

  def fatal(self, reason):
    """Ends the session (see the module docstring); the reply carries the output read so far."""
    self.kill_everything()
    try:
      self.reply(dict(self._take_output(), fatal=reason))
    except OSError:
      pass
    os._exit(0)

  def serve(self):
    ops = {"run": self.run, "check": self.check, "write": self.write, "read": self.read,
           "env": self.set_env, "recycle": self.recycle}
    while True:
      ready, _, _ = select.select([self.request_fd, self.out.fd, self.err.fd, self.noise.fd,
                                   self.wake_r, self.status_r], [], [], 0.1)
      if self.wake_r in ready:
        self._clear_wake()
        self._reap()
      if self.out.fd in ready or self.err.fd in ready or self.noise.fd in ready:
        self._drain_background()
      if self.status_r in ready and self._pump_status() is None or self._shell_gone():
        self._restart_shell()
      self.check_session_limits()
      if self.request_fd not in ready:
        continue
      header = _read_exact(self.request_fd, 4)
      if header is None:
        return  # the host closed the session
      request = marshal.loads(_read_exact(self.request_fd, int.from_bytes(header, "big")))
      if request["op"] == "start":
        self.deadline = _now() + request["timeout_s"]
        self.reply({"id": request["id"]})
        continue
      pending, self.background_seen = self._take_output(), 0
      answer = ops[request["op"]](request)
      if request["op"] == "run":  # output from between commands comes first, as on a terminal
        for key in ("stdout", "stderr"):
          answer[key] = base64.b64encode(base64.b64decode(pending[key])
                                         + base64.b64decode(answer[key])).decode()
          answer[key + "_seen"] += pending[key + "_seen"]
      answer["id"] = request["id"]
      self.reply(answer)


def main(request_fd, report_fd):
  _no_dump()
  header = _read_exact(request_fd, 4)
  if header is None:
    return  # a warm session the host no longer needs
  init = marshal.loads(_read_exact(request_fd, int.from_bytes(header, "big")))
  supervisor = Supervisor(request_fd, report_fd, init)
  ready = supervisor.start_shell()
  supervisor.reply({"ready": isinstance(ready, int)})
  try:
    supervisor.serve()
  finally:
    supervisor.kill_everything()


if __name__ == "__main__":
  import sys
  main(int(sys.argv[1]), int(sys.argv[2]))
