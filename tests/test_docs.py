"""The README is a front page and the docs stay true: every command shown in README.md and docs/
parses (its flags and its config, as the script would read them), the README's two commands are
.ci/run's, docs/configuration.md is what scripts/config_reference.py writes from configs/base.py, and
the notebook's install cell finds the checkout from notebooks/ and fails loudly (issue 31)."""

import glob
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import types

import pytest

from meshrl.configs import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
GUIDES = ["rl-on-your-data.md", "real-checkpoints.md", "agents-and-sandboxes.md", "serving.md",
          "pods-and-aot.md", "configuration.md", "benchmarks.md"]


def _read(path):
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return f.read()


def _commands(text):
  """Every `scripts/...` command of a page: the lines of its ```bash blocks (continuations joined)
  and the inline code spans that start with `python scripts/` or `scripts/` and carry arguments."""
  found = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    found += [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`]+)`", prose):
    span = re.sub(r"\s+", " ", span).strip()
    if re.match(r"(python )?scripts/\S+ -", span) and "..." not in span and "<" not in span:
      found.append(span)
  return found


def _script_calls(command):
  """[(script path, argv)] of the meshrl scripts a shell command runs ($i taken as 0)."""
  calls = []
  for part in re.split(r"&&|;|(?<!&)&(?!&)|\bdo\b", command.replace("$i", "0")):
    words = shlex.split(part, comments=True)
    if words[:1] == ["python"]:
      words = words[1:]
    if words and words[0].startswith("scripts/") and words[0].endswith((".py", ".sh")):
      calls.append((words[0], words[1:]))
  return calls


CASES = sorted({(page, call[0], tuple(call[1])) for page in PAGES for command in _commands(_read(page))
                for call in _script_calls(command)})


class _Parsed(Exception):
  pass


def _parse_in_process(script, argv, monkeypatch):
  """Runs `script`'s main until its command line and config are parsed (cli.parse, or
  cli.ArgumentParser.parse_args for scripts without a config), then stops it."""
  path = os.path.join(REPO, script)
  with open(path, encoding="utf-8") as f:
    source = f.read()
  if "cli.parse(" in source:
    original = cli.parse
    def parse(*args, **kwargs):
      raise _Parsed(original(*args, **kwargs))
    monkeypatch.setattr(cli, "parse", parse)
  else:
    original_parse_args = cli.ArgumentParser.parse_args
    def parse_args(self, args=None, namespace=None):
      raise _Parsed(original_parse_args(self, args, namespace))
    monkeypatch.setattr(cli.ArgumentParser, "parse_args", parse_args)
  monkeypatch.setattr(cli, "simulate_cpu_devices", lambda count: None)  # jax is imported already
  monkeypatch.setattr(sys, "argv", [path, *argv])
  spec = importlib.util.spec_from_file_location(f"doc_{os.path.basename(script)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with pytest.raises(_Parsed):
    module.main(list(argv)) if inspect.signature(module.main).parameters else module.main()


_DRIVER = """
import runpy, sys
from meshrl.configs import cli
parse_args = cli.ArgumentParser.parse_args
def parsed(self, args=None, namespace=None):
  parse_args(self, args, namespace)
  sys.exit(0)
cli.ArgumentParser.parse_args = parsed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("page, script, argv", CASES, ids=[f"{p}:{s} {' '.join(a)}"[:120] for p, s, a in CASES])
def test_every_documented_command_parses(page, script, argv, monkeypatch, request):
  argv = list(argv)
  assert os.path.isfile(os.path.join(REPO, script)), f"{page} names {script}, which does not exist"
  if script.endswith(".sh"):  # scripts/launch_tpu_pod.sh --tpu= --zone= [--setup] -- COMMAND
    flags = argv[:argv.index("--")] if "--" in argv else argv
    assert all(re.match(r"--(tpu|zone|project)=\S+$|--setup$", f) for f in flags), (page, flags)
    return
  if any(a.startswith("--config=configs/hf_qwen3_moe.py:/models/") for a in argv):
    folder = request.getfixturevalue("tiny_qwen3_moe").path  # the preset reads the model's config.json
    argv = [re.sub(r"^(--config=configs/hf_qwen3_moe.py:).*", rf"\g<1>{folder}", a) for a in argv]
  if script == "scripts/bench_attention.py":  # simulates its devices at import: a fresh process
    out = subprocess.run([sys.executable, "-c", _DRIVER, os.path.join(REPO, script), *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (page, out.stderr[-2000:])
    return
  monkeypatch.chdir(REPO)
  _parse_in_process(script, argv, monkeypatch)


def test_a_command_that_does_not_parse_fails_the_check(monkeypatch, capsys):
  """The check itself: a misspelt config key and an unknown flag stop the parse (exit 2)."""
  monkeypatch.chdir(REPO)
  for argv in (["--config=configs/tiny.py", "--config.rl.num_step=3"], ["--config=configs/tiny.py", "--no_such"]):
    with pytest.raises(SystemExit) as raised:
      _parse_in_process("scripts/rl.py", argv, monkeypatch)
    assert raised.value.code == 2
  err = capsys.readouterr().err
  assert "did you mean 'rl.num_steps'" in err and "unrecognized arguments: --no_such" in err


def test_every_page_has_commands_and_the_readme_is_a_front_page():
  readme = _read("README.md")
  assert len(readme.splitlines()) <= 200
  for guide in GUIDES:
    assert os.path.isfile(os.path.join(REPO, "docs", guide)), guide
    assert f"(docs/{guide})" in readme, f"the README does not point to docs/{guide}"
  for page in PAGES:
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", _read(page)):
      assert os.path.isfile(os.path.normpath(os.path.join(REPO, os.path.dirname(page), target))), (page, target)
  assert len(CASES) >= 40, len(CASES)


def test_the_readme_commands_are_the_ci_ones():
  """The first command installs and runs the demo; the second is .ci/run's install and test command."""
  readme, ci = _read("README.md"), _read(".ci/run")
  blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
  assert blocks[0].strip().endswith("pip install -e . && python scripts/rl.py --config=configs/tiny.py")
  second = blocks[1].strip()
  extras = re.search(r'pip install -e "(\.\[[^\]]*\])"', second).group(1)
  assert f'-e "{extras}"' in ci
  env = re.search(r"&& ((?:\w+=\S+ )+)python -m pytest -q$", second).group(1).split()
  assert f"export {' '.join(env)}" in ci and "\npython -m pytest -q\n" in ci


def test_configuration_reference_is_generated_from_base():
  spec = importlib.util.spec_from_file_location("config_reference", os.path.join(REPO, "scripts", "config_reference.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  text = module.render()
  assert _read("docs/configuration.md") == text, "docs/configuration.md is stale: python scripts/config_reference.py"
  rows = [line for line in text.splitlines() if line.startswith("| `")]
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.configs import checks  # pylint: disable=import-outside-toplevel
  base = configs.load("configs/base.py")
  for row in rows:
    name, default, meaning = (cell.strip() for cell in row.strip("|").split(" | ", 2))
    assert meaning, f"{name} has no comment in configs/base.py"
    assert default == f"`{checks.value_of(base, name.strip('`'))!r}`", row
  assert len(rows) == len(list(_leaves(base)))


def _leaves(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items"):
      yield from _leaves(value, prefix + key + ".")
    else:
      yield prefix + key


def test_notebook_install_cell_installs_the_checkout_from_notebooks_and_fails_loudly(tmp_path, monkeypatch):
  """Opened from notebooks/, the cell ran `pip install -e .` there (no setup.py), pip failed, and the
  notebook went on without meshrl installed."""
  cell = "".join(json.loads(_read("notebooks/quickstart.ipynb"))["cells"][1]["source"])
  calls = []
  fake = types.SimpleNamespace(run=lambda cmd, check: calls.append((cmd, check, os.getcwd())))
  monkeypatch.setitem(sys.modules, "subprocess", fake)
  monkeypatch.chdir(os.path.join(REPO, "notebooks"))
  exec(compile(cell, "quickstart cell 1", "exec"), {})  # pylint: disable=exec-used
  assert calls == [([sys.executable, "-m", "pip", "install", "-q", "-e", "."], True, REPO)]
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RuntimeError, match="no meshrl checkout"):
    exec(compile(cell, "quickstart cell 1", "exec"), {})  # pylint: disable=exec-used
