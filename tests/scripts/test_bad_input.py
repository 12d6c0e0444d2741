"""Bad input a user can type, script by script (issue 31): each is refused with exit status 2 and one
line on stderr naming the flag, field, file or line, and not a byte of the folder it points at
changes. The config values themselves are swept in tests/rl/test_config_checks.py; the damaged
checkpoints, full disks and signals in tests/train/test_checkpoint.py, tests/rl/test_run_inputs.py,
tests/serve/test_server.py and tests/scripts/test_ctrl_c.py."""

import importlib.util
import json
import os

import pytest

from support import folder_digests
from meshrl.configs import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = "--config=configs/tiny.py"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """Files of every kind of bad data, in one folder; {name with "_" for ".": path}."""
  folder = tmp_path_factory.mktemp("inputs")
  good = "\n".join(json.dumps({"prompt": f"rev {w}=", "answer": w[::-1]}) for w in ("abc", "dog", "owl")) + "\n"
  contents = {
      "empty.jsonl": b"", "garbage.jsonl": b"{not json\n[1, 2]\n", "binary.jsonl": b"\xff\xfe\x00\x80 bytes\n",
      "no_answer.jsonl": b'{"prompt": "2+2="}\n', "good.jsonl": good.encode(),
      "half.jsonl": (good + "{oops\n").encode(), "not.array_record": b"this is not an ArrayRecord file",
      "domains.jsonl": b'{"name": "a", "source": "generator:nope", "reward": "answer", "weight": 1}\n',
      "domains_json.jsonl": b"{nope\n", "quarantine.jsonl": b"not json\n", "tokenizer.json": b'{"not": "a tokenizer"}',
  }
  paths = {}
  for name, data in contents.items():
    (folder / name).write_bytes(data)
    paths[name.replace(".", "_")] = str(folder / name)  # {empty_jsonl} in the cases
  (folder / "a_dir").mkdir()
  (folder / "full").mkdir()
  (folder / "full" / "keep.txt").write_text("keep")
  paths["a_dir"], paths["full"], paths["folder"] = str(folder / "a_dir"), str(folder / "full"), str(folder)
  return paths


def _cases():
  """(script, argv with {name} placeholders, fragment of the one-line error)."""
  rl = lambda *a: ("rl", [TINY, "--workdir={full}/run", *a])  # noqa: E731
  return [
      # data and held-out files, read before anything is written
      rl("--config.data.jsonl={empty_jsonl}") + ("data.jsonl='{empty_jsonl}' holds no valid rows (0 malformed)",),
      rl("--config.data.jsonl={garbage_jsonl}") + ("holds no valid rows (2 malformed; the first malformed: {garbage_jsonl}:1:",),
      rl("--config.data.jsonl={binary_jsonl}") + ("data.jsonl='{binary_jsonl}' holds no valid rows (1 malformed",),
      rl("--config.data.jsonl={no_answer_jsonl}") + ("'answer' is missing or not a string or number",),
      rl("--config.data.jsonl={a_dir}") + ("data.jsonl='{a_dir}': no such file",),
      rl("--config.data.jsonl={half_jsonl}", "--config.data.skip_bad_rows=false") + ("{half_jsonl}:4: malformed task row",),
      rl("--config.data.array_record={not_array_record}") + ("data.array_record='{not_array_record}' is not a readable ArrayRecord file",),
      rl("--config.data.domains={domains_jsonl}") + ("{domains_jsonl}:1: domain 'a': field 'source': generator 'nope' is unknown",),
      rl("--config.data.domains={domains_json_jsonl}") + ("{domains_json_jsonl}:1: not valid JSON",),
      rl("--config.data.quarantine={quarantine_jsonl}") + ("{quarantine_jsonl}:1: a quarantine line must be a JSON object",),
      rl("--config.eval.every=5", "--config.eval.jsonl={empty_jsonl}") + ("eval.jsonl='{empty_jsonl}' holds no valid rows",),
      rl("--config.eval.every=5", "--config.eval.jsonl={good_jsonl}", "--config.data.jsonl={good_jsonl}") + (
          "eval.jsonl='{good_jsonl}' shares 3 prompt(s) with the training data",),
      rl("--config.model.tokenizer={tokenizer_json}") + ("model.tokenizer='{tokenizer_json}' cannot be read as a tokenizer.json",),
      rl("--config.model.tokenizer={folder}/no_such.json") + ("is neither 'byte' nor an existing tokenizer.json path",),
      rl("--config.model.init_from={a_dir}") + ("model.init_from='{a_dir}' is neither a Hugging Face folder",),
      rl("--config.model.init_from={folder}/missing") + ("model.init_from='{folder}/missing' does not exist",),
      rl("--config.data.tasks=nosuchtask:1.0") + ("'nosuchtask' is unknown; choose from",),
      rl("--config.rl.rewards=nosuch:1.0") + ("'nosuch' is unknown; choose from",),
      rl("--config.rl.rewards=answer:-1") + ("rl.rewards='answer:-1': weight -1.0 of 'answer' must be positive",),
      rl("--config.rl.reward_sources=*=reward_model", "--config.rl.reward_model_checkpoint={folder}/no_rm") + (
          "rl.reward_model_checkpoint='{folder}/no_rm' does not exist.",),
      # the command line itself
      rl("--cpu_devices=-2") + ("--cpu_devices=-2 must be >= 0",),
      rl("--num_processes=2") + ("--num_processes=2 / --process_id=-1 describe a multi-process job but no coordinator",),
      rl("--coordinator=127.0.0.1:1", "--num_processes=2") + ("needs the number of processes",),
      rl("--no_such_flag") + ("unrecognized arguments: --no_such_flag (--help lists the flags)",),
      rl("--config.rl.num_steps=abc") + ("rl.num_steps expects int, got 'abc'",),
      rl("--config.rl=3") + ("rl is a section; override one of its fields",),
      ("rl", ["--config=configs/nope.py"], "config file 'configs/nope.py' not found"),
      ("rl", ["--config=configs/hf_qwen3_moe.py:{folder}/missing"], "the argument must be a Hugging Face Qwen3-MoE folder"),
      ("rl", [TINY, "--workdir={good_jsonl}"], "--workdir='{good_jsonl}' is a file, not a folder"),
      # the other scripts' flags
      ("sft", [TINY, "--workdir={full}/sft", "--steps=-5"], "--steps=-5 must be at least 1"),
      ("sft", [TINY, "--workdir={full}/sft", "--config.rl.sft_steps=0"], "rl.sft_steps=0 and no --steps"),
      ("sft", [TINY, "--workdir={full}/sft", "--config.rl.sft_learning_rate=-1.0"], "rl.sft_learning_rate=-1.0 must be positive"),
      ("eval", [TINY, "--checkpoint={folder}/missing"], "--checkpoint='{folder}/missing' does not exist"),
      ("eval", [TINY, "--json={a_dir}"], "--json='{a_dir}' is a folder"),
      ("eval", [TINY, "--config.eval.jsonl={garbage_jsonl}"], "eval.jsonl='{garbage_jsonl}' holds no valid rows"),
      ("export_hf", [TINY, "--checkpoint={a_dir}", "--out={folder}/export"], "holds no meshrl checkpoint"),
      ("export_hf", [TINY, "--checkpoint={a_dir}", "--out={full}"], "--out='{full}' exists and is not empty"),
      ("export_hf", [TINY, "--checkpoint={a_dir}", "--out={folder}/export", "--dtype=int8"], "--dtype='int8' cannot hold the weights"),
      ("serve", [TINY, "--port=70000"], "--port=70000 must lie in 1..65535"),
      ("serve", [TINY, "--checkpoint={a_dir}"], "model.init_from='{a_dir}' is neither"),
      ("aot_compile", [TINY, "--step=update"], "--topology is needed to compile"),
      ("aot_compile", [TINY, "--topology=v5e:2x2", "--num_slices=0"], "--num_slices=0 must be at least 1"),
      ("show_config", [TINY, "--config.mesh.train_rules=embed=moon"], "mesh.train_rules='embed=moon'"),
      ("distill_draft", [TINY, "--draft_config=configs/tiny.py", "--out={full}"], "--out='{full}' exists and is not an empty folder"),
      ("distill_draft", [TINY, "--draft_config=configs/tiny.py", "--out={folder}/draft", "--steps=0"], "--steps=0 must be at least 1"),
      ("distill_draft", [TINY, "--draft_config=configs/tiny.py", "--out={folder}/draft", "--loss=mse"], "--loss='mse' is not one of"),
      ("resume_check", ["--json", "{folder}/r.json", "--workdir", "{full}"], "holds files this script did not make"),
      ("env_qa", ["--tasks", "{folder}/missing", "--json", "{folder}/qa.json"], "--tasks '{folder}/missing': no such directory"),
      ("env_qa", ["--tasks", "{a_dir}", "--json", "{folder}/qa.json", "--k", "0"], "--k, --workers and --samples must be >= 1"),
      ("aot_compile", [TINY, "--topology=v5e:2x2", "--json={a_dir}"], "--json='{a_dir}' is a folder"),
      ("resume_check", ["--json", "{a_dir}", "--workdir", "{folder}/scratch"], "--json='{a_dir}' is a folder"),
      ("env_qa", ["--tasks", "{a_dir}", "--json", "{a_dir}"], "--json='{a_dir}' is a folder"),
      ("make_terminal_tasks", ["--out", "{full}"], "is not empty; give a new or empty folder"),
      ("make_terminal_tasks", ["--out", "{folder}/tasks", "--per-family", "0"], "--per-family=0 must be >= 1"),
  ]


CASES = _cases()


def _script(name):
  spec = importlib.util.spec_from_file_location(f"bad_input_{name}", os.path.join(REPO, "scripts", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("script, argv, fragment", CASES, ids=[f"{s} {' '.join(a)}"[:100] for s, a, _ in CASES])
def test_bad_input_is_one_line_and_writes_nothing(inputs, script, argv, fragment, capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  argv = [a.format(**inputs) for a in argv]
  before = folder_digests(inputs["folder"])
  main = _script(script).main
  try:
    status = cli.run(main, argv) if main.__code__.co_argcount else cli.run(lambda a: main(a), argv)
  except SystemExit as exit_:  # argparse and the config loader exit 2 themselves
    status = exit_.code
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert status == 2, (status, err)
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert fragment.format(**inputs) in err[0], err[0]
  assert folder_digests(inputs["folder"]) == before
