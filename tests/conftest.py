"""Every test sees 8 simulated CPU devices, so every sharded path is really sharded.

The flags must be set before jax is first imported, which is why this file sets them at import time.
"""

from meshrl.configs.cli import simulate_cpu_devices  # imports no jax

simulate_cpu_devices(8)

import jax  # noqa: E402  (must come after the flags)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: longer than a minute; left out of the default run")


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
