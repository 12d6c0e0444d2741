"""rl/step/driver.run refuses what would lose or corrupt work before it writes a byte (issue 31): a folder
holding another run, bad data or held-out files found after the config check, a disk without room
for a checkpoint; a disk that fills during training is one line naming the last checkpoint; and a
warm-start-only run (rl.num_steps=0) exits 0 without plotting an empty curve."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from meshrl import configs
from meshrl.configs import cli
from meshrl.rl.step import driver as loop
from meshrl.rl.step.evaluation import held_out_examples
from meshrl.train import workdir as workdir_lib
from meshrl.train.preemption import Preemption

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
         "data.seq_len=16", "rl.prompts_per_step=4", "rl.group_size=4", "log.progress_bar=false",
         "log.tensorboard=false", "eval.every=0"]


def _files(folder) -> dict:
  """{relative path: bytes} of every file under `folder`."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


def _earlier_run(workdir) -> dict:
  """A folder holding another run's outputs (and a file of the user's), as files."""
  os.makedirs(workdir / "checkpoints" / "7" / "state")
  (workdir / "checkpoints" / "7" / "state" / "x").write_text("array bytes")
  (workdir / "config.json").write_text(json.dumps({"name": "earlier"}))
  (workdir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
  (workdir / "notes.txt").write_text("mine")
  return _files(workdir)


def test_restore_false_in_a_folder_holding_a_run_is_refused_and_changes_nothing(tmp_path):
  """checkpoint.restore=false there overwrote metrics.jsonl and config.json, trained, then crashed
  on the existing checkpoint step, leaving one run's checkpoints beside another's metrics."""
  before = _earlier_run(tmp_path)
  cfg = configs.load("configs/tiny.py", SMALL + ["checkpoint.restore=false"])
  with pytest.raises(workdir_lib.WorkdirError) as raised:
    loop.run(cfg, str(tmp_path))
  message = str(raised.value)
  assert "holds another run (config.json, metrics.jsonl, checkpoints; checkpoint.restore=false)" in message
  assert "pass --overwrite to replace it, or choose another --workdir" in message and "\n" not in message
  assert _files(tmp_path) == before


def test_another_config_without_a_checkpoint_is_refused_but_the_same_run_restarts(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  cfg = configs.load("configs/tiny.py", SMALL)
  configs.save_config(configs.load("configs/tiny.py", SMALL + ["rl.num_steps=7"]), str(tmp_path))
  with pytest.raises(workdir_lib.WorkdirError, match="no checkpoint there to resume from and another config.json"):
    workdir_lib.check_workdir(str(tmp_path), cfg, resuming=False, overwrite=False)
  configs.save_config(cfg, str(tmp_path))  # the same run, stopped before its first checkpoint
  assert workdir_lib.check_workdir(str(tmp_path), cfg, resuming=False, overwrite=False) == []


def test_overwrite_replaces_the_earlier_runs_outputs_and_nothing_else(tmp_path, monkeypatch):
  _earlier_run(tmp_path)
  seen = {}
  monkeypatch.setattr(loop, "_train", lambda cfg, workdir, ready, checkpointer, preemption: seen.setdefault(
      "files", sorted(_files(workdir))) and [])
  cfg = configs.load("configs/tiny.py", SMALL + ["checkpoint.restore=false"])
  assert loop.run(cfg, str(tmp_path), overwrite=True) == []
  assert seen["files"] == ["config.json", "notes.txt"]  # the run started on a folder without the old run
  assert json.loads((tmp_path / "config.json").read_text())["model"]["embed_dim"] == 64
  assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("field, rows, fragment", [
    ("eval.jsonl", "", "eval.jsonl='{path}' holds no valid rows (0 malformed)"),
    ("eval.jsonl", "not json\n[1]\n", "eval.jsonl='{path}' holds no valid rows (2 malformed; the first "
                                       "malformed: {path}:1:"),
    ("data.jsonl", '{"answer": "1"}\n', "data.jsonl='{path}' holds no valid rows (1 malformed"),
])
def test_a_bad_file_found_after_the_config_check_leaves_the_earlier_run_alone(tmp_path, field, rows, fragment):
  """Even with --overwrite: the data is read before the earlier run is removed or config.json saved
  (an empty eval.jsonl ended in IndexError after config.json had been overwritten)."""
  before = _earlier_run(tmp_path / "run")
  path = tmp_path / "rows.jsonl"
  path.write_text(rows)
  cfg = configs.load("configs/tiny.py", SMALL + [f"{field}={path}", "eval.every=5"])
  with pytest.raises(ValueError) as raised:
    loop.run(cfg, str(tmp_path / "run"), overwrite=True)
  assert fragment.format(path=path) in str(raised.value)
  assert _files(tmp_path / "run") == before


def test_malformed_held_out_rows_are_reported_or_refused(tmp_path):
  """eval.jsonl rows that do not parse were dropped silently (the score covered fewer prompts)."""
  path = tmp_path / "eval.jsonl"
  good = [{"prompt": f"rev {w}=", "answer": w[::-1]} for w in ("abc", "dog", "owl")]
  path.write_text("\n".join([json.dumps(good[0]), "{broken", json.dumps(good[1]), '{"prompt": ""}',
                             json.dumps(good[2])]) + "\n")
  cfg = configs.load("configs/tiny.py", [f"eval.jsonl={path}"])
  lines = []
  examples = held_out_examples(cfg, report=lines.append)
  assert [e["prompt"] for e in examples] == [g["prompt"] for g in good]
  assert len(lines) == 1 and f"skipped 2 malformed rows of 5 ({path}:2:" in lines[0] and f"{path}:4:" in lines[0]
  strict = configs.load("configs/tiny.py", [f"eval.jsonl={path}", "data.skip_bad_rows=false"])
  with pytest.raises(ValueError, match=f"{path}:2: malformed task row"):
    held_out_examples(strict)


def test_no_room_for_a_checkpoint_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
  usage = workdir_lib.shutil.disk_usage(tmp_path)
  monkeypatch.setattr(workdir_lib.shutil, "disk_usage", lambda path: usage._replace(free=4096))
  cfg = configs.load("configs/tiny.py", SMALL)
  with pytest.raises(OSError) as raised:
    loop.run(cfg, str(tmp_path / "run"))
  needed = loop.checkpoint_bytes(loop.build_spec(cfg).model, cfg.optim)
  assert raised.value.errno == errno.ENOSPC and "\n" not in raised.value.strerror
  assert f"has 0 MiB free on its disk; a checkpoint of this run needs about {needed / 2**20:,.0f} MiB" in (
      raised.value.strerror)
  assert not (tmp_path / "run").exists()


def test_a_disk_that_fills_during_training_is_one_line_naming_the_last_checkpoint(tmp_path, monkeypatch, capsys):
  """A full disk printed 1,038 lines (orbax's thread dumps) with the cause lost among them."""
  def fill(cfg, workdir, ready, checkpointer, preemption):
    os.makedirs(os.path.join(workdir, "checkpoints", "3"))
    try:
      raise OSError(errno.ENOSPC, "No space left on device", "ocdbt.process_0/d/abc")
    except OSError as error:
      raise ValueError("Error writing local file: [OS error 28]") from error  # as tensorstore wraps it
  monkeypatch.setattr(loop, "_train", fill)
  cfg = configs.load("configs/tiny.py", SMALL)
  status = cli.run(lambda argv: loop.run(cfg, str(tmp_path)), [])
  err = capsys.readouterr().err.strip()
  assert status == 1 and "\n" not in err, err
  assert err.startswith(f"error: the disk of {tmp_path} is full (")
  assert "the last complete checkpoint is step 3; run the same command to resume from it" in err


def test_script_errors_are_one_line_and_a_traceback_on_request(monkeypatch, capsys):
  def bad(argv):
    raise ValueError("rl.num_steps=-1 must be at least 0.\nsecond line")
  assert cli.run(bad, []) == 2
  assert capsys.readouterr().err == "error: rl.num_steps=-1 must be at least 0.\n"
  monkeypatch.setenv("MESHRL_TRACEBACK", "1")
  with pytest.raises(ValueError):
    cli.run(bad, [])
  monkeypatch.delenv("MESHRL_TRACEBACK")
  with pytest.raises(ZeroDivisionError):  # a bug is not an input error: its traceback is kept
    cli.run(lambda argv: 1 // 0, [])


def test_ctrl_c_requests_a_save_and_a_second_one_stops_at_once(capfd):
  before = signal.getsignal(signal.SIGINT)
  with Preemption() as preemption:
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.requested() and preemption.signal_name == "SIGINT"
    assert "Ctrl-C: finishing the step in flight, then saving it" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_a_warm_start_only_run_exits_0_without_a_reward_plot(tmp_path):
  """rl.num_steps=0 did its warm start, then exited 1 plotting an empty reward curve."""
  out = subprocess.run([sys.executable, "scripts/rl.py", "--config=configs/tiny.py", f"--workdir={tmp_path}"]
                       + [f"--config.{o}" for o in SMALL + ["rl.sft_steps=2", "rl.num_steps=0"]],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "rl.num_steps=0: the warm start alone" in out.stdout
  assert not (tmp_path / "reward_curve.png").exists() and not (tmp_path / "metrics.jsonl").exists()
  assert [json.loads(line)["step"] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_evaluation_takes_its_held_out_rows_from_the_training_read_of_data_jsonl(tmp_path, monkeypatch):
  """data.jsonl was read twice at start-up (training's pools, then evaluation's own mixture): seconds
  on a file of millions of rows. The held-out rows are the ones a fresh read gives."""
  from meshrl.rl.step import sources  # pylint: disable=import-outside-toplevel
  path = tmp_path / "data.jsonl"
  words = [a + b + c for a in "abcdefgh" for b in "ijklmnop" for c in "qrst"]
  path.write_text("".join(json.dumps({"prompt": f"rev {w}=", "answer": w[::-1]}) + "\n" for w in words))
  cfg = configs.load("configs/tiny.py", SMALL + [f"data.jsonl={path}", "data.tasks=", "data.eval_fraction=0.2",
                                                 "eval.every=5", "eval.num_prompts=16"])
  fresh = held_out_examples(cfg)
  reads = []
  real = sources.JsonlSource
  monkeypatch.setattr(sources, "JsonlSource", lambda *a, **k: reads.append(a) or real(*a, **k))
  ready = loop.prepare(cfg, str(tmp_path / "run"))
  assert len(reads) == 1
  assert ready.held_out == fresh and len(fresh) == 16
