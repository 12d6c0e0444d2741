"""What the sandbox attack tests (tests/rl/test_sandbox_attacks_*.py) share: their limits (`LIMITS`,
and `HANG` for programs that only end at the timeout), the repository root `REPO` (a path the sandbox
must not reach), `_make` (a Sandbox, or a skip without bubblewrap), and `_run`, which runs a hostile
program and then checks on the host that no sandbox process outlived it (`_sandbox_processes`,
`_assert_nothing_left`). tests/rl/conftest.py loads this file as the module `sandbox_attack_helpers`
and builds the `box`, `hang_box` and `host_helper` fixtures on it.

Every attack runs three times (the fixtures are parametrized by `MODES`): in a one-shot `Sandbox`, in
a persistent session (`SessionBox`: the program is one command of a fresh `Session`'s shell, after an
earlier command left a background process and shell state behind; the session is closed after it,
and `_run` then checks that nothing of it is left), and in a recycled session (the same, in a session
that an earlier episode used and left a background job and files in, then `Session.recycle`d, as a
SessionPool hands sessions to episodes). `box.mode` says which; a few expectations differ
by construction (in a session the program's parent is the shell, and PID 1 is not readable).

Hostile programs against the sandbox: each test asserts the containment itself on the host side
(canary unchanged, no process left, the host's server received nothing), not only an exit code.

Network tests talk only to servers they start on the host's 127.0.0.1 (or abstract/unix sockets);
nothing is ever sent beyond this machine.
"""

import contextlib
import fcntl
import os
import re
import shlex
import signal
import textwrap
import time

import pytest

from meshrl.rl import sandbox as sb
from meshrl.rl.sandbox import result as sandbox_result
from meshrl.rl.sandbox import runner
from meshrl.rl.sandbox.session import SESSION_ENDED, Session, SessionSpec

MODES = ("oneshot", "session", "recycled")

LIMITS = sb.Limits(timeout_s=4.0, cpu_s=4.0, memory_mb=256, max_processes=16, disk_mb=8,
                   max_files=300, max_output_bytes=4096)
HANG = sb.Limits(timeout_s=1.0, cpu_s=4.0, memory_mb=256, max_processes=16, disk_mb=8,
                 max_files=300, max_output_bytes=4096)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SessionBox:
  """`Sandbox.run`'s interface over persistent sessions: each run starts a session, runs a first
  command that leaves a background job and shell state, writes the files, runs the program as the
  next command (stderr apart, stdin from a file), closes the session and returns a SandboxResult
  (cpu_s, peak_memory_mb and startup_s are not measured per command: None)."""

  def __init__(self, limits, mode="session"):
    self.limits, self.mode = limits, mode
    self.spec = SessionSpec(limits)
    sb.check_bwrap(sb.Runtime.host(), uid=runner.UID_BASE if os.geteuid() == 0 else None)

  def run(self, cmd, *, files=None, stdin=None):
    session = Session.start(self.spec)
    try:
      if self.mode == "recycled":  # an earlier episode's job and files, then the pool's recycle
        earlier = session.run("(while true; do sleep 0.1; done) >/dev/null 2>&1 & touch /tmp/earlier")
        assert earlier.ok and session.recycle(), (earlier, session.ended)
      first = session.run("sleep 300 & MESHRL_EARLIER=1; cd /tmp")
      assert first.ok, first
      files = dict(files or {})
      if isinstance(cmd, str):
        files["main.py"], command = cmd, "cd /work && python3 -s main.py"
      else:
        command = "cd /work && " + shlex.join(cmd)
      if stdin is not None:
        files["/tmp/.stdin"] = stdin
        command += " < /tmp/.stdin"
      session.write_files(files)
      result = session.run(command, stderr="separate")
    finally:
      session.close()
    reason = result.killed_reason
    if reason and reason.startswith(SESSION_ENDED + ": "):
      reason = reason[len(SESSION_ENDED) + 2:]  # the session's limit ended the run
    exit_code, signal_name = result.exit_code, None
    if exit_code is not None and exit_code > 128 and reason is None:  # bash: 128 + signal
      signal_name = signal.Signals(exit_code - 128).name
      exit_code, reason = None, f"signal {signal_name}"
    return sandbox_result.SandboxResult(
        exit_code=exit_code, stdout=result.stdout, stderr=result.stderr,
        stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
        timed_out=result.timed_out, killed_reason=reason, wall_s=result.seconds, cpu_s=None,
        peak_memory_mb=None, startup_s=None, signal=signal_name)


def _make(limits, mode="oneshot"):
  try:
    if mode in ("session", "recycled"):
      return SessionBox(limits, mode)
    box = sb.Sandbox(limits)
    box.mode = "oneshot"
    return box
  except sb.SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run); a laptop may not.
    pytest.skip(f"bubblewrap unavailable: {error}")


def _leased(uid: int) -> bool:
  """Whether a live run holds sandbox uid `uid`: its lease file's flock (rl/sandbox/runner._UidPool)
  is held, by this process or another (an xdist worker running other sandbox tests)."""
  try:
    fd = os.open(os.path.join(runner._UIDS._lock_dir, str(uid)), os.O_RDWR)  # pylint: disable=protected-access
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return True
  finally:
    os.close(fd)  # drops the flock if it was taken
  return False


def _sandbox_processes(uids=None) -> list[int]:
  """Host pids of sandbox processes no live run accounts for. On a root host each run leases its own
  uid and releases it when the run is over: a process of a released sandbox uid (of `uids` when
  given: the runs of one test) outlived its run, while those of runs still going (in this process or
  another test worker) are left out. Not root: the processes in another PID namespace."""
  own_ns = os.readlink("/proc/self/ns/pid")
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/status") as handle:
        uid = int(re.search(r"^Uid:\s+(\d+)", handle.read(), re.M).group(1))
      other_ns = os.readlink(f"/proc/{entry}/ns/pid") != own_ns
    except (OSError, AttributeError):
      continue
    if uids is not None:
      sandbox_uid = uid in uids
    else:
      sandbox_uid = runner.UID_BASE <= uid < runner.UID_BASE + runner.UID_COUNT
    if (sandbox_uid and not _leased(uid)) or (os.geteuid() != 0 and uid == os.getuid() and other_ns):
      found.append(int(entry))
  return found


@contextlib.contextmanager
def _leases():
  """Records the sandbox uids this process leases inside the block (the runs of one test)."""
  uids = set()
  acquire = runner._UIDS.acquire  # pylint: disable=protected-access

  def recording():
    uid = acquire()
    uids.add(uid)
    return uid

  runner._UIDS.acquire = recording  # pylint: disable=protected-access
  try:
    yield uids
  finally:
    del runner._UIDS.acquire  # pylint: disable=protected-access


def _assert_nothing_left(before, uids=None, wait_s: float = 5.0):
  """No sandbox process (of `uids`, the test's runs, when given) but those alive before (e.g. idle
  warm sandboxes of a shared pool). A killed sandbox's processes die a little after its uid is
  released: waits up to `wait_s` for them (one that outlived its run stays, so the wait costs
  nothing when the check passes)."""
  deadline = time.monotonic() + wait_s
  while set(_sandbox_processes(uids)) - before and time.monotonic() < deadline:
    time.sleep(0.02)
  assert set(_sandbox_processes(uids)) - before == set(), "a sandbox process outlived its run"


def _run(box, code, **kwargs):
  before = set(_sandbox_processes())
  with _leases() as uids:
    result = box.run(textwrap.dedent(code), **kwargs)
  assert uids or os.geteuid() != 0, "the run leased no sandbox uid: the leftover check would see nothing"
  _assert_nothing_left(before, uids if os.geteuid() == 0 else None)
  return result
