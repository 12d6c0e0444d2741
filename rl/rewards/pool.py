"""Scoring a batch's completions concurrently, with a per-sample timeout: `RewardPool`.

Reward code is untrusted in the sense that it may raise, return garbage or hang (a regex that
backtracks forever, a verifier waiting on a subprocess). Each sample is one job on a pool of daemon
worker threads; a job that raises scores 0 for its term and is counted; a job that runs longer than
`timeout_s` scores 0, is counted in `reward_timeouts`, and its worker is written off and replaced,
so one hung sample delays only itself and never the next batch. (A thread cannot be killed: the
hung one keeps running in the background as a daemon and is dropped at exit. Rewards that run
programs should bound those themselves, as the sandbox does.)

Infrastructure failures are not wrong answers: a term that raises one of `INFRA_ERRORS` (its sandbox
could not start or broke; rl/envs/env_work.py's classes but a task directory's) is retried up to `max_retries` times after
`backoff_s * 2**attempt` seconds, as the environment scheduler retries an episode's start
(rl/envs/scheduler.py); a sample still failing is given up on: it scores 0, is marked in
info["given_up"] so the step leaves it out of the update (sample_valid False) instead of teaching the
policy that its answer was wrong, and `on_given_up(example, reason)` records it against its task (the
run's quarantine, rl/envs/env_work.EnvWork.record). Any other exception is the reward's own bug and
scores 0 at once (reward_errors), never retried.

Results are placed by sample index, so scores do not depend on which worker ran what.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from meshrl.rl.rewards.compose import _terms
from meshrl.rl.sandbox import SandboxUnavailable, SessionStartError
from meshrl.rl.sandbox.result import EnvFailure

INFRA_ERRORS = (EnvFailure, SandboxUnavailable, SessionStartError)  # a verifier's sandbox, not its verdict


class _Job:
  __slots__ = ("index", "completion", "example", "started", "done", "scores", "errors", "retries",
               "given_up")

  def __init__(self, index: int, completion: str, example: dict):
    self.index, self.completion, self.example = index, completion, example
    self.started: float | None = None
    self.done = False
    self.scores: list[float] = []
    self.errors: list[str] = []
    self.retries = 0
    self.given_up: str | None = None  # why, when an infrastructure failure outlasted the retries


class Pending(NamedTuple):
  """Samples queued by `RewardPool.submit`, in order."""
  jobs: list
  examples: list


class RewardPool:
  """Scores completions on `num_workers` threads, each sample within `timeout_s` seconds.

  Args:
    reward_fn: a WeightedReward (rl.rewards.compose), a {name: fn} dict, a list of fns or one fn,
      each `(completion, example) -> float`.
    num_workers: worker threads (>= 1).
    timeout_s: per-sample limit in seconds (> 0), counted from when a worker starts the sample (its
      retries included).
    max_retries, backoff_s: retries of an infrastructure failure and the first wait (rl.env_retries,
      rl.env_backoff_s: the same policy as environment starts).
    on_given_up: called as (example, reason) for a sample given up on (the run's quarantine).
  """

  def __init__(self, reward_fn, *, num_workers: int = 8, timeout_s: float = 30.0, max_retries: int = 2,
               backoff_s: float = 0.5, on_given_up: Callable[[dict, str], object] | None = None):
    if num_workers < 1:
      raise ValueError(f"rl.reward_workers={num_workers} must be at least 1.")
    if not timeout_s > 0:
      raise ValueError(f"rl.reward_timeout_s={timeout_s} must be positive.")
    self.terms = _terms(reward_fn)
    self.timeout_s = float(timeout_s)
    self.max_retries, self.backoff_s, self.on_given_up = int(max_retries), float(backoff_s), on_given_up
    self._queue: queue.Queue = queue.Queue()
    self._cond = threading.Condition()
    self._workers = 0
    self.abandoned = 0  # workers written off because their job hung
    for _ in range(num_workers):
      self._spawn()

  def _spawn(self) -> None:
    threading.Thread(target=self._work, daemon=True, name=f"reward-{self._workers}").start()
    self._workers += 1

  def _work(self) -> None:
    while True:
      job = self._queue.get()
      if job is None:
        return
      with self._cond:
        job.started = time.monotonic()
      scores, errors = [], []
      for name, _, fn in self.terms:
        try:
          value = float(self._call(fn, job))
          if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
          scores.append(value)
        except INFRA_ERRORS as error:
          scores.append(0.0)
          job.given_up = f"{name}[{job.index}]: {type(error).__name__}: {error}"
        except Exception as error:  # pylint: disable=broad-except  (never crash the loop)
          scores.append(0.0)
          errors.append(f"{name}[{job.index}]: {type(error).__name__}: {error}")
      with self._cond:
        if job.done:  # timed out meanwhile: this worker was written off, so it stops here
          return
        job.scores, job.errors, job.done = scores, errors, True
        self._cond.notify_all()
      if job.given_up is not None and self.on_given_up is not None and isinstance(job.example, Mapping):
        self.on_given_up(job.example, job.given_up)

  def _call(self, fn, job: _Job):
    """fn(completion, example), an infrastructure failure retried with backoff (module docstring)."""
    for attempt in range(self.max_retries + 1):
      try:
        return fn(job.completion, job.example)
      except INFRA_ERRORS:
        if attempt == self.max_retries:
          raise
        job.retries += 1
        time.sleep(self.backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")

  def score(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[np.ndarray, dict]:
    """-> (rewards [N] float32, info). Never raises for a failing or hanging reward.

    info: reward_errors (term calls that raised or returned a non-finite value), reward_timeouts
    (samples past timeout_s), first_errors (up to 3 messages), given_up [N] bool (samples whose
    infrastructure failure outlasted the retries: leave them out of the update), reward_env_retries,
    reward_env_given_up (counts), per_fn {name: [N] unweighted},
    by_domain {domain: mean reward}.
    """
    return self.collect(self.submit(completions, examples))

  def submit(self, completions: Sequence[str], examples: Sequence[dict]) -> "Pending":
    """Queues every sample and returns at once (the workers score them meanwhile); `collect` waits.
    A caller with work of its own (a reward model on the devices) does it between the two."""
    if len(completions) != len(examples):
      raise ValueError(f"len(completions)={len(completions)} != len(examples)={len(examples)}.")
    jobs = [_Job(i, c, e) for i, (c, e) in enumerate(zip(completions, examples))]
    for job in jobs:
      self._queue.put(job)
    return Pending(jobs, list(examples))

  def collect(self, pending: "Pending") -> tuple[np.ndarray, dict]:
    """Waits for `submit`'s samples -> (rewards [N] float32, info), as `score` returns them."""
    jobs, examples = pending.jobs, pending.examples
    timeouts = 0
    with self._cond:
      while not all(job.done for job in jobs):
        now = time.monotonic()
        for job in jobs:
          if not job.done and job.started is not None and now - job.started > self.timeout_s:
            job.done = True
            job.scores = [0.0] * len(self.terms)
            job.errors = [f"sample {job.index}: timed out after {self.timeout_s:g} s"]
            timeouts += 1
            self.abandoned += 1
            self._spawn()  # replace the hung worker
        self._cond.wait(timeout=min(0.05, self.timeout_s / 4))
    per_fn = {name: np.asarray([job.scores[t] for job in jobs], np.float32)
              for t, (name, _, _) in enumerate(self.terms)}
    total = np.zeros(len(jobs), np.float32)
    for name, weight, _ in self.terms:
      total += np.float32(weight) * per_fn[name]
    errors = [message for job in jobs for message in job.errors]
    domains = [e.get("domain", "") if isinstance(e, Mapping) else "" for e in examples]
    by_domain = {d: float(np.mean(total[[x == d for x in domains]])) for d in sorted(set(domains))}
    given_up = np.asarray([job.given_up is not None for job in jobs], bool)
    errors += [job.given_up for job in jobs if job.given_up is not None]
    info = {"reward_errors": sum(len(job.errors) for job in jobs) - timeouts,
            "reward_timeouts": timeouts, "first_errors": errors[:3], "per_fn": per_fn,
            "by_domain": by_domain, "given_up": given_up,
            "reward_env_retries": sum(job.retries for job in jobs),
            "reward_env_given_up": int(given_up.sum())}
    return total, info

  def close(self) -> None:
    """Stops the idle workers (hung ones are daemons and end with the process)."""
    for _ in range(self._workers):
      self._queue.put(None)


@dataclasses.dataclass
class Dispatched:
  """A model source's scoring started on the devices (`dispatch`), not yet read (`finish`)."""
  calls: list  # the device calls' outputs, each with how many of its rows are real
  completions: list  # the scored completions, for what `finish` computes on the host
  info: dict  # what the host already knows (counts of rows cut or prompts truncated)


def call_rows(count: int, per_call: int, call: int) -> tuple[np.ndarray, int]:
  """This host's rows of batched call `call` over its `count` items, `per_call` per call ->
  (indices [per_call] into the items, how many are real); a short call repeats its first row (item
  0 when the host has none left: the caller keeps a row 0 even when `count` is 0), so every call
  has one shape and every host makes the same number of calls (sharding/hosts.calls_over_hosts)."""
  part = np.arange(call * per_call, min((call + 1) * per_call, count))
  filler = part[0] if len(part) else 0
  return np.concatenate([part, np.full(per_call - len(part), filler, part.dtype)]), len(part)
