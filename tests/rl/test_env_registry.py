"""rl/envs/registry.py: domains declared in a JSONL file (bad fields named), the 300-domain mixture
with quotas, per-domain scores and per-domain held-out evaluation, the quarantine honoured, and
data.domains wired into the RL loop's training source."""

import json

import numpy as np
import pytest

from meshrl import configs
from meshrl.rl.step import driver as loop
from meshrl.rl.envs import terminal_tasks
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.registry import DomainMixture, held_out_from_file, load_domains, write_many_domains
from meshrl.rl.rewards import answer_reward
from meshrl.rl.rewards.pool import RewardPool

GOOD = {"name": "add", "source": "generator:arithmetic", "reward": "numeric", "weight": 1.0}


def _write(path, *rows):
  path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
  return str(path)


@pytest.mark.parametrize("row, message", [
    ({k: v for k, v in GOOD.items() if k != "reward"}, "domain 'add': field 'reward' is missing"),
    ({**GOOD, "wieght": 2}, r"domain 'add': unknown field\(s\) \['wieght'\]"),
    ({**GOOD, "weight": "2"}, "domain 'add': field 'weight'='2' has the wrong type"),
    ({**GOOD, "weight": 0}, "domain 'add': field 'weight'=0 must be positive"),
    ({**GOOD, "source": "generator:algebra"},
     "domain 'add': field 'source': generator 'algebra' is unknown"),
    ({**GOOD, "source": "jsonl:missing.jsonl"},
     "domain 'add': field 'source': .*missing.jsonl does not exist"),
    ({**GOOD, "source": "http://x"}, "domain 'add': field 'source'='http://x'"),
    ({**GOOD, "reward": "vibes"}, "domain 'add': field 'reward'='vibes' is unknown"),
    ({**GOOD, "reward": "terminal"}, "domain 'add': field 'reward'='terminal': task directories"),
    ({**GOOD, "difficulty": 9}, "domain 'add': field 'difficulty'=9 must lie in 1..4"),
    ({**GOOD, "quota": 1.5}, "domain 'add': field 'quota'=1.5"),
    ({**GOOD, "priority": True}, "domain 'add': field 'priority'=True has the wrong type"),
])
def test_bad_domain_rows_name_the_file_line_domain_and_field(tmp_path, row, message):
  path = _write(tmp_path / "domains.jsonl", GOOD | {"name": "other"}, row)
  with pytest.raises(ValueError, match="domains.jsonl:2: " + message):
    load_domains(path)


def test_bad_files_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="no such file"):
    load_domains(str(tmp_path / "none.jsonl"))
  with pytest.raises(ValueError, match=":1: not valid JSON"):
    load_domains(_write(tmp_path / "a.jsonl", "{oops"))
  with pytest.raises(ValueError, match=r"\['add'\] declared twice"):
    load_domains(_write(tmp_path / "b.jsonl", GOOD, GOOD))
  with pytest.raises(ValueError, match="quotas add up to 1.200"):
    load_domains(_write(tmp_path / "c.jsonl", {**GOOD, "quota": 0.6},
                        {**GOOD, "name": "b", "quota": 0.6}))


def test_300_domain_mixture_quotas_metrics_and_held_out(tmp_path):
  rows = write_many_domains(str(tmp_path / "domains.jsonl"), 300)
  specs = load_domains(str(tmp_path / "domains.jsonl"))
  assert len(specs) == 300 and len({s.priority for s in specs}) == 3
  train = DomainMixture(specs, seed=1, split="train", eval_fraction=0.2, batch_size=100)
  batches = [train.take(100, start=100 * b) for b in range(6)]
  quota_domains = [r["name"] for r in rows if r.get("quota")]
  for batch in batches:  # quota 0.02 of 100 = at least 2 slots of each quota domain per batch
    assert all(sum(e["domain"] == name for e in batch) >= 2 for name in quota_domains)
  examples = [e for batch in batches for e in batch]
  counts = {}
  for e in examples:
    counts[e["domain"]] = counts.get(e["domain"], 0) + 1
  weights = {r["name"]: r["weight"] for r in rows}
  heavy = sorted(weights, key=weights.get)[-30:]
  light = sorted(weights, key=weights.get)[:30]
  assert sum(counts.get(n, 0) for n in heavy) > 5 * sum(counts.get(n, 0) for n in light)
  assert train[123] == DomainMixture(specs, seed=1, split="train", eval_fraction=0.2, batch_size=100)[123]
  # Per-domain scores: right answers for half the samples, wrong for the rest.
  pool = RewardPool(answer_reward, num_workers=2)
  completions = [e["answer"] if i % 2 else "wrong" for i, e in enumerate(examples)]
  _, info = pool.score(completions, examples)
  pool.close()
  assert set(info["by_domain"]) == set(counts) and len(counts) > 200
  for domain in counts:  # each domain's mean is the share of its samples that got the right answer
    right = [i % 2 for i, e in enumerate(examples) if e["domain"] == domain]
    assert info["by_domain"][domain] == pytest.approx(np.mean(right))
  held = DomainMixture(specs, seed=2, split="eval", eval_fraction=0.2).held_out(per_domain=2)
  held_domains = {e["domain"] for e in held}
  assert len(held_domains) == 300
  assert not {e["prompt"] for e in held} & {e["prompt"] for e in examples}
  from_file = held_out_from_file(str(tmp_path / "domains.jsonl"), count=600, seed=2, eval_fraction=0.2)
  assert from_file == held


def test_pools_and_terminal_tasks_honour_the_quarantine(tmp_path):
  terminal_tasks.write_tasks(str(tmp_path / "tasks"), per_family=2, families=("create", "find"))
  _write(tmp_path / "rows.jsonl", {"id": "r1", "prompt": "1+1=", "answer": "2"},
         {"id": "r2", "prompt": "2+2=", "answer": "4"}, '{"bad": 1}')
  path = _write(tmp_path / "domains.jsonl",
                {"name": "term", "source": "tasks:tasks", "reward": "terminal", "weight": 1,
                 "max_turns": 4},
                {"name": "rows", "source": "jsonl:rows.jsonl", "reward": "numeric", "weight": 1})
  specs = load_domains(path)
  quarantine = Quarantine(str(tmp_path / "q.jsonl"))
  quarantine.add("create-0-000", "qa")
  mixture = DomainMixture(specs, quarantine=quarantine)
  assert mixture.broken == {"rows": {"line 3": "malformed row"}}
  ids = {e["task_id"] for e in mixture.take(200)}
  assert ids == {"create-0-001", "find-0-000", "find-0-001", "r1", "r2"}
  term = next(e for e in mixture.take(50) if e["domain"] == "term")
  assert term["verifier"] == "terminal" and term["max_turns"] == 4
  quarantine.record_failure({"task_id": "r1"}, "x")
  quarantine.record_failure({"task_id": "r1"}, "checker crashed")  # threshold 2: now quarantined
  assert "r1" not in {e["task_id"] for e in mixture.take(200, start=200)}


def test_data_domains_feeds_the_training_source(tmp_path):
  path = _write(tmp_path / "domains.jsonl", GOOD, {**GOOD, "name": "rev", "source": "generator:reverse",
                                                  "reward": "exact", "quota": 0.5})
  cfg = configs.load("configs/tiny.py", [f"data.domains={path}", "rl.prompts_per_step=8"])
  source = loop.train_source(cfg)
  assert isinstance(source, DomainMixture) and source.split == "train"
  first = source.take(8)
  assert sum(e["domain"] == "rev" for e in first) >= 4 and {e["domain"] for e in first} <= {"add", "rev"}
  assert loop.train_prompts(source) == []
  rows = _write(tmp_path / "rows.jsonl", *({"id": f"r{i}", "prompt": f"{i}+1=", "answer": str(i + 1)}
                                          for i in range(40)))
  quarantined = _write(tmp_path / "q.jsonl", {"id": "r1", "reason": "qa"}, {"id": "r2", "reason": "qa"})
  with_rows = _write(tmp_path / "rows_domain.jsonl",
                     {"name": "rows", "source": f"jsonl:{rows}", "reward": "numeric", "weight": 1})
  cfg = configs.load("configs/tiny.py", [f"data.domains={with_rows}", f"data.quarantine={quarantined}",
                                         "data.eval_fraction=0"])
  source = loop.train_source(cfg)
  drawn = {e["task_id"] for e in source.take(400)}
  assert len(drawn) == 38 and not drawn & {"r1", "r2"}
  assert len(loop.train_prompts(source)) == 38
  terminal_tasks.write_tasks(str(tmp_path / "t"), per_family=1, families=("create",))
  term = _write(tmp_path / "term.jsonl",
                {"name": "term", "source": "tasks:t", "reward": "terminal", "weight": 1})
  cfg = configs.load("configs/tiny.py", [f"data.domains={term}"])
  with pytest.raises(ValueError, match="single-turn RL step cannot score yet"):
    loop.train_source(cfg)
  cfg = configs.load("configs/tiny.py", [f"data.domains={path}", f"data.jsonl={path}"])
  with pytest.raises(ValueError, match="data.domains and data.jsonl/data.array_record are both set"):
    loop.train_source(cfg)


@pytest.mark.slow
def test_rl_steps_over_300_domains_report_per_domain_rewards(tmp_path):
  """Two GRPO steps of the tiny model on a 300-domain registry (2.5-4 minutes on 2 busy cores)."""
  write_many_domains(str(tmp_path / "domains.jsonl"), 300)
  cfg = configs.load("configs/tiny.py", [
      f"data.domains={tmp_path / 'domains.jsonl'}", "rl.sft_steps=0", "rl.num_steps=2", "eval.every=0",
      "log.progress_bar=false", "log.tensorboard=false", "checkpoint.enabled=false", "log.plot=false",
      "rl.max_prompt_len=24", "model.max_seq_len=32"])
  records = loop.run(cfg, str(tmp_path / "work"))
  for record in records:
    per_domain = [k for k in record if k.startswith("reward_mean/")]
    assert len(per_domain) >= 8 and all(k.split("/")[1].rsplit("_", 1)[0] in
                                        ("arithmetic", "copy", "countdown", "reverse", "sort")
                                        for k in per_domain)


def test_the_gates_curriculum_flags_drive_sampling_with_a_floor(tmp_path):
  """Tasks the gate flags always / never solved are drawn flagged_weight times as often as the others
  of their domain (never zero); the report's flags are read by load_curriculum."""
  from meshrl.rl.envs.registry import load_curriculum  # pylint: disable=import-outside-toplevel
  rows = [{"id": f"r{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
  path = _write(tmp_path / "domains.jsonl", {"name": "rows", "source": "jsonl:rows.jsonl",
                                             "reward": "numeric", "weight": 1})
  _write(tmp_path / "rows.jsonl", *rows)
  report = tmp_path / "qa.json"
  report.write_text(json.dumps({"curriculum": {"r0": "always_solved", "r1": "never_solved"}}))
  flags = load_curriculum(str(report))
  counts = {}
  for weight in (1.0, 0.25):
    mixture = DomainMixture(load_domains(path), curriculum=flags, flagged_weight=weight)
    drawn = [e["task_id"] for e in mixture.take(4000)]
    counts[weight] = {task: drawn.count(task) / len(drawn) for task in ("r0", "r1", "r2", "r3")}
  assert all(abs(share - 0.25) < 0.03 for share in counts[1.0].values())  # weight 1: no effect
  flagged = counts[0.25]["r0"] + counts[0.25]["r1"]
  assert abs(flagged - 0.5 * 0.25 / (0.5 * 0.25 + 0.5)) < 0.03  # 0.2 of the draws, not 0.5
  assert min(counts[0.25]["r0"], counts[0.25]["r1"]) > 0.05  # the floor: still drawn
  with pytest.raises(ValueError, match="flagged_weight=0"):
    DomainMixture(load_domains(path), curriculum=flags, flagged_weight=0)
  with pytest.raises(ValueError, match=r"curriculum flags \['easy'\] are unknown"):
    DomainMixture(load_domains(path), curriculum={"r0": "easy"})
  (tmp_path / "other.json").write_text("{}")
  with pytest.raises(ValueError, match="no 'curriculum' object"):
    load_curriculum(str(tmp_path / "other.json"))
