"""Scheduling a heterogeneous task queue: per-batch quotas, priorities, fair dispatch, retries.

  plan_batch(policies, batch_size, rng)        -> the domain of each slot of one batch
  Scheduler(policies, workers=4).run(jobs, fn) -> results, with retries and per-domain accounting

Batch composition (`plan_batch`): a domain with quota q gets at least floor(q * B) slots of every
batch of B (the remainders go by largest fraction, ties to higher priority); the other slots are
drawn by weight. So a domain's share cannot be crowded out by cheap, heavily weighted domains.

Dispatch (`pick_next`, pure): among queued jobs, the highest effective priority runs first, where a
job's effective priority grows by one for every `aging_s` seconds it has waited (no job starves
behind a stream of higher-priority work); ties go to the domain that has used the least worker time
per unit of weight (start-time fair queueing, Goyal et al., SIGCOMM 1996), so a domain whose tasks
are 10x as expensive does not hold the workers while cheap domains wait, then first in, first out.

Retries: `fn(job)` raising `EnvFailure` (a sandbox that cannot start, a checker that crashes) is
retried up to `max_retries` times after `backoff_s * 2**attempt` seconds; any other outcome, a wrong
answer included, is a result and is never retried; any other exception is a failure, not retried.
A job out of retries reports `on_failure(job, reason)` (the quarantine's hook,
rl/envs/quality.py `Quarantine.record_failure`). Failures, retries and busy time are counted per
domain (`stats()`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from meshrl.rl.sandbox import result


@dataclasses.dataclass(frozen=True)
class DomainPolicy:
  """How a domain is scheduled."""
  weight: float = 1.0  # share of the non-quota slots, and of worker time under contention
  priority: int = 0  # higher runs first
  quota: float = 0.0  # least share of every batch (0..1)

  def __post_init__(self):
    if not (math.isfinite(self.weight) and self.weight > 0):
      raise ValueError(f"weight={self.weight!r} must be positive.")
    if not 0.0 <= self.quota <= 1.0:
      raise ValueError(f"quota={self.quota!r} must lie in [0, 1].")


def check_quotas(policies: Mapping[str, DomainPolicy]) -> None:
  total = sum(p.quota for p in policies.values())
  if total > 1.0 + 1e-9:
    raise ValueError(f"the domains' quotas add up to {total:.3f} > 1: a batch cannot hold them all.")


def plan_batch(policies: Mapping[str, DomainPolicy], batch_size: int,
               rng: np.random.Generator) -> list[str]:
  """The domain of each of `batch_size` slots (quota slots first, then weighted draws, shuffled)."""
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1.")
  check_quotas(policies)
  names = sorted(policies)
  exact = {n: policies[n].quota * batch_size for n in names}
  counts = {n: int(math.floor(exact[n] + 1e-9)) for n in names}
  spare = int(math.floor(sum(exact.values()) + 1e-9)) - sum(counts.values())
  by_remainder = sorted(names, key=lambda n: (-(exact[n] - counts[n]), -policies[n].priority, n))
  for name in by_remainder[:max(spare, 0)]:
    counts[name] += 1
  slots = [n for n in names for _ in range(counts[n])]
  weights = np.array([policies[n].weight for n in names], np.float64)
  rest = batch_size - len(slots)
  if rest > 0:
    slots += [names[i] for i in rng.choice(len(names), size=rest, p=weights / weights.sum())]
  order = rng.permutation(len(slots))
  return [slots[i] for i in order]


EnvFailure = result.EnvFailure  # raised by a job function when the environment, not the policy, failed (retried)


@dataclasses.dataclass
class Job:
  domain: str
  payload: object = None
  index: int = 0  # position in the caller's list (results come back in this order)
  attempts: int = 0
  queued_at: float = 0.0
  ready_at: float = 0.0  # not before (backoff)


@dataclasses.dataclass
class JobResult:
  index: int
  domain: str
  value: object = None
  failure: str | None = None  # set when the job failed for good
  attempts: int = 1
  seconds: float = 0.0


@dataclasses.dataclass
class DomainStats:
  runs: int = 0
  ok: int = 0
  env_failures: int = 0  # attempts that raised EnvFailure (retried or not)
  retries: int = 0
  failed: int = 0  # jobs given up on
  busy_s: float = 0.0
  waits: list = dataclasses.field(default_factory=list)  # seconds from queued to first start


def pick_next(queue: Sequence[Job], now: float, policies: Mapping[str, DomainPolicy],
              used_s: Mapping[str, float], *, aging_s: float) -> int | None:
  """Index in `queue` of the job to start now (None if none is ready); see the module docstring."""
  best, best_key = None, None
  for i, job in enumerate(queue):
    if job.ready_at > now:
      continue
    policy = policies[job.domain]
    effective = policy.priority + (now - job.queued_at) / aging_s
    key = (-math.floor(effective), used_s.get(job.domain, 0.0) / policy.weight, job.queued_at, job.index)
    if best_key is None or key < best_key:
      best, best_key = i, key
  return best


class Scheduler:
  """Runs jobs on `workers` threads in the order `pick_next` chooses, with retries (thread-safe
  between runs; one `run` at a time).

  Args:
    policies: {domain: DomainPolicy}.
    workers: jobs running at once.
    max_retries: extra attempts after an EnvFailure.
    backoff_s: first retry delay; doubles per attempt.
    aging_s: waiting seconds worth one priority level.
    on_failure: called (job, reason) for a job given up on.
  """

  def __init__(self, policies: Mapping[str, DomainPolicy], *, workers: int = 4, max_retries: int = 2,
               backoff_s: float = 0.05, aging_s: float = 5.0,
               on_failure: Callable[[Job, str], None] | None = None,
               clock: Callable[[], float] = time.monotonic):
    if workers < 1 or max_retries < 0 or backoff_s < 0 or not aging_s > 0:
      raise ValueError(f"workers={workers} must be >= 1, max_retries={max_retries} and "
                       f"backoff_s={backoff_s} >= 0, aging_s={aging_s} > 0.")
    check_quotas(policies)
    self.policies = dict(policies)
    self.workers, self.max_retries = workers, max_retries
    self.backoff_s, self.aging_s = backoff_s, aging_s
    self.on_failure, self.clock = on_failure, clock
    self.used_s: dict[str, float] = {}
    self._stats = {name: DomainStats() for name in self.policies}
    self._cond = threading.Condition()

  def add_domain(self, name: str, policy: DomainPolicy) -> None:
    """Schedules jobs of a further domain (between runs); ValueError if the quotas no longer fit."""
    with self._cond:
      check_quotas({**self.policies, name: policy})
      self.policies[name] = policy
      self._stats.setdefault(name, DomainStats())

  def stats(self) -> dict[str, DomainStats]:
    with self._cond:
      return {name: dataclasses.replace(s, waits=list(s.waits)) for name, s in self._stats.items()}

  def run(self, items: Sequence[tuple[str, object]], fn: Callable[[object], object]) -> list[JobResult]:
    """Runs fn(payload) for every (domain, payload); results in item order."""
    unknown = sorted({d for d, _ in items} - set(self.policies))
    if unknown:
      raise ValueError(f"jobs name unknown domain(s) {unknown[:5]}; known: {len(self.policies)} domains.")
    now = self.clock()
    queue = [Job(d, p, index=i, queued_at=now, ready_at=now) for i, (d, p) in enumerate(items)]
    results: list[JobResult | None] = [None] * len(queue)
    state = {"running": 0, "left": len(queue)}

    def worker():
      while True:
        with self._cond:
          while True:
            if state["left"] == 0:
              self._cond.notify_all()
              return
            now = self.clock()
            index = pick_next(queue, now, self.policies, self.used_s, aging_s=self.aging_s)
            if index is not None:
              job = queue.pop(index)
              break
            waits = [j.ready_at - now for j in queue]
            self._cond.wait(timeout=max(min(waits), 0.001) if waits else 0.05)
          if job.attempts == 0:
            self._stats[job.domain].waits.append(now - job.queued_at)
        self._attempt(job, fn, queue, results, state)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.workers)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    return results

  def _attempt(self, job: Job, fn, queue: list, results: list, state: dict) -> None:
    started = self.clock()
    value, failure, retry = None, None, False
    try:
      value = fn(job.payload)
    except EnvFailure as error:
      failure, retry = f"environment failure: {error}", job.attempts < self.max_retries
    except Exception as error:  # pylint: disable=broad-except  (a broken job must not stop the rest)
      failure = f"{type(error).__name__}: {error}"
    spent = self.clock() - started
    with self._cond:
      stats = self._stats[job.domain]
      stats.runs += 1
      stats.busy_s += spent
      self.used_s[job.domain] = self.used_s.get(job.domain, 0.0) + spent
      job.attempts += 1
      if failure and failure.startswith("environment failure"):
        stats.env_failures += 1
      if retry:
        stats.retries += 1
        job.ready_at = self.clock() + self.backoff_s * 2 ** (job.attempts - 1)
        queue.append(job)
      else:
        stats.ok += failure is None
        stats.failed += failure is not None
        results[job.index] = JobResult(job.index, job.domain, value, failure, job.attempts, spent)
        state["left"] -= 1
      self._cond.notify_all()
    if failure and not retry and self.on_failure is not None:
      self.on_failure(job, failure)


def simulate(jobs: Sequence[tuple[str, float]], policies: Mapping[str, DomainPolicy], *,
             workers: int, aging_s: float = 5.0, arrivals: Sequence[float] | None = None
             ) -> list[tuple[float, float]]:
  """Discrete-event run of `pick_next` with job costs in seconds (no threads, no sleeping):
  [(start, end)] per job. `arrivals` (default all 0) lets jobs join the queue over time."""
  arrivals = list(arrivals) if arrivals is not None else [0.0] * len(jobs)
  pending = sorted(range(len(jobs)), key=lambda i: arrivals[i])
  queue: list[Job] = []
  free = [0.0] * workers  # heap of times each worker is free
  used: dict[str, float] = {}
  timeline: list[tuple[float, float] | None] = [None] * len(jobs)
  now = 0.0
  while pending or queue:
    now = max(now, heapq.heappop(free))
    if not queue and pending:
      now = max(now, arrivals[pending[0]])
    while pending and arrivals[pending[0]] <= now:
      i = pending.pop(0)
      queue.append(Job(jobs[i][0], index=i, queued_at=arrivals[i], ready_at=arrivals[i]))
    job = queue.pop(pick_next(queue, now, policies, used, aging_s=aging_s))
    cost = jobs[job.index][1]
    used[job.domain] = used.get(job.domain, 0.0) + cost
    timeline[job.index] = (now, now + cost)
    heapq.heappush(free, now + cost)
  return timeline
