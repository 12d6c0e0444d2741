"""scripts/bench_learning.py (issue 33): the compute-to-capability curve read from a run's files, and its
bad input (the experiments themselves are the job, tested in tests/rl)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from meshrl import configs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
  spec = importlib.util.spec_from_file_location("bench_learning", os.path.join(REPO, "scripts", "bench_learning.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_counts_the_warm_start_then_each_steps_generation_update_and_rft_flops(tmp_path):
  bench = _module()
  cfg = configs.load("configs/tiny_hard.py")
  (tmp_path / "config.json").write_text(cfg.to_json())
  steps = [{"step": s, "gen_flops_per_s": 10.0, "rollout_s": 2.0, "update_flops_per_s": 5.0, "update_s": 1.0,
            "solved_frac": 0.5, **({"rft_loss": 1.0} if s % 5 == 0 else {})} for s in range(1, 11)]
  _write(tmp_path / "metrics.jsonl", steps)
  _write(tmp_path / "eval.jsonl", [{"step": s, "eval/accuracy": a, "eval/accuracy/sort": a}
                                   for s, a in ((0, 0.0), (5, 0.25), (10, 0.5))])
  points, summary = bench.curve(str(tmp_path))
  warm, per_token, _ = bench.warm_start_flops(str(tmp_path))
  assert warm == per_token * 150 * cfg.rl.sft_batch_size * cfg.data.seq_len > 0
  rft = per_token * cfg.rl.rft_steps * cfg.rl.sft_batch_size * cfg.data.seq_len
  assert [p["step"] for p in points] == [0, 5, 10] and [p["accuracy"] for p in points] == [0.0, 0.25, 0.5]
  assert points[0]["train_flops"] == warm
  assert points[1]["train_flops"] == pytest.approx(warm + 5 * 25.0 + rft)
  assert points[2]["train_flops"] == pytest.approx(warm + 10 * 25.0 + 2 * rft)
  assert points[2]["sort"] == 0.5 and summary["rl_steps"] == 10 and summary["solved_frac_last10"] == 0.5


@pytest.mark.parametrize("argv, fragment", [
    (["--experiments=nope"], "--experiments='nope'"),
    (["--budget_s=0"], "--budget_s=0.0 must be positive"),
    (["--set", "rl.nope=1"], "unknown config key 'rl.nope'"),
    (["--set", "rl.rft_every"], "--set 'rl.rft_every': write KEY=VALUE"),
])
def test_bad_input_is_one_line_naming_the_flag_before_any_run(tmp_path, argv, fragment):
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_learning.py"),
                        f"--json={tmp_path / 'out.json'}", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
  assert out.returncode == 2 and fragment in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert os.listdir(tmp_path) == []
