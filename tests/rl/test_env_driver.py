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


class _FlakyEnv:
  """A single-turn env whose reset fails `fail_times` times (an infrastructure failure: a sandbox
  that does not start), then answers with reward 1 for "4" and 0 otherwise."""

  def __init__(self, state, task_id):
    self.state, self.task_id = state, task_id

  def reset(self, task):
    self.state[self.task_id] = self.state.get(self.task_id, 0) + 1
    if self.state[self.task_id] <= task["fail_times"]:
      from meshrl.rl.sandbox import SessionStartError  # pylint: disable=import-outside-toplevel
      raise SessionStartError("a sandbox session did not start: bwrap exited")
    return task["prompt"]

  def step(self, action):
    from meshrl.rl.envs.base import StepResult  # pylint: disable=import-outside-toplevel
    return StepResult("", 1.0 if action.strip() == "4" else 0.0, True, {})


def test_infrastructure_failures_are_retried_a_persistent_one_quarantines_and_the_checkpoint_remembers(tmp_path):
  """env_scheduler: an environment that fails once is retried (with backoff) and scored; one that
  keeps failing is given up on and quarantined against its task id; a wrong answer is a result,
  never retried. The quarantine's state (a checkpoint's) brings the list and the counts back."""
  from meshrl.rl.envs.driver import env_scheduler  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.scheduler import DomainPolicy  # pylint: disable=import-outside-toplevel
  attempts = {}
  examples = [{"task_id": "flaky", "domain": "d", "prompt": "2+2=", "fail_times": 1},
              {"task_id": "broken", "domain": "d", "prompt": "2+2=", "fail_times": 99},
              {"task_id": "wrong", "domain": "d", "prompt": "2+3=", "fail_times": 0},
              {"task_id": "half", "domain": "d", "prompt": "2+2=", "fail_times": 99}]
  answers = {"flaky": "4", "broken": "4", "wrong": "6", "half": "4"}
  quarantine = Quarantine(str(tmp_path / "q.jsonl"), threshold=2)
  scheduler = env_scheduler({"d": DomainPolicy()}, quarantine, workers=2, max_retries=1, backoff_s=0.01)
  results = run_batch(examples[:3], lambda c: answers[next(e["task_id"] for e in examples
                                                              if e["prompt"] == c[0]["content"])],
                      scheduler=scheduler, make_env=lambda e: _FlakyEnv(attempts, e["task_id"]))
  assert [r.attempts for r in results] == [2, 2, 1]
  assert results[0].value.reward == 1.0 and results[2].value.reward == 0.0  # scored; wrong: no retry
  assert results[1].value is None and "did not start" in results[1].failure
  assert quarantine.ids == frozenset() and quarantine.failures == {"broken": 1}  # threshold 2
  run_batch(examples[1:2], lambda c: "4", scheduler=scheduler,
            make_env=lambda e: _FlakyEnv(attempts, e["task_id"]))
  assert quarantine.ids == {"broken"}  # kept failing: quarantined during the run
  run_batch(examples[3:], lambda c: "4", scheduler=scheduler,
            make_env=lambda e: _FlakyEnv(attempts, e["task_id"]))
  state = json.loads(json.dumps(quarantine.state()))  # what a checkpoint stores
  resumed = Quarantine(threshold=2)  # a fresh process, without the file
  resumed.restore(state)
  assert resumed.ids == {"broken"} and resumed.failures["half"] == 1
  assert resumed.record_failure("half", "again") and resumed.ids == {"broken", "half"}  # counts went on
  with pytest.raises(ValueError, match="quarantine state"):
    resumed.restore({"reasons": []})
