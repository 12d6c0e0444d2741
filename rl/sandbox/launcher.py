"""The supervisor that runs as PID 1 inside every sandbox (stdlib only; never imported by meshrl).

The host sends this file's text as `python3 -I -S -c <text> PAYLOAD_FD REPORT_FD`. It:
  1. waits for the payload (a marshal dict from the host: argv, files, stdin, rlimits, timeout_s,
     max_files, watch) on PAYLOAD_FD (a pipe: a warm sandbox is started before its run is known)
     and writes the files into /work;
  2. forks the program with stdin from a memfd, the rlimits set and the signal state Python changed
     reset to defaults;
  3. reaps every process (orphans re-parent to PID 1) until the program exits, its wall-clock
     budget runs out, or the writable mounts hold more than max_files inodes;
  4. kills whatever is left in the PID namespace (`kill(-1, SIGKILL)` from PID 1), reaps it, and
     writes one JSON line to REPORT_FD: wait status, reason, CPU seconds and peak RSS of all
     processes, and the monotonic time the program started (the host's clock: no time namespace).
Imports stay minimal (`_signal`, not `signal`, which pulls in enum) to keep start-up near 10 ms.
"""

import marshal
import os
import time

import _signal
import resource


def _read_all(fd):
  chunks = []
  while True:
    chunk = os.read(fd, 1 << 20)
    if not chunk:
      return b"".join(chunks)
    chunks.append(chunk)


def _write_files(files):
  for path, data in files:
    full = "/work/" + path
    parent = os.path.dirname(full)
    if parent != "/work":
      os.makedirs(parent, exist_ok=True)
    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view):]
    finally:
      os.close(fd)


def _stdin_fd(data):
  if not data:
    return os.open("/dev/null", os.O_RDONLY)
  fd = os.memfd_create("stdin")
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _exec_program(argv, rlimits, stdin_fd):
  """In the forked child: stdin, limits, default signals, exec. Never returns."""
  try:
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, [])
    for name in ("SIGPIPE", "SIGXFSZ", "SIGINT"):
      _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    for name, soft, hard in rlimits:
      resource.setrlimit(getattr(resource, name), (soft, hard))
    os.execvpe(argv[0], argv, os.environ)
  except BaseException as error:  # pylint: disable=broad-except
    os.write(2, f"sandbox: cannot run {argv[0]!r}: {error}\n".encode())
  os._exit(127)


def _inodes_in_use(paths):
  used = 0
  for path in paths:
    stat = os.statvfs(path)
    used += stat.f_files - stat.f_ffree
  return used


def _supervise(pid, deadline, max_files, watch):
  """Reaps until the program `pid` exits or a limit trips; returns (wait status or None, reason)."""
  mask = [_signal.SIGCHLD]
  status = None
  baseline = _inodes_in_use(watch)
  while True:
    while True:
      try:
        reaped, wait_status, _ = os.wait4(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if reaped == 0:
        break
      if reaped == pid:
        status = wait_status
    if status is not None:
      return status, None
    now = time.monotonic()
    if now >= deadline:
      return None, "timeout"
    if _inodes_in_use(watch) - baseline > max_files:
      return None, "file_count_limit"
    _signal.sigtimedwait(mask, min(0.05, deadline - now))


def _kill_all_and_reap(pid, status):
  try:
    os.kill(-1, _signal.SIGKILL)  # From PID 1: every other process of the namespace.
  except ProcessLookupError:
    pass
  while True:
    try:
      reaped, wait_status, _ = os.wait4(-1, 0)
    except ChildProcessError:
      return status
    if reaped == pid and status is None:
      status = wait_status


def main(payload_fd, report_fd):
  data = _read_all(payload_fd)
  os.close(payload_fd)
  if not data:  # A warm sandbox the host no longer needs.
    return
  payload = marshal.loads(data)
  try:
    _write_files(payload["files"])
  except OSError as error:
    os.write(report_fd, ('{"setup_error": %s}\n' % _quote(f"writing files: {error}")).encode())
    return
  stdin_fd = _stdin_fd(payload["stdin"])
  _signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGCHLD])
  started = time.monotonic()
  pid = os.fork()
  if pid == 0:
    os.close(report_fd)
    _exec_program(payload["argv"], payload["rlimits"], stdin_fd)
  os.close(stdin_fd)
  status, reason = _supervise(pid, started + payload["timeout_s"], payload["max_files"],
                              payload["watch"])
  status = _kill_all_and_reap(pid, status)
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  report = '{"status": %s, "reason": %s, "cpu_s": %.6f, "maxrss_kb": %d, "started": %.6f}\n' % (
      "null" if status is None else int(status), _quote(reason), usage.ru_utime + usage.ru_stime,
      usage.ru_maxrss, started)
  os.write(report_fd, report.encode())


def _quote(text):
  if text is None:
    return "null"
  return '"' + "".join(c if c.isalnum() or c in " _-:.,/'()" else "?" for c in text) + '"'


if __name__ == "__main__":
  import sys
  main(int(sys.argv[1]), int(sys.argv[2]))
