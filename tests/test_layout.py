"""The layout's rules that the code must keep, read from the source (issue 30).

The config is read once: a run config becomes model numbers (a ModelConfig) in one builder per kind of
run, and everything downstream takes the numbers (or the run spec) as an argument:
  train/init_from.model_config    SFT, a reward model, a judge, a warm start, and under both rule sets
                                  the RL run spec's (rl/step/run_spec.model_numbers builds through it)
  model/convert.py                a Hugging Face folder's config (import and export)
  model/transformer.py            where ModelConfig.from_config is defined
"""

import ast
import os


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = ("configs", "sharding", "model", "train", "rl", "serve")  # setup.py's subpackages
BUILDERS = {"model/transformer.py", "model/convert.py", "train/init_from.py"}
# Scripts are the edge and build through the builders too.


def from_config_calls(source: str) -> list[int]:
  """Lines of `ModelConfig.from_config(...)` calls (also `transformer.ModelConfig.from_config`)."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_config":
      owner = node.func.value
      name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
      if name == "ModelConfig":
        lines.append(node.lineno)
  return lines


def _sources():
  for top in PACKAGE_DIRS + ("scripts",):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in sorted(files):
        if name.endswith(".py") and "__pycache__" not in root:
          path = os.path.join(root, name)
          yield os.path.relpath(path, REPO).replace(os.sep, "/"), path


def test_the_scan_finds_a_call():
  """The scanner sees the spellings a module would use (a test of the test: an empty scan passes)."""
  source = ("from meshrl.model import transformer\nfrom meshrl.model.transformer import ModelConfig\n"
            "a = ModelConfig.from_config(cfg)\nb = transformer.ModelConfig.from_config(cfg, mesh)\n"
            "c = LossSpec.from_config(cfg)\n")
  assert from_config_calls(source) == [3, 4]


def test_model_numbers_are_built_only_by_the_builders():
  """No module or script rebuilds model numbers from a config outside the builders (module docstring):
  a library function that needs them takes a ModelConfig or the run spec. Fails naming each file and
  line that calls ModelConfig.from_config elsewhere."""
  found = {rel: from_config_calls(open(path, encoding="utf-8").read()) for rel, path in _sources()}
  assert found["train/init_from.py"], "the scan read no builder: the layout changed"
  outside = [f"{rel}:{line}" for rel, lines in found.items() if rel not in BUILDERS for line in lines]
  assert not outside, ("ModelConfig.from_config outside the builders (take the numbers as an argument, or build "
                       f"them with train/init_from.model_config / rl/step/run_spec.model_numbers): {outside}")
