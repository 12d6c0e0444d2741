"""rl/envs/scheduler.py: per-batch quotas, fair dispatch under skewed task costs, no starvation, and
retries of environment failures (never of wrong answers) with a cap, backoff and accounting."""

import time

import numpy as np
import pytest

from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.scheduler import DomainPolicy, EnvFailure, Scheduler, plan_batch, simulate


def test_quotas_hold_in_every_batch():
  policies = {"rare": DomainPolicy(weight=0.01, quota=0.25), "common": DomainPolicy(weight=100.0),
              "mid": DomainPolicy(weight=1.0, quota=0.1)}
  for batch in range(20):
    slots = plan_batch(policies, 16, np.random.default_rng(batch))
    assert len(slots) == 16 and slots.count("rare") >= 4 and slots.count("mid") >= 1
  draws = [plan_batch({"a": DomainPolicy(weight=3.0), "b": DomainPolicy(weight=1.0)}, 64,
                      np.random.default_rng(i)) for i in range(20)]
  share = np.mean([d.count("a") / 64 for d in draws])
  assert 0.7 < share < 0.8  # weights set the rest of the batch
  with pytest.raises(ValueError, match="add up to 1.200"):
    plan_batch({"a": DomainPolicy(quota=0.6), "b": DomainPolicy(quota=0.6)}, 8, np.random.default_rng(0))


def test_cheap_domain_is_not_stuck_behind_expensive_jobs():
  # 20 jobs of 1 s queued before 20 jobs of 0.01 s, on 2 workers.
  jobs = [("slow", 1.0)] * 20 + [("fast", 0.01)] * 20
  policies = {"slow": DomainPolicy(), "fast": DomainPolicy()}
  timeline = simulate(jobs, policies, workers=2, aging_s=1e9)
  fast_done = max(end for (domain, _), (_, end) in zip(jobs, timeline) if domain == "fast")
  slow_done = max(end for (domain, _), (_, end) in zip(jobs, timeline) if domain == "slow")
  assert fast_done < 1.5 < slow_done  # FIFO would finish the fast domain after 10 s
  # With weight 4 to 1, the expensive domain gets about four times the worker time while both wait.
  heavy = {"slow": DomainPolicy(weight=4.0), "fast": DomainPolicy(weight=1.0)}
  jobs = [("slow", 0.1)] * 200 + [("fast", 0.1)] * 200
  timeline = simulate(jobs, heavy, workers=1, aging_s=1e9)
  started = sorted((start, domain) for (domain, _), (start, _) in zip(jobs, timeline))[:100]
  assert 75 <= sum(domain == "slow" for _, domain in started) <= 85


def test_priorities_first_but_waiting_jobs_age_in():
  policies = {"high": DomainPolicy(priority=2), "low": DomainPolicy(priority=0)}
  jobs = [("low", 1.0)] + [("high", 1.0)] * 50
  together = simulate(jobs, policies, workers=1, aging_s=2.0)
  assert together[0][0] == 50.0  # queued together, the higher priority runs first
  # High-priority jobs keep arriving (2 per second, 1 s each): strict priority starves the low job
  # until the stream ends; with aging it runs within seconds.
  jobs = [("low", 1.0)] + [("high", 1.0)] * 200
  arrivals = [0.0] + [i * 0.5 for i in range(200)]
  strict = simulate(jobs, policies, workers=1, aging_s=1e9, arrivals=arrivals)
  assert strict[0][0] == 200.0
  aged = simulate(jobs, policies, workers=1, aging_s=2.0, arrivals=arrivals)
  assert aged[0][0] <= 12.0


def test_env_failures_are_retried_with_backoff_wrong_answers_are_not(tmp_path):
  calls, times = {}, {}

  def job(payload):
    calls[payload] = calls.get(payload, 0) + 1
    times.setdefault(payload, []).append(time.monotonic())
    if payload == "flaky_env" and calls[payload] < 3:
      raise EnvFailure("sandbox could not start")
    if payload == "broken_env":
      raise EnvFailure("checker crashed")
    if payload == "bug":
      raise KeyError("answer")
    return 0.0 if payload == "wrong" else 1.0

  quarantine = Quarantine(str(tmp_path / "q.jsonl"), threshold=1)
  scheduler = Scheduler({"a": DomainPolicy(), "b": DomainPolicy()}, workers=2, max_retries=2,
                        backoff_s=0.05, on_failure=lambda j, r: quarantine.record_failure(j.payload, r))
  results = scheduler.run([("a", "flaky_env"), ("a", "wrong"), ("b", "broken_env"), ("b", "ok"),
                           ("b", "bug")], job)
  assert [r.value for r in results] == [1.0, 0.0, None, 1.0, None]
  assert [r.attempts for r in results] == [3, 1, 3, 1, 1]
  assert calls["wrong"] == 1 and calls["bug"] == 1  # never retried
  gaps = np.diff(times["flaky_env"])
  assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # exponential backoff
  assert "checker crashed" in results[2].failure and results[4].failure.startswith("KeyError")
  stats = scheduler.stats()
  assert (stats["a"].runs, stats["a"].env_failures, stats["a"].retries, stats["a"].failed) == (4, 2, 2, 0)
  assert (stats["b"].runs, stats["b"].env_failures, stats["b"].retries, stats["b"].failed) == (5, 3, 2, 2)
  assert quarantine.ids == {"broken_env", "bug"}
  with pytest.raises(ValueError, match="unknown domain"):
    scheduler.run([("c", 1)], job)
