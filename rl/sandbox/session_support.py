"""Helpers of the persistent session's supervisor (rl/sandbox/session_shell.py; stdlib only, never
imported by meshrl): frames on the host's pipes, capped output streams, the processes in the sandbox,
and the checks `recycle` makes that nothing of the last episode is left (files in the writable mounts,
SysV IPC objects, kernel keys).

rl/sandbox/session.py runs this text and session_shell.py's as one program (`python3 -I -S -c`
takes one source text): this one first, so the supervisor's code uses these names as its own.
"""

import os
import time

def _now():
  return time.monotonic()


def _read_exact(fd, size):
  chunks = []
  while size:
    chunk = os.read(fd, size)
    if not chunk:
      return None
    chunks.append(chunk)
    size -= len(chunk)
  return b"".join(chunks)


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _no_dump():
  import ctypes  # pylint: disable=import-outside-toplevel
  ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def _pids():
  return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _keys():
  """The kernel keys this uid can see (/proc/keys lines)."""
  try:
    with open("/proc/keys") as keys:
      return keys.read().splitlines()
  except OSError:
    return []


def _empty(path):
  """Removes everything under the directory `path` (made writable first: the policy may have taken
  the write bit off its own folders)."""
  for entry in os.scandir(path):
    full = entry.path
    if entry.is_dir(follow_symlinks=False):
      os.chmod(full, 0o700)
      _empty(full)
      os.rmdir(full)
    else:
      os.unlink(full)


_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl system call's number
KEYCTL_GET_PERSISTENT, KEYCTL_CLEAR = 22, 7
KEY_GC_S = 1.0
KEY_SPEC_PROCESS, KEY_SPEC_USER, KEY_SPEC_USER_SESSION = -2, -4, -5


def _clear_keys():
  """Unlinks every key from the keyrings that outlive this uid's processes (the user, user-session
  and persistent keyrings), so a key of the last episode is unreachable and collected; False when
  that cannot be done here."""
  import ctypes  # pylint: disable=import-outside-toplevel
  number = _KEYCTL.get(os.uname().machine)
  if number is None:
    return False
  libc = ctypes.CDLL(None, use_errno=True)
  keyctl = lambda *args: libc.syscall(number, *[ctypes.c_long(a) for a in args])
  persistent = keyctl(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_PROCESS)
  if persistent < 0 and ctypes.get_errno() not in (38, 95):  # ENOSYS, EOPNOTSUPP: no such keyring here
    return False
  for keyring in (KEY_SPEC_USER, KEY_SPEC_USER_SESSION) + ((persistent,) if persistent >= 0 else ()):
    if keyctl(KEYCTL_CLEAR, keyring) < 0 and ctypes.get_errno() != 38:
      return False
  return True


def _leftovers(mounts, modes):
  """None when nothing of the last episode is left (after every process is gone): the writable
  mounts emptied and their modes restored, no SysV IPC object, no key reachable; else why."""
  if _pids() != {1}:
    return "a process survived"
  try:
    for path in mounts:
      os.chmod(path, 0o700)
      _empty(path)
      os.chmod(path, modes[path])
      if os.listdir(path):
        return "%s is not empty" % path
  except OSError as error:
    return "emptying the mounts: %s" % error
  for kind in ("shm", "sem", "msg"):
    try:
      with open("/proc/sysvipc/" + kind) as table:
        if len(table.read().splitlines()) > 1:
          return "a SysV %s object is left" % kind
    except OSError:
      pass
  if not _clear_keys():
    return "the keyrings could not be cleared"
  deadline = _now() + KEY_GC_S  # unlinked keys are collected by the kernel a moment later
  while any(line.split()[7:8] != ["keyring"] for line in _keys()):
    if _now() > deadline:
      return "a kernel key is left"
    time.sleep(0.005)
  return None


class Stream:
  """One pipe read into a capped buffer: `kept` (at most `cap` bytes), `seen` (bytes read)."""

  def __init__(self, fd, cap):
    self.fd, self.cap, self.kept, self.seen = fd, cap, bytearray(), 0
    os.set_blocking(fd, False)

  def pump(self):
    """Reads what is there (at most 1 MiB, so a flood cannot hold the caller); False at EOF."""
    for _ in range(16):
      try:
        chunk = os.read(self.fd, 1 << 16)
      except BlockingIOError:
        return True
      if not chunk:
        return False
      self.seen += len(chunk)
      room = self.cap - len(self.kept)
      if room > 0:
        self.kept += chunk[:room]
    return True

  def take(self):
    data, seen = bytes(self.kept), self.seen
    self.kept, self.seen = bytearray(), 0
    return data, seen
