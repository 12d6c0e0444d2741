"""Every test sees 8 simulated CPU devices, so every sharded path is really sharded.

The flags must be set before jax is first imported, which is why this file sets them at import time.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

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
