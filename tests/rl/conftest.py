"""Fixtures of the sandbox attack tests (tests/rl/test_sandbox_attacks_*.py): `box` and `hang_box`
(one sandbox per test module and mode, with sandbox_attack_helpers.LIMITS and .HANG; each attack runs
in a one-shot sandbox and in a persistent session), `host_helper` (a host process the attacks try to
reach).

tests/ is no package and pytest imports with --import-mode=importlib, so a helper file beside the
tests is not importable by name; as tests/conftest.py does for hf_fixtures.py, this file loads
tests/rl/sandbox_attack_helpers.py by path, as the module `sandbox_attack_helpers` in sys.modules.
pytest imports a conftest before the test modules of its folder, so they can
`from sandbox_attack_helpers import ...`. A test module's own fixture of the same name wins over
these (test_sandbox.py has its own `box`).
"""

import importlib.util
import os
import subprocess
import sys

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


@pytest.fixture(scope="module", params=_helpers.MODES)
def box(request):
  """A one-shot Sandbox, then a persistent-session box (sandbox_attack_helpers.SessionBox)."""
  return _helpers._make(_helpers.LIMITS, request.param)  # pylint: disable=protected-access


@pytest.fixture(scope="module", params=_helpers.MODES)
def hang_box(request):
  return _helpers._make(_helpers.HANG, request.param)  # pylint: disable=protected-access


@pytest.fixture
def host_helper():
  """A host process the attacks try to reach; it must survive untouched."""
  helper = subprocess.Popen(["sleep", "60"])
  yield helper
  helper.kill()
  helper.wait()
