"""Sandbox attacks on processes, CPU, memory and time: fork and thread bombs, memory bombs (in one
process and in many), busy loops, sleeping past the timeout, and daemons that try to outlive the run
(also ignoring signals). Each test checks on the host that no sandbox process is left and, for the
fork bomb, that the host can still start processes. Shared limits and helpers:
tests/rl/sandbox_attack_helpers.py; fixtures: tests/rl/conftest.py.
"""

import os
import subprocess
import time

import pytest

from meshrl.rl.sandbox import runner
from sandbox_attack_helpers import LIMITS, _run, _sandbox_processes  # loaded by tests/rl/conftest.py


def test_the_leftover_check_sees_an_orphan_and_leaves_out_live_runs():
  """What every `_run` asserts with: a process of a sandbox uid whose lease is released counts as left
  over; while a run (here this test) holds the uid's lease, the same process is that run's, not a
  leftover (so sandbox tests on another xdist worker do not fail these)."""
  if os.geteuid() != 0:
    pytest.skip("sandbox uids are leased only when the host is root")
  uid = runner._UIDS.acquire()  # pylint: disable=protected-access
  try:
    proc = subprocess.Popen(["sleep", "30"], user=uid)
    try:
      deadline = time.monotonic() + 5
      while not os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
      assert proc.pid not in _sandbox_processes()  # leased: a live run's process
      runner._UIDS.release(uid)  # pylint: disable=protected-access
      uid = None
      assert proc.pid in _sandbox_processes()  # released: it outlived its run
    finally:
      proc.kill()
      proc.wait()
  finally:
    runner._UIDS.release(uid)  # pylint: disable=protected-access


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
        count = len(chunks)
        chunks = None  # print's own allocations would fail at the limit (no stdout, a traceback)
        print(8 * count)
      """)
  assert result.stdout.strip() and int(result.stdout) < LIMITS.memory_mb, result
  if box.mode == "oneshot":  # a session does not measure one command's peak memory
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
            count = len(chunks)
            chunks = None  # freed first: print needs memory of its own
            print(8 * count, flush=True)
          os._exit(0)
      for _ in range(4):
        os.wait()
      """)
  sizes = [int(line) for line in result.stdout.split()]
  assert len(sizes) == 4 and max(sizes) < LIMITS.memory_mb, result
  if box.mode == "oneshot":
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
