"""Ctrl-C in a fresh process saves like SIGTERM and the run resumes exactly (issue 31: Ctrl-C gave
a traceback and no save). Each script runs three times in its own process: straight through (the
reference), interrupted by SIGINT once it has written a few steps, and the same command again."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from meshrl.rl.step.driver import metrics_equal
from meshrl.train.checkpoint import committed_steps, load_params
from meshrl.train.metrics import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
         "data.seq_len=16", "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_batch_size=8",
         "log.progress_bar=false", "log.tensorboard=false", "log.plot=false", "eval.every=0",
         "checkpoint.every=1000", "checkpoint.async_save=false"]


def _command(script, workdir, overrides):
  return [sys.executable, f"scripts/{script}", "--config=configs/tiny.py", f"--workdir={workdir}"] + [
      f"--config.{o}" for o in SMALL + overrides]


def _env(cache):
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _interrupt_after(cmd, env, metrics, records: int) -> subprocess.CompletedProcess:
  """Starts `cmd`, sends SIGINT once `metrics` holds `records` lines, and waits for it to exit."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 600
  while not (metrics.exists() and metrics.read_text().count("\n") >= records) and time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=600)
  return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _saved_arrays(folder):
  return {str(k): np.asarray(v) for k, v in _flatten(load_params(str(folder), parts=None))}


def _flatten(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, f"{prefix}{key}/")
    else:
      yield prefix + key, value


def _assert_same_run(reference, resumed, metrics_name, checkpoints):
  assert metrics_equal(read_jsonl(str(reference / metrics_name)), read_jsonl(str(resumed / metrics_name)))
  want, got = _saved_arrays(reference / checkpoints), _saved_arrays(resumed / checkpoints)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.slow  # 40 s; the RL Ctrl-C test covers the signal path, tests/train/test_sft.py the SFT resume
def test_ctrl_c_to_sft_saves_the_step_and_the_rerun_resumes_exactly(tmp_path):
  steps = ["rl.sft_steps=60"]
  env = _env(tmp_path / "xla_cache")
  straight = subprocess.run(_command("sft.py", tmp_path / "reference", steps), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
  assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]
  run = tmp_path / "run"
  stopped = _interrupt_after(_command("sft.py", run, steps), env, run / "metrics.jsonl", records=3)
  assert stopped.returncode == 0, stopped.stdout[-3000:]
  assert "Traceback" not in stopped.stdout
  last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
  assert f"SIGINT: stopped after SFT step {last} of 60, saved in the checkpoint of step {last}" in stopped.stdout
  assert committed_steps(str(run / "checkpoints"))[-1] == last < 60
  again = subprocess.run(_command("sft.py", run, steps), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  _assert_same_run(tmp_path / "reference", run, "metrics.jsonl", "checkpoints")


@pytest.mark.slow  # three RL runs in fresh processes, about 2 min on a quiet 2-core machine
def test_ctrl_c_to_rl_saves_the_step_and_the_rerun_resumes_exactly(tmp_path):
  steps = ["rl.sft_steps=0", "rl.num_steps=40"]
  env = _env(tmp_path / "xla_cache")
  straight = subprocess.run(_command("rl.py", tmp_path / "reference", steps), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
  assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]
  run = tmp_path / "run"
  stopped = _interrupt_after(_command("rl.py", run, steps), env, run / "metrics.jsonl", records=2)
  assert stopped.returncode == 0, stopped.stdout[-3000:]
  last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
  assert f"SIGINT: stopped after RL step {last} of 40, saved in the checkpoint of step {last}" in stopped.stdout
  again = subprocess.run(_command("rl.py", run, steps), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  assert f"resumed from {run / 'checkpoints'} at step {last}" in again.stdout
  _assert_same_run(tmp_path / "reference", run, "metrics.jsonl", "checkpoints")
