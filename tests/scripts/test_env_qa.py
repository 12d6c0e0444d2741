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
