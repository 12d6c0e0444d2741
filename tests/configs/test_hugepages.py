"""configs/hugepages.py: when a script re-executes itself with huge pages, and that it really does."""

import os
import subprocess
import sys

import pytest

from meshrl.configs import hugepages

_SCRIPT = ("import os, sys; from meshrl.configs import cli; cli.parse([]); "
           "print(os.getpid(), os.environ.get('GLIBC_TUNABLES', ''), 'jax' in sys.modules)")


def test_tunable_is_added_to_what_the_environment_holds():
  assert hugepages.tunables({}) == "glibc.malloc.hugetlb=1"
  assert hugepages.tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
      "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")


def test_opt_out_and_a_tunable_already_set_are_respected():
  assert not hugepages.wanted({"MESHRL_HUGEPAGES": "0"})
  assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})


def _run(env_changes: dict) -> tuple[int, list[str]]:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHRL_HUGEPAGES")}
  env.update(env_changes)
  proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0
  return proc.pid, out.split()


@pytest.mark.skipif(not hugepages.wanted({}), reason="no glibc >= 2.35 with madvise-mode huge pages here")
def test_cli_parse_reexecutes_the_script_with_the_tunable_once():
  """cli.parse replaces the process (same pid) with one whose environment holds the tunable, before
  anything imported jax; MESHRL_HUGEPAGES=0 keeps the process as it started."""
  pid, (printed_pid, tunables, jax_loaded) = _run({})
  assert int(printed_pid) == pid and tunables == "glibc.malloc.hugetlb=1" and jax_loaded == "False"
  pid, printed = _run({"MESHRL_HUGEPAGES": "0"})
  assert int(printed[0]) == pid and printed[1:] == ["False"]  # no tunables printed
