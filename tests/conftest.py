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
