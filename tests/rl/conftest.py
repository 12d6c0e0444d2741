"""Fixtures of the sandbox attack tests (tests/rl/test_sandbox_attacks_*.py): `box` and `hang_box`
(one sandbox per test module, with sandbox_attack_helpers.LIMITS and .HANG), `host_helper` (a host
process the attacks try to reach) and `one_attack_module_at_a_time` (a lock each attack module holds).

tests/ is no package and pytest imports with --import-mode=importlib, so a helper file beside the
tests is not importable by name; as tests/conftest.py does for hf_fixtures.py, this file loads
tests/rl/sandbox_attack_helpers.py by path, as the module `sandbox_attack_helpers` in sys.modules.
pytest imports a conftest before the test modules of its folder, so they can
`from sandbox_attack_helpers import ...`. A test module's own fixture of the same name wins over
these (test_sandbox.py has its own `box`).
"""

import fcntl
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest


def _load_helpers():
  """tests/rl/sandbox_attack_helpers.py, imported once and kept in sys.modules under its file name."""
  name = "sandbox_attack_helpers"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


_helpers = _load_helpers()


@pytest.fixture(scope="module")
def box():
  return _helpers._make(_helpers.LIMITS)  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def hang_box():
  return _helpers._make(_helpers.HANG)  # pylint: disable=protected-access


@pytest.fixture
def host_helper():
  """A host process the attacks try to reach; it must survive untouched."""
  helper = subprocess.Popen(["sleep", "60"])
  yield helper
  helper.kill()
  helper.wait()


@pytest.fixture(scope="module")
def one_attack_module_at_a_time():
  """Holds an flock on a file in the temp dir for a whole attack module, so two attack modules never
  run at once (on two xdist workers, or in two pytest runs on this host). `_run` counts every sandbox
  process on the host, so another module's sandbox started during a run would read as one that
  outlived it; when the attacks were one file, one worker ran them all one after another."""
  fd = os.open(os.path.join(tempfile.gettempdir(), "meshrl-sandbox-attacks.lock"), os.O_RDWR | os.O_CREAT,
               0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # drops the flock
