"""Sandbox and SandboxPool: results, limits, fault recovery and bad input (rl/sandbox/)."""

import os
import sys
import time

import pytest

from meshrl.rl import sandbox as sb
from meshrl.rl.sandbox import bwrap, runner

FAST = sb.Limits(timeout_s=3.0, cpu_s=3.0, memory_mb=256, max_processes=16, disk_mb=8,
                 max_files=500, max_output_bytes=4096)


def _make(limits=FAST, **kwargs):
  try:
    return sb.Sandbox(limits, **kwargs)
  except sb.SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run); a laptop may not.
    pytest.skip(f"bubblewrap unavailable: {error}")


@pytest.fixture(scope="module")
def box():
  return _make()


def test_result_of_a_simple_program(box):
  result = box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
  assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
  assert result.killed_reason is None and not result.timed_out and not result.ok
  assert not result.stdout_truncated and not result.stderr_truncated
  assert 0 < result.startup_s < result.wall_s < 3.0
  assert 0 < result.cpu_s < 3.0 and 1.0 < result.peak_memory_mb < 100.0
  assert box.run(["true"]).ok


def test_argv_files_and_stdin(box):
  result = box.run(["sh", "-c", "cat deep/dir/in.txt; tr a-z A-Z; pwd; ls -A"],
                   files={"deep/dir/in.txt": "from file\n", "raw.bin": bytes([0, 255])},
                   stdin="from stdin\n")
  assert result.ok, result
  assert result.stdout_text == "from file\nFROM STDIN\n/work\ndeep\nraw.bin\n"
  assert box.run("print(open('raw.bin', 'rb').read())", files={"raw.bin": b"\0\xff"}
                 ).stdout == b"b'\\x00\\xff'\n"


def test_binary_garbage_is_kept_byte_for_byte(box):
  result = box.run("import sys; sys.stdout.buffer.write(bytes(range(256)) * 2)")
  assert result.ok and result.stdout == bytes(range(256)) * 2
  assert "\\x80" in result.stdout_text and "\\xff" in result.stdout_text


def test_output_is_capped_and_flagged(box):
  result = box.run("import sys\nsys.stdout.write('x' * 10000)\nsys.stderr.write('y' * 10)")
  assert result.ok, "output past the cap (but under the kill factor) is drained, not fatal"
  assert result.stdout == b"x" * FAST.max_output_bytes and result.stdout_truncated
  assert result.stderr == b"y" * 10 and not result.stderr_truncated


def test_wall_clock_timeout_kills_the_run():
  box = _make(sb.Limits(timeout_s=0.5, max_output_bytes=1024))
  start = time.monotonic()
  result = box.run("import time\nprint('started', flush=True)\ntime.sleep(60)")
  assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
  assert result.stdout == b"started\n"
  assert 0.5 <= result.wall_s < 2.5 and time.monotonic() - start < 2.5


def test_cpu_limit_kills_a_busy_loop():
  box = _make(sb.Limits(timeout_s=15.0, cpu_s=0.5))  # RLIMIT_CPU counts whole seconds: 1 s
  result = box.run("while True: pass")
  assert result.killed_reason == "cpu_limit", result
  # The kernel's CPU accounting is tick-based: a 1 s limit once read back as 0.896 s under overload.
  assert result.signal in ("SIGXCPU", "SIGKILL") and 0.8 <= result.cpu_s < 3.0


def test_memory_limit_and_peak_memory():
  box = _make(sb.Limits(memory_mb=128))
  denied = box.run("x = bytearray(300 << 20)")
  assert denied.exit_code == 1 and b"MemoryError" in denied.stderr
  allowed = _make(sb.Limits(memory_mb=512)).run("x = bytearray(150 << 20)\nx[::4096] = b'1' * len(x[::4096])")
  assert allowed.ok, allowed
  assert 150 <= allowed.peak_memory_mb < 200


def test_file_size_and_disk_limits():
  box = _make(sb.Limits(max_file_mb=1, disk_mb=4))
  shell = box.run(["sh", "-c", "exec head -c 3000000 /dev/zero > big"])
  assert shell.killed_reason == "file_size_limit" and shell.signal == "SIGXFSZ"
  # Python ignores SIGXFSZ, so it sees EFBIG; the file stops at the limit.
  code = ("import os\ntry:\n  open('big', 'wb').write(b'0' * (3 << 20))\nexcept OSError as e:\n"
          "  print(e.errno)\nprint(os.path.getsize('big'))")
  assert box.run(code).stdout == b"27\n1048576\n"
  fill = ("import os\nn = 0\ntry:\n  for i in range(100):\n    open(f'f{i}', 'wb').write(b'0' * (512 << 10))\n"
          "    n += 512 << 10\nexcept OSError as e:\n  print(e.errno, n)")
  errno, written = box.run(fill).stdout.split()
  assert errno == b"28" and int(written) <= 4 << 20  # ENOSPC at disk_mb


def test_process_limit(box):
  code = ("import os, time\nn = 0\ntry:\n  while True:\n    if os.fork() == 0:\n      time.sleep(2)\n"
          "      os._exit(0)\n    n += 1\nexcept OSError:\n  print(n)")
  forks = int(box.run(code).stdout)
  assert 1 <= forks <= FAST.max_processes


def test_signal_is_reported(box):
  result = box.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
  assert result.exit_code is None and result.signal == "SIGSEGV"
  assert result.killed_reason == "signal SIGSEGV"


def test_missing_program_exits_127(box):
  result = box.run(["no-such-program"])
  assert result.exit_code == 127 and b"cannot run 'no-such-program'" in result.stderr


def test_each_run_gets_a_fresh_work_directory_and_a_clean_environment(box):
  assert box.run("open('left', 'w').write('1')").ok
  again = box.run("import os\nprint(sorted(os.listdir('.')), sorted(os.environ))")
  assert again.stdout_text == ("['main.py'] ['HOME', 'LANG', 'PATH', 'PWD', "
                               "'PYTHONDONTWRITEBYTECODE', 'TMPDIR']\n")


@pytest.mark.parametrize("kwargs, match", [
    ({"memory_mb": 0}, "memory_mb=0"),
    ({"timeout_s": -1}, "timeout_s=-1"),
    ({"cpu_s": float("nan")}, "cpu_s=nan"),
    ({"max_processes": 2.5}, "max_processes=2.5 must be a whole number"),
    ({"disk_mb": "8"}, "disk_mb='8' must be a number"),
    ({"max_files": True}, "max_files=True"),
])
def test_nonsense_limits_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sb.Limits(**kwargs)


@pytest.mark.parametrize("files, match", [
    ({"../escape": "x"}, "outside the work directory"),
    ({"/etc/passwd": "x"}, "outside the work directory"),
    ({"a/../../x": "x"}, "outside the work directory"),
    ({"": "x"}, "non-empty string"),
    ({"ok.txt": 5}, r"files\['ok.txt'\] must be str or bytes"),
    ({"a//b": "1", "a/b": "2"}, "twice"),
    ({"big": b"0" * (9 << 20)}, "disk_mb=8"),
    (["a"], "must be a mapping"),
])
def test_bad_files_are_rejected(box, files, match):
  with pytest.raises(ValueError, match=match):
    box.run(["true"], files=files)


def test_bad_argv_and_code_collisions_are_rejected(box):
  for argv in ([], ["ls", 3], ["a\0b"]):
    with pytest.raises(ValueError, match="non-empty list of strings"):
      box.run(argv)
  with pytest.raises(ValueError, match="'main.py'"):
    box.run("print(1)", files={"main.py": "x"})
  with pytest.raises(ValueError, match="stdin must be str or bytes"):
    box.run(["true"], stdin=3)
  with pytest.raises(ValueError, match="limits must be a Limits"):
    sb.Sandbox({"timeout_s": 1})


def test_missing_or_broken_bwrap_says_how_to_install(monkeypatch, tmp_path):
  runtime = bwrap.Runtime.host()
  monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
  with pytest.raises(sb.SandboxUnavailable, match="apt-get install -y bubblewrap"):
    bwrap.check_bwrap.__wrapped__(runtime)
  fake = tmp_path / "bwrap"
  fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setattr(bwrap.shutil, "which", lambda name: str(fake))
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  with pytest.raises(sb.SandboxUnavailable, match="No permissions to create new namespace"):
    bwrap.check_bwrap.__wrapped__(runtime)


@pytest.mark.needs_sandbox  # bubblewrap must run for the bind check below to be the failure it tests
@pytest.mark.skipif(sys.base_prefix.startswith("/usr"), reason="interpreter already under /usr")
def test_interpreter_prefix_runtime_is_bound_at_a_neutral_path():
  runtime = bwrap.Runtime.host(python_prefix=sys.base_prefix)
  assert (sys.base_prefix, "/opt/python") in runtime.binds
  hidden = any(not os.access(p, os.X_OK) or not os.stat(p).st_mode & 0o001
               for p in _parents(sys.base_prefix))
  if hidden and os.geteuid() == 0:  # e.g. pyenv under /root (0700): the sandbox uid cannot bind it
    with pytest.raises(sb.SandboxUnavailable, match=f"{sys.base_prefix}.*readable by the sandbox"):
      sb.Sandbox(FAST, runtime=runtime)
    return
  result = _make(runtime=runtime).run(["python3", "-c", "import os, sys; print(sys.prefix, "
                                       "os.path.exists('/root'), os.path.exists('/home'))"])
  assert result.stdout_text == "/opt/python False False\n", result


def _parents(path):
  parts = path.rstrip("/").split("/")
  return ["/".join(parts[:i]) or "/" for i in range(2, len(parts) + 1)]


@pytest.mark.parametrize("report", [
    b"", b"not json", b"[1]", b'{"status": "0", "reason": null, "cpu_s": 0, "maxrss_kb": 0, '
    b'"started": 0}', b'{"status": 0, "reason": null, "cpu_s": "x", "maxrss_kb": 0, "started": 0}'])
def test_missing_or_malformed_report_becomes_a_sandbox_error(report):
  class Streams:
    kept = {"stdout": b"", "stderr": b"bwrap: boom", "report": report}
    seen = {"stdout": 0, "stderr": 11, "report": len(report)}
  result = runner._result(Streams(), None, 0.1, 0.0, FAST)  # pylint: disable=protected-access
  assert result.killed_reason.startswith("sandbox_error") and "bwrap: boom" in result.killed_reason
  assert result.exit_code is None and result.cpu_s is None


def test_pool_runs_in_parallel_and_reports_startup_latency():
  try:
    pool = sb.SandboxPool(4, limits=FAST)
  except sb.SandboxUnavailable as error:
    pytest.skip(str(error))
  program = "import time; print(time.time()); time.sleep(0.4); print(time.time())"
  with pool:
    results = pool.map([sb.Request(program) for _ in range(8)])
  assert all(r.ok for r in results)
  # Concurrency, not speed: some runs' [start, end] intervals overlap (a serial pool has none).
  spans = sorted(tuple(float(x) for x in r.stdout_text.split()) for r in results)
  overlaps = sum(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))
  assert overlaps >= 2, spans
  stats = pool.stats()
  assert stats.runs == 8 and stats.ok == 8 and stats.failures == {}
  assert 0 < stats.startup_p50_s <= stats.startup_p99_s < 2.0


def test_pool_survives_crashes_hangs_and_bad_requests(monkeypatch):
  try:
    pool = sb.SandboxPool(2, limits=FAST)
  except sb.SandboxUnavailable as error:
    pytest.skip(str(error))
  hang = sb.Limits(timeout_s=0.5)
  with pool:
    futures = [pool.submit("import os; os.abort()"),
               pool.submit("while True: pass", limits=hang),
               pool.submit(["true"], files={"../x": "1"}),
               pool.submit(["sh", "-c", "exit 4"]),
               pool.submit("print('alive')")]
    results = [f.result() for f in futures]
    original = pool.default.prepare
    calls = []

    def broken_once(*args, **kwargs):
      if not calls:
        calls.append(1)
        raise RuntimeError("worker blew up")
      return original(*args, **kwargs)
    monkeypatch.setattr(pool.default, "prepare", broken_once)
    internal, after = pool.submit(["true"]).result(), pool.submit("print('still alive')").result()
  assert results[0].killed_reason == "signal SIGABRT"
  assert results[1].timed_out and results[1].killed_reason == "timeout"
  assert results[2].killed_reason.startswith("invalid_request: files path '../x'")
  assert results[3].exit_code == 4
  assert results[4].stdout == b"alive\n"
  assert internal.killed_reason == "sandbox_error: RuntimeError: worker blew up"
  assert after.stdout == b"still alive\n"
  stats = pool.stats()
  assert stats.runs == 7 and stats.ok == 2
  assert stats.failures == {"signal SIGABRT": 1, "timeout": 1, "invalid_request": 1,
                            "exit_nonzero": 1, "sandbox_error": 1}
  assert any("worker blew up" in line for line in stats.recent_failures)
