"""rl/envs/driver.py: a batch of single-turn and terminal episodes from one registry mixture on the
scheduler; a task whose checker crashes is retried, then quarantined and never drawn again."""

import json

import pytest

from meshrl.rl.envs import terminal_tasks
from meshrl.rl.envs.driver import run_batch
from meshrl.rl.envs.episode import Budget
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.registry import DomainMixture, load_domains
from meshrl.rl.envs.scheduler import Scheduler


@pytest.mark.needs_sandbox
def test_mixed_batch_with_retries_and_quarantine(tmp_path):
  oracles = {}
  for index in range(2):
    meta, spec = terminal_tasks.make_task("create", index)
    terminal_tasks.write_task(str(tmp_path / "tasks" / meta["id"]), meta, spec)
    oracles[meta["prompt"]] = spec["oracle"].strip()
  meta, spec = terminal_tasks.make_task("find", 0)
  meta["id"] = "crashy"
  terminal_tasks.write_task(str(tmp_path / "tasks" / "crashy"), meta, {**spec, "check": "no_such_tool\n"})
  (tmp_path / "domains.jsonl").write_text(
      json.dumps({"name": "term", "source": "tasks:tasks", "reward": "terminal", "weight": 1,
                  "max_turns": 3, "timeout_s": 5, "quota": 0.5}) + "\n" +
      json.dumps({"name": "add", "source": "generator:arithmetic", "reward": "numeric", "weight": 1}) + "\n")
  quarantine = Quarantine(str(tmp_path / "q.jsonl"), threshold=1)
  mixture = DomainMixture(load_domains(str(tmp_path / "domains.jsonl")), quarantine=quarantine, seed=3,
                          batch_size=8)
  examples = mixture.take(8)
  answers = {e["prompt"]: e["answer"] for e in examples if e["domain"] == "add"}

  def policy(conversation):
    prompt = conversation[0]["content"]
    if prompt in answers:
      return answers[prompt]
    if prompt in oracles and len(conversation) == 1:
      return f"<cmd>{oracles[prompt]}</cmd>"
    return "<done>"

  scheduler = Scheduler(mixture.policies, workers=2, max_retries=1, backoff_s=0.01,
                        on_failure=lambda job, reason: quarantine.record_failure(job.payload, reason))
  results = run_batch(examples, policy, scheduler=scheduler, budget=Budget(max_turns=4))
  by_kind = {}
  for example, result in zip(examples, results):
    kind = example.get("task_id") or "add"
    by_kind.setdefault(kind, set()).add((result.value.reward if result.value else None, result.attempts))
  assert by_kind["add"] == {(1.0, 1)}
  assert by_kind["crashy"] == {(None, 2)}  # retried once, then given up
  assert by_kind["create-0-000"] == by_kind["create-0-001"] == {(1.0, 1)}
  assert sum(e["domain"] == "term" for e in examples) >= 4
  stats = scheduler.stats()["term"]
  assert stats.failed == len([e for e in examples if e.get("task_id") == "crashy"]) > 0
  assert "crashy" in quarantine and "exit 127" in quarantine.reasons["crashy"]
  assert "crashy" not in {e.get("task_id") for e in mixture.take(64, start=8)}
