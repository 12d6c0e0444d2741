"""A batch of episodes over mixed domains on the scheduler: the host side of an agentic RL step.

  episodes, stats = run_batch(examples, generate, scheduler=Scheduler(mixture.policies))

Each example (from `registry.DomainMixture`) gets the environment its verifier names (`env_for`:
terminal task directories run in `TerminalEnv`, everything else is a `SingleTurnEnv` scored by
rl.rewards.answer_reward) and one episode (`run_episode`) under the budget its domain declares
(max_turns, timeout_s per command). An environment failure (a sandbox that does not start, a crashing
check.sh, a task directory that no longer loads) makes the episode an `EnvFailure` that the scheduler
retries with backoff and, out of retries, reports to its on_failure hook, e.g.
`Quarantine.record_failure` (rl/envs/quality.py; `env_scheduler` builds a scheduler wired so), so
broken tasks leave the mixture. A wrong answer is an episode with reward 0, never retried.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from meshrl.rl.envs.base import SingleTurnEnv
from meshrl.rl.envs.episode import Budget, Episode, Generate, run_episode
from meshrl.rl.envs.scheduler import DomainPolicy, EnvFailure, Job, JobResult, Scheduler
from meshrl.rl.envs.terminal import TaskError, TerminalEnv
from meshrl.rl.sandbox import SandboxUnavailable, SessionPool, SessionStartError

TERMINAL = "terminal"


def env_scheduler(policies: Mapping[str, DomainPolicy], quarantine, *, workers: int = 4,
                  max_retries: int = 2, backoff_s: float = 0.5, **kwargs) -> Scheduler:
  """A Scheduler for a training step's episodes whose jobs given up on (an environment failure out
  of retries, or a job that raised) are recorded in `quarantine` (rl/envs/quality.Quarantine) against
  the example's task_id: a task that keeps failing leaves the mixture while training runs."""

  def record(job: Job, reason: str) -> None:
    payload = job.payload if isinstance(job.payload, dict) else {}
    task_id = payload.get("task_id")
    if task_id:
      quarantine.record_failure(str(task_id), reason)

  return Scheduler(policies, workers=workers, max_retries=max_retries, backoff_s=backoff_s,
                   on_failure=record, **kwargs)


def env_for(example: dict, sessions: SessionPool | None = None):
  """The environment of an example: TerminalEnv for verifier "terminal", else SingleTurnEnv."""
  if example.get("verifier") == TERMINAL:
    return TerminalEnv(sessions, call_timeout_s=float(example.get("timeout_s", 10.0)))
  from meshrl.rl.rewards import answer_reward  # pylint: disable=import-outside-toplevel
  return SingleTurnEnv(answer_reward)


def budget_for(example: dict, base: Budget) -> Budget:
  """`base` with the example's max_turns (its domain's, or its task's) when that is lower."""
  turns = int(example.get("max_turns", base.max_turns))
  return Budget(max_turns=max(1, min(turns, base.max_turns)), max_turn_tokens=base.max_turn_tokens,
                max_episode_tokens=base.max_episode_tokens, call_timeout_s=base.call_timeout_s)


def run_batch(examples: Sequence[dict], generate: Generate, *, scheduler: Scheduler,
              budget: Budget = Budget(), sessions: SessionPool | None = None,
              make_env: Callable[[dict], object] | None = None) -> list[JobResult]:
  """One episode per example, dispatched by `scheduler` (domains = the examples' "domain");
  JobResult.value is the Episode, or None with `failure` set when the environment kept failing."""
  make_env = make_env or (lambda example: env_for(example, sessions))

  def one(example: dict) -> Episode:
    try:
      env = make_env(example)
      episode = run_episode(env, example, generate, budget_for(example, budget))
    except (TaskError, SandboxUnavailable, SessionStartError) as error:
      raise EnvFailure(f"task {example.get('task_id')}: {error}") from None
    if episode.env_failure:
      raise EnvFailure(episode.env_failure)
    return episode

  return scheduler.run([(str(e.get("domain", "")), e) for e in examples], one)
