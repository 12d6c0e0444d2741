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
    (["--experiments=joint", "--domains=sort_1,nope"], "--domains='sort_1,nope': ['nope'] not among"),
    (["--experiments=demo", "--domains=sort_1"], "--domains='sort_1' applies to the experiments ['joint']"),
])
def test_bad_input_is_one_line_naming_the_flag_before_any_run(tmp_path, argv, fragment):
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_learning.py"),
                        f"--json={tmp_path / 'out.json'}", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
  assert out.returncode == 2 and fragment in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert os.listdir(tmp_path) == []


def test_joint_runs_each_domain_alone_on_its_share_of_the_budget_and_reports_deltas(tmp_path):
  """Experiment (c) with the training job replaced: the joint run gets --budget_s, each of the n domains
  alone gets --budget_s / n, a registry of that domain only, 1/n of the warm start and RL steps and the
  joint run's per-domain share of held-out prompts; the deltas compare the last evaluations."""
  from meshrl.rl.envs.registry import load_domains  # pylint: disable=import-outside-toplevel
  bench = _module()
  args, _ = bench._flags([f"--json={tmp_path / 'out.json'}", "--experiments=joint", "--budget_s=800",
                          "--max_steps=40", "--eval_every=20"])
  joint_acc = {"arithmetic_1": 0.2, "copy_1": 0.9, "copy_2": 0.1, "countdown_1": 0.3, "reverse_1": 0.5,
               "reverse_2": 0.1, "sort_1": 0.8, "sort_2": 0.6}
  alone_acc = {**joint_acc, "copy_1": 1.0, "reverse_2": 0.0, "sort_1": 0.7}  # joint 90% of alone on copy_1
  calls = []

  def runner(config, overrides, workdir, run_args, *, budget_s):
    cfg = configs.load(os.path.join(REPO, config), overrides + run_args.set)
    names = [s.name for s in load_domains(cfg.data.domains)]
    calls.append({"budget_s": budget_s, "domains": names, "cfg": cfg})
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(cfg.to_json())
    steps = range(1, cfg.rl.num_steps + 1)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps({"step": s, "gen_flops_per_s": 1.0, "rollout_s": 1.0}) + "\n" for s in steps)
    accuracy = joint_acc if len(names) > 1 else {names[0]: alone_acc[names[0]]}
    with open(os.path.join(workdir, "eval.jsonl"), "w") as f:
      for step in (0, cfg.rl.num_steps):
        row = {f"eval/accuracy/{d}": (a if step else 0.0) for d, a in accuracy.items()}
        f.write(json.dumps({"step": step, "eval/accuracy": sum(accuracy.values()) / len(accuracy), **row}) + "\n")
    return {"wall_s": 1.0, "cpu_s": budget_s, "stopped_by_budget": False}

  base = tmp_path / "runs"
  base.mkdir()
  result = bench.run_joint("joint", str(base), args, runner=runner)
  joint, alone = calls[0], calls[1:]
  n = len(joint["domains"])
  assert n == 8 and joint["budget_s"] == 800 and joint["cfg"].rl.num_steps == 40
  assert [c["domains"] for c in alone] == [[d] for d in sorted(joint["domains"])]  # each restricted to its own
  for call in alone:
    assert call["budget_s"] == pytest.approx(800 / n)
    assert call["cfg"].rl.sft_steps == -(-joint["cfg"].rl.sft_steps // n) and call["cfg"].rl.num_steps == 5
    assert call["cfg"].eval.num_prompts == joint["cfg"].eval.num_prompts // n
  deltas = result["deltas"]
  assert deltas["copy_1"]["delta"] == pytest.approx(-0.1) and deltas["copy_1"]["ratio"] == pytest.approx(0.9)
  assert deltas["reverse_2"]["delta"] == pytest.approx(0.1) and deltas["reverse_2"]["ratio"] is None
  assert result["mean_joint"] == pytest.approx(sum(joint_acc.values()) / 8)
  assert result["mean_alone"] == pytest.approx(sum(alone_acc.values()) / 8)
  assert result["target_c"]  # >= 90% everywhere (0.9 exactly on copy_1) and the mean ahead (0.2 gained, 0.1 lost)
  assert result["alone"]["sort_1"]["budget_cpu_s"] == pytest.approx(100.0)
  assert "| copy_1 | 90.0 | 100.0 | -10.0 | 0.90 |" in bench.deltas_table(result)
  together = result["alone_curve"]  # the runs alone as one curve: FLOPs summed, accuracy averaged
  assert len(together) == 2 and together[1]["accuracy"] == pytest.approx(sum(alone_acc.values()) / 8)
  assert together[1]["train_flops"] == pytest.approx(sum(a["points"][-1]["train_flops"] for a in result["alone"].values()))
  assert bench.plot({"joint": result}, str(tmp_path / "curve.png")) and os.path.getsize(tmp_path / "curve.png") > 1000
  planted = dict(alone_acc)
  for domain, accuracy, name in (("sort_2", 0.7, "runs2"), ("sort_1", 0.8, "runs3")):
    alone_acc.update(planted, **{domain: accuracy})  # joint's 0.6 under 90% of 0.7; the means level
    calls.clear()
    (tmp_path / name).mkdir()
    assert not bench.run_joint("joint", str(tmp_path / name), args, runner=runner)["target_c"]


def test_target_b_needs_each_family_from_under_5_percent_to_at_least_50():
  """(b) over the hard_<family> experiments: met only when all three ran, each first evaluation under
  5% and each last at or above 50%; the best evaluation does not count, nor do other experiments."""
  bench = _module()
  assert {bench.EXPERIMENTS[f"hard_{f}"][0] for f in bench.FAMILIES} == {
      "configs/tiny_hard.py:reverse", "configs/tiny_hard.py:copy", "configs/tiny_hard.py:sort"}
  run = lambda first, last, best=None: {"first_accuracy": first, "last_accuracy": last,  # noqa: E731
                                        "best_accuracy": best if best is not None else last}
  met = {"demo": run(0.4, 0.2), "hard_reverse": run(0.035, 1.0), "hard_copy": run(0.01, 0.5),
         "hard_sort": run(0.0, 0.9)}
  assert bench.target_b(met)["met"] and bench.target_b(met)["families"]["copy"] == {"first": 0.01, "last": 0.5,
                                                                                     "met": True}
  for name, bad in (("hard_copy", run(0.05, 1.0)), ("hard_sort", run(0.0, 0.49, best=0.9)), ("hard_reverse", None)):
    results = {k: v for k, v in {**met, name: bad}.items() if v is not None}
    assert not bench.target_b(results)["met"], name
  assert bench.target_b({"demo": run(0.0, 1.0)}) is None
