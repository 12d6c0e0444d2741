"""Sandbox attacks on the file system: writing outside the work directory (a host canary, the
repository, /usr), reading the repository, the home directory and the parent's environment, filling
the disk and the file table, leftovers after the run, symlink escapes and /proc tricks. Each test
checks the host side (canary unchanged, nothing written, no secret in the output). Shared limits and
helpers: tests/rl/sandbox_attack_helpers.py; fixtures: tests/rl/conftest.py.
"""

import ast
import os
import secrets


from sandbox_attack_helpers import LIMITS, REPO, _run  # loaded by tests/rl/conftest.py



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
      try:
        print(sorted(os.listdir('/proc/1/root')))
      except OSError as error:
        print(type(error).__name__)
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
  if box.mode == "oneshot":
    assert lines[0] == "[1, 2]"  # the supervisor and this program: no host process is visible
    assert lines[1] == str(sorted(["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp",
                                   "usr", "work"]))
  else:
    # The supervisor, the shell, the earlier command's `sleep` job and this program (in a recycled
    # session, pids after the earlier episode's); PID 1 (the supervisor, non-dumpable) cannot even be
    # looked into.
    pids = ast.literal_eval(lines[0])
    assert len(pids) == 4 and pids[0] == 1 and (box.mode == "recycled" or pids == [1, 2, 3, 4]), pids
    assert lines[1] == "PermissionError"
  assert lines[2] == "[b'/usr/bin/python3', b'-I', b'-S']"
  assert lines[3:7] == ["denied"] * 4
  assert REPO not in result.stdout_text and "/root" not in result.stdout_text
