"""Hostile programs against the sandbox: each test asserts the containment itself on the host side
(canary unchanged, no process left, the host's server received nothing), not only an exit code.

Network tests talk only to servers this file starts on the host's 127.0.0.1 (or abstract/unix
sockets); nothing is ever sent beyond this machine.
"""

import os
import re
import secrets
import socket
import subprocess
import textwrap
import time

import pytest

from meshrl.rl import sandbox as sb
from meshrl.rl.sandbox import runner

LIMITS = sb.Limits(timeout_s=4.0, cpu_s=4.0, memory_mb=256, max_processes=16, disk_mb=8,
                   max_files=300, max_output_bytes=4096)
HANG = sb.Limits(timeout_s=1.0, cpu_s=4.0, memory_mb=256, max_processes=16, disk_mb=8,
                 max_files=300, max_output_bytes=4096)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make(limits):
  try:
    return sb.Sandbox(limits)
  except sb.SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run); a laptop may not.
    pytest.skip(f"bubblewrap unavailable: {error}")


@pytest.fixture(scope="module")
def box():
  return _make(LIMITS)


@pytest.fixture(scope="module")
def hang_box():
  return _make(HANG)


def _sandbox_processes() -> list[int]:
  """Host pids of sandbox processes: owned by a sandbox uid (root host) or in another PID ns."""
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
    if runner.UID_BASE <= uid < runner.UID_BASE + runner.UID_COUNT or (
        os.geteuid() != 0 and uid == os.getuid() and other_ns):
      found.append(int(entry))
  return found


def _assert_nothing_left(before):
  """No sandbox process but those alive before (e.g. idle warm sandboxes of a shared pool)."""
  deadline = time.monotonic() + 1.0
  while set(_sandbox_processes()) - before and time.monotonic() < deadline:
    time.sleep(0.02)
  assert set(_sandbox_processes()) - before == set(), "a sandbox process outlived its run"


def _run(box, code, **kwargs):
  before = set(_sandbox_processes())
  result = box.run(textwrap.dedent(code), **kwargs)
  _assert_nothing_left(before)
  return result


@pytest.fixture
def host_helper():
  """A host process the attacks try to reach; it must survive untouched."""
  helper = subprocess.Popen(["sleep", "60"])
  yield helper
  helper.kill()
  helper.wait()


# ---------------------------------------------------------------- processes, CPU, memory, time

def test_fork_bomb(hang_box):
  result = _run(hang_box, """
      import os
      while True:
        try:
          os.fork()
        except OSError:
          pass
      """)
  assert result.timed_out and result.wall_s < 4.0
  assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_fork_count_is_capped(box):
  result = _run(box, """
      import os, time
      n = 0
      try:
        while True:
          if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
          n += 1
      except OSError:
        print(n)
      """)
  assert 1 <= int(result.stdout) <= LIMITS.max_processes


def test_thread_bomb_is_capped(box):
  result = _run(box, """
      import threading, time
      n = 0
      try:
        while True:
          threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
          n += 1
      except (RuntimeError, MemoryError):
        print(n)
      """)
  assert 0 <= int(result.stdout) <= LIMITS.max_processes


def test_memory_bomb(box):
  result = _run(box, """
      chunks = []
      try:
        while True:
          chunks.append(bytearray(8 << 20))
      except MemoryError:
        print(8 * len(chunks))
      """)
  assert int(result.stdout) < LIMITS.memory_mb
  assert result.peak_memory_mb <= LIMITS.memory_mb


def test_memory_bomb_in_many_processes(box):
  result = _run(box, """
      import os
      for _ in range(4):
        if os.fork() == 0:
          chunks = []
          try:
            while True:
              chunks.append(bytearray(8 << 20))
          except MemoryError:
            print(8 * len(chunks), flush=True)
          os._exit(0)
      for _ in range(4):
        os.wait()
      """)
  sizes = [int(line) for line in result.stdout.split()]
  assert len(sizes) == 4 and max(sizes) < LIMITS.memory_mb
  assert result.peak_memory_mb <= LIMITS.memory_mb


def test_busy_loops_in_many_processes(hang_box):
  result = _run(hang_box, """
      import os
      for _ in range(4):
        if os.fork() == 0:
          while True:
            pass
      while True:
        pass
      """)
  assert result.timed_out and result.wall_s < 4.0


def test_sleeping_past_the_timeout(hang_box):
  result = _run(hang_box, "import time\ntime.sleep(60)\nprint('woke')")
  assert result.timed_out and result.stdout == b"" and result.wall_s < 4.0


def test_daemon_cannot_outlive_the_run(box):
  start = time.monotonic()
  result = _run(box, """
      import os, sys, time
      if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
          os.close(1)
          os.close(2)
          while True:
            time.sleep(1)
        os._exit(0)
      print('parent done')
      """)
  assert result.ok and result.stdout == b"parent done\n"
  assert time.monotonic() - start < 2.0, "the run waited for its daemon"


def test_daemon_ignoring_signals_is_killed(hang_box):
  result = _run(hang_box, """
      import os, signal, time
      for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
      if os.fork() == 0:
        os.setsid()
        while True:
          time.sleep(1)
      time.sleep(60)
      """)
  assert result.timed_out


# ---------------------------------------------------------------- network

def test_connecting_to_a_host_loopback_tcp_server_fails(box):
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(8)
  server.setblocking(False)
  port = server.getsockname()[1]
  try:
    result = _run(box, f"""
        import socket
        try:
          socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"exfiltrated")
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"ConnectionRefusedError\n"
    with pytest.raises(BlockingIOError):
      server.accept()  # the host server received no connection
  finally:
    server.close()


def test_sending_to_a_host_loopback_udp_server_reaches_nothing(box):
  server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  server.bind(("127.0.0.1", 0))
  server.setblocking(False)
  port = server.getsockname()[1]
  try:
    result = _run(box, f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(20):
          s.sendto(b"exfiltrated", ("127.0.0.1", {port}))
        print("sent")
        """)
    assert b"sent" in result.stdout or result.exit_code is not None
    time.sleep(0.1)
    with pytest.raises(BlockingIOError):
      server.recv(100)
  finally:
    server.close()


def test_abstract_unix_socket_of_the_host_is_unreachable(box):
  name = f"\0meshrl-test-{secrets.token_hex(8)}"
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(name)
  server.listen(4)
  server.setblocking(False)
  try:
    result = _run(box, f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
          s.connect({name!r})
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"ConnectionRefusedError\n"
    with pytest.raises(BlockingIOError):
      server.accept()
  finally:
    server.close()


def test_unix_socket_file_of_the_host_is_unreachable(box, tmp_path):
  path = str(tmp_path / "host.sock")
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(path)
  server.listen(4)
  server.setblocking(False)
  try:
    result = _run(box, f"""
        import socket
        try:
          socket.socket(socket.AF_UNIX).connect({path!r})
          print("connected")
        except OSError as error:
          print(type(error).__name__)
        """)
    assert result.stdout == b"FileNotFoundError\n"
    with pytest.raises(BlockingIOError):
      server.accept()
  finally:
    server.close()


def test_only_a_private_loopback_interface_and_no_routes(box):
  result = _run(box, """
      import socket
      print(socket.if_nameindex())
      print(len(open('/proc/net/route').read().splitlines()))
      for family, kind in ((socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_INET, socket.SOCK_RAW)):
        try:
          socket.socket(family, kind, 0 if family == socket.AF_PACKET else socket.IPPROTO_ICMP)
          print("raw socket")
        except OSError as error:
          print(type(error).__name__)
      """)
  assert result.stdout_text == "[(1, 'lo')]\n1\nPermissionError\nPermissionError\n"
  assert len(socket.if_nameindex()) >= 1  # the host's interfaces are untouched


# ---------------------------------------------------------------- file system

def test_writing_outside_the_work_directory(box, tmp_path):
  canary = tmp_path / "canary.txt"
  canary.write_text("intact")
  targets = ["/x", "/usr/x", "/etc/x", "/dev/x", "/proc/x", "/bin/x", str(canary),
             os.path.join(REPO, "pwned")]
  result = _run(box, f"""
      for path in {targets!r}:
        try:
          open(path, "w").write("pwned")
          print("WROTE", path)
        except OSError as error:
          print("denied", type(error).__name__)
      """)
  assert b"WROTE" not in result.stdout and result.stdout.count(b"denied") == len(targets)
  assert canary.read_text() == "intact"
  assert not os.path.exists(os.path.join(REPO, "pwned")) and not os.path.exists("/usr/x")


def test_reading_the_repository(box):
  with open(os.path.join(REPO, "setup.py")) as handle:
    secret_line = handle.readline().strip()
  result = _run(box, f"""
      import os
      for path in [{os.path.join(REPO, "setup.py")!r}, "/work/main/setup.py", "../setup.py"]:
        try:
          print(open(path).read())
        except OSError as error:
          print("missing", type(error).__name__)
      for top in ["/", "/work", "/tmp"]:
        for root, dirs, files in os.walk(top):
          dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/usr", "/dev")]
          print(root, files)
      """)
  assert result.ok and secret_line.encode() not in result.stdout
  assert b"setup.py" not in result.stdout.replace(b"/setup.py", b"")
  assert result.stdout.count(b"missing") == 3


def test_reading_the_home_directory(box):
  home = os.path.expanduser("~")
  result = _run(box, f"""
      import os
      print(os.path.expanduser("~"), os.path.exists({home!r}), os.path.exists("/root"),
            os.path.exists("/home"))
      """)
  assert result.stdout == b"/work False False False\n"


def test_parent_environment_is_invisible(box, monkeypatch):
  token = secrets.token_hex(16)
  monkeypatch.setenv("MESHRL_SANDBOX_SECRET", token)
  result = _run(box, """
      import os
      print(dict(os.environ))
      for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
        try:
          print(open(f'/proc/{pid}/environ', 'rb').read())
        except OSError as error:
          print(pid, type(error).__name__)
      """)
  assert result.ok and token.encode() not in result.stdout
  assert b"MESHRL_SANDBOX_SECRET" not in result.stdout


def test_filling_the_disk(box):
  result = _run(box, """
      import os
      for top in ("/work", "/tmp", "/dev/shm"):
        written = 0
        try:
          for i in range(1000):
            with open(f"{top}/fill{i}", "wb") as handle:
              handle.write(b"0" * (1 << 20))
            written += 1 << 20
        except OSError as error:
          print(top, written, error.errno)
      """)
  lines = result.stdout_text.split("\n")[:3]
  assert [line.split()[0] for line in lines] == ["/work", "/tmp", "/dev/shm"]
  for line in lines:
    _, written, errno = line.split()
    assert int(written) <= LIMITS.disk_mb << 20 and errno in ("28", "27")  # ENOSPC / EFBIG


def test_huge_number_of_files(box):
  result = _run(box, """
      import os
      n = 0
      while True:
        for i in range(100):
          open(f"f{n + i}", "w").close()
        n += 100
        print(n, flush=True)
      """)
  assert result.killed_reason == "file_count_limit", result.summary()
  assert int(result.stdout.split()[-1]) <= LIMITS.max_files + 20_000


def test_work_directory_is_gone_after_the_run(box):
  marker = f"marker-{secrets.token_hex(8)}"
  _run(box, f"open('/work/{marker}', 'w').write('x')\nopen('/tmp/{marker}', 'w').write('x')")
  for top in ("/tmp", "/dev/shm", "/var/tmp", REPO):
    assert not os.path.exists(os.path.join(top, marker))
  assert _run(box, f"import os\nprint(os.path.exists('/work/{marker}'))").stdout == b"False\n"


def test_symlink_tricks(box):
  with open(os.path.join(REPO, "setup.py")) as handle:
    secret_line = handle.readline().strip()
  result = _run(box, f"""
      import os
      links = {{"root": "/", "proc_root": "/proc/1/root", "repo": {REPO!r},
               "up": "../../../../..", "cwd": "/proc/self/cwd/.."}}
      for name, target in links.items():
        os.symlink(target, name)
        for rel in ("setup.py", "main/setup.py", "root/.bashrc"):
          try:
            print(open(os.path.join(name, rel)).read())
          except OSError as error:
            print("denied", type(error).__name__)
      """)
  assert result.ok and secret_line.encode() not in result.stdout
  assert result.stdout.count(b"denied") == 15


def test_proc_tricks(box):
  result = _run(box, """
      import os
      pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
      print(pids)
      print(sorted(os.listdir('/proc/1/root')))
      print(open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:3])
      for path in ('/proc/kcore', '/proc/sysrq-trigger', '/proc/sys/kernel/hostname',
                   '/proc/sys/vm/drop_caches'):
        try:
          open(path, 'w').write('1')
          print("WROTE", path)
        except OSError as error:
          print("denied")
      print(open('/proc/self/mountinfo').read())
      """)
  lines = result.stdout_text.split("\n")
  assert lines[0] == "[1, 2]"  # the supervisor and this program: no host process is visible
  assert lines[1] == str(sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp",
                                 "usr", "work"]))
  assert lines[2] == "[b'/usr/bin/python3', b'-I', b'-S']"
  assert lines[3:7] == ["denied"] * 4
  assert REPO not in result.stdout_text and "/root" not in result.stdout_text


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
  assert _make(LIMITS).run(["true"]).ok  # the supervisor and the host are fine


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


def test_reading_another_sandboxs_work_directory_while_both_run():
  try:
    pool = sb.SandboxPool(2, limits=LIMITS)
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
for top in ('/work', '/tmp', '/dev/shm', '/proc'):
  for root, dirs, files in os.walk(top):
    if root.count('/') > 4:
      dirs[:] = []
    for name in files:
      try:
        seen.append(open(os.path.join(root, name), 'rb').read(4096))
      except OSError:
        pass
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
  for rel in ('root/work/secret.txt', 'cwd/secret.txt', 'root/tmp/secret.txt'):
    try:
      seen.append(open(f'/proc/{{pid}}/{{rel}}', 'rb').read())
    except OSError:
      pass
print(len(seen) > 100, any(SECRET in data for data in seen))
"""
  before = set(_sandbox_processes())
  with pool:
    victim_future = pool.submit(victim)
    thief_result = pool.submit(thief).result()
    victim_result = victim_future.result()
  _assert_nothing_left(before)
  assert victim_result.ok and victim_result.stdout == b"victim ready\n"
  assert thief_result.ok, thief_result
  assert thief_result.stdout == b"True False\n"  # it read plenty, but never the victim's secret

