"""scripts/tbench.py: on the shipped tasks (tasks/tbench) the oracle passes every task and the null
policy none, in the JSON report's `pass_rate` and `tasks`; a task outside the supported subset stops
the script before anything runs or is written; --checkpoint plays episodes with a real model."""

import importlib.util
import json
import os
import shutil

import pytest

from meshrl.rl.envs.terminal import load_tasks
from meshrl.rl.sandbox import SandboxUnavailable, check_bwrap
from meshrl.rl.sandbox.bwrap import Runtime
from meshrl.rl.sandbox.runtimes import host_missing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(REPO, "tasks", "tbench")


def _script():
  spec = importlib.util.spec_from_file_location("tbench_script", os.path.join(REPO, "scripts", "tbench.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _needs_host_runtime():
  try:
    check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  missing = sorted({m for t in load_tasks([SHIPPED])[0] for m in host_missing(t.environment.runtime)})
  if missing:
    pytest.skip(f"the host lacks {missing} for --runtime host (apt-get install -y jq sqlite3 git)")


def test_oracle_passes_every_shipped_task_and_null_none(tmp_path):
  _needs_host_runtime()
  script = _script()
  ids = sorted(os.listdir(SHIPPED))
  for flag, expected in (("--oracle", True), ("--null", False)):
    out = tmp_path / f"{flag[2:]}.json"
    assert script.main(["--tasks", SHIPPED, flag, "--runtime", "host", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pass_rate"] == (1.0 if expected else 0.0)
    assert report["tasks"] == {task_id: expected for task_id in ids}, report["details"]
    assert report["errors"] == 0 and report["policy"] == flag[2:] and report["runtime"] == "host"
    assert set(report["details"]) == set(ids) and set(report["runtimes"].values()) == {"host"}


def test_a_task_outside_the_subset_stops_the_script_before_anything_runs(tmp_path, capsys):
  tasks = tmp_path / "tasks"
  shutil.copytree(os.path.join(SHIPPED, "hello-file"), tasks / "good")
  shutil.copytree(os.path.join(SHIPPED, "hello-file"), tasks / "bad")
  (tasks / "bad" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\nEXPOSE 80\n")
  out = tmp_path / "report.json"
  with pytest.raises(SystemExit) as caught:
    _script().main(["--tasks", str(tasks), "--oracle", "--runtime", "host", "--json", str(out)])
  assert caught.value.code == 2 and not out.exists()
  assert "Dockerfile:3: EXPOSE is outside the supported subset" in capsys.readouterr().err
  for bad in (["--oracle", "--null"], ["--checkpoint", str(tmp_path)], ["--config", "configs/tiny.py"],
              ["--oracle", "--max-turns", "0"]):
    with pytest.raises(SystemExit):
      _script().main(["--tasks", str(tasks / "good"), "--json", str(out)] + bad)
  assert not out.exists()


TINY = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.mlp_dim=64", "model.max_seq_len=256", "rl.temperature=1.0",
        "rl.max_turn_tokens=8", "serve.slots=2", "serve.decode_chunk=8"]


def test_checkpoint_policy_plays_episodes(tmp_path):
  """A freshly initialised tiny model (saved as a run saves it) plays the tasks through Engine.generate:
  it solves none, but it played every turn."""
  _needs_host_runtime()
  import optax  # pylint: disable=import-outside-toplevel

  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import create_train_state  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", TINY)
  _, state = create_train_state(build_model(ModelConfig.from_config(cfg)), optax.sgd(0.1))
  with Checkpointer(str(tmp_path / "run" / "checkpoints"), every=1, async_save=False) as ckpt:
    ckpt.save(0, state, config=cfg)
  tasks = tmp_path / "tasks"
  for name in ("hello-file", "env-config"):
    shutil.copytree(os.path.join(SHIPPED, name), tasks / name)
  out = tmp_path / "policy.json"
  assert _script().main(["--tasks", str(tasks), "--checkpoint", str(tmp_path / "run"), "--config",
                         "configs/tiny.py", "--max-turns", "2", "--runtime", "host", "--json", str(out)]
                        + [f"--config.{o}" for o in TINY]) == 0
  report = json.loads(out.read_text())
  assert report["pass_rate"] == 0.0 and report["tasks"] == {"env-config": False, "hello-file": False}
  assert report["policy"] == "checkpoint" and report["policy_stats"]["calls"] >= 2
  assert all(1 <= d["turns"] <= 2 and d["status"] == "fail" for d in report["details"].values())


@pytest.mark.slow
def test_oracle_and_null_with_built_runtimes(tmp_path):
  """--runtime build: each task's Dockerfile becomes a runtime built by mmdebstrap (five distinct
  declarations; minutes the first time, then cached); the oracle still passes all, null none."""
  if shutil.which("mmdebstrap") is None:
    pytest.skip("mmdebstrap is not installed: apt-get update && apt-get install -y mmdebstrap")
  try:
    check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  script = _script()
  for flag, rate in (("--oracle", 1.0), ("--null", 0.0)):
    out = tmp_path / f"{flag[2:]}.json"
    assert script.main(["--tasks", SHIPPED, flag, "--runtime", "build", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pass_rate"] == rate and report["errors"] == 0, report["details"]
    assert len(set(report["runtimes"].values())) == 5
