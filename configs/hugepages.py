"""Transparent huge pages for the host's buffers: re-executes a script with glibc's
`glibc.malloc.hugetlb=1` tunable (`reexec_with_hugepages`, called by cli.parse before jax is imported).

XLA:CPU allocates each program execution's buffers afresh, and glibc serves allocations that large
with new memory mappings, returned to the kernel when freed, so every execution faults in its
temporaries 4 KiB at a time. Measured on this 2-core machine: scripts/bench_model.py's d512 training
step took 98,039 minor page faults a step (383 MiB touched fresh) and 5,460 with the tunable, which
has glibc advise its mappings for 2 MiB pages (madvise(MADV_HUGEPAGE)); the step's best of 5 went
from 0.513 and 0.456 s to 0.364 and 0.339 s in alternating processes.

glibc reads its tunables once, when the process starts, so the setting cannot be made from Python;
the script re-executes itself (same pid, arguments and environment plus the tunable) when:
  - it runs on Linux with glibc 2.35 or newer (where the tunable exists),
  - the kernel's transparent huge pages are in `madvise` mode (with `always` every mapping gets them
    already; with `never` the advice does nothing),
  - GLIBC_TUNABLES does not name glibc.malloc.hugetlb already, and MESHRL_HUGEPAGES is not "0".
This module imports no jax.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_at_least(major: int, minor: int) -> bool:
  name, version = platform.libc_ver()
  if name != "glibc" or not version:
    return False
  parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
  return parts >= (major, minor)


def _thp_mode() -> str:
  """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" if unknown."""
  try:
    with open(THP_MODE_FILE, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return ""
  return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def wanted(environ=None) -> bool:
  """Whether re-executing with the tunable would change anything here (see the module docstring)."""
  environ = os.environ if environ is None else environ
  if environ.get("MESHRL_HUGEPAGES", "1") == "0" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
    return False
  return sys.platform == "linux" and _glibc_at_least(2, 35) and _thp_mode() == "madvise"


def tunables(environ=None) -> str:
  """GLIBC_TUNABLES with the huge-page tunable added to whatever it held."""
  environ = os.environ if environ is None else environ
  held = environ.get("GLIBC_TUNABLES", "")
  return f"{held}:{TUNABLE}=1" if held else f"{TUNABLE}=1"


def reexec_with_hugepages() -> None:
  """Replaces this process with the same command line under the tunable when `wanted()`; returns
  otherwise. Call it first thing, before any work or output (nothing of this process survives)."""
  if not wanted() or "jax" in sys.modules:
    return
  env = dict(os.environ, GLIBC_TUNABLES=tunables())
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
