"""Joint multi-domain training (issue 33, part 2): the configs/tiny_multi.py preset, per-domain held-out
prompts that do not depend on the other domains of the registry, and eval/accuracy/<domain> reaching
eval.jsonl, TensorBoard and the per-domain plot."""

import collections
import json
import os

import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.envs.registry import held_out_from_file, load_domains
from meshrl.rl.step import driver as loop
from meshrl.rl.step.evaluation import Evaluator, held_out_examples
from meshrl.sharding import make_mesh
from meshrl.train.metrics import MetricsWriter, plot_domains, read_jsonl, read_tensorboard
from meshrl.train.state import split_model

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "moe.expert_mlp_dim=32",
         "model.mlp_dim=64", "rl.max_prompt_len=16", "rl.max_new_tokens=4", "model.max_seq_len=24",
         "eval.batch_size=16", "eval.num_prompts=16", "model.init_std=0.5"]


def _rows(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def test_tiny_multi_preset_loads_and_passes_check_config():
  cfg = configs.load("configs/tiny_multi.py")
  assert loop.check_config(cfg) is not None
  specs = load_domains(cfg.data.domains)
  assert len(specs) >= 8
  levels = collections.defaultdict(set)
  for spec in specs:
    levels[spec.target].add(spec.difficulty)
  assert any(len(v) >= 2 for v in levels.values()) and "countdown" in levels  # two levels, countdown
  assert sum(s.quota for s in specs) <= 1.0 and all(s.quota > 0 for s in specs)  # every batch holds each
  held = collections.Counter(e["domain"] for e in held_out_examples(cfg))
  assert set(held) == {s.name for s in specs}  # every domain is evaluated
  source = loop.train_source(cfg)  # the quotas compose every batch: each domain in each 16 prompts
  for batch in range(3):
    drawn = {source[batch * 16 + i]["domain"] for i in range(16)}
    assert drawn == {s.name for s in specs}
  with pytest.raises(ValueError, match="takes no option"):
    configs.load("configs/tiny_multi.py:wide")


def test_a_domain_alone_is_evaluated_on_the_prompts_the_joint_run_evaluates_it_on(tmp_path):
  """held-out prompts are keyed by the domain's name: a stream keyed by its position among the file's
  domains would give a one-domain file other prompts, and the joint-vs-alone deltas would compare
  different test sets."""
  path = configs.load("configs/tiny_multi.py").data.domains
  rows = _rows(path)
  joint = held_out_from_file(path, count=8 * len(rows), seed=3, eval_fraction=0.2)
  for row in (rows[0], rows[3]):  # neither first in sorted order: a position-keyed stream differs there
    alone = tmp_path / f"{row['name']}.jsonl"
    alone.write_text(json.dumps(row) + "\n")
    mine = [e["prompt"] for e in held_out_from_file(str(alone), count=8, seed=3, eval_fraction=0.2)]
    assert mine == [e["prompt"] for e in joint if e["domain"] == row["name"]] and len(mine) >= 4


def test_per_domain_held_out_accuracy_reaches_eval_jsonl_tensorboard_and_the_plot(devices, tmp_path):
  """The evaluator on the preset's held-out prompts (a small model), through the driver's eval hook
  and the metrics writer: every domain's eval/accuracy/<domain> is in eval.jsonl, in TensorBoard and
  drawn in the per-domain plot."""
  cfg = configs.load("configs/tiny_multi.py", SMALL)
  domains = sorted(s.name for s in load_domains(cfg.data.domains))
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0)
  _, params, extra = split_model(model)
  evaluator = Evaluator(cfg, mesh, TOK, held_out_examples(cfg))

  class Run:  # what the hook reads of an RLRun
    state = type("State", (), {"params": params, "extra": extra})

  eval_path = str(tmp_path / "eval.jsonl")
  hook = loop.eval_hook(evaluator, every=1, last_step=2, eval_path=eval_path)
  with MetricsWriter(str(tmp_path), progress_bar=False) as writer:
    for step in (1, 2):
      metrics = {"reward_mean": 0.0}
      hook(step, Run, metrics)
      writer.write(step, metrics)
  evaluator.close()
  wanted = {f"eval/accuracy/{d}" for d in domains}
  rows = read_jsonl(eval_path)
  assert [r["step"] for r in rows] == [1, 2] and all(wanted <= set(r) for r in rows)
  for row in rows:  # the mean is the mean over the domains' prompts (equal counts here)
    counts = collections.Counter(e["domain"] for e in evaluator.examples)
    total = sum(row[f"eval/accuracy/{d}"] * counts[d] for d in domains) / sum(counts.values())
    assert row["eval/accuracy"] == pytest.approx(total, abs=1e-6)
  scalars = read_tensorboard(str(tmp_path / "tb"))
  assert all(set(scalars[key]) == {1, 2} for key in wanted), sorted(scalars)
  drawn = plot_domains(eval_path, "eval/accuracy", str(tmp_path / "eval_curve.png"))
  assert drawn == ["eval/accuracy"] + sorted(wanted) and os.path.getsize(tmp_path / "eval_curve.png") > 1000
  with pytest.raises(ValueError, match="no numeric 'eval/pass@9'"):
    plot_domains(eval_path, "eval/pass@9", str(tmp_path / "x.png"))
