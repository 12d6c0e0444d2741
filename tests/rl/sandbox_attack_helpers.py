"""What the sandbox attack tests (tests/rl/test_sandbox_attacks_*.py) share: their limits (`LIMITS`,
and `HANG` for programs that only end at the timeout), the repository root `REPO` (a path the sandbox
must not reach), `_make` (a Sandbox, or a skip without bubblewrap), and `_run`, which runs a hostile
program and then checks on the host that no sandbox process outlived it (`_sandbox_processes`,
`_assert_nothing_left`). tests/rl/conftest.py loads this file as the module `sandbox_attack_helpers`
and builds the `box`, `hang_box` and `host_helper` fixtures on it.

Hostile programs against the sandbox: each test asserts the containment itself on the host side
(canary unchanged, no process left, the host's server received nothing), not only an exit code.

Network tests talk only to servers they start on the host's 127.0.0.1 (or abstract/unix sockets);
nothing is ever sent beyond this machine.
"""

import os
import re
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
