"""Installs the one package `meshrl`; each top-level folder is one of its subpackages.

`meshrl` itself is a namespace package: it has no folder of its own, only its subpackages.

`configs/` becomes `meshrl.configs`, `model/` becomes `meshrl.model`, and so on, so nothing named
`model` or `train` lands in site-packages (see ../shared/DESIGN.md, "Layout").
"""
import os

import setuptools

_SUBPACKAGE_DIRS = ("configs", "sharding", "model", "train", "rl", "serve")


def _find_subpackages():
  """Maps every folder with an __init__.py under the subpackage dirs to its meshrl.* name."""
  package_dir = {}
  packages = []
  for top in _SUBPACKAGE_DIRS:
    for root, _, files in os.walk(top):
      if "__init__.py" in files and "__pycache__" not in root:
        name = "meshrl." + root.replace(os.sep, ".")
        packages.append(name)
        package_dir[name] = root
  return packages, package_dir


_PACKAGES, _PACKAGE_DIR = _find_subpackages()

setuptools.setup(
    name="meshrl",
    version="0.1.0",
    description="JAX/TPU-native RL post-training for large Mixture-of-Experts language models.",
    python_requires=">=3.11",
    packages=_PACKAGES,
    package_dir=_PACKAGE_DIR,
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.6",
        "orbax-checkpoint>=0.11.0",
        "tensorstore>=0.1.70",
        "grain>=0.2.12",
        "ml-collections>=1.1.0",
        "numpy>=2.0",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "jinja2>=3.1.6",  # chat templates (model/chat_template.py); older versions have sandbox escapes
        "pyyaml>=6.0",  # Terminal-Bench task.yaml files (rl/envs/tbench.py)
    ],
    extras_require={
        # pytest-xdist: the suite runs on 2 worker processes (most tests are single-threaded XLA
        # compiles, so 2 processes use the 2 cores a CI machine has).
        # nbclient + ipykernel: .ci/run executes notebooks/quickstart.ipynb top to bottom.
        # starlette + uvicorn: the server's ASGI stack (serve/app.py); httpx + openai: tests/serve drives
        # the server with the official client and a concurrent load test (serve/loadtest.py).
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "nbclient>=0.10", "ipykernel>=6.29",
                 "starlette>=0.40", "uvicorn>=0.30", "httpx>=0.27", "openai>=1.40"],
        "serve": ["starlette>=0.40", "uvicorn>=0.30", "httpx>=0.27"],
        "tpu": ["jax[tpu]>=0.10.2"],
        "hf": ["transformers>=4.57", "safetensors>=0.4", "tokenizers>=0.21", "torch==2.13.0"],
    },
)
