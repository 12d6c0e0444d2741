"""The layout's rules that the code must keep, read from the source (issue 30).

The config is read once: a run config becomes model numbers (a ModelConfig) in one builder per kind of
run, and everything downstream takes the numbers (or the run spec) as an argument:
  train/init_from.model_config    SFT, a reward model, a judge, a warm start, and under both rule sets
                                  the RL run spec's (rl/step/run_spec.model_numbers builds through it)
  model/convert.py                a Hugging Face folder's config (import and export)
  model/transformer.py            where ModelConfig.from_config is defined
"""

import ast
import fnmatch
import functools
import os
import re


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


# --- imports: the layering of docs/architecture.md "Dependencies" ---------------------------------

def _module_name(rel: str) -> str:
  """'rl/step/spec.py' -> 'rl.step.spec'; 'rl/step/__init__.py' -> 'rl.step'."""
  parts = rel[:-3].split("/")
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node) -> bool:
  """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
  if not isinstance(node, ast.If):
    return False
  return getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", None) == "TYPE_CHECKING"


def imported_modules(source: str, modules: set, *, top_level_only: bool) -> set:
  """The meshrl modules (names without 'meshrl.', as in `modules`) a source imports when it runs: every
  import but those under `if TYPE_CHECKING:` (annotations only), or with `top_level_only` those that run
  when the module is imported (not inside a function or class). `from meshrl.a import b` names a.b
  when that is a module, else a."""
  found = set()

  def add(name: str):
    if name.startswith("meshrl."):
      name = name[len("meshrl."):]
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name:
        found.add(name)

  def visit(node, nested: bool):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Import) and not (nested and top_level_only):
        for alias in child.names:
          add(alias.name)
      elif isinstance(child, ast.ImportFrom) and child.module and not (nested and top_level_only):
        for alias in child.names:
          add(f"{child.module}.{alias.name}")
      elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        visit(child, True)
      elif _is_type_checking(child):
        continue  # type annotations only: never runs
      else:
        visit(child, nested)

  visit(ast.parse(source), False)
  return found


@functools.lru_cache(maxsize=None)  # three tests read the same graph: parse the package once
def _import_graph(top_level_only: bool) -> dict:
  """{module: modules it imports} over the package (scripts apart: they are the edge)."""
  files = {_module_name(rel): path for rel, path in _sources() if not rel.startswith("scripts/")}
  modules = set(files)
  return {name: imported_modules(open(path, encoding="utf-8").read(), modules, top_level_only=top_level_only) - {name}
          for name, path in files.items()}


def test_the_import_scan_resolves_modules_and_skips_deferred_imports():
  """A test of the scanner: submodules, packages, deferred and TYPE_CHECKING imports."""
  modules = {"rl", "rl.envs", "rl.envs.levels", "model.transformer", "configs"}
  source = ("from meshrl.rl.envs import levels\nimport meshrl.configs\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n  from meshrl.model.transformer import ModelConfig\n"
            "def f():\n  from meshrl.rl import envs\n")
  assert imported_modules(source, modules, top_level_only=True) == {"rl.envs.levels", "configs"}
  assert imported_modules(source, modules, top_level_only=False) == {"rl.envs.levels", "configs", "rl.envs"}


# Which top-level folders each one may import (any import, deferred ones too). configs/ sits below the
# rest, except where its edge functions reach up, each named here with its reason.
MAY_IMPORT = {
    "configs": {"configs"},
    "sharding": {"configs", "sharding"},
    "model": {"configs", "sharding", "model"},
    "train": {"configs", "sharding", "model", "train"},
    "rl": {"configs", "sharding", "model", "train", "rl"},
    "serve": {"configs", "sharding", "model", "train", "rl", "serve"},
}
UPWARD_EXCEPTIONS = {
    ("configs.cli", "sharding.hosts"): "the command line joins a multi-host job before it reads flags",
    ("configs.checks", "rl.envs.levels"): "rl.sft_difficulty is checked against the task families",
}


def test_each_folder_imports_only_the_layers_below_it():
  """docs/architecture.md: configs <- sharding <- model <- train <- rl <- serve; `train/` never
  imports `rl/` (a module that generates, like draft distillation or the reward model's policy pairs,
  lives in rl/). Fails naming each importing module and what it imports."""
  graph = _import_graph(top_level_only=False)
  assert "train.sft" in graph and "rl.step.spec" in graph, "the scan read no modules: the layout changed"
  wrong = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                 if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]]
                 and (name, target) not in UPWARD_EXCEPTIONS)
  assert not wrong, f"imports against the layering: {wrong}"


def test_generation_imports_only_model_and_sharding():
  """rl/generation/ imports only model/ and sharding/ (and itself), so serve/ decodes through it."""
  graph = _import_graph(top_level_only=False)
  wrong = sorted(f"{name} -> {target}" for name, targets in graph.items() if name.startswith("rl.generation")
                 for target in targets
                 if not target.startswith(("model", "sharding", "rl.generation")) and target != "rl")
  assert not wrong, f"rl/generation imports outside model/ and sharding/: {wrong}"


def test_presets_import_nothing_but_configs():
  """A preset (configs/*.py with get_config) imports only meshrl.configs modules."""
  graph = _import_graph(top_level_only=False)
  presets = [name for rel, path in _sources() if rel.startswith("configs/")
             and re.search(r"^def get_config", open(path, encoding="utf-8").read(), re.M)
             for name in [_module_name(rel)]]
  assert "configs.tiny_agent" in presets and "configs.hf_qwen3_moe" in presets
  wrong = sorted(f"{name} -> {target}" for name in presets for target in graph[name]
                 if not target.startswith("configs"))
  assert not wrong, f"presets importing beyond configs/: {wrong}"


def _cycle(graph: dict) -> list:
  """One import circle of `graph` as [a, b, ..., a], or [] when there is none."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = "done"
    stack.pop()
    return []

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return []


def test_the_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
  """No circle among the imports that run when a module is imported (deferred ones are the way out)."""
  found = _cycle(_import_graph(top_level_only=True))
  assert not found, f"an import circle: {' -> '.join(found)}"


# --- mesh axis names: spelled only in sharding/ ----------------------------------------------------

# Words that name a mesh axis and nothing else in this code: anywhere outside sharding/ they are a
# hard-coded axis, but for a read of the mesh config's own key (cfg.mesh.get("stage", 1)).
AXIS_ONLY_WORDS = {"stage", "fsdp", "expert", "tensor"}
# Words that are also ordinary keys ("data" of a checkpoint, "sequence" of a TIS level): an axis only
# where the code places something on the mesh.
MESH_CALLS = {"PartitionSpec", "P", "Mesh", "NamedSharding", "psum", "pmean", "pmax", "pmin", "all_gather",
              "all_to_all", "ppermute", "psum_scatter", "axis_index", "axis_size"}
AXIS_KEYWORDS = {"axis_name", "axis_names", "spmd_axis_name", "in_axes_names", "manual_axes"}


def _docstrings(tree) -> set:
  return {id(node.body[0].value) for node in ast.walk(tree)
          if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
          and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _call_name(call) -> str:
  func = call.func
  return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _reads_mesh_config(call) -> bool:
  """`cfg.mesh.get(KEY, ...)` / `mesh_cfg.get(KEY, ...)`: the config's key, not the axis."""
  func = call.func
  if not (isinstance(func, ast.Attribute) and func.attr == "get"):
    return False
  owner = func.value
  return "mesh" in (owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", ""))


def axis_literals(source: str, axes: tuple) -> list[int]:
  """Lines where `source` spells a mesh axis name (one of `axes`) in code, docstrings apart: a word of
  AXIS_ONLY_WORDS anywhere but as the key of a mesh-config read; any axis name inside a sharding or
  collective call (MESH_CALLS), an axis keyword (AXIS_KEYWORDS) or a `.shape[...]` subscript."""
  tree = ast.parse(source)
  skip, lines = _docstrings(tree), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and _reads_mesh_config(node) and node.args:
      skip.add(id(node.args[0]))

  def literals(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in axes]

  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and node.value in AXIS_ONLY_WORDS and node.value in axes \
        and id(node) not in skip:
      lines.add(node.lineno)
    elif isinstance(node, ast.Call) and _call_name(node) in MESH_CALLS:
      lines.update(n.lineno for arg in node.args for n in literals(arg))
    if isinstance(node, ast.Call):
      lines.update(n.lineno for kw in node.keywords if kw.arg in AXIS_KEYWORDS for n in literals(kw.value))
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
      lines.update(n.lineno for n in literals(node.slice))
  return sorted(lines)


def test_the_axis_scan_finds_spelled_axes():
  """A test of the scanner: each spelling it must catch, and the ordinary uses of the shared words."""
  axes = ("data", "stage", "fsdp", "expert", "sequence", "tensor")
  source = ('"""Sharded over \'expert\'."""\n'               # 1: a docstring
            'n = mesh.shape["expert"]\n'                     # 2
            'spec = P(("data", "fsdp"), None)\n'             # 3
            'x = jax.lax.psum(x, "sequence")\n'              # 4
            'y = shard_map(f, axis_names={"data"})\n'        # 5
            'stages = cfg.mesh.get("stage", 1)\n'            # 6: the config's key
            'items = ("state", "data", "config")\n'          # 7: an ordinary key
            'level = "sequence"\n'                           # 8: an ordinary word
            'if axis == "tensor": pass\n')                   # 9
  assert axis_literals(source, axes) == [2, 3, 4, 5, 9]


def test_mesh_axis_names_are_spelled_only_in_sharding():
  """Issue 30: the mesh's axis names live in sharding/ (sharding/mesh.py's *_AXIS constants); every
  other module imports them, so renaming or adding an axis is one change. Fails naming file and line."""
  from meshrl.sharding.mesh import MESH_AXES
  assert set(AXIS_ONLY_WORDS) <= set(MESH_AXES), "the axis words changed: update AXIS_ONLY_WORDS"
  found = {rel: axis_literals(open(path, encoding="utf-8").read(), MESH_AXES) for rel, path in _sources()
           if not rel.startswith("sharding/")}
  assert "model/moe.py" in found, "the scan read no modules: the layout changed"
  spelled = [f"{rel}:{line}" for rel, lines in found.items() for line in lines]
  assert not spelled, f"mesh axis names spelled outside sharding/ (import the *_AXIS constants): {spelled}"


# Paths the text names on purpose although they do not exist: the missing preset of the bad-input tests.
MISSING_ON_PURPOSE = {"configs/nope.py"}
TOPS = PACKAGE_DIRS + ("scripts", "tests", "docs", "notebooks", "tasks")
# "rl/batches/rows.DeviceRows", "docs/pods-and-aot.md", "scripts/bench_accelerator.sh"; a path followed by
# "*" or "{" is a pattern ("tests/rl/test_sandbox_attacks_{processes,files}.py") and is not checked.
PATH_REFERENCE = re.compile(r"(?<![\w/.$-])((?:%s)/[\w/-]*\w(?:\.\w+)*)([*{]?)" % "|".join(TOPS))


def stale_path_references(text: str, exists) -> list[str]:
  """The repo paths `text` names (a file, a folder, or a module with a dotted attribute after it) for
  which `exists(candidate)` holds for no reading: the whole reference, or its module part with ".py"
  or ".sh" added."""
  stale = []
  for match in PATH_REFERENCE.finditer(text):
    reference, pattern = match.groups()
    if pattern or reference in MISSING_ON_PURPOSE:
      continue
    parts = reference.split(".")
    bases = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    if not any(exists(base + suffix) for base in bases for suffix in ("", ".py", ".sh")):
      stale.append(reference)
  return stale


def test_the_path_scan_finds_a_moved_module():
  exists = {"rl/batches/rows.py", "docs/pods-and-aot.md", "scripts/bench_accelerator.sh"}.__contains__
  moved = "rl/" + "rows.DeviceRows"  # spelled in two parts so that this file does not name it
  text = (f"rows (rl/batches/rows.DeviceRows, {moved}) `docs/pods-and-aot.md` "
          "scripts/bench_accelerator.sh tests/rl/test_attacks_{a,b}.py configs/nope.py /tmp/rl/x.py")
  assert stale_path_references(text, exists) == [moved]


def test_every_path_the_code_and_docs_name_exists():
  """Docstrings, comments and pages name modules by path ("rl/step/episodes.EpisodeRunner"): after a
  module moves, every such name must follow it (the layout split of issue 30 left 40 behind)."""
  exists = lambda relative: os.path.exists(os.path.join(REPO, relative))
  texts = [os.path.join(REPO, "README.md")]
  for top in TOPS:
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
      dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
      texts += [os.path.join(root, name) for name in files if name.endswith((".py", ".md", ".sh", ".ipynb"))]
  stale = []
  for path in texts:
    with open(path, encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        stale += [f"{os.path.relpath(path, REPO)}:{number}: {ref}" for ref in stale_path_references(line, exists)]
  assert not stale, "paths that do not exist:\n" + "\n".join(stale)


def module_map_gaps(page: str, listing) -> list[str]:
  """What docs/architecture.md's module map (`page`: its rows "| `folder/` | ... |") gets wrong:
  a file a row names (`name.py`, `name.sh`, or a pattern such as `bench_*.py`) that its folder lacks,
  and a module of the folder (`listing(folder)`, without __init__.py) that no name of its row covers."""
  gaps = []
  for folder, body in re.findall(r"^\| `([\w/]+/)` \| (.*) \|$", page, re.M):
    named = set(re.findall(r"`([\w*]+\.(?:py|sh))`", body))
    present = listing(folder)
    gaps += [f"{folder}{name} is named but absent" for name in sorted(named)
             if not any(fnmatch.fnmatch(module, name) for module in present)]
    gaps += [f"{folder}{module} is not on the map" for module in sorted(present)
             if not any(fnmatch.fnmatch(module, name) for name in named)]
  return gaps


def _folder_modules(folder: str) -> set[str]:
  if folder in ("tests/", "notebooks/"):  # described as a whole, not file by file
    return set()
  return {name for name in os.listdir(os.path.join(REPO, folder))
          if name.endswith((".py", ".sh")) and name != "__init__.py"}


def test_the_map_check_finds_a_missing_and_an_unmapped_module():
  page = "| `zz/` | `a.py` (one), `b_*.py` and `gone.py` |\n"
  listing = lambda folder: {"a.py", "b_one.py", "new.py"}
  assert module_map_gaps(page, listing) == ["zz/gone.py is named but absent", "zz/new.py is not on the map"]


def test_the_module_map_names_every_module_and_only_modules_that_exist():
  with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
    gaps = module_map_gaps(f.read(), _folder_modules)
  assert not gaps, "docs/architecture.md's module map: " + "; ".join(gaps)
