"""scripts/make_terminal_tasks.py and scripts/env_qa.py: the generator writes 60+ tasks in the
directory format; the gate's command line writes the report and the quarantine list; bad flags are
errors that write nothing."""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_make_terminal_tasks_writes_every_family(tmp_path):
  make = _script("make_terminal_tasks")
  assert make.main(["--out", str(tmp_path / "tasks"), "--faults", str(tmp_path / "faults")]) == 0
  tasks = sorted(os.listdir(tmp_path / "tasks"))
  assert len(tasks) == 72 and len({t.split("-")[0] for t in tasks}) == 6
  for name in tasks:
    assert {"task.json", "check.sh", "oracle.sh"} <= set(os.listdir(tmp_path / "tasks" / name))
  assert len(os.listdir(tmp_path / "faults")) >= 12
  with pytest.raises(SystemExit):  # a non-empty folder is refused, nothing overwritten
    make.main(["--out", str(tmp_path / "tasks")])


@pytest.mark.needs_sandbox
def test_env_qa_writes_report_and_quarantine_list(tmp_path, capsys):
  from meshrl.rl.envs import terminal_tasks
  terminal_tasks.write_tasks(str(tmp_path / "tasks"), per_family=1, families=("create",))
  meta, spec = terminal_tasks.make_task("find", 0)
  terminal_tasks.write_task(str(tmp_path / "tasks" / "weak"), {**meta, "id": "weak"},
                            {**spec, "check": "exit 0\n"})
  os.makedirs(tmp_path / "tasks" / "empty_dir")
  qa = _script("env_qa")
  out = tmp_path / "out" / "qa.json"
  assert qa.main(["--tasks", str(tmp_path / "tasks"), "--json", str(out), "--k", "2", "--repeats", "2"]) == 0
  report = json.loads(out.read_text())
  assert report["tasks"] == 3 and report["quarantined"] == ["empty_dir", "weak"]
  assert "task.json is missing" in report["reasons"]["empty_dir"]
  lines = [json.loads(l) for l in open(tmp_path / "out" / "quarantine.jsonl")]
  assert [l["id"] for l in lines] == ["empty_dir", "weak"]
  assert "QUARANTINED weak" in capsys.readouterr().out
  for bad in (["--tasks", str(tmp_path / "nope"), "--json", str(out)],
              ["--tasks", str(tmp_path / "tasks"), "--json", str(out), "--repeats", "1"],
              ["--tasks", str(tmp_path / "tasks"), "--json", str(out), "--policy", "nomodule"]):
    with pytest.raises(SystemExit):
      qa.main(bad)


def test_env_qa_gates_tbench_tasks_and_jsonl_datasets(tmp_path):
  """Terminal-Bench task directories (host runtime) and --jsonl datasets in one report and one
  quarantine list."""
  import shutil  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox import SandboxUnavailable, check_bwrap  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox.bwrap import Runtime  # pylint: disable=import-outside-toplevel
  try:
    check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  shipped = os.path.join(REPO, "tasks", "tbench", "hello-file")
  shutil.copytree(shipped, tmp_path / "tasks" / "hello-file")
  shutil.copytree(shipped, tmp_path / "tasks" / "lazy")
  (tmp_path / "tasks" / "lazy" / "solution.sh").write_text("true\n")
  data = tmp_path / "rows.jsonl"
  data.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n{"id": "b", "prompt": "1+1=", "answer": "2"}\n')
  out = tmp_path / "qa.json"
  assert _script("env_qa").main(["--tasks", str(tmp_path / "tasks"), "--jsonl", str(data), "--json",
                                 str(out), "--k", "1", "--repeats", "2", "--runtime", "host"]) == 0
  report = json.loads(out.read_text())
  assert report["tasks"] == 2 and report["quarantined"] == ["lazy"]
  assert report["datasets"][str(data)]["reasons"] == {"b": "duplicate prompt of a"}
  assert [json.loads(l)["id"] for l in open(tmp_path / "quarantine.jsonl")] == ["lazy", "b"]
  with pytest.raises(SystemExit):
    _script("env_qa").main(["--json", str(out)])  # neither --tasks nor --jsonl


TINY = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.mlp_dim=64", "model.max_seq_len=256", "rl.temperature=1.0",
        "rl.max_turn_tokens=8", "serve.slots=2", "serve.decode_chunk=8"]


@pytest.mark.needs_sandbox
def test_env_qa_flags_tasks_a_random_checkpoint_never_solves(tmp_path):
  """--checkpoint of a freshly initialised tiny model (saved like a run saves it): every sound task is
  flagged never_solved, the planted fault is still quarantined (and gets no policy episodes)."""
  import optax  # pylint: disable=import-outside-toplevel

  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs import terminal_tasks  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import create_train_state  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", TINY)
  _, state = create_train_state(build_model(ModelConfig.from_config(cfg)), optax.sgd(0.1))
  with Checkpointer(str(tmp_path / "run" / "checkpoints"), every=1, async_save=False) as ckpt:
    ckpt.save(0, state, config=cfg)
  terminal_tasks.write_tasks(str(tmp_path / "tasks"), per_family=1, families=("create", "find"))
  meta, spec = terminal_tasks.make_task("find", 1)
  terminal_tasks.write_task(str(tmp_path / "tasks" / "weak"), {**meta, "id": "weak"},
                            {**spec, "check": "exit 0\n"})
  qa = _script("env_qa")
  out = tmp_path / "qa.json"
  flags = ["--config", "configs/tiny.py"] + [f"--config.{o}" for o in TINY]
  assert qa.main(["--tasks", str(tmp_path / "tasks"), "--json", str(out), "--k", "1", "--repeats", "2",
                  "--samples", "2", "--checkpoint", str(tmp_path / "run")] + flags) == 0
  report = json.loads(out.read_text())
  sound = sorted(t for t in os.listdir(tmp_path / "tasks") if t != "weak")
  assert len(sound) == 2 and report["quarantined"] == ["weak"]
  assert report["curriculum"] == {t: "never_solved" for t in sound}
  # The policy really played: 2 tasks x 2 episodes, each of several turns of sampled tokens.
  assert report["policy"]["calls"] >= 4 and report["policy"]["generated_tokens"] > 4
  for bad in (["--checkpoint", str(tmp_path / "run")],  # no --config
              ["--config", "configs/tiny.py"],  # no --checkpoint
              ["--checkpoint", str(tmp_path / "run"), "--policy", "m:f"] + flags,
              ["--checkpoint", str(tmp_path / "run"), "--config", "configs/tiny.py"]):  # another model
    with pytest.raises(SystemExit):
      qa.main(["--tasks", str(tmp_path / "tasks"), "--json", str(tmp_path / "bad.json")] + bad)
  assert not (tmp_path / "bad.json").exists()


def test_render_conversation_and_cut_turn():
  from meshrl.model.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  qa = _script("env_qa")
  conversation = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "<cmd>ls</cmd>"},
                  {"role": "tool", "content": "a.txt"}]
  assert qa.render_conversation(load_tokenizer("byte"), conversation) == "task<cmd>ls</cmd><out>a.txt</out>"
  assert qa.cut_turn("x<cmd>ls</cmd> junk <done>") == "x<cmd>ls</cmd>"
  assert qa.cut_turn("no end") == "no end"
  with pytest.raises(ValueError, match="user message"):
    qa.render_conversation(load_tokenizer("byte"), conversation[1:])
