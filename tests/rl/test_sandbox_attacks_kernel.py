"""Sandbox attacks through the kernel's other interfaces: ptrace of and signals to host processes,
setuid binaries, chroot, mount and new namespaces, devices and mknod, clock and hostname changes, the
open file limit, inherited file descriptors (forging the supervisor's report), output floods, tty
injection, and one sandbox reading another's files while both run. Each test checks the host side
(the host process untouched and untraced, no sandbox process left). Shared limits and helpers:
tests/rl/sandbox_attack_helpers.py; fixtures: tests/rl/conftest.py.
"""

import concurrent.futures
import os
import re
import secrets
import socket
import time

import pytest

from meshrl.rl import sandbox as sb
from meshrl.rl.sandbox.session import SessionSpec
from meshrl.rl.sandbox.session_pool import SessionPool
from sandbox_attack_helpers import (  # loaded by tests/rl/conftest.py
    LIMITS, MODES, _assert_nothing_left, _leases, _make, _run, _sandbox_processes)



def test_ptrace_of_a_host_process(box, host_helper):
  result = _run(box, f"""
      import ctypes, os
      libc = ctypes.CDLL(None, use_errno=True)
      print(libc.ptrace(16, {host_helper.pid}, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
      try:
        print(open('/proc/{host_helper.pid}/status').read())
      except OSError as error:
        print(type(error).__name__)
      """)
  assert result.stdout.split(b"\n")[0] in (b"-1 3", b"-1 1")  # ESRCH (not in the PID ns) / EPERM
  with open(f"/proc/{host_helper.pid}/status") as handle:
    assert re.search(r"^TracerPid:\s+0$", handle.read(), re.M)
  assert host_helper.poll() is None


def test_signalling_the_parent_and_host_processes(box, host_helper):
  result = _run(box, f"""
      import os, signal
      for pid in (os.getppid(), 1, {os.getpid()}, {host_helper.pid}, -1):
        try:
          os.kill(pid, signal.SIGKILL)
          print(pid, "sent")
        except OSError as error:
          print(pid, type(error).__name__)
      """)
  assert result.exit_code in (0, None)
  assert host_helper.poll() is None, "a host process was killed from inside the sandbox"
  assert _make(LIMITS, box.mode).run(["true"]).ok  # the supervisor and the host are fine


def test_setuid_binaries_give_no_privileges(box):
  result = _run(box, """
      import os, subprocess
      print([line for line in open('/proc/self/status') if line.startswith('NoNewPrivs')])
      for argv in (["mount", "-t", "tmpfs", "none", "/tmp"], ["su", "-c", "id", "root"],
                   ["unshare", "-r", "id"], ["umount", "/usr"]):
        print(argv[0], subprocess.run(argv, capture_output=True).returncode != 0)
      try:
        os.setuid(0)
        print("setuid worked")
      except OSError:  # EINVAL: uid 0 does not even exist in the sandbox's user namespace
        print("setuid denied")
      print(os.geteuid())
      """)
  assert result.stdout_text == ("['NoNewPrivs:\\t1\\n']\nmount True\nsu True\nunshare True\n"
                                "umount True\nsetuid denied\n1000\n")


def test_chroot_mount_and_namespace_escapes_are_denied(box):
  result = _run(box, """
      import ctypes, os
      libc = ctypes.CDLL(None, use_errno=True)
      try:
        os.chroot("/tmp")
        print("chroot worked")
      except PermissionError:
        print("chroot denied")
      print(libc.unshare(0x10000000), libc.unshare(0x00020000))  # CLONE_NEWUSER, CLONE_NEWNS
      print(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
      """)
  assert result.stdout == b"chroot denied\n-1 -1\n-1\n"


def test_devices_are_not_reachable(box):
  result = _run(box, """
      import os
      for path in ("/dev/mem", "/dev/kmem", "/dev/kmsg", "/dev/vda", "/dev/sda", "/dev/port"):
        print(os.path.exists(path))
      try:
        os.mknod("/work/null", 0o20666, os.makedev(1, 3))
        print(open("/work/null", "rb").read(1))
      except OSError as error:
        print(type(error).__name__)
      try:
        open("/dev/tty")
        print("tty")
      except OSError as error:
        print(type(error).__name__)
      """)
  assert result.stdout_text == "False\n" * 6 + "PermissionError\nOSError\n"


def test_clock_and_hostname_changes_are_denied(box):
  host_name = socket.gethostname()
  result = _run(box, """
      import socket, time
      try:
        time.clock_settime(time.CLOCK_REALTIME, 0)
        print("clock changed")
      except PermissionError:
        print("clock denied")
      try:
        socket.sethostname("pwned")
      except PermissionError:
        pass
      print(socket.gethostname())
      """)
  assert result.stdout == b"clock denied\nsandbox\n"
  assert socket.gethostname() == host_name and abs(time.time() - 1.7e9) < 5e8


def test_open_file_limit(box):
  result = _run(box, """
      fds = []
      try:
        while True:
          fds.append(open("/dev/null"))
      except OSError as error:
        print(len(fds), error.errno)
      """)
  count, errno = result.stdout.split()
  assert int(count) <= LIMITS.max_open_files and errno == b"24"  # EMFILE


def test_program_sees_no_host_file_descriptors_and_cannot_forge_the_report(box):
  result = _run(box, """
      import os, sys
      print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')), flush=True)
      for fd in range(3, 64):
        try:
          os.write(fd, b'{"status": 0, "reason": null, "cpu_s": 0, "maxrss_kb": 0, "started": 0}\\n')
          print("wrote", fd)
        except OSError:
          pass
      sys.exit(5)
      """)
  assert result.stdout_text.split("\n")[0] == "[0, 1, 2, 3]"  # 3: listdir's own descriptor
  assert result.exit_code == 5 and b"wrote" not in result.stdout


def test_output_floods_are_cut_off(box):
  for stream in ("stdout", "stderr"):
    result = _run(box, f"import sys\nwhile True:\n  sys.{stream}.write('x' * 65536)")
    assert result.killed_reason == "output_limit", result.summary()
    assert getattr(result, stream) == b"x" * LIMITS.max_output_bytes
    assert getattr(result, f"{stream}_truncated") and result.wall_s < LIMITS.timeout_s


def test_tty_injection_has_no_terminal(box):
  result = _run(box, """
      import fcntl, os, termios
      try:
        fcntl.ioctl(0, termios.TIOCSTI, b"x")
        print("injected")
      except OSError as error:
        print(type(error).__name__)
      print(os.isatty(0), os.getsid(0) == os.getpid() or os.getsid(0) == 1)
      """)
  assert result.stdout_text.split("\n")[0] == "OSError"


@pytest.mark.parametrize("mode", MODES)
def test_reading_another_sandboxs_work_directory_while_both_run(mode):
  """Two sandboxes at once (two pool runs, or two persistent sessions of one SessionPool): the thief
  searches everything it can see while the victim holds its secret in /work, /tmp and /dev/shm."""
  try:
    pool = sb.SandboxPool(2, limits=LIMITS) if mode == "oneshot" else SessionPool(
        SessionSpec(LIMITS), warm=2)
  except sb.SandboxUnavailable as error:
    pytest.skip(str(error))
  secret = secrets.token_hex(16)
  victim = f"""
import time
open('/work/secret.txt', 'w').write({secret!r})
open('/tmp/secret.txt', 'w').write({secret!r})
open('/dev/shm/secret.txt', 'w').write({secret!r})
print('victim ready', flush=True)
time.sleep(2.0)
"""
  thief = f"""
import os, time
SECRET = {secret[::-1]!r}[::-1].encode()  # never written out whole: main.py holds it reversed
time.sleep(0.6)
seen = []
def read(path):  # non-blocking: /proc/<pid>/fd/ holds pipes (in a session, the shell's input)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
      seen.append(os.read(fd, 4096))
    finally:
      os.close(fd)
  except OSError:
    pass
for top in ('/work', '/tmp', '/dev/shm', '/proc'):
  for root, dirs, files in os.walk(top):
    if root.count('/') > 4:
      dirs[:] = []
    for name in files:
      read(os.path.join(root, name))
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
  for rel in ('root/work/secret.txt', 'cwd/secret.txt', 'root/tmp/secret.txt'):
    read(f'/proc/{{pid}}/{{rel}}')
print(len(seen) > 100, any(SECRET in data for data in seen))
"""
  before = set(_sandbox_processes())
  with pool, _leases() as uids:
    if mode == "oneshot":
      victim_future = pool.submit(victim)
      thief_result = pool.submit(thief).result()
      victim_result = victim_future.result()
    else:
      sessions = [pool.acquire(), pool.acquire()]
      with concurrent.futures.ThreadPoolExecutor(2) as threads:
        runs = [threads.submit(_session_program, session, code)
                for session, code in zip(sessions, (victim, thief))]
        victim_result, thief_result = [run.result() for run in runs]
      for session in sessions:
        session.close()
  _assert_nothing_left(before, uids if os.geteuid() == 0 else None)
  assert victim_result.ok and victim_result.stdout == b"victim ready\n"
  assert thief_result.ok, thief_result
  assert thief_result.stdout == b"True False\n"  # it read plenty, but never the victim's secret


def _session_program(session, code):
  session.write_files({"main.py": code})
  return session.run("python3 -s main.py", stderr="separate")
