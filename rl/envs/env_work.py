"""The environment work of an RL step on one `Scheduler`, with the run's quarantine: what training
runs through to start environments, retry infrastructure failures and quarantine tasks that keep
failing.

  quarantine = run_quarantine(cfg)                                        # one per run
  mixture = DomainMixture(specs, ..., **mixture_options(cfg, quarantine))  # + the gate's curriculum
  work = EnvWork.from_config(cfg, mixture.policies, quarantine)           # the same quarantine
  results = work.run([(domain, example), ...], start)  # JobResult per item, in order
  work.record(example, reason)                         # a failure seen outside `run` (mid-episode)
  checkpoint extra_state["env"] = work.state(); on resume work.restore(state)

Retries (rl/envs/scheduler.py): an infrastructure failure, i.e. `fn` raising one of `INFRA_ERRORS`
(a sandbox or session that cannot start, a task directory that no longer loads, or an explicit
`EnvFailure`), is retried up to rl.env_retries times with backoff rl.env_backoff_s * 2**attempt. A
wrong answer is a value, never an exception, so it is never retried. A job given up on (out of
retries, or raising anything else) counts one failure against its example's task_id in the quarantine
(rl/envs/quality.Quarantine, data.quarantine_after failures quarantine a task), and the quarantine is
what the domain mixture reads at every draw: a task that keeps failing leaves training while it runs.
Jobs are dispatched by the domains' priority, quota and fair share; a domain the policies do not
name runs with the default policy (weight 1, priority 0).

Sampling (`mixture_options`): the quality gate's report (data.curriculum, scripts/env_qa.py --json)
flags tasks a policy always or never solves; the mixture draws them data.flagged_weight times as
often as the others of their domain, a floor above zero (rl/envs/registry.py DomainMixture).
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Sequence

from meshrl.rl.envs.driver import env_scheduler
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.envs.scheduler import DomainPolicy, EnvFailure, JobResult
from meshrl.rl.envs.terminal import TaskError
from meshrl.rl.sandbox import SandboxUnavailable, SessionStartError

INFRA_ERRORS = (EnvFailure, SandboxUnavailable, SessionStartError, TaskError)


def run_quarantine(cfg) -> Quarantine:
  """The run's quarantine: data.quarantine (a list file, "" in memory) with data.quarantine_after
  failures per task. Build it once per run and give it to the mixture and the EnvWork."""
  return Quarantine(cfg.data.quarantine, threshold=cfg.data.quarantine_after)


def mixture_options(cfg, quarantine: Quarantine) -> dict:
  """DomainMixture's keyword arguments for the run's quarantine (the one its EnvWork records into)
  and its curriculum: {"quarantine", "curriculum", "flagged_weight"}."""
  from meshrl.rl.envs.registry import load_curriculum  # pylint: disable=import-outside-toplevel
  return {"quarantine": quarantine,
          "curriculum": load_curriculum(cfg.data.curriculum) if cfg.data.curriculum else None,
          "flagged_weight": float(cfg.data.flagged_weight)}


class EnvWork:
  """A Scheduler for environment jobs wired to a quarantine (see the module docstring).

  Args:
    policies: {domain: DomainPolicy} (a mixture's), more domains join with the default policy.
    quarantine: the run's Quarantine (default: an in-memory one).
    workers, max_retries, backoff_s: the Scheduler's.
  """

  def __init__(self, policies: Mapping[str, DomainPolicy] | None = None, quarantine: Quarantine | None = None,
               *, workers: int = 4, max_retries: int = 2, backoff_s: float = 0.5):
    self.quarantine = Quarantine() if quarantine is None else quarantine
    self.scheduler = env_scheduler(dict(policies or {}), self.quarantine, workers=workers,
                                   max_retries=max_retries, backoff_s=backoff_s)
    self._lock = threading.Lock()  # one `run` at a time (the scheduler's contract)

  @classmethod
  def from_config(cls, cfg, policies: Mapping[str, DomainPolicy] | None = None,
                  quarantine: Quarantine | None = None) -> "EnvWork":
    """rl.env_workers workers, rl.env_retries retries after rl.env_backoff_s; `quarantine` the run's
    (default: a new `run_quarantine(cfg)`)."""
    if quarantine is None:
      quarantine = run_quarantine(cfg)
    return cls(policies, quarantine, workers=cfg.rl.env_workers, max_retries=cfg.rl.env_retries,
               backoff_s=cfg.rl.env_backoff_s)

  def run(self, items: Sequence[tuple[str, object]], fn: Callable[[object], object]) -> list[JobResult]:
    """fn(payload) for every (domain, payload) through the scheduler; JobResult per item, in order
    (`value` set, or `failure` naming why it was given up on)."""

    def job(payload):
      try:
        return fn(payload)
      except INFRA_ERRORS as error:
        raise EnvFailure(f"{type(error).__name__}: {error}") from None

    with self._lock:
      for domain in {str(d) for d, _ in items} - set(self.scheduler.policies):
        self.scheduler.add_domain(domain, DomainPolicy())
      return self.scheduler.run([(str(d), p) for d, p in items], job)

  def record(self, example, reason: str) -> bool:
    """An environment failure of `example`'s task seen outside `run` (an episode whose environment
    raised or timed out mid-way); True when it quarantined the task."""
    return self.quarantine.record_failure(example, reason)

  def metrics(self) -> dict[str, float]:
    """Totals over the run so far: env_retries, env_given_up (jobs), quarantined (task ids)."""
    stats = self.scheduler.stats().values()
    return {"env_retries": float(sum(s.retries for s in stats)),
            "env_given_up": float(sum(s.failed for s in stats)),
            "quarantined": float(len(self.quarantine.ids))}

  def state(self) -> dict:
    """What a checkpoint keeps (JSON): the quarantine's ids, reasons and failure counts."""
    return {"quarantine": self.quarantine.state()}

  def restore(self, state: dict) -> None:
    """Resumes from `state()` (ValueError naming what is malformed)."""
    if not isinstance(state, dict) or "quarantine" not in state:
      raise ValueError(f"an environment state is {{'quarantine': ...}}, got {str(state)[:80]!r}.")
    self.quarantine.restore(state["quarantine"])
