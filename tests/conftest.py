"""Every test sees 8 simulated CPU devices, so every sharded path is really sharded.

The flags must be set before jax is first imported, which is why this file sets them at import time.
"""

import atexit
import os
import shutil
import tempfile

from meshrl.configs.cli import simulate_cpu_devices  # imports no jax

# Test programs are tiny and compiled once each, so XLA:CPU's compile time dominates the suite: LLVM
# at -O1 instead of -O2 cuts backend compile by about a third on the RL update and runs these shapes
# no slower (tests/rl/test_loop.py's learning run: 58 s against 75 s). Benchmarks and jobs keep -O2.
# XLA:CPU's new fusion emitters and its parallel codegen (the module split into LLVM pieces compiled
# on a thread pool) cost more than they give on programs this small with two cores busy: off, the
# generation and update tests took 148 s of wall time and 227 CPU-s on two workers against 211 s and
# 364 CPU-s (2026-12-04, `pytest tests/rl/test_generation.py tests/rl/test_update.py`). Set one of them
# in XLA_FLAGS yourself to override the test default.
_TEST_XLA_FLAGS = {"xla_backend_optimization_level": "1", "xla_cpu_use_fusion_emitters": "false",
                   "xla_cpu_parallel_codegen_split_count": "1"}
for _flag, _value in _TEST_XLA_FLAGS.items():
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_flag}={_value}").strip()
simulate_cpu_devices(8)

# Tests run on 4 KiB pages: huge pages (configs/hugepages.py) did not make the suite faster (its time
# is compilation), and a script a test starts in a subprocess must not re-execute itself. xdist's
# workers and those subprocesses inherit this.
os.environ["MESHRL_HUGEPAGES"] = "0"

import jax  # noqa: E402  (must come after the flags)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Most test programs run a few times after a compile that takes seconds: MESHRL_TEST_FAST_COMPILE=1
# makes the in-process compiles skip XLA's backend optimizations (backend level 0, no expensive LLVM
# passes), which cut the CPU time of tests/rl/test_update.py by 28% (160 -> 115 CPU-s); tests marked
# `optimized` (learning curves) then compile at level 1 while they run (`_xla_optimizations`). It is
# off by default: two of the four clean-clone CI runs with it on lost a worker to an XLA:CPU crash (an
# abort in a device-to-host copy; a segfault while writing a level-0 executable to the compilation
# cache), and pytest-xdist then hung; none did at level 1. Scripts run in subprocesses keep level 1.
FAST_COMPILE = os.environ.get("MESHRL_TEST_FAST_COMPILE", "0") == "1"
jax.config.update("jax_disable_most_optimizations", FAST_COMPILE)

# Many tests compile the same small programs (the tiny config's rollout, update, reference forward):
# MESHRL_TEST_COMPILE_CACHE=1 gives each worker process a persistent compilation cache, empty at the
# start of the run, which compiles each once (one per worker because jax writes cache files in place:
# a reader in another process could see half a file). Off by default since 2026-12-03: two clean-clone
# CI runs in a row lost a worker to an XLA:CPU crash (a segfault, then an abort) inside jax's cache
# write (`compilation_cache.put_executable_and_time`), at level 0 and at level 1, and pytest-xdist hung
# after each. The cause is not known; tests/conftest.py's `compile_cache` fixture still checks the
# cache itself.
if os.environ.get("MESHRL_TEST_COMPILE_CACHE", "0") == "1":
  _CACHE_DIR = tempfile.mkdtemp(prefix="meshrl-test-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: longer than a minute; left out of the default run")
  config.addinivalue_line("markers", "optimized: runs enough steps that XLA's backend optimizations pay for "
                          "their compile time (learning curves); compiled at level 1, not the tests' level 0")
  config.addinivalue_line("markers", "needs_sandbox: runs model code in the bubblewrap sandbox; skipped, "
                          "with the install hint, where bubblewrap cannot run (a fresh machine)")


def sandbox_unavailable() -> str | None:
  """Why the bubblewrap sandbox cannot run here (the install hint included), or None when it can.

  Probed once per process as the environments use it: as an unprivileged uid when the tests run as
  root (TerminalEnv drops to one). .ci/run installs bubblewrap, so CI runs these tests."""
  from meshrl.rl.sandbox import SandboxUnavailable, check_bwrap  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox.bwrap import Runtime  # pylint: disable=import-outside-toplevel
  try:
    check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    return f"bubblewrap sandbox unavailable: {error}"
  return None


def pytest_runtest_setup(item):
  if item.get_closest_marker("needs_sandbox") is not None:
    reason = sandbox_unavailable()
    if reason:
      pytest.skip(reason)


@pytest.fixture(autouse=True)
def _xla_optimizations(request):
  """A test marked `optimized` compiles with XLA's backend optimizations (see FAST_COMPILE)."""
  optimized = FAST_COMPILE and request.node.get_closest_marker("optimized") is not None
  if optimized:
    jax.config.update("jax_disable_most_optimizations", False)
  yield
  if optimized:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session")
def devices():
  found = jax.devices()
  assert len(found) == 8, f"expected 8 simulated devices, got {len(found)}"
  return found


@pytest.fixture
def compile_cache(tmp_path):
  """A persistent compilation cache for one test, so runs that restart (a resumed job) reuse the
  programs the first run compiled, as jobs with jax_compilation_cache_dir do; the previous settings
  come back after."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  old = {name: getattr(jax.config, name) for name in
         ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  compilation_cache.reset_cache()
  yield
  for name, value in old.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def hf_fixtures():
  """tests/hf_fixtures.py (tiny Hugging Face folders built locally), loaded by path."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  if "hf_fixtures" not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        "hf_fixtures", os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_fixtures.py"))
    sys.modules["hf_fixtures"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["hf_fixtures"])
  return sys.modules["hf_fixtures"]


@pytest.fixture(scope="session")
def tiny_qwen3_moe(hf_fixtures, tmp_path_factory):  # pylint: disable=redefined-outer-name
  """A tiny random Qwen3-MoE folder saved by transformers, with tokenizer and chat template."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  return hf_fixtures.save_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))
